"""Gate files: format, round trip (identical selections), bad input, autoload beside save_pretrained."""
from __future__ import annotations

import logging
import pickle

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

import hf_sparse
from hf_sparse import distributed
from hf_sparse import gate_files
from hf_sparse import gates
from hf_sparse.tools import gate_eval
from hf_sparse.tools import gate_training
from hf_sparse.tools import hub
from hf_sparse.kernels import reference

from conftest import build, tiny_config

BLOCK = 16


def _model(layers: int = 3, kv_heads: int = 2, head_dim: int = 16, block_size: int = BLOCK, seed: int = 0):
    model = build(tiny_config(layers=layers, kv_heads=kv_heads, head_dim=head_dim), "sdpa", seed=seed)
    hf_sparse.configure(model, hf_sparse.PLASConfig(block_size=block_size, prefill_top_k=(2, 3), dense_below=0,
                                                    query_union=16))
    return model


def _random_gates(model, seed: int = 0) -> dict[int, torch.Tensor]:
    spec = gates.gate_spec(model)
    generator = torch.Generator().manual_seed(seed)
    return {i: torch.randn(spec.shape, generator=generator) / spec.block_size for i in spec.gated_layers}


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name in ("hf_sparse.gates", "hf_sparse.gate_files")]


def _selection(gate: torch.Tensor | None, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    query = torch.randn(1, 4, 200, 16, generator=generator)
    key = torch.randn(1, 2, 200, 16, generator=generator)
    kv_start = torch.zeros(1, dtype=torch.long)
    summaries = reference.block_summaries(key, gate, kv_start, BLOCK)
    return reference.select_blocks(query, summaries, scale=0.25, q_offset=0, kv_start=kv_start, block_size=BLOCK,
                                   top_k=(2, 3), query_tile=16, head_union=False)


def test_round_trip_gives_identical_selections_and_outputs(tmp_path):
    source = _model()
    gates.set_gates(source, _random_gates(source))
    path = gate_files.save_gates(source, tmp_path)
    assert path == tmp_path / gate_files.GATE_FILENAME
    target = _model()
    loaded = gate_files.load_gates(target, tmp_path, strict=True)
    assert sorted(loaded) == [0, 1], "the last layer is dense (dense_layers=(-1,)) and has no gate"
    for layer, weight in gates.get_gates(source).items():
        assert torch.equal(loaded[layer], weight)
        before, after = _selection(weight), _selection(loaded[layer])
        assert torch.equal(before.indices, after.indices) and torch.equal(before.counts, after.counts)
    assert not torch.equal(_selection(loaded[0]).indices, _selection(None).indices), "the gate changes selections"
    ids = torch.randint(0, 128, (1, 96), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(source(ids).logits, target(ids).logits)


def test_file_layout_and_metadata(tmp_path):
    model = _model()
    model.config._name_or_path = "org/base-model"
    gates.set_gates(model, _random_gates(model))
    path = gate_files.save_gates(model, tmp_path)
    with safe_open(str(path), framework="pt") as handle:
        assert sorted(handle.keys()) == ["layers.0.gate_weight", "layers.1.gate_weight"]
        assert handle.get_tensor("layers.0.gate_weight").dtype == torch.float32
        assert handle.metadata() == {
            "format": "hf_sparse.plas_gates", "format_version": "1", "block_size": "16", "num_layers": "3",
            "kv_heads": "2", "head_dim": "16", "layers": "0,1", "base_model": "org/base-model",
            "hf_sparse_version": hf_sparse.__version__,
        }
    assert [p.name for p in tmp_path.iterdir()] == [gate_files.GATE_FILENAME], "no temporary file left behind"


def test_mean_pooling_gates_equal_the_gateless_summaries():
    model = _model()
    key = torch.randn(1, 2, 4 * BLOCK, 16)
    kv_start = torch.zeros(1, dtype=torch.long)
    mean = gates.mean_pooling_gates(model)
    assert sorted(mean) == [0, 1]
    torch.testing.assert_close(reference.block_summaries(key, mean[0], kv_start, BLOCK),
                               reference.block_summaries(key, None, kv_start, BLOCK))


def _file_from(tmp_path, **kwargs) -> str:
    other = _model(**kwargs)
    gates.set_gates(other, _random_gates(other))
    return str(gate_files.save_gates(other, tmp_path / "other"))


@pytest.mark.parametrize("kwargs, message", [
    ({"layers": 5}, "num_layers 5 != model's 3"),
    ({"kv_heads": 4}, "kv_heads 4 != model's 2"),
    ({"head_dim": 8}, "head_dim 8 != model's 16"),
    ({"block_size": 32}, "block_size 32 != model's 16"),
])
def test_mismatched_file_names_file_and_field(tmp_path, caplog, kwargs, message):
    path = _file_from(tmp_path, **kwargs)
    with pytest.raises(gate_files.GateFileError) as error:
        gate_files.load_gates(_model(), path, strict=True)
    assert str(error.value).startswith(path) and message in str(error.value)
    caplog.set_level(logging.WARNING)
    model = _model()
    assert gate_files.load_gates(model, path) == {} and gates.get_gates(model) == {}
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and message in warnings[0] and "mean-pooled" in warnings[0]


def test_shape_checked_without_metadata(tmp_path):
    path = tmp_path / "foreign.safetensors"
    save_file({"layers.0.gate_weight": torch.ones(2, 32, 16), "layers.1.gate_weight": torch.ones(2, 16, 16)}, str(path))
    with pytest.raises(gate_files.GateFileError, match=r"layer 0 gate has shape \(2, 32, 16\).*block_size 32 != model's 16"):
        gate_files.load_gates(_model(), path, strict=True)
    path = tmp_path / "extra-layer.safetensors"
    save_file({f"layers.{i}.gate_weight": torch.ones(2, 16, 16) for i in range(4)}, str(path))
    with pytest.raises(gate_files.GateFileError, match=r"layer\(s\) \[3\] but the model has 3 layers"):
        gate_files.load_gates(_model(), path, strict=True)


@pytest.mark.parametrize("content", ["truncated", "pickle", "text", "empty"])
def test_unreadable_file_is_rejected_without_unpickling(tmp_path, content):
    good = _file_from(tmp_path)
    data = open(good, "rb").read()
    path = tmp_path / gate_files.GATE_FILENAME
    path.write_bytes({"truncated": data[: len(data) // 2], "pickle": pickle.dumps({"layers.0.gate_weight": [1.0]}),
                      "text": b"not a safetensors file", "empty": b""}[content])
    with pytest.raises(gate_files.GateFileError, match=rf"^{path}: not a readable safetensors gate file"):
        gate_files.load_gates(_model(), tmp_path, strict=True)
    assert gate_files.load_gates(_model(), tmp_path) == {}


def test_missing_file_or_folder(tmp_path, caplog):
    with pytest.raises(gate_files.GateFileError, match="no gate file in the folder"):
        gate_files.load_gates(_model(), tmp_path, strict=True)
    with pytest.raises(gate_files.GateFileError, match="no such gate file"):
        gate_files.load_gates(_model(), tmp_path / "nowhere" / "gates.safetensors", strict=True)
    caplog.set_level(logging.WARNING)
    assert gate_files.load_gates(_model(), tmp_path) == {}
    assert len(_warnings(caplog)) == 1


def test_partial_file_loads_present_layers_unless_strict(tmp_path, caplog):
    path = tmp_path / "partial.safetensors"
    weight = torch.full((2, BLOCK, 16), 0.5)
    save_file({"layers.0.gate_weight": weight}, str(path))
    with pytest.raises(gate_files.GateFileError, match=r"no gate for layer\(s\) \[1\]"):
        gate_files.load_gates(_model(), path, strict=True)
    caplog.set_level(logging.WARNING)
    model = _model()
    assert sorted(gate_files.load_gates(model, path)) == [0]
    assert torch.equal(gates.get_gates(model)[0], weight) and len(_warnings(caplog)) == 1


def test_foreign_tensor_names_through_a_mapping(tmp_path):
    path = tmp_path / "fastdeploy-style.safetensors"
    tensors = {f"model.layers.{i}.self_attn.attn_gate_weight": torch.full((2, BLOCK, 16), float(i)) for i in range(2)}
    save_file(tensors, str(path))
    with pytest.raises(gate_files.GateFileError, match="unexpected tensor"):
        gate_files.load_gates(_model(), path, strict=True)
    model = _model()
    loaded = gate_files.load_gates(model, path, strict=True, tensor_names="model.layers.{layer}.self_attn.attn_gate_weight")
    assert torch.equal(loaded[1], torch.ones(2, BLOCK, 16))
    by_map = gate_files.load_gates(_model(), path, strict=True,
                              tensor_names={i: f"model.layers.{i}.self_attn.attn_gate_weight" for i in range(2)})
    assert torch.equal(by_map[0], loaded[0])


def test_non_finite_gate_rejected(tmp_path):
    path = tmp_path / "nan.safetensors"
    save_file({"layers.0.gate_weight": torch.full((2, BLOCK, 16), float("nan"))}, str(path))
    with pytest.raises(gate_files.GateFileError, match="NaN or infinite"):
        gate_files.load_gates(_model(), path, strict=True)


def test_atomic_save_keeps_the_old_file_when_writing_fails(tmp_path, monkeypatch):
    model = _model()
    first = _random_gates(model, seed=1)
    gates.set_gates(model, first)
    path = gate_files.save_gates(model, tmp_path)
    gates.set_gates(model, _random_gates(model, seed=2))

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(gate_files, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        gate_files.save_gates(model, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [gate_files.GATE_FILENAME]
    assert torch.equal(gate_files.read_gate_file(path, gates.gate_spec(model))[0], first[0])


def test_save_alongside_and_autoload_from_the_model_folder(tmp_path, caplog):
    model = _model()
    assert gate_files.save_gates_alongside(model, tmp_path / "none") is None, "no gates attached: nothing written"
    with pytest.raises(ValueError, match="no gates attached"):
        gate_files.save_gates(model, tmp_path / "none")
    gates.set_gates(model, _random_gates(model))
    model.save_pretrained(tmp_path / "other", is_main_process=False)
    assert not (tmp_path / "other" / gate_files.GATE_FILENAME).exists(), "only the main process writes the gate file"
    model.save_pretrained(tmp_path / "positional", False)  # save_pretrained's second parameter is is_main_process
    assert not (tmp_path / "positional" / gate_files.GATE_FILENAME).exists()
    model.save_pretrained(tmp_path / "saved")  # writes the gate file beside the weights
    assert (tmp_path / "saved" / gate_files.GATE_FILENAME).is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", attn_implementation="plas")
    assert reloaded.config.hf_sparse["block_size"] == BLOCK
    attached = gates.get_gates(reloaded)  # picked up by from_pretrained itself
    assert attached.keys() == gates.get_gates(model).keys()
    assert all(torch.equal(attached[i], w) for i, w in gates.get_gates(model).items())
    assert gates.get_gates(AutoModelForCausalLM.from_pretrained(tmp_path / "saved", attn_implementation="sdpa")) == {}
    loaded = gate_files.autoload_gates(reloaded)
    assert all(torch.equal(loaded[i], w) for i, w in gates.get_gates(model).items())

    caplog.set_level(logging.WARNING)
    (tmp_path / "saved" / gate_files.GATE_FILENAME).unlink()
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "saved", attn_implementation="plas")
    assert len(_warnings(caplog)) == 1, "from_pretrained warns once about the missing gate file"
    caplog.clear()
    assert gate_files.autoload_gates(plain) == {} and gates.get_gates(plain) == {}
    warnings = _warnings(caplog)
    assert len(warnings) == 1 and str(tmp_path / "saved" / gate_files.GATE_FILENAME) in warnings[0]


def test_gates_stay_out_of_the_state_dict():
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gates.set_gates(model, _random_gates(model))
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    gates.set_gates(model, None)
    assert gates.get_gates(model) == {}


# -- tensor parallelism: each rank keeps its chunk of the KV heads (two ranks: tests/test_tensor_parallel_cpu.py)
@pytest.mark.parametrize("kv_heads, tp_size", [(4, 2), (4, 4), (8, 2), (2, 1)])
def test_shard_gates_gives_each_rank_its_contiguous_heads(kv_heads, tp_size):
    generator = torch.Generator().manual_seed(0)
    whole = {layer: torch.randn(kv_heads, BLOCK, 8, generator=generator) for layer in (0, 3)}
    per_rank = kv_heads // tp_size
    shards = [gates.shard_gates(whole, kv_heads, rank, tp_size) for rank in range(tp_size)]
    for rank, shard in enumerate(shards):  # heads [rank * n / tp, (rank + 1) * n / tp), as a column-wise k_proj
        assert shard.keys() == whole.keys()
        assert all(torch.equal(shard[i], whole[i][rank * per_rank:(rank + 1) * per_rank]) for i in whole)
    assert all(torch.equal(torch.cat([shard[i] for shard in shards]), whole[i]) for i in whole)


def test_shard_gates_rejects_heads_that_do_not_split_or_do_not_match():
    with pytest.raises(ValueError, match="3 KV heads do not split over tensor parallelism's 2 ranks"):
        gates.shard_gates({0: torch.zeros(3, BLOCK, 8)}, 3, 0, 2)
    with pytest.raises(ValueError, match=r"layer 0: gate shape \(1, 16, 8\) does not hold the model's 2 KV heads"):
        gates.shard_gates({0: torch.zeros(1, BLOCK, 8)}, 2, 1, 2)  # a rank's chunk, not the whole gate


class _Mesh:
    """What tensor_parallel_rank_and_size reads of a torch DeviceMesh: ndim, names, [name], size, local rank."""

    def __init__(self, sizes: dict[str, int], ranks: dict[str, int], names: bool = True):
        self.sizes, self.ranks, self.ndim = sizes, ranks, len(sizes)
        self.mesh_dim_names = tuple(sizes) if names else None

    def __getitem__(self, name):
        return _Mesh({name: self.sizes[name]}, {name: self.ranks[name]})

    def size(self):
        return next(iter(self.sizes.values())) if self.ndim == 1 else None

    def get_local_rank(self):
        return next(iter(self.ranks.values()))


class _Model:
    def __init__(self, tp_size=None, mesh=None):
        self.tp_size, self._device_mesh = tp_size, mesh


def test_tensor_parallel_rank_and_size_reads_the_models_mesh():
    assert distributed.tensor_parallel_rank_and_size(torch.nn.Linear(2, 2)) == (0, 1)  # not a transformers model
    assert distributed.tensor_parallel_rank_and_size(_Model(None)) == (0, 1)  # not split
    assert distributed.tensor_parallel_rank_and_size(_Model(1, _Mesh({"tp": 1}, {"tp": 0}))) == (0, 1)
    # up to transformers 5.17: the 1-D mesh of the tensor-parallel ranks (init_device_mesh without names)
    assert distributed.tensor_parallel_rank_and_size(_Model(2, _Mesh({"tp": 2}, {"tp": 1}, names=False))) == (1, 2)
    # from 5.18: the ("pp", "fsdp", "tp") mesh
    mesh = _Mesh({"pp": 1, "fsdp": 2, "tp": 4}, {"pp": 0, "fsdp": 1, "tp": 3})
    assert distributed.tensor_parallel_rank_and_size(_Model(4, mesh)) == (3, 4)
    with pytest.raises(ValueError, match="no device mesh"):
        distributed.tensor_parallel_rank_and_size(_Model(2))
    with pytest.raises(ValueError, match="!= tp_size 4"):
        distributed.tensor_parallel_rank_and_size(_Model(4, _Mesh({"tp": 2}, {"tp": 0})))


def test_set_and_load_gates_keep_the_rank_chunk_under_tensor_parallelism(tmp_path, monkeypatch, caplog):
    source = _model(kv_heads=2)
    whole = _random_gates(source)
    gates.set_gates(source, whole)
    path = gate_files.save_gates(source, tmp_path)
    model = _model(kv_heads=2)
    for module in (gates, gate_files):
        monkeypatch.setattr(module, "tensor_parallel_rank_and_size", lambda model: (1, 2))  # rank 1 of 2
    gates.set_gates(model, whole)
    assert all(torch.equal(w, whole[i][1:2]) for i, w in gates.get_gates(model).items())
    gates.set_gates(model, None)
    loaded = gate_files.load_gates(model, path, strict=True)
    assert all(torch.equal(loaded[i], whole[i]) for i in whole), "load_gates returns the file's gates, every head"
    assert all(torch.equal(w, whole[i][1:2]) for i, w in gates.get_gates(model).items())
    with pytest.raises(ValueError, match="does not hold the model's 2 KV heads"):
        gates.set_gates(model, gates.get_gates(model))  # set_gates takes whole gates

    gates.set_gates(model, None)
    for module in (gates, gate_files):
        monkeypatch.setattr(module, "tensor_parallel_rank_and_size", lambda model: (0, 4))  # 2 heads over 4 ranks
    with pytest.raises(gate_files.GateFileError, match="2 KV heads do not split over tensor parallelism's 4 ranks"):
        gate_files.load_gates(model, path, strict=True)
    caplog.set_level(logging.WARNING)
    assert gate_files.load_gates(model, path) == {} and gates.get_gates(model) == {}
    assert len(_warnings(caplog)) == 1 and "do not split" in _warnings(caplog)[0]
    with pytest.raises(ValueError, match="do not split"):
        gates.set_gates(model, whole)
    monkeypatch.setattr(hub, "tensor_parallel_rank_and_size", lambda model: (0, 2))
    with pytest.raises(ValueError, match="push_gates_to_hub on a model split by tensor parallelism"):
        hub.push_gates_to_hub(source, "org/gates")


def test_only_the_first_tensor_parallel_rank_writes_the_gate_file_and_training_refuses_a_split_model(
        tmp_path, monkeypatch):
    """``save_pretrained`` runs on every rank: each gathers the heads, the group's first rank writes. Gate training
    and evaluation read every head and refuse a split model by name."""
    from hf_sparse import gate_files
    from hf_sparse import gates
    from hf_sparse.tools import gate_objective

    model = _model(kv_heads=2)
    whole = _random_gates(model)
    gates.set_gates(model, whole)
    monkeypatch.setattr(gate_files, "gathered_gates", lambda model: whole)  # what the all-gather returns
    monkeypatch.setattr(gate_files, "tensor_parallel_rank_and_size", lambda model: (1, 2))
    assert gate_files.save_gates_alongside(model, tmp_path / "rank1") is None
    assert not (tmp_path / "rank1").exists()
    monkeypatch.setattr(gate_files, "tensor_parallel_rank_and_size", lambda model: (0, 2))
    written = gate_files.save_gates_alongside(model, tmp_path / "rank0")
    assert written is not None and torch.equal(gate_files.read_gate_file(written, gates.gate_spec(model))[0], whole[0])

    monkeypatch.setattr(gate_objective, "tensor_parallel_rank_and_size", lambda model: (0, 2))
    ids = torch.zeros(1, 4 * BLOCK, dtype=torch.long)
    with pytest.raises(ValueError, match="evaluate_gates needs the whole model.*tp_size 2"):
        gate_eval.evaluate_gates(model, ids, None)
    with pytest.raises(ValueError, match="train_gates needs the whole model.*tp_size 2"):
        gate_training.train_gates(model, [ids[0]])
