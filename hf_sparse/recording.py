"""What the attention calls did: ``hf_sparse.record_sparsity()`` and the records it collects."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .selection import BlockSelection


@dataclass
class LayerRecord:
    """What one attention call did: phase, dense reason (or None when sparse), block counts."""

    layer_idx: int
    phase: str
    dense_reason: str | None
    attended_blocks: torch.Tensor | None = None   # scalar tensors, summed over (batch, head, tile)
    causal_blocks: torch.Tensor | None = None
    selection: BlockSelection | None = None
    inputs: tuple[torch.Tensor, ...] | None = None   # (query, key, value, kv_start) with keep_inputs=True


@dataclass
class SparsityRecorder:
    """Collects a :class:`LayerRecord` per attention call inside :func:`record_sparsity`."""

    keep_inputs: bool = False
    records: list[LayerRecord] = field(default_factory=list)

    def density(self, phase: str | None = None) -> float:
        """Attended / causal key blocks over the sparse calls of ``phase`` (dense calls count as 1.0)."""
        attended = causal = 0.0
        for rec in self.records:
            if phase is not None and rec.phase != phase:
                continue
            if rec.dense_reason is not None:
                continue
            attended += float(rec.attended_blocks)
            causal += float(rec.causal_blocks)
        return attended / causal if causal else 1.0

    def dense_layers(self, phase: str | None = None) -> dict[int, str]:
        """Layers that ran dense, with the reason."""
        return {r.layer_idx: r.dense_reason for r in self.records
                if r.dense_reason is not None and (phase is None or r.phase == phase)}


_RECORDERS: list[SparsityRecorder] = []


@contextlib.contextmanager
def record_sparsity(keep_inputs: bool = False) -> Iterator[SparsityRecorder]:
    """Record what every hf_sparse attention call does while the context is open.

    Recording reads block counts back from the device, so ``generate()`` decodes eagerly inside it (no CUDA
    graph; about 10x slower decode on small models): time outside the context."""
    recorder = SparsityRecorder(keep_inputs=keep_inputs)
    _RECORDERS.append(recorder)
    try:
        yield recorder
    finally:
        _RECORDERS.remove(recorder)


def recording() -> bool:
    """Whether a :func:`record_sparsity` context is open."""
    return bool(_RECORDERS)


def record(rec: LayerRecord) -> None:
    """Hand ``rec`` to every open recorder (without its tensors where inputs are not kept)."""
    for recorder in _RECORDERS:
        if not recorder.keep_inputs:
            rec = LayerRecord(rec.layer_idx, rec.phase, rec.dense_reason, rec.attended_blocks, rec.causal_blocks)
        recorder.records.append(rec)
