"""A layer's query and keys from a dense forward, the forward stopped after the last layer asked for."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ..integration import attention_probe


class _StopForward(Exception):
    """Raised from the probe after the last layer of interest: the rest of the model is not needed."""


def probe_layers(model: Any, input_ids: torch.Tensor, layers: Sequence[int],
                 callback: Callable[[int, torch.nn.Module, torch.Tensor, torch.Tensor], None]) -> None:
    """Run ``model`` on ``input_ids`` (dense attention, no grad) and call ``callback(layer, module, query, key)``
    for each layer in ``layers``; the forward stops after the last of them."""
    wanted = set(layers)
    last = max(wanted)

    def on_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: Any) -> None:
        layer_idx = module.layer_idx
        if layer_idx in wanted:
            callback(layer_idx, module, query.detach(), key.detach())
        if layer_idx == last:
            raise _StopForward

    with torch.no_grad(), attention_probe(model, on_attention):
        try:
            model(input_ids=input_ids, use_cache=False, logits_to_keep=1)
        except _StopForward:
            pass
