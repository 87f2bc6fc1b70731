"""PLAS's key scorer (hf_sparse.key_scorer): the block scores against their definition, the selection against the
study's (studies/block_scorers.py, whose runs docs/gates.md reports), chunking, fitting, attaching, and a model's
prefill ranking blocks through it."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import hf_sparse
from hf_sparse import gate_files
from hf_sparse import gates
from hf_sparse import key_scorer
from hf_sparse.tools import key_scorer_fit
from hf_sparse.kernels import reference as ref
from hf_sparse.selection import RowLayout

from conftest import build, tiny_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "studies"))


def orthonormal(kv_heads: int, rank: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(kv_heads, dim, rank, generator=generator)).Q.mT.contiguous()


def test_block_scores_are_each_blocks_largest_projected_logit_from_the_rows_first_key():
    """Written out: per query and block (counted from the row's first real key), the largest scaled logit of the
    projected query and keys over the block's keys at or before the query; -inf for blocks it cannot see."""
    gen = torch.Generator().manual_seed(0)
    batch, q_heads, kv_heads, dim, rank, length, block, num_queries = 2, 4, 2, 16, 3, 70, 16, 30
    q_offset = length - num_queries
    query, key = torch.randn(batch, q_heads, num_queries, dim, generator=gen), torch.randn(batch, kv_heads, length, dim,
                                                                                         generator=gen)
    directions = orthonormal(kv_heads, rank, dim, gen)
    kv_start = torch.tensor([0, 21])
    scores = key_scorer.block_scores(query, key, directions, block, 0.5, q_offset, RowLayout.read(kv_start))
    assert scores.shape == (batch, q_heads, num_queries, ref.num_row_blocks(length, kv_start, block))
    for b in range(batch):
        start = int(kv_start[b])
        for h in range(q_heads):
            basis = directions[h // (q_heads // kv_heads)]
            for i in range(num_queries):
                slot = q_offset + i
                for j in range(scores.shape[-1]):
                    keys = [s for s in range(start + j * block, min(start + (j + 1) * block, length)) if s <= slot]
                    if not keys:
                        assert scores[b, h, i, j] == float("-inf")
                        continue
                    logits = (basis @ query[b, h, i]) @ (basis @ key[b, h // 2, keys].T) * 0.5
                    torch.testing.assert_close(scores[b, h, i, j], logits.max(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("stride", [1, 4])
def test_selection_equals_the_studys_and_does_not_depend_on_chunks(monkeypatch, stride):
    """Unpadded: the study's scored selection (threshold top-k, forced blocks, tile union on the PyTorch path) with
    its fitted low-rank scorer selects the same blocks; scores computed in chunks of whole tiles select what one
    chunk does."""
    from block_scorers import low_rank_max, scored_select_prefill

    gen = torch.Generator().manual_seed(1)
    batch, q_heads, kv_heads, dim, length, block = 1, 4, 2, 16, 300, 16
    query, key = torch.randn(batch, q_heads, length, dim, generator=gen), torch.randn(batch, kv_heads, length, dim,
                                                                                     generator=gen)
    directions = orthonormal(kv_heads, 4, dim, gen)
    config = hf_sparse.PLASConfig(block_size=block, query_union=32, prefill_top_k=(3, 4), prefill_top_k_length=None,
                                  query_stride=stride, dense_below=0)
    rows = RowLayout.uniform(batch, "cpu")
    arguments = dict(scale=0.25, q_offset=0, kv_start=rows, block_size=block, top_k=(3, 4), query_tile=32,
                     sink_blocks=config.sink_blocks, search_steps=config.search_steps, query_stride=stride)
    whole = key_scorer.select_prefill(query, key, directions, **arguments)
    study = scored_select_prefill(hf_sparse.methods.plas.PLASMethod(config), low_rank_max(lambda _: directions),
                                  stride, query, None, key, scale=0.25, q_offset=0, kv_start=rows)
    assert torch.equal(whole.to_mask(19), study.to_mask(19))
    assert (whole.counts < 19).any()
    monkeypatch.setattr(key_scorer, "CHUNK_BYTES", 1)  # one tile per chunk
    chunked = key_scorer.select_prefill(query, key, directions, **arguments)
    assert torch.equal(chunked.indices, whole.indices) and torch.equal(chunked.counts, whole.counts)


def test_fit_attach_and_a_prefill_that_ranks_by_keys():
    """Directions fitted on a model's keys are orthonormal per KV head; attached, a PLAS prefill selects through
    the key scorer (and gives other logits than mean pooling); removed, mean pooling again."""
    config = tiny_config("llama", 4, 2, 16, layers=2)
    model = build(config, "sdpa")
    windows = torch.randint(3, 128, (2, 96), generator=torch.Generator().manual_seed(2))
    directions = key_scorer_fit.fit_key_directions(model, windows, rank=4, progress=False)
    assert sorted(directions) == [0, 1]
    for tensor in directions.values():
        assert tensor.shape == (2, 4, 16)
        torch.testing.assert_close(tensor @ tensor.mT, torch.eye(4).expand(2, 4, 4), atol=1e-4, rtol=0)
    hf_sparse.configure(model, hf_sparse.PLASConfig(block_size=16, query_union=16, prefill_top_k=(2, 3),
                                                    prefill_top_k_length=None, dense_below=0, dense_layers=(),
                                                    dense_above_density=None))
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        pooled = model(ids).logits
        gates.set_key_directions(model, directions)
        calls = []
        original = key_scorer.select_prefill
        key_scorer.select_prefill = lambda *args, **kwargs: calls.append(1) or original(*args, **kwargs)
        try:
            scored = model(ids).logits
        finally:
            key_scorer.select_prefill = original
        assert len(calls) == 2  # each layer's prefill
        assert not torch.allclose(scored, pooled, atol=1e-4)
        gates.set_key_directions(model, None)
        torch.testing.assert_close(model(ids).logits, pooled)


def test_attaching_refuses_what_does_not_fit():
    model = build(tiny_config("llama", 4, 2, 16, layers=2), "sdpa")
    good = torch.linalg.qr(torch.randn(2, 16, 4)).Q.mT
    with pytest.raises(ValueError, match="layer 5"):
        gates.set_key_directions(model, {5: good})
    with pytest.raises(ValueError, match="kv_heads=2"):
        gates.set_key_directions(model, {0: good[:1]})
    with pytest.raises(ValueError, match="not finite"):
        gates.set_key_directions(model, {0: good * float("nan")})
    with pytest.raises(ValueError, match="several ranks"):
        gates.set_key_directions(model, {0: good, 1: good[:, :3]})
    gates.set_key_directions(model, {0: good})
    attached = [gates.get_key_directions(layer.self_attn) for layer in model.model.layers]
    assert attached[0] is not None and attached[1] is None


def test_gate_file_version_2_holds_key_directions(tmp_path, monkeypatch):
    """save_gates writes attached key directions into a version-2 gate file (no block size when it holds no gates);
    load_gates attaches them to another model; a reader of version 1 refuses the file; directions that do not fit
    the model are refused, naming the file and the problem, and nothing is attached."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from hf_sparse import gates

    config = tiny_config("llama", 4, 2, 16, layers=2)
    source, target = build(config, "sdpa"), build(config, "sdpa")
    directions = {0: orthonormal(2, 4, 16, torch.Generator().manual_seed(4)),
                  1: orthonormal(2, 4, 16, torch.Generator().manual_seed(5))}
    gates.set_key_directions(source, directions)
    path = gate_files.save_gates(source, tmp_path)
    with safe_open(str(path), framework="pt") as handle:
        metadata = handle.metadata()
        assert sorted(handle.keys()) == ["layers.0.key_directions", "layers.1.key_directions"]
    assert metadata["format_version"] == "2" and metadata["key_rank"] == "4" and "block_size" not in metadata
    assert gate_files.load_gates(target, tmp_path, strict=True) == {}  # no gates in the file
    for layer in (0, 1):
        assert torch.equal(gates.get_key_directions(target.model.layers[layer].self_attn), directions[layer])
    monkeypatch.setattr(gate_files, "FORMAT_VERSION", 1)
    with pytest.raises(gate_files.GateFileError, match="reads versions 1..1"):
        gate_files.load_gates(build(config, "sdpa"), tmp_path, strict=True)
    monkeypatch.undo()
    wrong = tmp_path / "wrong.safetensors"
    save_file({"layers.0.key_directions": torch.zeros(3, 4, 16)}, str(wrong),
              metadata={"format": "hf_sparse.plas_gates", "format_version": "2"})
    fresh = build(config, "sdpa")
    with pytest.raises(gate_files.GateFileError, match=r"wrong.safetensors: layer 0: key directions of shape \(3, 4, 16\)"):
        gate_files.load_gates(fresh, wrong, strict=True)
    assert gate_files.load_gates(fresh, wrong) == {}  # not strict: one warning, nothing attached
    assert gates.get_key_directions(fresh.model.layers[0].self_attn) is None
    spec = gates.gate_spec(target)
    for bad, message in [({0: directions[0] * float("nan")}, "not finite"), ({7: directions[0]}, "layer 7")]:
        with pytest.raises(ValueError, match=message):  # what a reader would refuse is not written
            gate_files.write_gate_file({}, tmp_path / "bad.safetensors", spec, bad)
    assert not (tmp_path / "bad.safetensors").exists()
    # gates and directions in one file: both attached; a file of gates alone is version 1 and leaves no directions
    gate = {0: torch.rand(spec.shape, generator=torch.Generator().manual_seed(6))}
    both = gate_files.write_gate_file(gate, tmp_path / "both.safetensors", spec, directions)
    assert sorted(gate_files.load_gates(fresh, both, strict=True)) == [0]
    assert torch.equal(gates.get_key_directions(fresh.model.layers[1].self_attn), directions[1])
    only_gates = gate_files.write_gate_file(gate, tmp_path / "gates.safetensors", spec)
    with safe_open(str(only_gates), framework="pt") as handle:
        assert handle.metadata()["format_version"] == "1"
    assert sorted(gate_files.load_gates(fresh, only_gates, strict=True)) == [0]
    assert all(gates.get_key_directions(layer.self_attn) is None for layer in fresh.model.layers)


def test_fit_key_scorer_command_writes_a_file_load_gates_attaches(tmp_path, capsys):
    """``hf-sparse fit-key-scorer`` on the embedded SmolLM2 (one short window of the standard library's code): a
    version-2 gate file of 30 layers' directions that load_gates attaches."""
    from hf_sparse import gates
    from hf_sparse.tools import key_scorer_fit
    from hf_sparse.tools.cli import main
    from hf_sparse.tools.default_model import load_default_model

    assert main(["fit-key-scorer", "--rank", "4", "--windows", "1", "--length", "256", "--out", str(tmp_path),
                 "--device", "cpu", "--no-progress"]) == 0
    assert "fitted 30 layer(s) x 4 key directions" in capsys.readouterr().out
    model, _ = load_default_model()
    assert gate_files.load_gates(model, tmp_path, strict=True) == {}
    attached = [gates.get_key_directions(layer.self_attn) for layer in model.model.layers]
    assert all(tensor is not None and tensor.shape == (3, 4, 64) for tensor in attached)
    with pytest.raises(SystemExit, match="--rank"):
        main(["fit-key-scorer", "--rank", "0", "--out", str(tmp_path / "other")])
    with pytest.raises(SystemExit, match="exists"):  # the file there is not overwritten
        main(["fit-key-scorer", "--rank", "4", "--windows", "1", "--length", "256", "--out", str(tmp_path),
              "--device", "cpu", "--no-progress"])
    with pytest.raises(ValueError, match=r"rank must be 1\.\.64"):
        key_scorer_fit.fit_key_directions(model, torch.zeros(1, 8, dtype=torch.long), rank=65, progress=False)


def test_benchmarks_method_option_keys_attaches_a_files_directions(tmp_path, monkeypatch):
    """The benchmarks' method name "plas-keys=PATH" attaches the file's key directions for that method only (a PATH
    without "-": relative to the folder here)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from _common import key_scorer_path, sparse_config, use_method

    from hf_sparse import gates

    config = tiny_config("llama", 4, 2, 16, layers=2)
    model = build(config, "sdpa")
    directions = {0: orthonormal(2, 4, 16, torch.Generator().manual_seed(6))}
    gates.set_key_directions(model, directions)
    monkeypatch.chdir(tmp_path)
    folder = "ks"
    gate_files.save_gates(model, folder)
    gates.set_key_directions(model, None)
    name = f"plas-keys={folder}-block_size=16"
    with pytest.raises(ValueError, match="holds a '-'"):
        key_scorer_path("plas-keys=my-ks-block_size=16")
    assert key_scorer_path("plas-keys=ks-int8") == "ks"  # an option flag after the path
    assert key_scorer_path(name) == folder and sparse_config(name).block_size == 16
    use_method(model, name)
    assert torch.equal(gates.get_key_directions(model.model.layers[0].self_attn), directions[0])
    use_method(model, "plas-block_size=16")
    assert gates.get_key_directions(model.model.layers[0].self_attn) is None
    with pytest.raises(ValueError, match="PLAS option"):
        sparse_config(f"xattn-keys={folder}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("stride, padding", [(1, 0), (4, 0), (4, 300)])
def test_selection_on_the_gpu_equals_the_cpus(monkeypatch, stride, padding):
    """The Triton path (scores by pooled_block_logits, selection by select_blocks_from_logits, several chunks)
    selects what the PyTorch reference path does on the CPU, float32, with and without left padding: the same
    blocks but for cuts that fall between logits closer than the two paths' rounding."""
    gen = torch.Generator().manual_seed(7)
    batch, q_heads, kv_heads, dim, length, block = 2, 6, 2, 32, 3000, 64
    query = torch.randn(batch, q_heads, length, dim, generator=gen)
    key = torch.randn(batch, kv_heads, length, dim, generator=gen)
    directions = orthonormal(kv_heads, 8, dim, gen)
    starts = torch.tensor([0, padding])
    arguments = dict(scale=dim ** -0.5, q_offset=0, block_size=block, top_k=(6, 8), query_tile=128, sink_blocks=1,
                     search_steps=16, query_stride=stride)
    num_blocks = ref.num_row_blocks(length, starts, block)
    cpu = key_scorer.select_prefill(query, key, directions, kv_start=RowLayout.read(starts), **arguments)
    cuda_args = (query.cuda(), key.cuda(), directions.cuda())
    monkeypatch.setattr(key_scorer, "CHUNK_BYTES", 1 << 16)  # several chunks (unpadded)
    gpu = key_scorer.select_prefill(*cuda_args, kv_start=RowLayout.read(starts.cuda()), **arguments)
    same = (gpu.to_mask(num_blocks).cpu() == cpu.to_mask(num_blocks)).float().mean()
    assert same > 0.999, f"{1 - float(same):.4%} of (tile, block) choices differ"
    assert (cpu.counts < num_blocks).any()


def test_a_padded_batch_past_the_chunk_size_warns_once(monkeypatch, caplog):
    """A left-padded batch is scored in one chunk: past CHUNK_BYTES one warning says how much and what to do."""
    from hf_sparse import log
    from hf_sparse import key_scorer

    gen = torch.Generator().manual_seed(8)
    query, key = torch.randn(2, 4, 64, 16, generator=gen), torch.randn(2, 2, 64, 16, generator=gen)
    monkeypatch.setattr(key_scorer, "CHUNK_BYTES", 1)
    monkeypatch.setattr(log, "WARNED", set())
    arguments = dict(scale=0.25, q_offset=0, kv_start=RowLayout.read(torch.tensor([0, 9])), block_size=16,
                     top_k=(2, 3), query_tile=16, sink_blocks=1, search_steps=16, query_stride=1)
    with caplog.at_level("WARNING"):
        key_scorer.select_prefill(query, key, orthonormal(2, 4, 16, gen), **arguments)
        key_scorer.select_prefill(query, key, orthonormal(2, 4, 16, gen), **arguments)
    warned = [record for record in caplog.records if "left-padded batch in one chunk" in record.getMessage()]
    assert len(warned) == 1 and "one row at a time" in warned[0].getMessage()
