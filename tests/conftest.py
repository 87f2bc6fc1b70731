"""Shared fixtures: tiny random-init models and the embedded SmolLM2 model."""
from __future__ import annotations

import copy
import os

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, PreTrainedTokenizerFast, Qwen2Config

import hf_sparse  # noqa: F401  (registers "plas")

torch.set_num_threads(max(1, min(4, os.cpu_count() or 1)))


def _patch_language_once_per_launch() -> None:
    """Triton's interpreter re-patches ``triton.language`` (an ``inspect.getmembers`` scan of four namespaces) at
    every call of a ``@triton.jit`` helper inside a kernel, though the kernel's launch has patched it already and
    the helpers see the same modules: a quarter of an interpreted run's time in our kernels, which call helpers in
    their loops. Skip the re-patch where every ``triton.language`` namespace the function sees is patched already
    (its ``load`` is then the interpreter's); a launch still patches and restores as before. Values are unchanged:
    the helpers run with the patch in place."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return
    patch = getattr(interpreter, "_patch_lang", None)
    if patch is None or not hasattr(interpreter, "_LangPatchScope") or not tl.core.is_builtin(tl.load):
        return

    def patch_unless_patched(fn):
        langs = [value for value in fn.__globals__.values() if value is tl or value is tl.core]
        if langs and not any(tl.core.is_builtin(getattr(lang, "load", None)) for lang in langs):
            return interpreter._LangPatchScope()  # every namespace the function sees is patched already
        return patch(fn)

    interpreter._patch_lang = patch_unless_patched


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_language_once_per_launch()

#: Where the model tests run: the CPU always (the Triton path there in the interpreter), CUDA with ``-m gpu``.
MODEL_DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1", reason="needs CUDA")])]

ARCHS = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "mistral": MistralConfig,
}


#: A chat template of the plainest kind, for tokenizers trained in tests.
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
                 "{% if add_generation_prompt %}<s>assistant\n{% endif %}")


def trained_tokenizer(texts: list[str], vocab_size: int, chat_template: bool = True) -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer of ``vocab_size`` ids trained on ``texts`` (no download), with ``<s>`` / ``</s>``
    and, unless ``chat_template=False``, :data:`CHAT_TEMPLATE`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")
    if chat_template:
        fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(arch: str = "llama", q_heads: int = 4, kv_heads: int = 2, head_dim: int = 16, layers: int = 2):
    """A small random-init decoder config (no download)."""
    kwargs = dict(vocab_size=128, hidden_size=q_heads * head_dim, intermediate_size=64, num_hidden_layers=layers,
                  num_attention_heads=q_heads, num_key_value_heads=kv_heads, max_position_embeddings=4096)
    if arch == "llama":
        kwargs["head_dim"] = head_dim
    if arch in ("mistral", "qwen2"):
        kwargs["sliding_window"] = None
    return ARCHS[arch](**kwargs)


def build(config, attn: str, seed: int = 0):
    """Model from a deep copy of ``config`` (from_config writes the implementation into the config object)."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=attn, dtype=torch.float32).eval()


def counting(monkeypatch, module, name: str) -> list:
    """Replace ``module.name`` with a wrapper that records each call's positional arguments; the list of them."""
    calls, original = [], getattr(module, name)
    monkeypatch.setattr(module, name, lambda *args, **kwargs: calls.append(args) or original(*args, **kwargs))
    return calls


def unpadded_padded_unpadded(length: int = 40):
    """Token ids ``[2, length]`` and three forwards' masks: no padding, the second row left-padded by 7, no
    padding again (a new mask tensor each time)."""
    ids = torch.randint(0, 128, (2, length), generator=torch.Generator().manual_seed(5))
    padded = torch.ones_like(ids)
    padded[1, :7] = 0
    return ids, [torch.ones_like(ids), padded, torch.ones_like(ids)]


def full_density(block_size: int = 16) -> hf_sparse.PLASConfig:
    """Sparse path everywhere, but every block selected: must equal dense attention."""
    return hf_sparse.PLASConfig(block_size=block_size, prefill_top_k=(10_000, 10_000), decode_top_k=(10_000, 10_000),
                                dense_below=0, dense_layers=(), query_union=32)


def graph_config(method: str, **fields):
    """A small-block PLAS or XAttention config that selects on tiny models' inputs (the CUDA-graph tests')."""
    fields = {"dense_below": 0, **fields}
    if method == "plas":
        return hf_sparse.PLASConfig(block_size=16, prefill_top_k=(3, 4), decode_top_k=(3, 4), query_union=32,
                                    **fields)
    return hf_sparse.XAttnConfig(**{"dense_last": 0, "block_size": 16, "stride": 4, "threshold": 0.6,
                                    "decode_threshold": 0.6, **fields})


def selecting_config(method: str, **fields):
    """``graph_config`` that skips blocks on a random tiny model's few hundred tokens: no density probe (it would run
    such a prefill dense) and XAttention at threshold 0.3 (at 0.6 its estimate keeps 97% of a 400-token prompt's
    blocks, at 0.3 70%)."""
    if method == "xattn":
        fields = {"threshold": 0.3, "decode_threshold": 0.3, **fields}
    return graph_config(method, dense_above_density=None, **fields)


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, float32, sdpa attention."""
    from hf_sparse.tools.default_model import load_default_model

    return load_default_model(attn_implementation="sdpa")
