"""torch.distributed helpers: Star Attention's ranks, context-block shards and LSE merge of partial attention; the
tensor-parallel rank of a model that transformers split (:func:`tensor_parallel_rank_and_size`).

Works with any backend torch.distributed supports for ``all_gather`` (gloo on CPU, NCCL on GPUs). Nothing here
runs unless a process group is initialised (e.g. by ``torchrun``).
"""
from __future__ import annotations

from typing import Any

import torch
import transformers
from packaging.version import Version
import torch.distributed as dist

from . import kernels


def is_distributed(group: Any = None) -> bool:
    """Whether a process group with more than one rank is initialised."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def rank_and_world(group: Any = None) -> tuple[int, int]:
    """``(rank, world_size)`` in ``group``; ``(0, 1)`` without an initialised process group."""
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def query_rank(world_size: int) -> int:
    """The rank that keeps the query and generated tokens' KV (the last, as in NVIDIA's implementation)."""
    return world_size - 1


def shard_blocks(num_blocks: int, world_size: int) -> list[tuple[int, int]]:
    """Contiguous ``[first, end)`` context-block ranges per rank; the first ``num_blocks % world_size`` ranks get
    one block more (``torch.tensor_split`` order). Ranks past ``num_blocks`` get empty ranges."""
    if num_blocks < 0 or world_size < 1:
        raise ValueError(f"need num_blocks >= 0 and world_size >= 1, got {num_blocks}, {world_size}")
    base, extra = divmod(num_blocks, world_size)
    ranges, first = [], 0
    for rank in range(world_size):
        end = first + base + (1 if rank < extra else 0)
        ranges.append((first, end))
        first = end
    return ranges


def check_same_on_all_ranks(values: list[int], device: torch.device, what: str, group: Any = None) -> None:
    """Raise on every rank if the integers ``values`` differ between ranks (e.g. input shapes)."""
    if not is_distributed(group):
        return
    local = torch.tensor(values, dtype=torch.int64, device=device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, local, group=group)
    if any(not torch.equal(g, gathered[0]) for g in gathered):
        raise ValueError(f"{what} differ between ranks: {[g.tolist() for g in gathered]}; every rank must pass the same inputs")


def merge_partials(out: torch.Tensor, lse: torch.Tensor, group: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather each rank's partial attention over its own keys and merge by log-sum-exp.

    ``out`` is ``[B, H, S, D]`` (any float dtype), ``lse`` float32 ``[B, H, S]`` (``-inf`` where the rank has no
    visible key). One collective carries both, in float32. Every rank merges the same list in rank order, so
    every rank gets bit-identical results. Returns the merged output (``out``'s dtype) and log-sum-exp.
    """
    world_size = dist.get_world_size(group)
    packed = torch.cat([out.float(), lse.float().unsqueeze(-1)], dim=-1).contiguous()
    gathered = [torch.empty_like(packed) for _ in range(world_size)]
    dist.all_gather(gathered, packed, group=group)
    stacked = torch.stack(gathered)
    merged, merged_lse = kernels.merge_lse(stacked[..., :-1].contiguous(), stacked[..., -1].contiguous())
    return merged.to(out.dtype), merged_lse


def tensor_parallel_kwargs(plan: Any = "auto") -> dict[str, Any]:
    """``from_pretrained``'s keyword arguments for tensor parallelism with ``plan`` on the installed transformers:
    ``tp_plan=plan`` up to 5.17, ``distributed_config=DistributedConfig(tp_plan=plan)`` from 5.18 (which deprecates
    the former)."""
    if Version(transformers.__version__).release >= (5, 18) and hasattr(transformers, "DistributedConfig"):
        return {"distributed_config": transformers.DistributedConfig(tp_plan=plan)}
    return {"tp_plan": plan}


def tensor_parallel_mesh(model: Any) -> Any:
    """The one-dimensional device mesh of ``model``'s tensor-parallel ranks, or ``None`` for a model that
    transformers' tensor parallelism did not split (``model.tp_size`` unset or 1).

    transformers keeps the degree in ``model.tp_size`` and the mesh in ``model._device_mesh``: up to 5.17 the 1-D
    mesh of the tensor-parallel ranks (``integrations/tensor_parallel.py::distribute_model``); from 5.18 the
    ``("pp", "fsdp", "tp")`` mesh (``distributed/mixin.py::maybe_distribute_model``), whose ``"tp"`` dimension is
    taken here."""
    size = int(getattr(model, "tp_size", None) or 1)
    if size <= 1:
        return None
    mesh = getattr(model, "_device_mesh", None)
    if mesh is None:
        raise ValueError(f"{type(model).__name__} has tp_size {size} but no device mesh (model._device_mesh)")
    if mesh.ndim > 1:
        if "tp" not in (mesh.mesh_dim_names or ()):
            raise ValueError(f"{type(model).__name__}'s device mesh {mesh} has no 'tp' dimension")
        mesh = mesh["tp"]
    if mesh.size() != size:
        raise ValueError(f"{type(model).__name__}: tensor-parallel mesh of {mesh.size()} ranks != tp_size {size}")
    return mesh


def tensor_parallel_rank_and_size(model: Any) -> tuple[int, int]:
    """``(rank, size)`` of this process in ``model``'s tensor-parallel group; ``(0, 1)`` for a model not split by
    tensor parallelism. A column-wise projection (``k_proj``, ``v_proj``) gives rank ``r`` the contiguous output
    rows ``[r * n / size, (r + 1) * n / size)``: transformers' ``Shard(0)`` (``torch.chunk`` order), so of ``H``
    key/value heads rank ``r`` holds heads ``[r * H / size, (r + 1) * H / size)``."""
    mesh = tensor_parallel_mesh(model)
    if mesh is None:
        return 0, 1
    return mesh.get_local_rank(), mesh.size()
