"""Tensor parallelism on the CPU: ``tests/tp_worker.py`` (the GPU test's worker) on two processes under ``torchrun``,
which transformers connects with gloo. Not marked ``gpu``: the GPUs, if any, are hidden from the workers.

What only GPUs show (``tests/test_multi_gpu.py``): CUDA-graph decode under tensor parallelism and the Triton kernels
on local heads. Here decode runs eagerly, on the PyTorch reference."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist
import transformers
from packaging.version import Version

from conftest import build, tiny_config

pytestmark = [
    pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                       reason="needs torch.distributed with the gloo backend (tensor parallelism on the CPU)"),
    pytest.mark.skipif(Version(transformers.__version__).release < (5, 18),
                       reason="CPU tensor parallelism is shown with transformers' DTensor-based one (5.18 on); "
                              "the hook-based one of earlier releases runs on GPUs (tests/test_multi_gpu.py)"),
]

#: The full density and sparse rows' tolerance: float32 on the CPU, the same reductions in a different order.
TOLERANCE = 1e-5


def _saved_model(directory: Path) -> Path:
    """A tiny random Llama (2 layers, hidden 128, 4 query / 2 KV heads of 32, vocabulary 256) as safetensors."""
    config = tiny_config(q_heads=4, kv_heads=2, head_dim=32, layers=2)
    config.vocab_size = 256
    build(config, "sdpa").save_pretrained(directory)
    return directory


def test_tensor_parallel_on_two_cpu_ranks(tmp_path):
    """Two ranks, each with half the heads: at full density plas / xattn equal sdpa under the same tensor
    parallelism (prefill logits, decode scores, tokens; dynamic and static caches); with sparse selection they equal
    the whole model in one process (selection is per head), with PLAS gates too (a gate file loaded on the sharded
    model keeps each rank's chunk of the KV heads; save_gates gathers them back); Star's generate() path equals the whole model and its
    context sharding is refused; the fused decode leaves the split layers and head alone and its compiled modules
    equal the eager step; both ranks agree."""
    model_dir = _saved_model(tmp_path / "tiny_llama")
    out = tmp_path / "tp.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(Path(__file__).with_name("tp_worker.py")), "--model", str(model_dir), "--out", str(out)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    report = json.loads(out.read_text())

    assert (report["world_size"], report["device"], report["backend"], report["tp_size"]) == (2, "cpu", "gloo", 2)
    assert report["ranks_agree"]
    shards = report["sharding"]
    assert shards["attention_heads"] == [4 // 2, 2 // 2] and shards["model_heads"] == [4, 2]
    assert shards["fusable_layers"] == 0 and not shards["fusable_head"], shards
    if Version(transformers.__version__).release >= (5, 18):
        assert shards["weight_type"] == "DTensor", shards  # DTensor-based tensor parallelism
    fused = report["fused_step"]
    assert fused["swapped"] > 0 and fused["max_diff"] <= TOLERANCE, fused
    assert fused["compiled"] > 0 and fused["eager_fallbacks"] == 0, fused  # the compiled modules ran
    for method in ("plas", "xattn"):
        row = report["full_density"][method]
        assert row["prefill_max_diff"] <= TOLERANCE and row["scores_max_diff"] <= TOLERANCE, (method, row)
        assert row["static_scores_max_diff"] <= TOLERANCE, (method, row)
        assert row["tokens_equal"] and row["static_tokens_equal"], (method, row)
        sparse = report["sparse"][method]
        assert sparse["prefill_density"] < 0.95, (method, sparse)  # the selection skipped blocks
        assert sparse["unsharded_prefill_max_diff"] <= TOLERANCE, (method, sparse)
        assert sparse["unsharded_scores_max_diff"] <= TOLERANCE and sparse["unsharded_tokens_equal"], (method, sparse)
    gated = report["gates"]  # a gate file loaded on the sharded model: each rank keeps its chunk of the KV heads
    assert gated["tp_size"] == 2 and gated["layers"] == [0], gated  # the last layer is dense: no gate
    assert [rank["tp_rank"] for rank in gated["ranks"]] == [0, 1], gated
    for rank in gated["ranks"]:
        assert rank["attached_shape"] == [[1, 16, 32]], gated  # 1 of the 2 KV heads
        assert rank["attached_is_rank_chunk"] and rank["key_rows_are_rank_chunk"], gated  # heads [r, r + 1)
        assert rank["resaved_equal"], gated  # save_gates on the sharded model gathers every head
    assert gated["prefill_density"] < 0.95 and gated["mean_pooling_prefill_max_diff"] > TOLERANCE, gated
    assert gated["unsharded_prefill_max_diff"] <= TOLERANCE, gated
    assert gated["unsharded_scores_max_diff"] <= TOLERANCE and gated["unsharded_tokens_equal"], gated
    star = report["star"]
    assert star["unsharded_prefill_max_diff"] <= TOLERANCE and star["unsharded_scores_max_diff"] <= TOLERANCE, star
    assert star["unsharded_tokens_equal"], star
    assert "tp_size 2" in (star["context_sharding_refused"] or ""), star
