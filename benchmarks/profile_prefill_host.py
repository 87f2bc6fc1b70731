"""Host cost of a sparse prefill: wall time against GPU busy time, and the host syncs by call site.

Run on a GPU: ``python benchmarks/profile_prefill_host.py [--length 32768] [--repeats 5]``. A SmolLM2-135M-shaped
model (random weights, bf16; small layers, so host time shows) prefills ``--length`` uniform random ids with
"sdpa", "plas" (default config: the density probe sends these dense selections to cuDNN) and "plas, no density
fallback" (``dense_above_density=None``: the sparse kernels run). Prints per method the median wall time of one
forward, its GPU busy time (``torch.profiler``, kernels summed), and the synchronising CUDA calls of one forward
grouped by the Python line that made them (``torch.cuda.set_sync_debug_mode``).
"""
from __future__ import annotations

import argparse
import collections
import statistics
import time
import traceback
import warnings

import torch
from torch.profiler import ProfilerActivity, profile
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_sparse


def smollm2_shaped_model(layers: int = 30) -> torch.nn.Module:
    """SmolLM2-135M's shape with random weights (seed 0), bf16, on the GPU, sdpa attention, eval mode."""
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=262144,
                         rope_theta=100000.0, tie_word_embeddings=True)
    torch.manual_seed(0)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa").eval()


def forward(model, ids: torch.Tensor) -> None:
    model(input_ids=ids, attention_mask=torch.ones_like(ids), logits_to_keep=1)


def sync_sites(model, ids: torch.Tensor) -> collections.Counter:
    """Synchronising CUDA calls of one forward, counted by the innermost ``file:line`` of hf_sparse (else of
    transformers) on the Python stack that made them."""
    sites = collections.Counter()
    shown = warnings.showwarning

    def record(message, *args, **kwargs):
        if "synchroniz" not in str(message):
            return
        frames = traceback.extract_stack()[:-1]
        ours = [f for f in frames if "/hf_sparse/" in f.filename] or [f for f in frames if "transformers" in f.filename]
        frame = (ours or frames)[-1]
        sites[f"{frame.filename.split('/')[-1]}:{frame.lineno} {frame.name}"] += 1

    torch.cuda.set_sync_debug_mode("warn")
    warnings.showwarning = record
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            forward(model, ids)
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = shown
    return sites


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_prefill_host.py measures GPU timings; no CUDA device found")
    model = smollm2_shaped_model(args.layers)
    ids = torch.randint(0, 49152, (1, args.length), generator=torch.Generator().manual_seed(0)).cuda()
    methods = {"sdpa": None, "plas": hf_sparse.PLASConfig(),
               "plas, no density fallback": hf_sparse.PLASConfig(dense_above_density=None)}
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | SmolLM2-135M shape, {args.layers} layers, "
          f"random weights, bf16, {args.length} uniform ids, medians of {args.repeats}")
    for name, config in methods.items():
        if config is None:
            model.set_attn_implementation("sdpa")
        else:
            hf_sparse.configure(model, config)
        with torch.no_grad():
            forward(model, ids)  # warm-up (kernel compilation)
            walls = []
            for _ in range(args.repeats):
                torch.cuda.synchronize()
                start = time.perf_counter()
                forward(model, ids)
                torch.cuda.synchronize()
                walls.append(time.perf_counter() - start)
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                forward(model, ids)
                torch.cuda.synchronize()
            sites = sync_sites(model, ids)
        gpu = sum(e.device_time_total for e in prof.key_averages()) / 1e3
        wall = statistics.median(walls) * 1e3
        print(f"\n{name}: wall {wall:.1f} ms, GPU busy {gpu:.1f} ms, host-bound gap {wall - gpu:.1f} ms "
              f"({(wall - gpu) / args.layers:.2f} ms per layer); {sum(sites.values())} syncs per forward")
        for site, count in sites.most_common(12):
            print(f"  {count:>4}  {site}")


if __name__ == "__main__":
    main()
