"""Gate distillation: the objective against a brute-force spec, and training on SmolLM2 (small settings)."""
from __future__ import annotations

import glob
import hashlib
import math
import os
import signal

import pytest
import torch
import transformers
from safetensors import safe_open

from hf_sparse import gate_files
from hf_sparse import gates
from hf_sparse.tools import gate_eval
from hf_sparse.tools import gate_objective
from hf_sparse.tools import gate_training
from hf_sparse.tools import text_data
from hf_sparse.tools.cli import main as cli_main

from conftest import build, tiny_config

SEQ = 256
BLOCK = 64
LAYERS = (2, 3)


def _brute_force_loss(query, key, gate, block_size, scale, sink_blocks, pool="max", ranking_top_k=None):
    """The objective written out one query at a time (the spec ``gate_distillation_loss`` must match)."""
    _, q_heads, length, dim = query.shape
    group = q_heads // key.shape[1]
    total, count = 0.0, 0
    for h in range(q_heads):
        k = key[0, h // group].double()
        num_blocks = math.ceil(length / block_size)
        summaries = []
        for j in range(num_blocks):
            block = k[j * block_size : (j + 1) * block_size]
            if gate is None:
                summaries.append(block.mean(0))
            else:
                summaries.append((block * gate[h // group, : block.shape[0]].double()).sum(0))
        summaries = torch.stack(summaries)
        for i in range(block_size, length):
            q = query[0, h, i].double()
            probs = torch.softmax(k[: i + 1] @ q * scale, dim=0)
            blocks = list(range(i // block_size + 1))
            if sink_blocks is not None:  # PLAS always attends these: not ranked by the gate
                blocks = [j for j in blocks if j >= sink_blocks and j != i // block_size]
            if len(blocks) < 2:
                continue
            reduce = torch.max if pool == "max" else torch.sum
            target = torch.stack([reduce(probs[j * block_size : (j + 1) * block_size]) for j in blocks])
            target = target / target.sum()
            logits = summaries[blocks] @ q * scale
            if ranking_top_k is None:
                total += float((target * (target.log() - torch.log_softmax(logits, dim=0))).sum())
            else:  # Plackett-Luce: the target's r-th best must outscore every block not yet placed
                order = target.argsort(descending=True)
                total += sum(float(torch.logsumexp(logits[order[r:]], 0) - logits[order[r]])
                             for r in range(min(ranking_top_k, len(blocks))))
            count += 1
    return total / count


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("sink_blocks", [None, 1])
@pytest.mark.parametrize("pool", ["max", "sum"])
def test_objective_matches_brute_force(gated, sink_blocks, pool):
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 4, 72, 8, generator=generator)
    key = torch.randn(1, 2, 72, 8, generator=generator)
    gate = torch.rand(2, 16, 8, generator=generator) / 16 if gated else None
    loss = gate_objective.gate_distillation_loss(query, key, gate, 16, scale=0.5, query_chunk=7, sink_blocks=sink_blocks,
                                           pool=pool)
    assert loss.item() > 0
    expected = _brute_force_loss(query, key, gate, 16, 0.5, sink_blocks, pool)
    assert loss.item() == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("sink_blocks", [None, 1])
@pytest.mark.parametrize("top_k", [1, 3, 9])
def test_ranking_objective_matches_brute_force(sink_blocks, top_k):
    generator = torch.Generator().manual_seed(2)
    query = torch.randn(1, 4, 88, 8, generator=generator)
    key = torch.randn(1, 2, 88, 8, generator=generator)
    gate = (torch.rand(2, 16, 8, generator=generator) / 16).requires_grad_()
    loss = gate_objective.gate_distillation_loss(query, key, gate, 16, scale=0.5, query_chunk=7, sink_blocks=sink_blocks,
                                           pool="sum", objective="ranking", ranking_top_k=top_k)
    expected = _brute_force_loss(query, key, gate.detach(), 16, 0.5, sink_blocks, "sum", ranking_top_k=top_k)
    assert expected > 0 and loss.item() == pytest.approx(expected, rel=1e-5)
    loss.backward()  # rows with nothing or one block to rank give no NaN
    assert torch.isfinite(gate.grad).all() and gate.grad.abs().sum() > 0


def test_gradient_reaches_only_the_gate():
    generator = torch.Generator().manual_seed(1)
    query = torch.randn(1, 4, 64, 8, generator=generator, requires_grad=True)
    key = torch.randn(1, 2, 64, 8, generator=generator, requires_grad=True)
    gate = torch.full((2, 16, 8), 1 / 16, requires_grad=True)
    gate_objective.gate_distillation_loss(query.detach(), key.detach(), gate, 16, scale=0.5).backward()
    assert gate.grad is not None and torch.isfinite(gate.grad).all() and gate.grad.abs().sum() > 0
    assert query.grad is None and key.grad is None


def _texts() -> list[str]:
    root = os.path.dirname(transformers.__file__)
    return text_data.read_text_files(sorted(glob.glob(os.path.join(root, "models", "llama", "*.py"))))


def _weights_hash(model) -> str:
    digest = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _config(**overrides) -> gate_training.GateTrainingConfig:
    settings = dict(seq_length=SEQ, block_size=BLOCK, layers=LAYERS, max_tokens=SEQ * 10, learning_rate=2e-3,
                    warmup_steps=2, checkpoint_every=3, seed=0)
    settings.update(overrides)
    return gate_training.GateTrainingConfig(**settings)


def test_training_on_smollm2_lowers_the_loss_and_leaves_the_model_alone(smollm2, tmp_path):
    model, tokenizer = smollm2
    before = _weights_hash(model)
    requires_grad = [p.requires_grad for p in model.parameters()]
    sequences = text_data.pack_sequences(text_data.token_stream(_texts(), tokenizer, 4 * SEQ), SEQ)
    assert sequences.shape == (4, SEQ)
    # 4 epochs over 4 sequences: each epoch sees every sequence once (seeded order), so epoch means compare.
    result = gate_training.train_gates(model, sequences, _config(max_tokens=SEQ * 16), output_dir=tmp_path, progress=False)
    try:
        assert _weights_hash(model) == before, "model weights unchanged"
        assert [p.requires_grad for p in model.parameters()] == requires_grad
        assert model.config._attn_implementation == "sdpa"
        assert result.steps == 16 and len(result.losses) == 16 and sorted(result.gates) == list(LAYERS)
        epochs = [sum(result.losses[i : i + 4]) / 4 for i in range(0, 16, 4)]
        assert epochs[-1] < 0.5 * epochs[0], f"loss per epoch {epochs}"
        assert result.path == tmp_path / gate_files.GATE_FILENAME
        on_disk = gate_files.read_gate_file(result.path, gates.gate_spec(model, BLOCK))
        assert all(torch.equal(on_disk[i], result.gates[i]) for i in LAYERS)
        assert all(torch.equal(gates.get_gates(model)[i], result.gates[i]) for i in LAYERS), "attached"
    finally:
        gates.set_gates(model, None)


def _file_contents(path) -> tuple[dict, dict]:
    """Metadata and tensor bytes of a safetensors file (its header's key order is not stable across writes)."""
    with safe_open(str(path), framework="pt") as handle:
        return handle.metadata(), {name: handle.get_tensor(name).numpy().tobytes() for name in handle.keys()}


class _Crash(Exception):
    pass


def test_interrupted_runs_resume_to_the_uninterrupted_result(smollm2, tmp_path):
    model, tokenizer = smollm2
    texts = _texts()
    handler = signal.getsignal(signal.SIGINT)  # the default one, or SIG_IGN under a runner started with nohup / &
    try:
        reference = gate_training.train_gates(model, texts, _config(), tokenizer=tokenizer, output_dir=tmp_path / "a",
                                         progress=False)

        def crash_at_5(step, loss):  # a hard failure: everything after the step-3 checkpoint is redone
            if step == 5:
                raise _Crash

        with pytest.raises(_Crash):
            gate_training.train_gates(model, texts, _config(), tokenizer=tokenizer, output_dir=tmp_path / "b",
                                 progress=False, on_step=crash_at_5)
        resumed = gate_training.train_gates(model, texts, _config(), tokenizer=tokenizer, output_dir=tmp_path / "b",
                                       progress=False)
        assert resumed.resumed_from == 3

        def interrupt_at_4(step, loss):  # Ctrl-C: handled between steps, checkpointed, nothing lost
            if step == 4:
                os.kill(os.getpid(), signal.SIGINT)

        with pytest.raises(KeyboardInterrupt, match="interrupted after step 4"):
            gate_training.train_gates(model, texts, _config(), tokenizer=tokenizer, output_dir=tmp_path / "c",
                                 progress=False, on_step=interrupt_at_4)
        assert signal.getsignal(signal.SIGINT) is handler, "handler restored"
        interrupted = gate_training.train_gates(model, texts, _config(), tokenizer=tokenizer, output_dir=tmp_path / "c",
                                           progress=False)
        assert interrupted.resumed_from == 4
        for run in (resumed, interrupted):
            assert run.losses == reference.losses
            assert all(torch.equal(run.gates[i], reference.gates[i]) for i in LAYERS)
            assert _file_contents(tmp_path / "a" / gate_files.GATE_FILENAME) == _file_contents(run.path)

        with pytest.raises(ValueError, match="learning_rate: 0.002 -> 0.001"):
            gate_training.train_gates(model, texts, _config(learning_rate=1e-3), tokenizer=tokenizer,
                                 output_dir=tmp_path / "a", progress=False)
        other_seed = gate_training.train_gates(model, texts, _config(seed=1), tokenizer=tokenizer, progress=False)
        assert not torch.equal(other_seed.gates[LAYERS[0]], reference.gates[LAYERS[0]]), "the seed sets the data order"
    finally:
        gates.set_gates(model, None)


def test_log_held_out_evaluations_and_a_deadline_that_resumes(smollm2, tmp_path, monkeypatch):
    """The JSON-lines log holds every step and the held-out evaluations (before the first step: the initial gates,
    mean pooling; every eval_every steps; after the last); a time budget stops the run between steps with a
    checkpoint and nothing attached, and the same call resumes to the uninterrupted result, appending to the log."""
    import json

    model, tokenizer = smollm2
    texts = _texts()
    seen = []

    def evaluate(current):
        seen.append({layer: gate.clone() for layer, gate in current.items()})
        return {"mean_gate": float(sum(gate.mean() for gate in current.values()) / len(current))}

    def read(path):
        return [json.loads(line) for line in path.read_text().splitlines()]

    try:
        reference = gate_training.train_gates(model, texts, _config(), tokenizer=tokenizer, output_dir=tmp_path / "a",
                                         progress=False, log_path=tmp_path / "a.jsonl", evaluate=evaluate,
                                         eval_every=4)
        lines = read(tmp_path / "a.jsonl")
        steps = [line for line in lines if "loss" in line]
        evals = [line for line in lines if "eval" in line]
        assert [line["step"] for line in steps] == list(range(1, 11))
        assert [line["loss"] for line in steps] == reference.losses
        assert all(line["tokens"] == line["step"] * SEQ and line["tokens_per_second"] > 0 for line in steps)
        assert [line["step"] for line in evals] == [0, 4, 8, 10]
        assert all(torch.all(gate == 1.0 / BLOCK) for gate in seen[0].values()), "step 0: the initial gates"
        assert all(torch.equal(seen[-1][i], reference.gates[i]) for i in LAYERS), "the last: the trained gates"
        assert evals[0]["eval"] == {"mean_gate": pytest.approx(1.0 / BLOCK)}

        clock = iter(range(0, 10_000, 10))  # each reading of the clock 10 s later: steps of 10 s
        monkeypatch.setattr(gate_training, "_now", lambda: next(clock))
        gates.set_gates(model, None)
        stopped = gate_training.train_gates(model, texts, _config(), tokenizer=tokenizer, output_dir=tmp_path / "b",
                                       progress=False, log_path=tmp_path / "b.jsonl", evaluate=evaluate,
                                       eval_every=4, max_minutes=1.0)
        assert stopped.stopped == "deadline" and stopped.path is None and len(stopped.losses) == 2
        assert not gates.get_gates(model), "nothing attached at a deadline"
        assert not (tmp_path / "b" / gate_files.GATE_FILENAME).exists()
        monkeypatch.setattr(gate_training, "_now", __import__("time").monotonic)
        resumed = gate_training.train_gates(model, texts, _config(), tokenizer=tokenizer, output_dir=tmp_path / "b",
                                       progress=False, log_path=tmp_path / "b.jsonl", evaluate=evaluate,
                                       eval_every=4)
        assert resumed.resumed_from == 2 and resumed.losses == reference.losses
        assert all(torch.equal(resumed.gates[i], reference.gates[i]) for i in LAYERS)
        lines = read(tmp_path / "b.jsonl")
        assert [line["step"] for line in lines if "loss" in line] == list(range(1, 11))
        assert [line["step"] for line in lines if "eval" in line] == [0, 4, 8, 10]
        with pytest.raises(ValueError, match="max_minutes"):
            gate_training.train_gates(model, texts, _config(), tokenizer=tokenizer, progress=False, max_minutes=0)
    finally:
        gates.set_gates(model, None)


def test_cli_train_gates(smollm2, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    for i, text in enumerate(_texts()):
        (data / f"part{i}.py").write_text(text)
    out = tmp_path / "out"
    code = cli_main(["train-gates", "--model", "default", "--data", str(data), "--tokens", str(3 * SEQ),
                     "--out", str(out), "--seq-length", str(SEQ), "--block-size", str(BLOCK), "--layers", "0",
                     "--checkpoint-every", "2", "--no-progress"])
    assert code == 0
    assert "trained 1 layer gate(s) on 768 tokens in 3 steps" in capsys.readouterr().out
    model, _ = smollm2
    written = gate_files.read_gate_file(out / gate_files.GATE_FILENAME, gates.gate_spec(model, BLOCK))
    assert sorted(written) == [0]
    assert (out / gate_training.CHECKPOINT_FILENAME).is_file()


def test_cli_train_gates_options_reach_the_config(smollm2, tmp_path, monkeypatch):
    """--target, --objective, --ranking-top-k, --include-forced and --data stdlib (beside a folder) become the run's
    settings and texts."""
    seen = {}

    def fake_train(model, texts, config, **kwargs):
        seen.update(config=config, texts=texts)
        return gate_training.GateTrainingResult({}, [0.5], 1, SEQ, 0, None)

    monkeypatch.setattr(gate_training, "train_gates", fake_train)
    data = tmp_path / "data"
    data.mkdir()
    (data / "own.py").write_text("x = 1\n")
    code = cli_main(["train-gates", "--model", "default", "--data", "stdlib", str(data), "--tokens", str(SEQ),
                     "--out", str(tmp_path / "out"), "--seq-length", str(SEQ), "--target", "sum",
                     "--objective", "ranking", "--ranking-top-k", "5", "--include-forced", "--no-progress"])
    assert code == 0
    config = seen["config"]
    assert config.target == "sum" and config.skip_forced_blocks is False
    assert config.objective == "ranking" and config.ranking_top_k == 5
    with pytest.raises(ValueError, match="objective must be one of"):
        gate_training.GateTrainingConfig(objective="listwise")
    from hf_sparse.tools.eval import stdlib_training_files

    assert len(seen["texts"]) == len(stdlib_training_files()) + 1 and seen["texts"][-1] == "x = 1\n"


def test_cli_train_gates_long_context_log_eval_and_deadline(smollm2, tmp_path, monkeypatch, capsys):
    """--long-context loads the long-context default model at the run's length; --log, --eval-every (held-out
    prose through evaluate_gates) and --max-minutes reach train_gates; a deadline stop says how to resume."""

    model, tokenizer = smollm2
    seen = {}

    def fake_load(**kwargs):
        seen["load"] = kwargs
        return model, tokenizer

    def fake_train(model, texts, config, **kwargs):
        seen.update(kwargs)
        seen["metrics"] = kwargs["evaluate"]({})
        return gate_training.GateTrainingResult({}, [0.5, 0.4], 9, 9 * SEQ, 0, None, "deadline")

    monkeypatch.setattr(gate_training, "load_default_model", fake_load)
    monkeypatch.setattr(gate_training, "train_gates", fake_train)
    monkeypatch.setattr(gate_training, "evaluate_gates", lambda *args, **kwargs: gate_eval.GateMetrics(
        kl=0.5, top1=0.25, kl_all=0.0, top1_all=0.0, recall=0.75, oracle_recall=0.875, density=0.25, per_layer={}))
    (tmp_path / "own.py").write_text("x = 1\n" * 50)
    out = tmp_path / "out"
    code = cli_main(["train-gates", "--model", "default", "--long-context", "--data", str(tmp_path / "own.py"),
                     "--tokens", str(SEQ), "--out", str(out), "--seq-length", str(SEQ), "--eval-every", "5",
                     "--eval-length", str(2 * SEQ), "--max-minutes", "7.5", "--no-progress", "--device", "cpu"])
    assert code == 0
    assert seen["load"]["long_context"] is True and seen["load"]["adapter_path"] is None
    assert seen["load"]["max_length"] == 2 * SEQ
    assert seen["eval_every"] == 5 and seen["max_minutes"] == 7.5
    assert seen["log_path"] == str(out / "gate_training.log.jsonl")
    assert seen["metrics"] == {"kl": 0.5, "top1": 0.25, "recall": 0.75, "oracle_recall": 0.875, "density": 0.25}
    assert "stopped at the --max-minutes deadline after 2 of 9 steps" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--long-context needs --model default"):
        cli_main(["train-gates", "--model", str(tmp_path), "--long-context", "--data", str(tmp_path / "own.py"),
                  "--tokens", str(SEQ), "--out", str(out)])


def test_evaluate_gates_mean_pooling_equals_constant_gates():
    model = build(tiny_config(layers=2), "sdpa")
    ids = torch.randint(0, 128, (1, 96), generator=torch.Generator().manual_seed(0))
    constant = gates.mean_pooling_gates(model, block_size=16)
    constant[1] = torch.full_like(constant[0], 1 / 16)
    a = gate_eval.evaluate_gates(model, ids, None, layers=[0, 1], block_size=16)
    b = gate_eval.evaluate_gates(model, ids, constant, layers=[0, 1], block_size=16)
    assert a.kl == pytest.approx(b.kl, rel=1e-5) and a.recall == pytest.approx(b.recall, rel=1e-6)
    assert 0 < a.recall <= a.oracle_recall <= 1 + 1e-6 and 0 <= a.top1 <= 1 and 0 < a.density <= 1
    assert set(a.per_layer) == {0, 1}


def test_training_data_and_held_out_prose_are_disjoint():
    """Gate training reads the stdlib's package sources; the held-out prose comes from files it never reads."""
    import sysconfig

    from hf_sparse.tools.eval import stdlib_prose, stdlib_training_files, stdlib_text

    root = sysconfig.get_paths()["stdlib"]
    files = stdlib_training_files()
    assert len(files) > 100 and files == sorted(files)
    for path in files:
        parts = os.path.relpath(path, root).split(os.sep)
        assert len(parts) > 1 and parts[0] not in ("pydoc_data", "site-packages", "dist-packages"), path
    prose = stdlib_prose()
    assert len(prose) > 500_000 and prose.startswith("The \"assert\" statement")  # the reference's topics first
    assert stdlib_text(1000)[:1000] not in prose  # the benchmarks' top-level source is not the prose either
    # No training file holds a stretch of the held-out prose (samples across it).
    training_text = "".join(text_data.read_text_files(files))
    for start in range(0, len(prose) - 300, len(prose) // 25):
        assert prose[start:start + 300] not in training_text, prose[start:start + 80]
