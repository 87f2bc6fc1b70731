"""The density fallback: a prefill whose selection keeps most blocks runs dense attention instead (on CUDA, where
cuDNN / flash is faster than the sparse kernel at high density)."""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Callable

import torch

from . import kernels
from .kernels import reference
from .selection import BlockSelection, RowLayout

#: Where the density fallback applies, a prefill of at least ``4 * PROBE_QUERIES`` queries first selects for
#: ``PROBE_QUERIES`` of them only, a cheap estimate of the call's density (a sparse probe is followed by the full
#: selection's own check). The selection for the rest is still to be paid at the probe, so it runs the call dense
#: from a lower density: :func:`probe_threshold`.
PROBE_QUERIES = 1024
#: The probe's queries are this many runs spread evenly over the prefill, the last at its end (:func:`probe_runs`;
#: with 1024 queries, one 128-query tile each): a tile's density depends on where it sits. On SmolLM2's text at 128K
#: the last 1024 queries alone read 0.69-0.78 in layers whose full selection keeps 0.40-0.66 (H100,
#: docs/benchmarks.md), which sent those layers dense; eight runs measured a little faster than four there.
PROBE_RUNS = 8


def probe_runs(num_queries: int, sample: int, align: int) -> list[tuple[int, int]]:
    """``(first query, queries)`` of the probe's runs over a prefill of ``num_queries`` queries: :data:`PROBE_RUNS`
    runs of ``sample // PROBE_RUNS`` queries ending at evenly spaced points (rounded down to a multiple of
    ``align``, the last at the end), so that, weighted by the blocks they see as the call's density is, they stand
    for every part of it."""
    size = max(1, sample // PROBE_RUNS)
    runs = []
    for i in range(1, PROBE_RUNS + 1):
        end = num_queries if i == PROBE_RUNS else max(size, num_queries * i // PROBE_RUNS // align * align)
        runs.append((end - size, size))
    return runs


def probe_density(select: Callable[..., BlockSelection], query: torch.Tensor, key: torch.Tensor,
                  key_scale: torch.Tensor | None, q_offset: int, rows: RowLayout, sample: int, align: int) -> torch.Tensor:
    """Each row's attended / causal blocks of ``select``'s selections for the :func:`probe_runs` of a prefill's
    ``query`` (keys ``key`` ending at its last query, ``q_offset`` the first query's slot): float ``[B]`` on the
    host (one device-to-host read). ``select(query, key, key_scale, q_offset)`` selects for a run, its keys cut at
    the run's end."""
    attended = causal = None
    for first, size in probe_runs(query.shape[2], sample, align):
        end = q_offset + first + size
        run_scale = key_scale[:, :, :end] if key_scale is not None else None
        selection = select(query[:, :, first:first + size], key[:, :, :end], run_scale, q_offset + first)
        run_attended, run_causal = row_block_counts(selection, size, q_offset + first, rows)
        attended = run_attended if attended is None else attended + run_attended
        causal = run_causal if causal is None else causal + run_causal
    return _ratio(attended, causal)


def probe_threshold(dense_above_density: float, selection_share: float) -> float:
    """Probe density from which a prefill runs dense: where the sparse kernel plus the selection still to run
    cost what dense attention costs. Sparse attention time grows about in proportion to the density and
    matches dense at ``dense_above_density``; the selection adds ``selection_share`` of the dense time."""
    return dense_above_density * max(0.0, 1.0 - selection_share)


def floor_and_threshold(policy: object, dense_above_density: float, num_queries: int, key_length: int,
                        head_dim: int) -> tuple[float, float, float]:
    """``(floor, threshold, share)``: the least density ``policy`` could select here (its ``density_floor``), the
    probe threshold, and the selection's share of dense time behind it. A floor at the threshold runs the call
    dense with no selection and no host read."""
    share = policy.selection_share(num_queries, head_dim)
    return policy.density_floor(num_queries, key_length), probe_threshold(dense_above_density, share), share


#: :func:`floor_and_threshold` per (policy class and its two estimates, configuration object, shape), with the
#: configuration it was computed for: a pure function of them that every layer of a forward asks (a short
#: prefill is bound by the host).
_FLOORS: dict[tuple, tuple[object, tuple[float, float, float]]] = {}


def known_floor_and_threshold(policy_class: type, config: object, num_queries: int, key_length: int,
                              head_dim: int) -> tuple[float, float, float]:
    """:func:`floor_and_threshold` of ``policy_class(config)`` at ``config.dense_above_density``, memoised."""
    key = (policy_class, policy_class.density_floor, policy_class.selection_share, id(config),
           config.dense_above_density, num_queries, key_length, head_dim)
    known = _FLOORS.get(key)
    if known is not None and known[0] is config:
        return known[1]
    if len(_FLOORS) >= 1024:
        _FLOORS.clear()
    value = floor_and_threshold(policy_class(config), config.dense_above_density, num_queries, key_length, head_dim)
    _FLOORS[key] = (config, value)
    return value


def falls_back_by_density(query: torch.Tensor) -> bool:
    """Whether a dense selection is run dense: on CUDA with the Triton kernels, where dense attention (cuDNN or
    flash) is faster than the sparse kernel at high density. Elsewhere the sparse path always runs, so the
    reference and interpreter paths stay what the tests compare."""
    return query.is_cuda and kernels.backend_for(query) == "triton"


def row_block_counts(selection: BlockSelection, num_queries: int, q_offset: int,
                     rows: RowLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(attended, causal) blocks of each row (int64 ``[B]`` device tensors, summed over heads and tiles); causal =
    row blocks up to each tile's last real query."""
    last_block = reference.tile_last_blocks(selection.num_query_tiles, selection.query_tile, num_queries, q_offset,
                                            rows.starts, selection.block_size)
    causal = (last_block + 1).sum(-1) * selection.num_heads
    return selection.counts.sum((1, 2), dtype=torch.int64), causal


def block_counts(selection: BlockSelection, num_queries: int, q_offset: int,
                 rows: RowLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(attended, causal) block totals over the batch as device scalars (:func:`row_block_counts`)."""
    attended, causal = row_block_counts(selection, num_queries, q_offset, rows)
    return attended.sum(), causal.sum()


def row_densities(selection: BlockSelection, num_queries: int, q_offset: int, rows: RowLayout) -> torch.Tensor:
    """Each row's attended / causal blocks, float ``[B]`` on the host (one device-to-host read)."""
    return _ratio(*row_block_counts(selection, num_queries, q_offset, rows))


def _ratio(attended: torch.Tensor, causal: torch.Tensor) -> torch.Tensor:
    """attended / causal per row, read to the host in one transfer (a row with no causal block: 0)."""
    both = torch.stack([attended, causal]).cpu().double()
    return both[0] / both[1].clamp_min(1)


@dataclass(frozen=True)
class Decision:
    """A layer's prefill decision for one configuration and length bucket."""

    dense: bool
    reason: str


#: Each attention module's remembered decisions, held beside the module (copies and pickles of it stay plain).
_DECISIONS: "weakref.WeakKeyDictionary[torch.nn.Module, dict[tuple, Decision]]" = weakref.WeakKeyDictionary()


def _bucket(module_config: object, key_length: int, num_queries: int) -> tuple:
    """Half an octave of key length and of query count, per configuration object (one per stored config)."""
    return id(module_config), int(2 * math.log2(max(key_length, 1))), int(2 * math.log2(max(num_queries, 1)))


def recall(module: torch.nn.Module, config: object, key_length: int, num_queries: int) -> Decision | None:
    """The decision remembered for this module, configuration and length bucket, if any."""
    return _DECISIONS.get(module, {}).get(_bucket(config, key_length, num_queries))


def remember(module: torch.nn.Module, config: object, key_length: int, num_queries: int, dense: bool,
             reason: str) -> None:
    """Keep a decision for later calls of this module, configuration and length bucket."""
    _DECISIONS.setdefault(module, {})[_bucket(config, key_length, num_queries)] = Decision(dense, reason)


def forget_decisions(model: torch.nn.Module) -> None:
    """Drop every decision the modules of ``model`` remember (the next prefills decide again)."""
    for module in model.modules():
        _DECISIONS.pop(module, None)
