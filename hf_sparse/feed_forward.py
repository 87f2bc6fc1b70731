"""Feed-forward blocks that hold less memory in a ``generate()`` prefill.

A prefill's peak memory is not its attention: it is a decoder layer's feed-forward block, whose gated MLP holds
three ``[tokens, intermediate_size]`` activations at once (SmolLM2 at 128K tokens: 1.1 GiB, against its whole KV
cache's 2.8 GiB). :func:`swap_in` (from ``integration``'s generate() hooks) runs the blocks through
:func:`lean_forward` in the prefill forwards of a ``generate()`` call, which keeps every method's peak under dense
attention's although the sparse cache holds block summaries that a dense cache does not
(:class:`hf_sparse.cache.SparseCacheLayer`).
Without gradients (as generate() runs), a gated MLP whose forward is transformers'
``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (Llama, Mistral, Qwen, Gemma, ...: the forward's code is compared)
runs

* with a SiLU gate, over the whole input, its activation and product in place in the gate projection's output (where
  no forward hook sees that output): the same launches and the same values as its own forward, two such
  activations alive instead of three;
* with another gate (or a hooked gate projection), over slices of the tokens (a dense MLP treats every token alone),
  each slice's gated product written into one ``[tokens, intermediate_size]`` tensor and the down projection taken
  over all of it: one such activation alive, in more, smaller launches.

Other blocks run over slices of the tokens, each slice's output copied into one output tensor (one more write and
read of the output).

Blocks taken: the child named ``mlp`` / ``feed_forward`` of a module that also holds an attention child, whose
``forward`` is its class's (not another library's instance hook) and which has no ``experts`` child (a mixture of
experts routes tokens in groups: left as it is).
"""
from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

#: Child names under which transformers' decoder layers hold their feed-forward block and their attention.
_FEED_FORWARD_NAMES = ("mlp", "feed_forward")
_ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention")
#: Activation modules that compute SiLU (torch's and transformers').
SILU_ACTIVATIONS = ("SiLU", "SiLUActivation")


#: Each model's feed-forward blocks as (parent, child name, block), from its last walk (:func:`feed_forward_blocks`).
_FOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def feed_forward_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The dense feed-forward blocks of ``model``'s decoder layers that :func:`lean_forward` may run (see the
    module's description). The walk over the model's modules (about half a millisecond of host time for 30 layers)
    is kept for the next call while each block found still sits where it was found."""
    found = _FOUND.get(model)
    if found is None or any(parent._modules.get(name) is not block for parent, name, block in found):
        found = []
        for module in model.modules():
            children = module._modules
            if not any(children.get(name) is not None for name in _ATTENTION_NAMES):
                continue
            found += [(module, name, children[name]) for name in _FEED_FORWARD_NAMES
                      if children.get(name) is not None and "experts" not in children[name]._modules]
        _FOUND[model] = found
    return [block for _, _, block in found if "forward" not in block.__dict__]


def _gated_mlp(self, x):  # transformers' gated MLP forward, the code :func:`gated` compares
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj


@functools.lru_cache(maxsize=None)
def gated(block_class: type) -> bool:
    """Whether ``block_class``'s forward is :func:`_gated_mlp`'s code (same instructions, names and arguments)."""
    code, reference = getattr(getattr(block_class, "forward", None), "__code__", None), _gated_mlp.__code__
    return code is not None and all(getattr(code, name) == getattr(reference, name)
                                    for name in ("co_code", "co_names", "co_varnames", "co_argcount", "co_consts"))


def _silu_in_place(block: torch.nn.Module) -> bool:
    """Whether a gated MLP's gate is SiLU and its gate projection's output may be overwritten: no forward hook sees
    that output (a probe that keeps it would find it changed)."""
    return (type(block.act_fn).__name__ in SILU_ACTIVATIONS and "forward" not in block.act_fn.__dict__
            and not block.gate_proj._forward_hooks and not torch.nn.modules.module._global_forward_hooks)


def lean_forward(block: torch.nn.Module, chunk_tokens: int, hidden_states: torch.Tensor, *args: Any,
                 **kwargs: Any) -> Any:
    """``block``'s forward on a ``[batch, positions, hidden]`` input with fewer activations alive: a SiLU-gated MLP's
    in place, others over slices of at most ``chunk_tokens`` tokens (``batch x positions``; see the module's
    description). Other calls (more arguments, another rank, few tokens) and blocks whose output is not a
    ``[batch, positions, ...]`` tensor run their own forward over the whole input."""
    if args or kwargs or not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
        return type(block).forward(block, hidden_states, *args, **kwargs)
    batch, positions = hidden_states.shape[:2]
    step = max(1, chunk_tokens // max(batch, 1))
    no_grad_gated = gated(type(block)) and not torch.is_grad_enabled()  # (in-place / out= products: no gradient)
    if no_grad_gated and _silu_in_place(block):
        product = block.gate_proj(hidden_states)
        torch.nn.functional.silu(product, inplace=True)
        product.mul_(block.up_proj(hidden_states))
        return block.down_proj(product)
    if positions <= step:
        return type(block).forward(block, hidden_states)
    if no_grad_gated:
        product = None
        for start in range(0, positions, step):
            part = hidden_states[:, start:start + step].contiguous()  # (a copy for batch > 1 only)
            activated, up = block.act_fn(block.gate_proj(part)), block.up_proj(part)
            if product is None:
                product = activated.new_empty(batch, positions, activated.shape[-1])
            torch.mul(activated, up, out=product[:, start:start + step])
            del activated, up
        return block.down_proj(product)
    output = None
    for start in range(0, positions, step):
        part = type(block).forward(block, hidden_states[:, start:start + step].contiguous())
        if output is None:
            if not isinstance(part, torch.Tensor) or part.dim() < 2 or part.shape[:2] != (batch, min(step, positions)):
                return type(block).forward(block, hidden_states)
            output = part.new_empty(batch, positions, *part.shape[2:])
        output[:, start:start + step] = part
    return output


def swap_in(model: torch.nn.Module, chunk_tokens: int) -> list[torch.nn.Module]:
    """Make ``model``'s :func:`feed_forward_blocks` run :func:`lean_forward` (slices of ``chunk_tokens`` tokens) until
    :func:`swap_out`; the blocks swapped."""
    blocks = feed_forward_blocks(model)
    for block in blocks:
        block.__dict__["forward"] = functools.partial(lean_forward, block, chunk_tokens)
    return blocks


def swap_out(blocks: list[torch.nn.Module]) -> None:
    """Give the blocks :func:`swap_in` swapped their own forwards back."""
    for block in blocks:
        block.__dict__.pop("forward", None)
