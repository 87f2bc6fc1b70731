"""Input checks, argument preparation and settings shared by the Triton launchers."""
from __future__ import annotations

import math
import operator
import os

import torch
import triton.language as tl

from ..selection import BlockSelection, RowLayout, row_starts
from .reference import check_softcap_and_sinks


def interpreting() -> bool:
    """Whether Triton runs in its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def dot_settings(dtype: torch.dtype) -> tuple[bool, str]:
    """``(upcast operands to float32, tl.dot input precision)`` for inputs of ``dtype``.

    float32 inputs use three tf32 products per product on the GPU ("tf32x3": float32 accuracy on tensor
    cores; plain "ieee" lowers to slow FMA loops there). The interpreter computes exactly, and since the one
    of triton 3.9 computes bfloat16 dots wrongly, half-precision operands are upcast there.
    """
    if interpreting():
        return True, "ieee"
    if dtype == torch.float32:
        return True, "tf32x3"
    return False, "tf32"


SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_token_scale(name: str, scale: torch.Tensor, key: torch.Tensor) -> None:
    """Raise unless ``scale`` is int8 ``key``'s float32 per-token scale ``[B, Hkv, Skv]`` on its device."""
    if scale.dtype != torch.float32 or tuple(scale.shape) != tuple(key.shape[:3]) or scale.device != key.device:
        raise ValueError(f"{name} must be float32 [B, Hkv, Skv] = {tuple(key.shape[:3])} on {key.device}, "
                         f"got {scale.dtype} {tuple(scale.shape)} on {scale.device}")


def check_attention_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                           selection: BlockSelection, kv_start: torch.Tensor | RowLayout,
                           key_scale: torch.Tensor | None = None, value_scale: torch.Tensor | None = None) -> None:
    """Raise a clear error for inputs the attention kernels do not take."""
    if query.dim() != 4 or key.dim() != 4 or value.dim() not in (4, 5):
        raise ValueError("sparse attention takes BNSD tensors: query [B,Hq,Sq,D], key [B,Hkv,Skv,D], value [B,Hkv,Skv,Dv]")
    if value.dim() == 5 and value.dtype != torch.int8:
        raise ValueError(f"blocked values [B,Hkv,blocks,Dv,block] are int8 only (the int8 cache's layout), got {value.dtype}")
    quantized = key_scale is not None or value_scale is not None
    for name, tensor in (("query", query),) + (() if quantized else (("key", key), ("value", value))):
        if tensor.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} dtype {tensor.dtype} unsupported: use float16, bfloat16 or float32")
    if quantized:
        if key.dtype != torch.int8 or value.dtype != torch.int8 or key_scale is None or value_scale is None:
            raise TypeError("key_scale/value_scale go with int8 key and value (both), got "
                            f"{key.dtype}/{value.dtype}")
        check_token_scale("key_scale", key_scale, key)
        check_token_scale("value_scale", value_scale, key)
    elif not query.dtype == key.dtype == value.dtype:
        raise TypeError(f"query/key/value dtypes differ: {query.dtype}, {key.dtype}, {value.dtype}"
                        + (" (int8 K/V need key_scale and value_scale)" if key.dtype == torch.int8 else ""))
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(f"query and key head dims differ ({query.shape[-1]} vs {key.shape[-1]})")
    if max(query.shape[-1], value.shape[3]) > 256:
        raise ValueError("head dims above 256 are not supported by the Triton kernels; set HF_SPARSE_BACKEND=torch")
    batch, q_heads = query.shape[:2]
    kv_heads = key.shape[1]
    value_slots = value.shape[2] * (value.shape[4] if value.dim() == 5 else 1)
    slots_ok = value_slots >= key.shape[2] if value.dim() == 5 else value_slots == key.shape[2]
    if key.shape[0] != batch or value.shape[:2] != key.shape[:2] or not slots_ok or kv_heads == 0 or q_heads % kv_heads:
        raise ValueError(f"shapes do not match: query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")
    sel_heads = selection.num_heads
    if sel_heads == 0 or q_heads % sel_heads or sel_heads % kv_heads:
        raise ValueError(f"selection has {sel_heads} head rows; need a divisor of {q_heads} query heads and a "
                         f"multiple of {kv_heads} KV heads")
    starts = row_starts(kv_start)
    if selection.indices.shape[0] != batch or starts.shape != (batch,) or starts.is_floating_point():
        raise ValueError("selection / kv_start ([batch] integers) do not match the query")
    if selection.indices.dtype != torch.int32 or selection.counts.dtype != torch.int32:
        raise TypeError("selection indices and counts must be int32")
    if not query.device == key.device == value.device == selection.indices.device == selection.counts.device:
        raise ValueError("query, key, value and selection must be on one device")


def check_append_kv_inputs(key_states: torch.Tensor, value_states: torch.Tensor, key_storage: torch.Tensor,
                           value_storage: torch.Tensor, length: torch.Tensor, starts: torch.Tensor | None = None,
                           counts: torch.Tensor | None = None, block_size: int = 0) -> None:
    """Raise a clear error for an ``append_kv`` call the ops do not take (the device-side ``length`` is not
    range-checked: that would read it back to the host)."""
    if key_states.dim() != 4 or value_states.dim() != 4 or key_states.shape[:3] != value_states.shape[:3]:
        raise ValueError(f"key/value states must be [B, H, n, D] with one [B, H, n], got {tuple(key_states.shape)} "
                         f"and {tuple(value_states.shape)}")
    batch, heads = key_states.shape[:2]
    slots = key_storage.shape[2] if key_storage.dim() == 4 else -1
    expected = ((batch, heads, slots, key_states.shape[3]), (batch, heads, slots, value_states.shape[3]))
    if (tuple(key_storage.shape), tuple(value_storage.shape)) != expected:
        raise ValueError(f"token-major storage must be keys {expected[0]} and values {expected[1]}, got "
                         f"{tuple(key_storage.shape)} and {tuple(value_storage.shape)}")
    if key_storage.dtype != key_states.dtype or value_storage.dtype != value_states.dtype:
        raise TypeError(f"storage dtypes {key_storage.dtype} / {value_storage.dtype} differ from the states' "
                        f"{key_states.dtype} / {value_states.dtype}")
    if not isinstance(length, torch.Tensor) or length.numel() != 1 or length.is_floating_point():
        raise ValueError(f"length must be a one-element integer tensor, got {length!r}")
    if not (key_states.device == value_states.device == key_storage.device == value_storage.device == length.device):
        raise ValueError("states, storage and length must be on one device")
    if counts is not None:
        batch = key_states.shape[0]
        for name, tensor in (("starts", starts), ("counts", counts)):
            if (not isinstance(tensor, torch.Tensor) or tensor.shape != (batch,) or tensor.is_floating_point()
                    or tensor.device != length.device or not tensor.is_contiguous()):
                raise ValueError(f"{name} must be a contiguous integer [{batch}] tensor on {length.device}, got "
                                 f"{tensor if not isinstance(tensor, torch.Tensor) else (tuple(tensor.shape), tensor.dtype)}")
        if block_size < 1:
            raise ValueError(f"block counts need a block_size >= 1, got {block_size}")


def check_append_inputs(key_states: torch.Tensor, value_states: torch.Tensor, key_storage: torch.Tensor,
                        value_storage: torch.Tensor, key_scales: torch.Tensor, value_scales: torch.Tensor,
                        start: int | torch.Tensor, clear_to: int = 0) -> None:
    """Raise a clear error for a ``quantize_append`` call the ops do not take (a device-side ``start`` is not
    range-checked: that would read it back to the host). Every int8 layer's write calls it, and a short prefill is
    bound by the host: a passing call builds no messages and loops over no tensors."""
    shape, value_shape = key_states.shape, value_states.shape
    if len(shape) != 4 or len(value_shape) != 4 or shape[:3] != value_shape[:3]:
        raise ValueError(f"key/value states must be [B, H, n, D] with one [B, H, n], got {tuple(shape)} "
                         f"and {tuple(value_shape)}")
    if key_states.dtype not in SUPPORTED_DTYPES or value_states.dtype not in SUPPORTED_DTYPES:
        name, dtype = (("key_states", key_states.dtype) if key_states.dtype not in SUPPORTED_DTYPES
                       else ("value_states", value_states.dtype))
        raise TypeError(f"{name} dtype {dtype} unsupported: use float16, bfloat16 or float32")
    batch, heads, tokens, head_dim = shape
    storage_shape, blocked_shape = key_storage.shape, value_storage.shape
    slots = storage_shape[2] if len(storage_shape) == 4 else -1
    token_major = (blocked_shape if len(blocked_shape) != 5 else
                   (blocked_shape[0], blocked_shape[1], blocked_shape[2] * blocked_shape[4], blocked_shape[3]))
    if (key_storage.dtype != torch.int8 or value_storage.dtype != torch.int8
            or storage_shape != (batch, heads, slots, head_dim)
            or tuple(token_major) != (batch, heads, slots, value_shape[3])):
        raise ValueError(f"int8 storage must be keys {(batch, heads, slots, head_dim)} and values "
                         f"{(batch, heads, slots, value_shape[3])} (or blocked), got {key_storage.dtype} "
                         f"{tuple(storage_shape)} and {value_storage.dtype} {tuple(blocked_shape)}")
    scales_shape = (batch, heads, slots)
    if not (key_scales.dtype == value_scales.dtype == torch.float32 and key_scales.shape == scales_shape
            and value_scales.shape == scales_shape):
        for name, scales in (("key_scales", key_scales), ("value_scales", value_scales)):
            if scales.dtype != torch.float32 or scales.shape != scales_shape:
                raise ValueError(f"{name} must be float32 {scales_shape}, got {scales.dtype} {tuple(scales.shape)}")
    if not (key_storage.is_contiguous() and value_storage.is_contiguous() and key_scales.is_contiguous()
            and value_scales.is_contiguous()):
        for name, tensor in (("key storage", key_storage), ("value storage", value_storage),
                             ("key_scales", key_scales), ("value_scales", value_scales)):
            if not tensor.is_contiguous():
                raise ValueError(f"{name} must be contiguous (as SparseCache allocates it), got strides "
                                 f"{tensor.stride()}")
    device = key_states.device
    if not (value_states.device == device and key_storage.device == device and value_storage.device == device
            and key_scales.device == device and value_scales.device == device):
        raise ValueError("states, storage and scales must be on one device")
    if clear_to.__class__ is not int:
        given = clear_to
        try:
            clear_to = None if isinstance(given, (bool, torch.Tensor)) else operator.index(given)
        except TypeError:
            clear_to = None
        if clear_to is None:
            raise TypeError(f"clear_to must be an integer (not a tensor or bool), got {given!r}")
    if isinstance(start, torch.Tensor):
        if (start.numel() != 1 or start.is_floating_point() or start.is_complex() or start.dtype == torch.bool
                or start.device != device):
            raise ValueError(f"a tensor start must be one integer element on {device}, got "
                             f"{tuple(start.shape)} {start.dtype} on {start.device}")
        if clear_to:
            raise ValueError("clear_to needs an integer start (a tensor start is not read on the host)")
        return
    try:
        first = operator.index(start) if not isinstance(start, bool) else None
    except TypeError:
        first = None
    if first is None:
        raise TypeError(f"start must be an integer or a one-element integer tensor, got {start!r}")
    if not 0 <= first <= slots - tokens:
        raise ValueError(f"slots {first}..{first + tokens} do not fit the storage's {slots}")
    if clear_to and not first + tokens <= clear_to <= slots:
        raise ValueError(f"clear_to must be 0 or from the write's end, {first + tokens}, to the storage's {slots} "
                         f"slots, got {clear_to}")


_SM_COUNTS: dict[int, int] = {}
_TICKETS: dict[tuple[torch.device, int], torch.Tensor] = {}


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (cached: the query costs tens of microseconds)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


#: Whether each CUDA device launches decode kernels with programmatic dependent launch (see :func:`dependent_launch`).
_DEPENDENT_LAUNCH: dict[int, bool] = {}


def dependent_launch(device: torch.device) -> bool:
    """Whether a decode step's kernels launch with programmatic dependent launch on ``device`` (CUDA, compute
    capability 9 or more, Triton's grid dependency control, not the interpreter, not turned off by
    ``HF_SPARSE_PDL=0``). Such a kernel waits for the kernel before it to finish (``gdc_wait``) before touching
    memory, then lets the next one launch (``gdc_launch_dependents``): the same order as plain stream order,
    with the next launch overlapping this kernel instead of following it."""
    if device.type != "cuda" or interpreting() or os.environ.get("HF_SPARSE_PDL") == "0":
        return False
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _DEPENDENT_LAUNCH:
        cuda = getattr(tl.extra, "cuda", None)
        _DEPENDENT_LAUNCH[index] = (torch.cuda.get_device_capability(index)[0] >= 9
                                    and hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents"))
    return _DEPENDENT_LAUNCH[index]


def dependent_launch_args(device: torch.device) -> dict:
    """A decode kernel's launch arguments for :func:`dependent_launch`: its ``PDL`` constexpr, and Triton's
    ``launch_pdl`` where it is on."""
    return {"PDL": True, "launch_pdl": True} if dependent_launch(device) else {"PDL": False}


def ticket_counters(count: int, device: torch.device) -> torch.Tensor:
    """At least ``count`` zeroed int32 counters for launches on ``device``'s current stream (launches of one
    stream run one after another, so they can share them): a kernel that takes tickets (the last of a group
    of programs to arrive does the group's final step) leaves its own at zero again."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    tickets = _TICKETS.get((device, stream))
    if tickets is None or tickets.numel() < count:
        tickets = torch.zeros(max(count, 1024), dtype=torch.int32, device=device)
        _TICKETS[(device, stream)] = tickets
    return tickets


def check_length(length: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """A device-side valid-slot count (one integer element on ``device``), or a never-read place holder."""
    if length is None:
        return _placeholder(device)
    if length.numel() != 1 or length.is_floating_point() or length.device != device:
        raise ValueError(f"length must be a one-element integer tensor on {device}, got {tuple(length.shape)} "
                         f"{length.dtype} on {length.device}")
    return length


_PLACEHOLDERS: dict[torch.device, torch.Tensor] = {}


def _placeholder(device: torch.device) -> torch.Tensor:
    """One int32 element per device, passed for pointers a launch never reads (no allocation per call)."""
    holder = _PLACEHOLDERS.get(device)
    if holder is None:
        holder = _PLACEHOLDERS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return holder


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def heads_per_program(heads_per_row: int, rows_per_head: int, max_rows: int = 128) -> int:
    """Largest divisor of ``heads_per_row`` whose heads times ``rows_per_head`` rows fit ``max_rows``."""
    best = 1
    for heads in range(1, heads_per_row + 1):
        if heads_per_row % heads == 0 and heads * rows_per_head <= max_rows:
            best = heads
    return best


def feature_args(logn_base: int | None, skip: torch.Tensor | None, query: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Kernel arguments of the optional features: ``1 / log(logn_base)`` (0 when off) and the skip flags as
    uint8 (a view of the bool tensor; ``kv_start``'s place holder when there is none)."""
    inv_log_base = 0.0
    if logn_base is not None:
        if int(logn_base) < 2:
            raise ValueError(f"logn_base (the training length) must be >= 2, got {logn_base}")
        inv_log_base = 1.0 / math.log(int(logn_base))
    if skip is None:
        return inv_log_base, query.new_empty(1, dtype=torch.uint8)
    if skip.shape != (query.shape[0],) or skip.dtype != torch.bool or skip.device != query.device:
        raise ValueError(f"skip must be a [batch={query.shape[0]}] bool tensor on {query.device}, got "
                         f"{tuple(skip.shape)} {skip.dtype} on {skip.device}")
    return inv_log_base, skip.contiguous().view(torch.uint8)


def scale_args(key_scale: torch.Tensor | None, value_scale: torch.Tensor | None,
               key: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The int8 K/V scales, or (never read) place holders ``[1, 1, 1]`` for unquantised K/V."""
    if key_scale is None:
        dummy = key.new_empty(1, 1, 1, dtype=torch.float32)
        return dummy, dummy
    return key_scale, value_scale


def alibi_args(alibi_slopes: torch.Tensor | None, query: torch.Tensor) -> torch.Tensor:
    """The ALiBi slopes as float32 ``[Hq]`` (a never-read place holder without ALiBi)."""
    if alibi_slopes is None:
        return query.new_empty(1, dtype=torch.float32)
    if tuple(alibi_slopes.shape) != (query.shape[1],) or alibi_slopes.device != query.device:
        raise ValueError(f"alibi_slopes must be [q_heads={query.shape[1]}] on {query.device}, got "
                         f"{tuple(alibi_slopes.shape)} on {alibi_slopes.device}")
    return alibi_slopes.float().contiguous()


#: ``SOFTCAP`` of the kernels: no cap; the cap with tanh written with exp2 (exact to a few ulp, any dtype, the
#: interpreter too); the cap with the GPU's ``tanh.approx.f32`` (one special-function instruction instead of an exp2
#: and a reciprocal; relative error about 2^-11, below the rounding of half-precision inputs).
SOFTCAP_OFF, SOFTCAP_EXACT, SOFTCAP_FAST = 0, 1, 2


def softcap_mode(softcap: float | None, query: torch.Tensor) -> int:
    """The kernels' ``SOFTCAP`` for ``query``: fast tanh for half-precision inputs on the GPU, else exact."""
    if softcap is None:
        return SOFTCAP_OFF
    fast = query.is_cuda and not interpreting() and query.dtype in (torch.float16, torch.bfloat16)
    return SOFTCAP_FAST if fast else SOFTCAP_EXACT


#: ``FIXED_MAX`` of the attention kernels: a capped base-2 score lies in ``[-cap, cap]``, so the softmax can subtract
#: the constant ``cap - FIXED_MAX_HEADROOM`` instead of a running row maximum (no maximum, no rescaling of the
#: accumulators). Every term is then at most ``2^64`` and a row's largest at least ``2^(64 - 2 cap)``, a normal
#: float32 above ``2^-100`` while ``cap <= FIXED_MAX_CAP`` (natural-log caps up to 56.8; Gemma 2's 50 is 72.1).
FIXED_MAX_HEADROOM = tl.constexpr(64.0)
FIXED_MAX_CAP = 82.0


def fixed_max(softcap: float | None, query: torch.Tensor, alibi_slopes: torch.Tensor | None) -> bool:
    """Whether the kernels subtract a constant maximum (``FIXED_MAX_HEADROOM``): a cap of at most
    ``FIXED_MAX_CAP`` (base 2), no ALiBi bias (it is added after the cap, unbounded), and probabilities in a dtype
    of float32's range (float16's largest, 65504, is far below ``2^64``)."""
    return (softcap is not None and alibi_slopes is None and query.dtype != torch.float16
            and float(softcap) * math.log2(math.e) <= FIXED_MAX_CAP)


def softcap_sink_args(softcap: float | None, sinks: torch.Tensor | None,
                      query: torch.Tensor) -> tuple[float, torch.Tensor]:
    """The kernels' softcap and sink arguments: ``softcap`` times log2(e) (the kernels' scores are in base 2,
    where ``c * tanh(s / c)`` of a natural-log score ``s`` is ``c' * tanh(s' / c')`` with ``s' = s * log2(e)``
    and ``c' = c * log2(e)``; 0 when off) and the sink logits as float32 ``[Hq]`` (without sinks the device's
    never-read place holder: no allocation per call)."""
    check_softcap_and_sinks(softcap, sinks, query)
    softcap_log2 = 0.0 if softcap is None else float(softcap) * math.log2(math.e)
    if sinks is None:
        return softcap_log2, _placeholder(query.device)
    return softcap_log2, sinks.float().contiguous()


def value_args(value: torch.Tensor) -> tuple[tuple[int, ...], int]:
    """The value strides the attention kernels take (batch, head, slot, channel, storage block) and the
    storage block of blocked values (``reference.blocked_values``; 0 for token-major ones)."""
    if value.dim() == 4:
        return (*value.stride(), 0), 0
    stride_b, stride_h, stride_block, stride_d, stride_s = value.stride()
    return (stride_b, stride_h, stride_s, stride_d, stride_block), value.shape[4]


def values_aligned(value_block: int, kv_start: torch.Tensor | RowLayout, block_n: int) -> bool:
    """Whether every key tile of ``block_n`` slots lies inside one storage block of blocked values: the rows
    share one start that is a multiple of ``block_n`` (no padding, the usual case; a RowLayout's own range, a
    plain tensor's read)."""
    return value_block > 0 and value_block % block_n == 0 and RowLayout.of(kv_start).aligned(block_n)


def wide_offsets(*tensors: torch.Tensor) -> bool:
    """Whether slot offsets (slot index times the sequence stride) may overflow int32."""
    return any(t.shape[2] * abs(t.stride(2)) >= 2**31 for t in tensors)


def attention_outputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, selection: BlockSelection,
                      kv_start: torch.Tensor | RowLayout, logn_base: int | None, skip: torch.Tensor | None,
                      key_scale: torch.Tensor | None, value_scale: torch.Tensor | None,
                      alibi_slopes: torch.Tensor | None, out: torch.Tensor | None, lse: torch.Tensor | None):
    """Validate a sparse-attention call and prepare what every attention launcher passes on: ``(out, lse,
    inv_log_base, skip_flags, key_scale, value_scale, slopes)`` with ``out`` / ``lse`` allocated when not given."""
    check_attention_inputs(query, key, value, selection, kv_start, key_scale, value_scale)
    if selection.block_size < 16 and not interpreting():
        raise ValueError(f"the Triton attention kernels take blocks of at least 16 tokens (their dots' narrowest "
                         f"tile); got block_size {selection.block_size} (the method configs require >= 16)")
    inv_log_base, skip_flags = feature_args(logn_base, skip, query)
    key_scale, value_scale = scale_args(key_scale, value_scale, key)
    slopes = alibi_args(alibi_slopes, query)
    batch, q_heads, num_queries = query.shape[:3]
    out_shape, lse_shape = (batch, q_heads, num_queries, value.shape[3]), (batch, q_heads, num_queries)
    if out is None:
        out = torch.empty(out_shape, dtype=query.dtype, device=query.device)
    if lse is None:
        lse = torch.empty(lse_shape, dtype=torch.float32, device=query.device)
    if tuple(out.shape) != out_shape or tuple(lse.shape) != lse_shape:
        raise ValueError(f"out {tuple(out.shape)} / lse {tuple(lse.shape)} do not match the query")
    return out, lse, inv_log_base, skip_flags, key_scale, value_scale, slopes


#: Input rows a decode_linear call takes (batch x step tokens of a decode step): the kernel holds them in one tile.
DECODE_LINEAR_MAX_ROWS = 64


def check_decode_linear_inputs(x: torch.Tensor, weights: tuple, biases: tuple, norm_weight: torch.Tensor | None,
                               residual: torch.Tensor | None, gated: bool, rotary: tuple | None = None) -> None:
    """Raise a clear error for a ``decode_linear`` call the ops do not take."""
    if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in SUPPORTED_DTYPES or x.stride(-1) != 1:
        raise ValueError(f"decode_linear takes a float16 / bfloat16 / float32 [M, K] input with unit stride along K, "
                         f"got {(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x).__name__}")
    rows, k = x.shape
    if not 1 <= rows <= DECODE_LINEAR_MAX_ROWS:
        raise ValueError(f"decode_linear takes 1 to {DECODE_LINEAR_MAX_ROWS} input rows, got {rows}")
    if not 1 <= len(weights) <= 3 or len(biases) != len(weights):
        raise ValueError(f"decode_linear takes 1 to 3 weights and one bias (or None) per weight, got "
                         f"{len(weights)} weights and {len(biases)} biases")
    for i, weight in enumerate(weights):
        if weight.dim() != 2 or weight.shape[1] != k or not weight.is_contiguous():
            raise ValueError(f"weight {i} must be a contiguous [N, {k}] matrix, got {tuple(weight.shape)}")
    if len({bias is None for bias in biases}) > 1:
        raise ValueError("decode_linear takes a bias for every weight or for none")
    for i, bias in enumerate(biases):
        if bias is not None and (bias.shape != (weights[i].shape[0],) or not bias.is_contiguous()):
            raise ValueError(f"bias {i} must be a contiguous [{weights[i].shape[0]}] vector, got {tuple(bias.shape)}")
    if norm_weight is not None and (norm_weight.shape != (k,) or not norm_weight.is_contiguous()):
        raise ValueError(f"norm_weight must be a contiguous [{k}] vector, got {tuple(norm_weight.shape)}")
    if gated and (len(weights) != 2 or weights[0].shape != weights[1].shape):
        raise ValueError(f"a gated product takes two weights of one shape, got "
                         f"{[tuple(weight.shape) for weight in weights]}")
    outputs = weights[0].shape[0] if gated else sum(weight.shape[0] for weight in weights)
    if residual is not None and len(weights) > 1 and not gated:
        raise ValueError("a residual is added to one product (or a gated product), not to several side by side")
    if residual is not None and (residual.shape != (rows, outputs) or residual.stride(-1) != 1):
        raise ValueError(f"residual must be [{rows}, {outputs}] with unit stride along its last dim, got "
                         f"{tuple(residual.shape)}")
    if rotary is not None:
        cos, sin = rotary
        steps = cos.shape[1] if cos.dim() == 3 else 0
        if (cos.dim() != 3 or cos.shape != sin.shape or steps == 0 or rows % steps
                or cos.shape[0] not in (1, rows // steps) or cos.shape[-1] % 2
                or cos.stride(-1) != 1 or sin.stride(-1) != 1):
            raise ValueError(f"rotary takes (cos, sin) of one [B or 1, S, D] shape for the {rows} rows (B * S), "
                             f"D even, unit stride along D; got {tuple(cos.shape)} and {tuple(sin.shape)}")
        if gated or len(weights) < 2 or any(weight.shape[0] % cos.shape[-1] for weight in weights[:2]):
            raise ValueError(f"rotary applies to the first two products (queries, keys) in whole heads of "
                             f"{cos.shape[-1]} columns; got {[tuple(weight.shape) for weight in weights]}"
                             f"{' with gated=True' if gated else ''}")
    tensors = [x, *weights, *(bias for bias in biases if bias is not None), norm_weight, residual,
               *(rotary if rotary is not None else ())]
    tensors = [tensor for tensor in tensors if tensor is not None]
    if any(tensor.dtype != x.dtype for tensor in tensors):
        raise TypeError(f"decode_linear takes one dtype for every tensor, got {sorted({str(t.dtype) for t in tensors})}")
    if any(tensor.device != x.device for tensor in tensors):
        raise ValueError("decode_linear's tensors must be on one device")
