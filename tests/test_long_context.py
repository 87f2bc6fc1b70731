"""Rope scaling (YaRN, the once-only warning), the long-context adapter (file, merge, loader refusals), its
training (loss falls, resume, chunked loss) and its data (deterministic packing, no standard library, retrieval)."""
from __future__ import annotations

import builtins
import copy
import json
import logging
import lzma
import math
import os
import random
import sysconfig
from types import SimpleNamespace

import pytest
import torch

import hf_sparse
from conftest import build, tiny_config

from hf_sparse.tools import adapter as adapter_file
from hf_sparse.tools import default_model
from hf_sparse.tools import long_context
from hf_sparse.tools import long_documents
from hf_sparse import rope_scaling as rs


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The tiny models' products are too small to share between threads (on a busy machine two threads make each
    one milliseconds slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class CharTokenizer:
    """One token per character (code point + 1, capped), EOS = 0: exact and fast, for the data tests."""

    eos_token_id = 0

    def _encode(self, text: str) -> list[int]:
        return [min(ord(c), 126) + 1 for c in text]

    def __call__(self, text, add_special_tokens=False, verbose=True):
        if isinstance(text, list):
            return SimpleNamespace(input_ids=[self._encode(t) for t in text])
        return SimpleNamespace(input_ids=self._encode(text))

    def decode(self, ids) -> str:
        return "".join("|" if int(i) == 0 else chr(int(i) - 1) for i in ids)


# -- rope scaling ---------------------------------------------------------------------------------------------
def test_yarn_parameters_keep_theta_and_scale_from_the_trained_length():
    config = tiny_config()  # max_position_embeddings 4096, rope_theta 10000
    parameters = rs.yarn_parameters(config, 10_000)
    assert parameters == {"rope_type": "yarn", "factor": 10_000 / 4096, "original_max_position_embeddings": 4096,
                          "rope_theta": 10_000.0}
    assert rs.yarn_parameters(config, 10_000, whole=True)["factor"] == 3.0
    assert rs.yarn_parameters(config, 1000)["factor"] == 1.0, "never below 1"
    assert rs.yarn_parameters(config, factor=4)["factor"] == 4.0
    assert config.rope_parameters["rope_type"] == "default", "the config itself is not touched"

    rs.apply_yarn(config, 16_384)
    assert config.rope_parameters["factor"] == 4.0 and config.max_position_embeddings == 16_384
    assert rs.trained_length(config) == 4096 and rs.has_rope_scaling(config)
    rs.apply_yarn(config, 32_768)  # rescaled from the original length, not from 16K
    assert config.rope_parameters["factor"] == 8.0
    assert config.rope_parameters["original_max_position_embeddings"] == 4096
    model = build(config, "sdpa")
    rotary = model.model.rotary_emb
    assert rotary.rope_type == "yarn" and rotary.attention_scaling == pytest.approx(0.1 * math.log(8.0) + 1)

    llama3 = tiny_config()
    llama3.rope_parameters = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 1024, "rope_theta": 10_000.0}
    with pytest.raises(ValueError, match="llama3"):
        rs.yarn_parameters(llama3, 8192)
    with pytest.raises(ValueError, match="factor must be a number >= 1"):
        rs.yarn_parameters(tiny_config(), factor=0.5)
    with pytest.raises(ValueError, match="exactly one"):
        rs.yarn_parameters(tiny_config())


@pytest.mark.parametrize("length, factor", [(8192, 1.0), (8193, 2.0), (9000, 2.0), (32_768, 4.0), (40_000, 5.0),
                                            (65_536, 8.0), (131_072, 16.0)])
def test_whole_factor_rounds_up(length, factor):
    assert rs.yarn_factor(length, 8192, whole=True) == factor
    assert rs.yarn_factor(length, 8192) == max(1.0, length / 8192)


def test_warning_once_per_model_names_the_fix(caplog):
    model = build(tiny_config(), "sdpa")
    with caplog.at_level(logging.WARNING, logger="hf_sparse.rope_scaling"):
        assert not rs.check_context_length(model, 4096), "at the trained length: no warning"
        assert rs.check_context_length(model, torch.zeros(1, 5000, dtype=torch.long))
        assert not rs.check_context_length(model, 9000), "once per model"
        assert not rs.check_context_length(model, None)
    assert len(caplog.records) == 1
    message = caplog.records[0].getMessage()
    assert "5000 tokens" in message and "max_position_embeddings 4096" in message and "LlamaForCausalLM" in message
    assert '"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 4096' in message
    assert "config.max_position_embeddings = 8192" in message and "--rope-scaling yarn:2" in message

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_sparse.rope_scaling"):
        other = build(tiny_config(), "sdpa")
        assert rs.check_context_length(other, torch.zeros(2, 4097, 64)), "another model warns (embeddings given)"
        other.config = copy.deepcopy(other.config)
        assert rs.check_context_length(other, 4097), "a new config object warns again"
        scaled = build(rs.apply_yarn(tiny_config(), 8192), "sdpa")
        assert not rs.check_context_length(scaled, 100_000), "rope scaling configured: not checked"
    assert len(caplog.records) == 2


# -- the adapter ----------------------------------------------------------------------------------------------
def _random_adapter(model, rank=4, alpha=8.0, seed=1, norms=True) -> adapter_file.LongContextAdapter:
    """LoRA wrappers with random (non-zero) B factors and perturbed norms, as an adapter; the model is restored."""
    wrappers = adapter_file.attach_lora(model, rank, alpha, seed)
    generator = torch.Generator().manual_seed(seed)
    norm_modules = adapter_file.norm_modules(model) if norms else {}
    with torch.no_grad():
        for wrapper in wrappers.values():
            wrapper.lora_B.copy_(torch.randn(wrapper.lora_B.shape, generator=generator) * 0.05)
        originals = {name: m.weight.clone() for name, m in norm_modules.items()}
        for module in norm_modules.values():
            module.weight.add_(torch.randn(module.weight.shape, generator=generator) * 0.1)
    adapter = adapter_file.adapter_from_lora(wrappers, norm_modules, rope=rs.rope_parameters(model.config),
                                   base_model="tiny", seq_lengths=[64], tokens_trained=1234)
    adapter_file.detach_lora(model)
    with torch.no_grad():
        for name, module in norm_modules.items():
            module.weight.copy_(originals[name])
    return adapter


def test_adapter_file_round_trip(tmp_path):
    model = build(tiny_config(), "sdpa")
    adapter = _random_adapter(model)
    path = adapter_file.save_adapter(adapter, tmp_path / "adapter.safetensors", dtype=torch.float32)
    loaded = adapter_file.load_adapter(path)
    summary = (loaded.rank, loaded.alpha, loaded.base_model, loaded.seq_length, loaded.tokens_trained)
    assert summary == (4, 8.0, "tiny", 64, 1234)
    assert loaded.rope_parameters == adapter.rope_parameters and loaded.projections == list(adapter_file.PROJECTIONS)
    assert set(loaded.lora) == set(adapter.lora) and len(loaded.lora) == 2 * 7
    assert all(torch.equal(loaded.lora[n][0], adapter.lora[n][0]) and torch.equal(loaded.lora[n][1], adapter.lora[n][1])
               for n in adapter.lora)
    assert all(torch.equal(loaded.norms[n], adapter.norms[n]) for n in adapter.norms) and len(loaded.norms) == 5
    small = adapter_file.load_adapter(adapter_file.save_adapter(adapter, tmp_path / "bf16.safetensors"))  # bfloat16 factors
    assert small.lora["layers.0.self_attn.q_proj"][0].dtype == torch.bfloat16
    torch.testing.assert_close(small.lora["layers.0.self_attn.q_proj"][1].float(),
                               adapter.lora["layers.0.self_attn.q_proj"][1], rtol=1e-2, atol=1e-4)
    assert not list(tmp_path.glob(".*.tmp")), "no temporary file left behind"


def test_merged_model_equals_the_lora_forward():
    config = tiny_config()
    model = build(config, "sdpa")
    adapter = _random_adapter(model, norms=False)
    ids = torch.randint(0, 128, (2, 48), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base = model(input_ids=ids).logits
        wrappers = adapter_file.attach_lora(model, adapter.rank, adapter.alpha)
        with torch.no_grad():
            for name, wrapper in wrappers.items():
                wrapper.lora_A.copy_(adapter.lora[name][0])
                wrapper.lora_B.copy_(adapter.lora[name][1])
        lora = model(input_ids=ids).logits
        adapter_file.detach_lora(model)
        merged = adapter_file.merge_adapter(build(config, "sdpa"), adapter)(input_ids=ids).logits
    assert (lora - base).abs().max() > 1e-2, "the update changes the output"
    torch.testing.assert_close(merged, lora, rtol=1e-5, atol=1e-5)


def _resave(path, target, metadata=None, drop=(), extra=None):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as handle:
        tensors = {k: handle.get_tensor(k) for k in handle.keys() if k not in drop}
        meta = dict(handle.metadata())
    meta.update(metadata or {})
    meta = {k: v for k, v in meta.items() if v is not None}
    tensors.update(extra or {})
    save_file(tensors, str(target), metadata=meta)
    return target


def test_loader_refuses_what_it_cannot_read(tmp_path):
    model = build(tiny_config(), "sdpa")
    good = adapter_file.save_adapter(_random_adapter(model), tmp_path / "good.safetensors")
    cases = [
        ({"format_version": "2"}, (), None, "format version '2'"),
        ({"format": "something else"}, (), None, "not a long-context adapter"),
        ({"rope_parameters": None}, (), None, "lacks the metadata rope_parameters"),
        ({"rank": "four"}, (), None, "unreadable metadata"),
        ({}, ("layers.1.mlp.up_proj.lora_B",), None, "no matching layers.1.mlp.up_proj.lora_B"),
        ({"rank": "8"}, (), None, "not \\[rank, in\\] and \\[out, rank\\] with rank 8"),
    ]
    for number, (metadata, drop, extra, message) in enumerate(cases):
        with pytest.raises(adapter_file.AdapterError, match=message):
            adapter_file.load_adapter(_resave(good, tmp_path / f"bad{number}.safetensors", metadata, drop, extra))
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(adapter_file.AdapterError, match="not a readable safetensors file"):
        adapter_file.load_adapter(tmp_path / "junk.safetensors")
    with pytest.raises(FileNotFoundError):
        adapter_file.load_adapter(tmp_path / "missing.safetensors")

    wider = build(tiny_config(head_dim=32), "sdpa")  # same layer count, other shapes
    with pytest.raises(adapter_file.AdapterError, match="trained for another model"):
        adapter_file.merge_adapter(wider, adapter_file.load_adapter(good))
    deeper = build(tiny_config(layers=3), "sdpa")
    with pytest.raises(adapter_file.AdapterError, match="7 projections without factors"):
        adapter_file.merge_adapter(deeper, adapter_file.load_adapter(good))


def test_long_context_default_needs_the_adapter_file(tmp_path, monkeypatch):

    monkeypatch.setattr(default_model, "SHIPPED_ADAPTER", tmp_path / "smollm2_long_context.safetensors")
    with pytest.raises(FileNotFoundError, match="does not ship it.*train-long-context"):
        default_model.load_default_model(long_context=True)
    with pytest.raises(FileNotFoundError, match="check the path"):
        default_model.load_default_model(adapter_path=tmp_path / "nothing.safetensors")


# -- the loss and training ------------------------------------------------------------------------------------
def test_chunked_loss_equals_the_full_loss_and_its_gradient():
    model = build(tiny_config(), "sdpa")
    wrappers = adapter_file.attach_lora(model, 4, 8.0)
    with torch.no_grad():
        for wrapper in wrappers.values():
            wrapper.lora_B.normal_(std=0.05)
    ids = torch.randint(0, 128, (2, 61), generator=torch.Generator().manual_seed(0))
    full = model(input_ids=ids, labels=ids).loss
    full.backward()
    reference = {name: w.lora_A.grad.clone() for name, w in wrappers.items()}
    model.zero_grad()
    chunked = long_context.causal_lm_loss(model, ids, chunk=16)  # 60 positions: chunks of 16, 16, 16, 12
    chunked.backward()
    torch.testing.assert_close(chunked, full, rtol=1e-5, atol=1e-6)
    for name, wrapper in wrappers.items():
        torch.testing.assert_close(wrapper.lora_A.grad, reference[name], rtol=1e-4, atol=1e-7)
    with torch.no_grad():
        torch.testing.assert_close(long_context.causal_lm_loss(model, ids, chunk=1000), full.detach(), rtol=1e-5, atol=1e-6)


def _repetitive_tokens(length=4096, period=7):
    pattern = torch.randint(1, 128, (period,), generator=torch.Generator().manual_seed(7))
    return pattern.repeat(length // period + 1)[:length]


def test_training_lowers_the_loss_and_leaves_the_model_alone(tmp_path):
    model = build(tiny_config(), "sdpa")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    config = long_context.LongContextTrainingConfig(rank=8, learning_rate=1e-2, warmup_steps=2, max_steps=40, loss_chunk=24)
    result = long_context.train_long_context(model, _repetitive_tokens(), 64, config, output=tmp_path / "a.safetensors",
                                   log_path=tmp_path / "log.jsonl", progress=False)
    first, last = result.losses[0], sum(result.losses[-5:]) / 5
    assert last < first - 1.0, f"loss {first:.3f} -> {last:.3f}"  # 4.82 -> 3.42 nats (LoRA on a random model)
    assert result.steps == 40 and result.tokens == 40 * 64 and result.stopped == "budget"
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), "weights and norms restored"
    assert not any(isinstance(m, adapter_file.LoRALinear) for m in model.modules())
    records = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 41))
    assert set(records[0]) >= {"step", "tokens", "loss", "lr", "seconds", "tokens_per_second"}
    assert records[0]["lr"] == pytest.approx(5e-3), "warm-up"
    assert records[-1]["lr"] == pytest.approx(1e-3, rel=0.05), "cosine decay to min_lr_ratio"
    merged = adapter_file.merge_adapter(model, adapter_file.load_adapter(result.path))
    ids = _repetitive_tokens(64)[None]
    with torch.no_grad():
        assert float(long_context.causal_lm_loss(merged, ids)) < first - 1.0, "the merged adapter keeps what was learnt"


class _Crash(Exception):
    pass


def test_resume_reaches_the_uninterrupted_state(tmp_path):
    config = long_context.LongContextTrainingConfig(rank=4, learning_rate=5e-3, warmup_steps=2, max_steps=6, checkpoint_every=3,
                                          loss_chunk=20)
    tokens = torch.randint(1, 128, (2000,), generator=torch.Generator().manual_seed(1))
    reference = long_context.train_long_context(build(tiny_config(), "sdpa"), tokens, 50, config, progress=False)

    def crash_at_5(record):
        if record["step"] == 5:
            raise _Crash

    checkpoint = tmp_path / "run.checkpoint.safetensors"
    with pytest.raises(_Crash):
        long_context.train_long_context(build(tiny_config(), "sdpa"), tokens, 50, config, checkpoint=checkpoint,
                              log_path=tmp_path / "log.jsonl", on_step=crash_at_5, progress=False)
    resumed = long_context.train_long_context(build(tiny_config(), "sdpa"), tokens, 50, config, checkpoint=checkpoint,
                                    resume=checkpoint, log_path=tmp_path / "log.jsonl", progress=False)
    assert resumed.resumed_from == 3 and resumed.steps == reference.steps == 6 and resumed.tokens == 300
    assert resumed.losses == pytest.approx(reference.losses[3:], rel=1e-6)
    for name, (lora_a, lora_b) in reference.adapter.lora.items():
        torch.testing.assert_close(resumed.adapter.lora[name][0], lora_a, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(resumed.adapter.lora[name][1], lora_b, rtol=1e-6, atol=1e-7)
    for name, weight in reference.adapter.norms.items():
        torch.testing.assert_close(resumed.adapter.norms[name], weight, rtol=1e-6, atol=1e-7)
    steps = [json.loads(line)["step"] for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 4, 5, 6], "the log goes on (the crashed step 4-5 are redone)"

    stop_at_2 = long_context.train_long_context(build(tiny_config(), "sdpa"), tokens, 50, config, checkpoint=tmp_path / "b",
                                      on_step=lambda record: record["step"] == 2, progress=False)
    assert stop_at_2.stopped == "requested" and stop_at_2.steps == 2
    with pytest.raises(ValueError, match="rank"):
        long_context.train_long_context(build(tiny_config(), "sdpa"), tokens, 50,
                              long_context.LongContextTrainingConfig(rank=8, max_steps=6), resume=checkpoint, progress=False)
    with pytest.raises(ValueError, match="other token data"):
        long_context.train_long_context(build(tiny_config(), "sdpa"), tokens + 1, 50, config, resume=checkpoint, progress=False)


def test_deadline_stops_cleanly_and_saves(tmp_path):
    config = long_context.LongContextTrainingConfig(rank=4, max_minutes=1e-9, loss_chunk=32)
    result = long_context.train_long_context(build(tiny_config(), "sdpa"), _repetitive_tokens(), 32, config,
                                   output=tmp_path / "a.safetensors", checkpoint=tmp_path / "ckpt", progress=False)
    assert result.stopped == "deadline" and result.steps == 0
    assert result.path.is_file() and (tmp_path / "ckpt").is_file()
    with pytest.raises(ValueError, match="set a budget"):
        long_context.LongContextTrainingConfig()


# -- data -----------------------------------------------------------------------------------------------------
def _fake_sources(tmp_path):
    site = tmp_path / "site-packages"
    for package, files in {"alpha": 3, "beta": 2}.items():
        for i in range(files):
            path = site / package / ("sub" if i else "") / f"m{i}.py"
            path.parent.mkdir(parents=True, exist_ok=True)
            functions = "".join(f"def f{j}():\n    return {j}\n" for j in range(400 * (i + 1)))
            path.write_text(f"# {package} {i}\n" + functions)
    (site / "alpha-1.0.dist-info").mkdir()
    (site / "alpha-1.0.dist-info" / "x.py").write_text("skipped")
    (site / "typing_extensions.py").write_text("a stdlib backport: skipped")
    (site / "beta" / "_vendor").mkdir()
    (site / "beta" / "_vendor" / "typing_extensions.py").write_text("a vendored backport: skipped")
    (site / "single.py").write_text("VALUE = 1\n" * 50)
    prose = tmp_path / "prose"
    (prose / "manual").mkdir(parents=True)
    (prose / "manual" / "a.txt").write_text("The tool reads its input line by line. " * 3000)
    with lzma.open(prose / "manual" / "b.txt.xz", "wt", encoding="utf-8") as handle:
        handle.write("Options are given before the file names. " * 2000)
    (prose / "other.txt").write_text("A short note. " * 10)
    (prose / "ignored.md").write_text("not prose of ours")
    return site, prose


def test_documents_group_packages_and_prose(tmp_path):
    site, prose = _fake_sources(tmp_path)
    sources = long_documents.long_documents(prose, site_packages=site, split="all", max_document_chars=40_000)
    names = [d.name for d in sources["code"]]
    assert names == ["code:alpha#0", "code:alpha#1", "code:beta#0", "code:top-level modules#0"]
    alpha = sources["code"][0]
    assert [os.path.relpath(p, site) for p in alpha.paths] == ["alpha/m0.py", "alpha/sub/m1.py"]
    assert [os.path.relpath(p, site) for p in sources["code"][1].paths] == ["alpha/sub/m2.py"], "cut under the cap"
    assert sources["code"][0].read().startswith("# alpha/m0.py\n# alpha 0")
    assert [d.name for d in sources["prose"]] == ["prose:.#0", "prose:manual#0", "prose:manual#1"]
    assert "Options are given" in sources["prose"][2].read(), ".xz read with lzma"
    assert all(".dist-info" not in p and "typing_extensions" not in p for d in sources["code"] for p in d.paths)
    common = dict(site_packages=site, heldout_share=0.5, max_document_chars=40_000)
    train = long_documents.long_documents(prose, **common)
    heldout = long_documents.long_documents(prose, **common, split="heldout")
    train_names = {d.name for docs in train.values() for d in docs}
    heldout_names = {d.name for docs in heldout.values() for d in docs}
    assert train_names and heldout_names and not train_names & heldout_names
    assert train_names | heldout_names == {d.name for docs in sources.values() for d in docs}


def test_stream_is_deterministic_packs_to_length_and_resumes(tmp_path):
    site, prose = _fake_sources(tmp_path)
    sources = long_documents.long_documents(prose, site_packages=site, split="all", max_document_chars=40_000)
    tokenizer = CharTokenizer()

    def stream(seed=0):
        return long_documents.LongDocumentStream(sources, tokenizer, [1000, 3000], seed=seed, retrieval_share=0.2)

    first = [next(stream_a) for stream_a in [stream()] for _ in range(12)]
    again = stream()
    assert all(torch.equal(a, next(again)) for a in first)
    assert {len(s) for s in first} == {1000, 3000}
    other = stream(seed=1)
    assert not all(torch.equal(a, next(other)) for a in first[:4])
    text = "".join(tokenizer.decode(s.tolist()) for s in first)
    assert "|" in text, "documents are separated by EOS"
    assert "def f" in text and ("line by line" in text or "Options are" in text), "both sources are used"

    partial = stream()
    for _ in range(5):
        next(partial)
    state = json.loads(json.dumps(partial.state_dict()))
    restored = stream()
    restored.load_state_dict(state)
    assert all(torch.equal(next(restored), first[i]) for i in range(5, 12))
    with pytest.raises(ValueError, match="seed"):
        stream(seed=3).load_state_dict(state)

    code_only = long_documents.LongDocumentStream(sources["code"], tokenizer, 70_000, retrieval_share=0.0)
    long_sequence = next(code_only)  # longer than a tokenizer piece and than some documents
    assert len(long_sequence) == 70_000
    joined = "|".join(d.read() for d in sources["code"])
    decoded = tokenizer.decode(long_sequence.tolist())
    assert decoded.split("|")[1] in joined, "a document's text survives tokenization in pieces"


def test_training_data_never_reads_the_standard_library(monkeypatch):
    documents = long_documents.package_documents(max_document_chars=100_000)
    paths = [os.path.realpath(p) for d in documents for p in d.paths]
    assert len(paths) > 100
    stdlib = os.path.realpath(sysconfig.get_paths()["stdlib"])
    own = os.path.realpath(os.path.dirname(hf_sparse.__file__))
    assert not any(long_documents.is_stdlib_path(p) for p in paths)
    assert not any(p.startswith(own + os.sep) for p in paths), "hf_sparse itself is left out"
    assert long_documents.is_stdlib_path(os.path.join(stdlib, "pydoc_data", "topics.py"))  # stdlib_prose's source
    assert long_documents.is_stdlib_path(os.path.join(stdlib, "os.py"))

    opened: list[str] = []
    real_open = builtins.open

    def recording_open(file, *args, **kwargs):
        opened.append(os.path.realpath(file) if isinstance(file, (str, os.PathLike)) else str(file))
        return real_open(file, *args, **kwargs)

    stream = long_documents.LongDocumentStream(documents, CharTokenizer(), 20_000, retrieval_share=0.5)
    monkeypatch.setattr(builtins, "open", recording_open)
    for _ in range(4):
        next(stream)
    monkeypatch.setattr(builtins, "open", real_open)
    assert opened and not any(long_documents.is_stdlib_path(p) for p in opened)


def test_retrieval_sequence_states_and_asks_for_its_number():
    tokenizer = CharTokenizer()
    hay = "abcdefghij" * 1000

    def haystack(count):
        return tokenizer(hay[:count]).input_ids

    for seed in range(20):
        ids, number = long_documents.retrieval_sequence(haystack, tokenizer, 800, random.Random(seed))
        text = tokenizer.decode(ids)
        assert len(ids) == 800 and 5 <= len(number) <= 7 and number.isdigit()
        assert text.count(number) == 2, text
        assert text.endswith(f" {number}.|"), "the answer and EOS end the sequence"
        assert "pass key" not in text and "The grass is green" not in text, "not the demo's evaluation text"
    with pytest.raises(ValueError, match="needs more than"):
        long_documents.retrieval_sequence(haystack, tokenizer, 30, random.Random(0))


# -- the real model (slow) ------------------------------------------------------------------------------------
@pytest.mark.slow
def test_default_model_yarn_from_max_length_and_adapter_from_the_cli(tmp_path, capsys):
    from hf_sparse.tools.cli import main
    from hf_sparse.tools.default_model import load_default_model

    model, _ = load_default_model(max_length=40_000)
    assert model.config.rope_parameters == {"rope_type": "yarn", "factor": 5.0,
                                            "original_max_position_embeddings": 8192, "rope_theta": 100_000.0}
    assert model.config.max_position_embeddings == 40_960

    (tmp_path / "prose").mkdir()
    (tmp_path / "prose" / "notes.txt").write_text("The tool reads its input line by line and prints a summary. " * 400)
    out = tmp_path / "adapter.safetensors"
    assert main(["train-long-context", "--model", "default", "--no-packages", "--data-dir", str(tmp_path / "prose"),
                 "--seq-length", "64", "--max-steps", "1", "--rank", "2", "--yarn-factor", "2", "--out", str(out),
                 "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "tokens/min" in printed and out.is_file() and (tmp_path / "adapter.log.jsonl").is_file()
    adapter = adapter_file.load_adapter(out)
    assert adapter.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct" and adapter.seq_length == 64
    assert adapter.tokens_trained == 64 and adapter.rope_parameters["factor"] == 2.0
    long, _ = load_default_model(adapter_path=out)
    assert long.config.rope_parameters == adapter.rope_parameters and long.config.max_position_embeddings == 16_384
    longer, _ = load_default_model(adapter_path=out, max_length=20_000)
    assert longer.config.rope_parameters["factor"] == 3.0, "beyond the adapter's rope: factor raised to cover it"
    delta = (long.model.layers[0].self_attn.q_proj.weight - model.model.layers[0].self_attn.q_proj.weight).abs().max()
    assert delta > 0, "the adapter is merged"


@pytest.mark.slow
def test_cli_picks_the_yarn_factor_from_the_prompt(monkeypatch):
    from hf_sparse.tools import cli

    seen = []

    def fake_load(*args, **kwargs):
        seen.append(kwargs)
        raise _Crash

    monkeypatch.setattr(cli, "load_default_model", fake_load)
    prompt = "word " * 300
    with pytest.raises(_Crash):
        cli.main(["generate", "--prompt", prompt, "--max-new-tokens", "9000", "--method", "sdpa"])
    from transformers import AutoTokenizer

    prompt_tokens = len(AutoTokenizer.from_pretrained(default_model.default_model_dir())(prompt).input_ids)
    assert seen[-1]["max_length"] == prompt_tokens + 9000 and not seen[-1]["long_context"]
    with pytest.raises(_Crash):
        cli.main(["generate", "--prompt", prompt, "--long-context", "--method", "sdpa"])
    assert seen[-1]["long_context"]
    with pytest.raises(SystemExit, match="--long-context gives the long-context default"):
        cli.main(["generate", "--prompt", prompt, "--long-context", "--rope-scaling", "yarn:2"])
    with pytest.raises(SystemExit, match="yarn:FACTOR"):
        cli.main(["generate", "--prompt", prompt, "--rope-scaling", "linear:2"])


@pytest.mark.slow
def test_the_shipped_adapter_makes_the_long_context_default_model(smollm2):
    """The adapter in the package (trained on an H100, docs/quality.md) loads into the default model with the rope
    it was trained with, and on 1,024 tokens of held-out prose the merged model predicts no worse than the base."""
    from hf_sparse.tools.default_model import load_default_model
    from hf_sparse.tools.eval import held_out_sequences

    adapter = adapter_file.load_adapter(adapter_file.SHIPPED_ADAPTER)
    assert adapter.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct" and adapter.rope_parameters["factor"] == 16.0
    assert adapter.tokens_trained > 1_000_000 and adapter_file.SHIPPED_ADAPTER.stat().st_size < 16 * 2**20
    base, tokenizer = smollm2
    long, _ = load_default_model(long_context=True)
    assert long.config.rope_parameters == adapter.rope_parameters and long.config.max_position_embeddings == 131_072
    ids = held_out_sequences(tokenizer, 1024, 1)
    with torch.no_grad():
        base_loss, long_loss = base(ids, labels=ids).loss.item(), long(ids, labels=ids).loss.item()
    assert long_loss < base_loss + 0.05, (long_loss, base_loss)  # measured: 2.486 against 2.543
