import pytest

from hf_sparse.tools.cli import config_from_overrides, main


def test_overrides_parse_and_validate():
    config = config_from_overrides(["block_size=64", "prefill_top_k=4,6", "dense_below=none", "dense_layers=0,-1"])
    assert config.block_size == 64 and config.prefill_top_k == (4, 6) and config.dense_below is None
    assert config.dense_layers == (0, -1)
    with pytest.raises(SystemExit, match="block_size"):
        config_from_overrides(["block_size=100"])
    with pytest.raises(SystemExit, match="field=value"):
        config_from_overrides(["blocksize=64"])


def test_generate_and_eval_commands(capsys, tmp_path):
    assert main(["generate", "--prompt", "The capital of France is", "--max-new-tokens", "4",
                 "--set", "dense_below=0", "--set", "block_size=16", "--set", "prefill_top_k=1,1"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip()
    assert "[plas]" in captured.err and "density prefill" in captured.err
    text = tmp_path / "input.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 60)
    assert main(["eval", "--prompt-file", str(text), "--tokens", "600", "--last-n", "64",
                 "--set", "block_size=32", "--set", "prefill_top_k=3,4", "--set", "dense_below=0"]) == 0
    table = capsys.readouterr().out
    assert "top-1 agreement" in table and "recall" in table
    assert "dense: dense_layers" in table


def test_eval_compares_a_gate_file_with_mean_pooling(capsys, tmp_path):
    """`hf-sparse eval --gates FILE` prints mean pooling and the gate file side by side; a bad file is refused with
    the gate loader's message."""
    import torch

    from hf_sparse.tools.default_model import load_default_model
    from hf_sparse.gate_files import write_gate_file
    from hf_sparse.gates import gate_spec, mean_pooling_gates

    model, _ = load_default_model()
    generator = torch.Generator().manual_seed(0)
    gates = {layer: gate * torch.rand(gate.shape, generator=generator) * 2
             for layer, gate in mean_pooling_gates(model, 32).items()}
    path = write_gate_file(gates, tmp_path / "gates.safetensors", gate_spec(model, 32))
    text = tmp_path / "input.txt"
    text.write_text("def add(a, b):\n    return a + b\n" * 40)
    common = ["eval", "--prompt-file", str(text), "--tokens", "320", "--last-n", "32", "--no-recall",
              "--set", "block_size=32", "--set", "prefill_top_k=3,4", "--set", "dense_below=0"]
    assert main(common + ["--gates", str(path)]) == 0
    table = capsys.readouterr().out
    assert "mean pooling" in table and f"gates {path}" in table
    kl = next(line for line in table.splitlines() if line.startswith("next-token KL")).split()[-2:]
    assert len(kl) == 2 and kl[0] != kl[1]  # another selection, another KL
    with pytest.raises(SystemExit, match="--gates"):
        main(common + ["--set", "block_size=64", "--gates", str(path)])  # made for block 32
