"""int8 decode attention by value layout: bf16 vs int8 token-major vs int8 blocked (the int8 cache's layout).

    python benchmarks/int8_layouts.py            (a GPU; CUDA-graph medians in us)

Part 1, rows that start at the same or at different slots (left padding; ragged rows take per-slot addresses
for blocked values). Part 2, the call a static cache makes: the whole storage, the valid-slot count read on the
device (a length that is no multiple of 16), PLAS's decode selection and every block (a dense layer).
"""
from __future__ import annotations

import torch

from bench_attention import BLOCK, DECODE_TOP_K, HEAD_DIM, KV_HEADS, graph_ms, structured_qkv
from hf_sparse import kernels
from hf_sparse.kernels import reference as ref
from hf_sparse.selection import BlockSelection


def select(query, keys, kv_start, valid):
    summaries = kernels.block_summaries(keys[:, :, :valid], None, kv_start, BLOCK)
    return kernels.select_blocks(query, summaries, scale=HEAD_DIM ** -0.5, q_offset=valid - 1, kv_start=kv_start,
                                 block_size=BLOCK, top_k=DECODE_TOP_K, query_tile=1, head_union=True, sink_blocks=1,
                                 key_length=valid)


def times(query, key, value, selection, **args) -> dict:
    """Graph medians (us) of the three layouts on one selection."""
    (k8, key_scale), (v8, value_scale) = ref.quantize_per_token(key), ref.quantize_per_token(value)
    blocked = ref.blocked_values(v8, BLOCK)
    scales = dict(key_scale=key_scale, value_scale=value_scale)
    return {"bf16": graph_ms(lambda: kernels.sparse_attention(query, key, value, selection, **args)) * 1e3,
            "int8 token-major": graph_ms(lambda: kernels.sparse_attention(query, k8, v8, selection, **scales,
                                                                          **args)) * 1e3,
            "int8 blocked": graph_ms(lambda: kernels.sparse_attention(query, k8, blocked, selection, **scales,
                                                                      **args)) * 1e3}


def show(label: str, result: dict) -> None:
    print(f"{label:<44} " + " | ".join(f"{name} {us:7.1f} ({result['bf16'] / us:.2f}x)" for name, us in result.items()),
          flush=True)


def main() -> None:
    print(f"{torch.cuda.get_device_name()} | graph medians, us (speed-up vs bf16)")
    for length, batch in ((131072, 1), (131072, 8), (32768, 8)):
        query, key, value = structured_qkv(batch, 1, length, structured=True)
        for padding in ("none", "shared 256", "rows"):
            if padding == "rows":  # rows start apart (batch 1: one row off the block grid)
                starts = [77] if batch == 1 else [(i * 977) % 3000 for i in range(batch)]
            else:
                starts = [0 if padding == "none" else 256] * batch
            kv_start = torch.tensor(starts, device="cuda")
            ref.note_range(kv_start, min(starts), max(starts))
            selection = select(query, key, kv_start, length)
            show(f"{length} batch {batch}, padding {padding}", times(
                query, key, value, selection, scale=HEAD_DIM ** -0.5, q_offset=length - 1, kv_start=kv_start))
        del query, key, value
        torch.cuda.empty_cache()
    for batch in (1, 8):  # the static cache's call
        length = 131072
        valid = length - 3
        capacity = -(-(length + 40) // BLOCK) * BLOCK
        query, key, value = structured_qkv(batch, 1, length, structured=True)
        keys = torch.zeros(batch, KV_HEADS, capacity, HEAD_DIM, dtype=key.dtype, device="cuda")
        values = torch.zeros_like(keys)
        keys[:, :, :length], values[:, :, :length] = key, value
        del key, value
        kv_start = ref.note_range(torch.zeros(batch, dtype=torch.int64, device="cuda"), 0, 0)
        blocks = capacity // BLOCK
        every = BlockSelection(torch.arange(blocks, dtype=torch.int32, device="cuda").expand(batch, KV_HEADS, 1, blocks),
                               torch.full((batch, KV_HEADS, 1), -(-valid // BLOCK), dtype=torch.int32, device="cuda"),
                               BLOCK, 1)
        for name, selection in (("PLAS selection", select(query, keys, kv_start, valid)), ("every block", every)):
            show(f"static call {length} batch {batch}, {name}", times(
                query, keys, values, selection, scale=HEAD_DIM ** -0.5, q_offset=0, kv_start=kv_start,
                length=torch.tensor([valid], device="cuda")))
        del query, keys, values
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
