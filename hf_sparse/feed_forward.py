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

* with a SiLU gate, its activation and product in place in the gate projection's output. An input of at most
  :attr:`Slices.silu_rows` tokens (any input, where that is None) runs whole: the same launches and the same values as
  its own forward, two such activations alive instead of three. A longer one runs over slices of at most that many
  rows of its ``[tokens, hidden]`` view (no copy of the input), all three projections per slice, each slice's output
  copied into one output tensor: two slice-sized activations alive, each projection a GEMM over the slice's rows
  (equal to one GEMM over all rows to rounding, which cuBLAS does not promise to keep). Where its three projections
  are plain ``torch.nn.Linear`` modules that no hook watches, they are called as ``torch.nn.functional.linear`` on
  their own weights, as their forward does, but without four module calls (projections and activation): a prompt of a
  few thousand tokens is bound by the host's time per layer, which this keeps under the block's own forward's;
* with another gate, over slices of :attr:`Slices.tokens` tokens (a dense MLP treats every token alone), each
  slice's gated product written into one ``[tokens, intermediate_size]`` tensor and the down projection taken over
  all of it: one such activation alive, in more, smaller launches.

Other blocks run over such slices of the tokens, each slice's output copied into one output tensor (one more write
and read of the output). A block one of whose children a forward hook or a forward of its own (another library's
instance hook) watches, and every block while a global forward hook is set, runs its own forward over the whole
input: a hook sees what it would see without hf_sparse (a position-indexing hook on slices, or a probe that keeps a
gate's output that the in-place SiLU overwrites, would silently differ).

Blocks taken: the child named ``mlp`` / ``feed_forward`` of a module that also holds an attention child, whose
``forward`` is its class's (not another library's instance hook) and which has no ``experts`` child (a mixture of
experts routes tokens in groups: left as it is).
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any

import torch

#: Child names under which transformers' decoder layers hold their feed-forward block and their attention.
_FEED_FORWARD_NAMES = ("mlp", "feed_forward")
_ATTENTION_NAMES = ("self_attn", "attn", "attention", "self_attention")
#: Activation modules that compute SiLU (torch's and transformers').
SILU_ACTIVATIONS = ("SiLU", "SiLUActivation")


#: ``prefill_silu_rows="auto"`` with an int8 K/V cache (the memory-first cache): a SiLU-gated MLP's rows a slice.
#: With a cache of the model's dtype "auto" runs it whole, since slices cost TTFT where the prefill runs dense
#: (docs/features.md, "MLP slices, with the int8 cache").
AUTO_INT8_SILU_ROWS = 8192


@dataclass(frozen=True)
class Slices:
    """How a prefill's feed-forward blocks hold fewer activations (see the module's description). ``silu_rows``: a
    SiLU-gated MLP over slices of at most this many rows of its ``[tokens, hidden]`` view (None: whole); ``tokens``:
    other blocks over slices of at most this many tokens (batch x positions)."""

    silu_rows: int | None
    tokens: int

    def __post_init__(self) -> None:
        if self.silu_rows is not None and self.silu_rows < 1 or self.tokens < 1:
            raise ValueError(f"Slices needs silu_rows None or >= 1 and tokens >= 1, got {self}")


def slices_for(config: Any) -> Slices | None:
    """The :class:`Slices` of a method config: ``prefill_mlp_chunk`` tokens, ``prefill_silu_rows`` rows
    (``"auto"``: :data:`AUTO_INT8_SILU_ROWS` with ``kv_cache_dtype="int8"``, else whole); None where
    ``prefill_mlp_chunk`` is None (transformers' own forwards)."""
    if config.prefill_mlp_chunk is None:
        return None
    rows = config.prefill_silu_rows
    if isinstance(rows, str):  # "auto" (the configs check the field)
        rows = AUTO_INT8_SILU_ROWS if getattr(config, "kv_cache_dtype", None) == "int8" else None
    return Slices(rows, config.prefill_mlp_chunk)


#: Each model's feed-forward blocks as [parent, child name, block, kept], from its last walk (:func:`_walk`); kept:
#: (the slices, the block's children, the forward :func:`swap_in` made for them) or None.
_FOUND: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _walk(model: torch.nn.Module) -> list[list[Any]]:
    """The entries of :data:`_FOUND` for ``model``: its walk over the modules (about half a millisecond of host time
    for 30 layers) is kept for the next call while each block found still sits where it was found."""
    found = _FOUND.get(model)
    if found is None or any(parent._modules.get(name) is not block for parent, name, block, _ in found):
        found = []
        for module in model.modules():
            children = module._modules
            if not any(children.get(name) is not None for name in _ATTENTION_NAMES):
                continue
            found += [[module, name, children[name], None] for name in _FEED_FORWARD_NAMES
                      if children.get(name) is not None and "experts" not in children[name]._modules]
        _FOUND[model] = found
    return found


def feed_forward_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The dense feed-forward blocks of ``model``'s decoder layers that :func:`lean_forward` may run (see the
    module's description)."""
    return [entry[2] for entry in _walk(model) if "forward" not in entry[2].__dict__]


def _gated_mlp(self, x):  # transformers' gated MLP forward, the code :func:`gated` compares
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj


@functools.lru_cache(maxsize=None)
def gated(block_class: type) -> bool:
    """Whether ``block_class``'s forward is :func:`_gated_mlp`'s code (same instructions, names and arguments)."""
    code, reference = getattr(getattr(block_class, "forward", None), "__code__", None), _gated_mlp.__code__
    return code is not None and all(getattr(code, name) == getattr(reference, name)
                                    for name in ("co_code", "co_names", "co_varnames", "co_argcount", "co_consts"))


def _silu(act_fn: Any) -> bool:
    """Whether a gated MLP's activation module computes SiLU with its class's forward."""
    return type(act_fn).__name__ in SILU_ACTIVATIONS and "forward" not in act_fn.__dict__


def _silu_gated(gate: Any, up: Any, down: Any, x: torch.Tensor) -> torch.Tensor:
    """``down(silu(gate(x)) * up(x))`` with the activation and the product in place in ``gate(x)``'s output."""
    product = gate(x)
    torch.nn.functional.silu(product, inplace=True)
    product.mul_(up(x))
    return down(product)


def _over_rows(forward: Any, hidden_states: torch.Tensor, rows: int | None) -> torch.Tensor:
    """``forward`` (a token-wise map of ``[..., hidden]`` to ``[..., out]``) over the whole input when ``rows`` is
    None or it has at most ``rows`` tokens, else over slices of at most ``rows`` rows of its ``[tokens, hidden]``
    view, each slice's output copied into one output tensor of the input's leading shape."""
    tokens = hidden_states.numel() // max(hidden_states.shape[-1], 1)
    if rows is None or tokens <= rows:
        return forward(hidden_states)
    flat = hidden_states.reshape(tokens, hidden_states.shape[-1])  # (a view of a contiguous input)
    output = None
    for start in range(0, tokens, rows):
        part = forward(flat[start:start + rows])
        if output is None:
            output = part.new_empty(tokens, part.shape[-1])
        output[start:start + rows] = part
        del part
    return output.view(*hidden_states.shape[:-1], output.shape[-1])


def lean_forward(block: torch.nn.Module, slices: Slices, hidden_states: torch.Tensor, *args: Any,
                 **kwargs: Any) -> Any:
    """``block``'s forward with fewer activations alive: a SiLU-gated MLP's in place, over slices of at most
    ``slices.silu_rows`` rows of its ``[tokens, hidden]`` view where it has more; on a ``[batch, positions, hidden]``
    input others over slices of at most ``slices.tokens`` tokens (``batch x positions``; see the module's
    description). Other calls (more arguments, another rank, few tokens), blocks whose output is not a ``[batch,
    positions, ...]`` tensor, and blocks a hook watches (:func:`_unwatched` of their children: the hook sees what it
    would see without hf_sparse) run their own forward over the whole input."""
    if (args or kwargs or not isinstance(hidden_states, torch.Tensor)
            or not _unwatched(tuple(block._modules.values()))):
        return type(block).forward(block, hidden_states, *args, **kwargs)
    no_grad_gated = gated(type(block)) and not torch.is_grad_enabled()  # (in-place / out= products: no gradient)
    if no_grad_gated and _silu(block.act_fn):
        return _over_rows(functools.partial(_silu_gated, block.gate_proj, block.up_proj, block.down_proj),
                          hidden_states, slices.silu_rows)
    if hidden_states.dim() != 3:
        return type(block).forward(block, hidden_states)
    batch, positions = hidden_states.shape[:2]
    step = max(1, slices.tokens // max(batch, 1))
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


def _plain_projections(block: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module] | None:
    """A SiLU-gated MLP's (gate, up, down) projections where each is a ``torch.nn.Linear`` (not a subclass, such as a
    quantised or adapted layer) that runs its class's forward; else None. (Read from the block's children without
    attribute lookups: :func:`swap_in` asks this of every block in each prefill.)"""
    children = block._modules
    if not _silu(children.get("act_fn")) or not gated(type(block)):
        return None
    projections = (children.get("gate_proj"), children.get("up_proj"), children.get("down_proj"))
    for linear in projections:
        if type(linear) is not torch.nn.Linear or "forward" in linear.__dict__ or "weight" not in linear._parameters:
            return None
    return projections


def _unwatched(modules: tuple[torch.nn.Module, ...]) -> bool:
    """Whether no forward hook (global, or of one of ``modules``) and no forward of a module's own (another
    library's instance hook, such as an offloading one) would see a call of ``modules``. (A block's children are
    read, not their children.)"""
    hooks = torch.nn.modules.module
    return not (hooks._global_forward_hooks or hooks._global_forward_pre_hooks
                or any(module is not None and (module._forward_hooks or module._forward_pre_hooks
                                                   or "forward" in module.__dict__) for module in modules))


def _linear(parameters: dict, x: torch.Tensor) -> torch.Tensor:
    """A plain ``torch.nn.Linear``'s forward from its parameter dict (read at each call: a reassigned weight
    counts)."""
    return torch.nn.functional.linear(x, parameters["weight"], parameters.get("bias"))


def direct_forward(block: torch.nn.Module, slices: Slices, children: tuple[torch.nn.Module, ...],
                   silu_gated: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """A SiLU-gated MLP's forward with its plain projections (:func:`_plain_projections`) called as
    ``torch.nn.functional.linear`` (``silu_gated``: :func:`_silu_gated` over :func:`_linear` of each) and its gate in
    place: :func:`lean_forward`'s ops and values, without the module calls. Calls with gradients or more arguments,
    and blocks a hook watches (one of its ``children``, or a global hook), go to :func:`lean_forward`."""
    if (args or kwargs or not isinstance(hidden_states, torch.Tensor) or torch.is_grad_enabled()
            or not _unwatched(children)):
        return lean_forward(block, slices, hidden_states, *args, **kwargs)
    return _over_rows(silu_gated, hidden_states, slices.silu_rows)


def swap_in(model: torch.nn.Module, slices: Slices) -> list[torch.nn.Module]:
    """Make ``model``'s :func:`feed_forward_blocks` run :func:`lean_forward` (with ``slices``), or
    :func:`direct_forward` where it applies, until :func:`swap_out`; the blocks swapped. Each block's forward is
    made once and kept for the next prefill while the block's children are the same objects, none with a forward
    of its own (a prompt of a few thousand tokens is bound by the host's time)."""
    blocks = []
    for entry in _walk(model):
        block, kept = entry[2], entry[3]
        if "forward" in block.__dict__:
            continue
        children = tuple(block._modules.values())
        if (kept is None or kept[0] != slices or kept[1] != children
                or any("forward" in child.__dict__ for child in children)):
            projections = _plain_projections(block)
            forward = (functools.partial(lean_forward, block, slices) if projections is None
                       else functools.partial(direct_forward, block, slices, children, functools.partial(
                           _silu_gated, *(functools.partial(_linear, linear._parameters) for linear in projections))))
            kept = entry[3] = (slices, children, forward)
        block.__dict__["forward"] = kept[2]
        blocks.append(block)
    return blocks


def swap_out(blocks: list[torch.nn.Module]) -> None:
    """Give the blocks :func:`swap_in` swapped their own forwards back."""
    for block in blocks:
        block.__dict__.pop("forward", None)
