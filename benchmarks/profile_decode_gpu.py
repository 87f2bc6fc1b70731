"""GPU time of one decode step over a static SparseCache, by kernel: where a sparse decode step spends the device.

Run on a GPU: ``python benchmarks/profile_decode_gpu.py [--length 32768] [--layers 8] [--methods plas xattn]``.
A Llama-3-8B-shaped model (random weights, bf16, ``--layers`` layers, the last dense) prefills ``--length`` random
ids into a static ``SparseCache``, then runs ``--steps`` eager decode steps (the kernels a CUDA-graph replay runs)
under ``torch.profiler``. Prints, per method, the kernels by GPU time per step, and the launches per step.
"""
from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

import hf_sparse
from bench_generate import llama3_8b_model


def decode_profile(model, method: str, length: int, steps: int, rows: int) -> None:
    config_class = hf_sparse.PLASConfig if method == "plas" else hf_sparse.XAttnConfig
    hf_sparse.configure(model, config_class(decode_cuda_graph=False))
    device = model.device
    ids = torch.randint(0, model.config.vocab_size, (1, length), generator=torch.Generator().manual_seed(0)).to(device)
    cache = hf_sparse.SparseCache(model.config, max_cache_len=length + 2 * steps + 2)
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        token = out.logits[:, -1:].argmax(-1)
        position = torch.tensor([[length]], device=device)

        def step():
            nonlocal token, position
            logits = model(input_ids=token, position_ids=position, past_key_values=cache, use_cache=True).logits
            token = logits[:, -1:].argmax(-1)
            position = position + 1

        for _ in range(steps):  # warm-up: compilation of the decode kernels
            step()
        torch.cuda.synchronize(device)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                step()
            torch.cuda.synchronize(device)
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: e.device_time_total, reverse=True)
    total = sum(e.device_time_total for e in events) / steps
    launches = sum(e.count for e in events) / steps
    print(f"\n{method}, {length} tokens, {model.config.num_hidden_layers} layers: GPU {total:.0f} us per step, "
          f"{launches:.0f} kernels per step")
    print(f"{'us/step':>9} {'calls/step':>10}  kernel")
    for event in events[:rows]:
        print(f"{event.device_time_total / steps:>9.1f} {event.count / steps:>10.1f}  {event.key[:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rows", type=int, default=25)
    parser.add_argument("--methods", nargs="+", default=["plas", "xattn"], choices=["plas", "xattn"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("profile_decode_gpu.py measures GPU time; no CUDA device found")
    model = llama3_8b_model(args.layers)
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__}")
    for method in args.methods:
        decode_profile(model, method, args.length, args.steps, args.rows)


if __name__ == "__main__":
    main()
