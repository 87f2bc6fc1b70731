"""A model spread over two GPUs: layers placed by ``device_map`` (one process) and tensor parallelism
(``tp_plan="auto"`` under ``torchrun``, one process per GPU; the worker is ``tests/tp_worker.py``, which
``tests/test_tensor_parallel_cpu.py`` runs on two CPU processes).

Marked ``gpu`` and ``multi_gpu``; below 2 GPUs they are skipped (reported as not run, never as passed)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hf_sparse
from conftest import build, selecting_config, tiny_config
from hf_sparse.tools.peer_tests import full_density_config

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 CUDA GPUs")]

#: Tiny Llama, four layers: two on each GPU.
SPLIT = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 0,
         "model.layers.2": 1, "model.layers.3": 1, "model.norm": 1, "lm_head": 1}

#: NCCL without NVLink multicast (the device machines' rule).
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def _saved_model(directory: Path) -> Path:
    """A tiny random Llama saved as safetensors (loaded back with ``device_map`` / ``tp_plan``)."""
    model = build(tiny_config(q_heads=8, kv_heads=2, head_dim=64, layers=4), "sdpa")
    model.config.vocab_size = 128
    model.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return _saved_model(tmp_path_factory.mktemp("tiny_llama"))


def _load(model_dir: Path, attn: str, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=attn, device_map=SPLIT,
                                                dtype=dtype).eval()


def _sparse_config(method: str, **fields):
    """A small-block config that selects on the tiny model's inputs (``conftest.selecting_config``)."""
    if method == "star":
        return hf_sparse.StarConfig(block_size=64, anchor_size=32, dense_below=0, **fields)
    return selecting_config(method, **fields)


def _inputs(length: int = 300):
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 128, (2, length), generator=gen).to("cuda:0")
    mask = torch.ones_like(ids)
    mask[0, :17] = 0
    return ids, mask


@pytest.mark.parametrize("method", ["plas", "xattn"])
def test_device_map_full_density_equals_sdpa(model_dir, method):
    """Layers on two GPUs: at full density the prefill logits and every decode step's scores equal sdpa's on the
    same split (the single-GPU equivalence tests' tolerance), and decode replays one CUDA graph per GPU."""
    ids, mask = _inputs()
    dense = _load(model_dir, "sdpa")
    sparse = _load(model_dir, method)
    hf_sparse.configure(sparse, full_density_config(method))
    assert {p.device.index for p in sparse.parameters()} == {0, 1}
    with torch.no_grad():
        torch.testing.assert_close(sparse(input_ids=ids, attention_mask=mask).logits,
                                   dense(input_ids=ids, attention_mask=mask).logits, atol=2e-5, rtol=1e-4)
    runs = {}
    for name, model in (("sdpa", dense), (method, sparse)):
        runs[name] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False,
                                    pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    for dense_scores, sparse_scores in zip(runs["sdpa"].scores, runs[method].scores):
        torch.testing.assert_close(sparse_scores, dense_scores, atol=1e-4, rtol=1e-4)
    assert torch.equal(runs[method].sequences, runs["sdpa"].sequences)
    stats = hf_sparse.graphs.stats(sparse)
    assert stats is not None and stats.disabled_reason is None
    assert stats.captures == 2 and stats.replays == 10  # one graph per GPU; steps 2..11 replay (1 warms up)


@pytest.mark.parametrize("method", ["plas", "xattn", "star"])
def test_device_map_graph_decode_equals_eager(model_dir, method):
    """Layers on two GPUs, sparse selection: every kernel launches on its tensors' GPU, and generate()'s graph
    decode gives eager decode's tokens and scores."""
    ids, mask = _inputs(400)
    model = _load(model_dir, method)
    if method == "star":
        mask = torch.ones_like(ids)  # Star's generate() path takes left padding; keep the batch unpadded here
    runs = {}
    for graphs in (False, True):
        hf_sparse.configure(model, _sparse_config(method, decode_cuda_graph=graphs))
        runs[graphs] = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                                      pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    stats = hf_sparse.graphs.stats(model)
    assert stats is not None and stats.disabled_reason is None and stats.captures == 2 and stats.replays == 22
    assert torch.equal(runs[True].sequences, runs[False].sequences)
    for eager, replayed in zip(runs[False].scores, runs[True].scores):
        torch.testing.assert_close(replayed, eager, atol=1e-4, rtol=1e-4)
    if method != "star":  # the selection ran sparse (fewer blocks than causal)
        with torch.no_grad(), hf_sparse.record_sparsity() as recorder:
            model(input_ids=ids, attention_mask=mask)
        assert recorder.density("prefill") < 0.8


def test_device_map_bf16_long_prompt_runs_every_method(model_dir):
    """bfloat16, a prompt of several hundred blocks, each method's defaults scaled to the tiny model: no device
    error, the first new tokens are those of the same model on one GPU."""
    ids = torch.randint(0, 128, (1, 2048), generator=torch.Generator().manual_seed(9)).to("cuda:0")
    from transformers import AutoModelForCausalLM

    for method in ("plas", "xattn", "star"):
        split = _load(model_dir, method, torch.bfloat16)
        single = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation=method,
                                                      dtype=torch.bfloat16).to("cuda:0").eval()
        for model in (split, single):
            hf_sparse.configure(model, _sparse_config(method))
        tokens = [model.generate(input_ids=ids, max_new_tokens=8, do_sample=False, pad_token_id=0)[:, -8:].cpu()
                  for model in (split, single)]
        assert torch.equal(tokens[0], tokens[1]), method
        del split, single


def _torchrun(model_dir: Path, out: Path, *args: str) -> dict:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", "29517",
               str(Path(__file__).with_name("tp_worker.py")), "--model", str(model_dir), "--out", str(out), *args]
    env = {**os.environ, **NCCL_ENV, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]),
                                                                     os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-8000:]
    return json.loads(out.read_text())


def test_tensor_parallel_equals_sdpa_under_the_same_split(model_dir, tmp_path):
    """Tensor parallelism (``tp_plan="auto"``, from transformers 5.18 ``distributed_config``) on two ranks: each
    rank's attention gets half the heads and the fused decode leaves the split layers alone; at full density each
    method's prefill logits and decode scores equal sdpa's under the same tensor parallelism; with sparse selection,
    graph decode equals eager decode and the whole model's decode on one GPU, with PLAS gates too (a gate file
    loaded on the sharded model keeps each rank's chunk of the KV heads; save_gates gathers them back); Star's
    generate() path equals the whole model's and its context sharding is refused; both ranks agree."""
    report = _torchrun(model_dir, tmp_path / "tp.json")
    assert report["world_size"] == 2 and report["ranks_agree"]
    shards = report["sharding"]
    assert shards["attention_heads"] == [heads // 2 for heads in shards["model_heads"]], shards
    assert shards["fusable_layers"] == 0 and not shards["fusable_head"], shards
    fused = report["fused_step"]
    assert fused["max_diff"] <= 1e-4 and fused["compiled"] > 0 and fused["eager_fallbacks"] == 0, fused
    for method in ("plas", "xattn"):
        row = report["full_density"][method]
        assert row["prefill_max_diff"] <= 1e-4 and row["scores_max_diff"] <= 1e-3, (method, row)
        assert row["static_scores_max_diff"] <= 1e-3, (method, row)
        assert row["tokens_equal"] and row["static_tokens_equal"], (method, row)
        sparse = report["sparse"][method]
        assert sparse["graph_tokens_equal_eager"] and sparse["scores_max_diff"] <= 1e-3, (method, sparse)
        assert sparse["replays"] > 0 and sparse["disabled_reason"] is None, (method, sparse)
        assert sparse["prefill_density"] < 0.95, (method, sparse)
        assert sparse["unsharded_prefill_max_diff"] <= 1e-4 and sparse["unsharded_scores_max_diff"] <= 1e-3, \
            (method, sparse)
        assert sparse["unsharded_tokens_equal"], (method, sparse)
    gated = report["gates"]  # a gate file loaded on the sharded model: each rank keeps its chunk of the KV heads
    assert gated["tp_size"] == 2 and gated["layers"] == [0, 1, 2], gated  # the last layer is dense: no gate
    assert [rank["tp_rank"] for rank in gated["ranks"]] == [0, 1], gated
    for rank in gated["ranks"]:
        assert rank["attached_shape"] == [[1, 16, 64]] * 3, gated  # 1 of the 2 KV heads
        assert rank["attached_is_rank_chunk"] and rank["key_rows_are_rank_chunk"], gated
        assert rank["resaved_equal"], gated  # save_gates on the sharded model gathers every head
    assert gated["prefill_density"] < 0.95 and gated["mean_pooling_prefill_max_diff"] > 1e-4, gated
    assert gated["unsharded_prefill_max_diff"] <= 1e-4 and gated["unsharded_scores_max_diff"] <= 1e-3, gated
    assert gated["unsharded_tokens_equal"], gated
    star = report["star"]
    assert star["unsharded_tokens_equal"] and star["unsharded_scores_max_diff"] <= 1e-3, star
    assert "tp_size 2" in (star["context_sharding_refused"] or ""), star
