"""Host-side (Python) cost of one PLAS decode step: cProfile of the per-layer ops and of a model's decode forward.

Run on a GPU: ``python benchmarks/profile_decode.py``. Prints the host microseconds per call of each stage
(GPU work is asynchronous and not waited for, so these are launch + Python costs) and the top functions.
"""
from __future__ import annotations

import cProfile
import pstats
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_sparse
from hf_sparse import kernels
from hf_sparse.cache import SparseCache

BLOCK, LENGTH, HEADS, KV_HEADS, DIM = 128, 32768, 32, 8, 128


def host_us(fn, reps: int = 200) -> float:
    """Mean host time of ``fn`` over ``reps`` calls, without waiting for the GPU in between."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / reps * 1e6


def main() -> None:
    device = "cuda"
    query = torch.randn(1, HEADS, 1, DIM, device=device, dtype=torch.bfloat16)
    key = torch.randn(1, KV_HEADS, LENGTH, DIM, device=device, dtype=torch.bfloat16)
    value = torch.randn_like(key)
    kv_start = torch.zeros(1, dtype=torch.int64, device=device)
    scale = DIM ** -0.5
    blocks = LENGTH // BLOCK
    summ = kernels.block_summaries(key, None, kv_start, BLOCK)

    def summaries():
        summ[:, :, blocks - 1:] = kernels.block_summaries(key, None, kv_start, BLOCK, blocks - 1, 1)

    def select():
        return kernels.select_blocks(query, summ, scale=scale, q_offset=LENGTH - 1, kv_start=kv_start,
                                     block_size=BLOCK, top_k=(100, 120), query_tile=1, head_union=True,
                                     sink_blocks=1, key_length=LENGTH)

    selection = select()

    def attend():
        return kernels.sparse_attention(query, key, value, selection, scale=scale, q_offset=LENGTH - 1,
                                        kv_start=kv_start)

    print(f"host us per call: summaries {host_us(summaries):.1f}, select {host_us(select):.1f}, "
          f"attend {host_us(attend):.1f}")

    # A 4-layer Llama-3-8B-shaped model: host cost of one decode forward, per layer, sdpa vs plas.
    config = LlamaConfig(vocab_size=1024, hidden_size=4096, intermediate_size=1024, num_hidden_layers=4,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=DIM,
                         max_position_embeddings=LENGTH * 2)
    ids = torch.randint(0, 1024, (1, LENGTH), device=device)
    for implementation in ("sdpa", "plas"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=implementation,
                                                 dtype=torch.bfloat16).to(device).eval()
        if implementation == "plas":
            hf_sparse.configure(model, hf_sparse.PLASConfig(dense_layers=()))
        with torch.no_grad():
            cache = SparseCache(model.config) if implementation == "plas" else None
            out = model(ids, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            step = ids[:, -1:]
            forward = lambda: model(step, past_key_values=cache, use_cache=True)  # noqa: E731
            for _ in range(3):
                forward()
                cache.crop(-1)
            torch.cuda.synchronize()
            reps, trials = 20, []
            for _ in range(7):  # the host is shared: the fastest trial is the least disturbed
                start = time.perf_counter()
                for _ in range(reps):
                    forward()
                    cache.crop(-1)
                torch.cuda.synchronize()
                trials.append((time.perf_counter() - start) / reps * 1e3)
            trials.sort()
            print(f"{implementation}: decode forward {trials[0]:.2f} ms wall, fastest of 7 trials (median "
                  f"{trials[3]:.2f}) (4 layers)")
            if implementation == "plas":
                profiler = cProfile.Profile()
                profiler.enable()
                for _ in range(50):
                    forward()
                    cache.crop(-1)
                profiler.disable()
                torch.cuda.synchronize()
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as gpu_profile:
                    for _ in range(10):
                        forward()
                        cache.crop(-1)
                    torch.cuda.synchronize()
                print("GPU kernels over 10 decode forwards:")
                print(gpu_profile.key_averages().table(sort_by="cuda_time_total", row_limit=12))
                stats = pstats.Stats(profiler)
                stats.sort_stats("tottime").print_stats(30)
                stats.sort_stats("cumulative").print_stats("hf_sparse|triton|transformers", 45)
        del model, cache
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
