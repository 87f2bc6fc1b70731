"""int8 KV cache fidelity: next-token KL and top-1 of PLAS (or XAttention, or Star) with an int8 SparseCache
against the same method with a float KV cache (and both against dense sdpa), on the embedded SmolLM2-135M-Instruct.

The prompt's first ``--tokens - --decode`` tokens are prefilled through the cache, the remaining ``--decode``
tokens are fed one at a time (teacher-forced decode); scored positions: the last ``--positions`` of the
prefill and every decode step. Prints one table.

    python benchmarks/int8_kv_fidelity.py --tokens 2048 --decode 32 [--method xattn|star]
"""
from __future__ import annotations

import argparse
import time

import torch

import hf_sparse
from hf_sparse.cache import SparseCache
from hf_sparse.default_model import load_default_model
from hf_sparse.eval import stdlib_text


def sample_ids(tokenizer, tokens: int) -> torch.Tensor:
    return tokenizer(stdlib_text(tokens * 6 + 1), return_tensors="pt").input_ids[:, :tokens]


@torch.no_grad()
def run(model, ids: torch.Tensor, kv_dtype: str | None, prefill: int, positions: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """(prefill logits of the last ``positions``, decode logits, bytes of KV per token) with a fresh cache;
    ``kv_dtype=None`` runs dense sdpa with transformers' own cache."""
    cache = SparseCache(model.config, kv_dtype=kv_dtype) if kv_dtype else None
    out = model(ids[:, :prefill], past_key_values=cache, use_cache=True, logits_to_keep=positions)
    cache = out.past_key_values
    steps = [model(ids[:, t:t + 1], past_key_values=cache, use_cache=True).logits for t in range(prefill, ids.shape[1])]
    memory = cache.memory_per_token() if isinstance(cache, SparseCache) else float("nan")
    return out.logits.float(), torch.cat(steps, 1).float(), memory


def compare(reference: torch.Tensor, other: torch.Tensor) -> tuple[float, float]:
    ref_lp, other_lp = torch.log_softmax(reference, -1), torch.log_softmax(other, -1)
    kl = (ref_lp.exp() * (ref_lp - other_lp)).sum(-1).mean().item()
    top1 = (ref_lp.argmax(-1) == other_lp.argmax(-1)).float().mean().item()
    return kl, top1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--positions", type=int, default=256)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--method", default="plas", choices=["plas", "xattn", "star"])
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    model, tokenizer = load_default_model(attn_implementation="sdpa", dtype=dtype)
    ids = sample_ids(tokenizer, args.tokens)
    prefill = ids.shape[1] - args.decode
    results = {}
    started = time.perf_counter()
    results["dense"] = run(model, ids, None, prefill, args.positions)
    if args.method == "plas":
        config = hf_sparse.PLASConfig(block_size=64, prefill_top_k=(5, 7), decode_top_k=(5, 7), query_union=64)
        settings = "PLAS block 64, top-k (5, 7)"
    elif args.method == "xattn":
        config = hf_sparse.XAttnConfig(block_size=64, stride=8, threshold=0.9)
        settings = "XAttention block 64, stride 8, threshold 0.9, decode threshold 0.99"
    else:  # the prompt's last `positions` tokens are the query (global attention), the rest the context
        config = hf_sparse.StarConfig(block_size=512, anchor_size=512, query_tokens=args.positions)
        settings = f"Star block 512, anchor 512, last {args.positions} prompt tokens as the query"
    hf_sparse.configure(model, config)
    name = args.method
    results[f"{name}, float KV"] = run(model, ids, "auto", prefill, args.positions)
    results[f"{name}, int8 KV"] = run(model, ids, "int8", prefill, args.positions)
    print(f"SmolLM2-135M-Instruct {args.dtype}, {ids.shape[1]} tokens: prefill {prefill} (last {args.positions} "
          f"scored) + {args.decode} teacher-forced decode steps; {settings}; "
          f"{time.perf_counter() - started:.0f} s")
    print(f"{'run':<17} {'vs':<17} {'prefill KL':>11} {'top-1':>7} {'decode KL':>10} {'top-1':>7} {'KV B/token':>11}")
    for name, against in ((f"{name}, float KV", "dense"), (f"{name}, int8 KV", "dense"),
                          (f"{name}, int8 KV", f"{name}, float KV")):
        pre_kl, pre_top = compare(results[against][0], results[name][0])
        dec_kl, dec_top = compare(results[against][1], results[name][1])
        print(f"{name:<17} {against:<17} {pre_kl:>11.5f} {pre_top:>7.4f} {dec_kl:>10.5f} {dec_top:>7.4f} "
              f"{results[name][2]:>11.0f}")


if __name__ == "__main__":
    main()
