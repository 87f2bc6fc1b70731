import pytest

from hf_sparse.cli import config_from_overrides, main


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
