"""Star Attention over several processes: a pass key hidden in a long context, answered by every rank.

Each rank encodes a contiguous shard of the context blocks (prefixed with the anchor it recomputes) and keeps only
that shard's KV; the query and generated tokens attend to the whole context through a log-sum-exp merge of the
ranks' partial attention, so every rank prints the same tokens. The last rank keeps the query/generated KV.

    # CPU, gloo, 2 processes
    torchrun --nproc-per-node 2 examples/star_distributed.py --tokens 4096 --block-size 1024
    # GPUs, NCCL, one GPU per rank (keep NVLink multicast off on the shared machines)
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        torchrun --nproc-per-node 2 examples/star_distributed.py --tokens 32768 --block-size 8192 --time-dense

Without torchrun it runs in one process: the reference the distributed tokens must equal (``--save`` writes the
token ids to compare runs). Uses the embedded SmolLM2-135M-Instruct (trained for 8K tokens: longer inputs are for
timing, not for answers).
"""
from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist

import hf_sparse  # noqa: F401  (registers attn_implementation="star")
from hf_sparse import star
from hf_sparse.config import StarConfig
from hf_sparse.default_model import load_default_model

from generate import passkey_prompt

QUESTION = "\n\nWhat is the pass key?"


def setup() -> tuple[int, int, torch.device]:
    """Join the torchrun process group (NCCL with one GPU per rank, else gloo); one process without torchrun."""
    if "RANK" not in os.environ:
        return 0, 1, torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, timeout=timedelta(minutes=10))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(minutes=10))
    return dist.get_rank(), dist.get_world_size(), device


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if dist.is_initialized():
        dist.barrier()


def kv_kept(cache) -> tuple[int, int]:
    """(tokens, bytes) of context KV this rank keeps (keys + values, all layers; storage is allocated in chunks)."""
    tokens = cache.layers[0].get_seq_length()
    return tokens, sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if layer.keys is not None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096, help="approximate prompt length")
    parser.add_argument("--block-size", type=int, default=1024)
    parser.add_argument("--anchor-size", type=int, default=None, help="default: the block size")
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-dense", action="store_true", help="also time a dense (sdpa) prefill of the context")
    parser.add_argument("--save", help="write the generated token ids here (rank 0)")
    args = parser.parse_args()

    rank, world_size, device = setup()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model, tokenizer = load_default_model(attn_implementation="star", dtype=dtype, device=str(device))
    config = StarConfig(block_size=args.block_size, anchor_size=args.anchor_size)
    prompt, key = passkey_prompt(tokenizer, args.tokens, args.seed)
    cut = prompt.index(QUESTION)
    context = tokenizer(prompt[:cut], return_tensors="pt", add_special_tokens=False).input_ids.to(device)
    query = tokenizer(prompt[cut:], return_tensors="pt", add_special_tokens=False).input_ids.to(device)
    if rank == 0:
        print(f"{world_size} rank(s) on {device.type}, context {context.shape[1]} tokens, query {query.shape[1]}, "
              f"pass key {key}, {config}")

    if device.type == "cuda":  # compile the Triton kernels outside the timed region
        warm = context[:, : 2 * config.block_size * world_size]
        star.generate(model, warm, query, config=config, max_new_tokens=2, do_sample=False)
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    start = time.perf_counter()
    encoded = star.encode_context(model, context, config=config, reserve_tokens=query.shape[1] + args.new_tokens)
    sync(device)
    phase1 = time.perf_counter() - start
    output = star.generate_from_context(model, encoded, query, max_new_tokens=args.new_tokens, do_sample=False)
    sync(device)
    phase2 = time.perf_counter() - start - phase1
    tokens = output[0, query.shape[1]:]
    kept_tokens, kept_bytes = kv_kept(encoded.cache)
    peak = f", peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB" if device.type == "cuda" else ""
    print(f"[rank {rank}] context tokens {encoded.shard[0]}..{encoded.shard[1]}, context KV kept: "
          f"{kept_tokens} tokens, {kept_bytes / 2**20:.1f} MiB{peak}; phase 1 {phase1:.3f} s, phase 2 {phase2:.3f} s; "
          f"tokens {tokens.tolist()}", flush=True)

    if args.time_dense and rank == 0:
        model.set_attn_implementation("sdpa")
        with torch.no_grad():
            model(context, logits_to_keep=1)  # warm-up
            sync_local = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
            sync_local()
            start = time.perf_counter()
            model(context, logits_to_keep=1)
            sync_local()
        print(f"dense (sdpa) prefill of the context on one device: {time.perf_counter() - start:.3f} s")
        model.set_attn_implementation("star")
    if rank == 0:
        answer = tokenizer.decode(tokens, skip_special_tokens=True).strip()
        print(f"answer {answer!r}: {'correct' if key in answer else 'wrong'}")
        if args.save:
            torch.save(tokens.cpu(), args.save)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
