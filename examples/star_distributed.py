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
token ids, and the logits of every generated token, to compare runs). Uses the embedded SmolLM2-135M-Instruct
(trained for 8K tokens: longer inputs are for timing, not for answers), or with ``--random-model`` a Llama-3.2-1B
shaped model with random weights (seeded, so every rank builds the same weights) and random token ids: no
download, for timing and for the 1-process vs n-process comparison (no pass key to answer).

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 \\
        torchrun --nproc-per-node 2 examples/star_distributed.py --random-model --tokens 131072 --block-size 8192
    # Llama-3-8B shape (issue: Star on 2 and 4 GPUs at 128K-512K), one GPU against 2
    python examples/star_distributed.py --random-model llama3-8b --tokens 524288 --block-size 16384 --time-dense
    torchrun --nproc-per-node 2 examples/star_distributed.py --random-model llama3-8b --tokens 524288 --block-size 16384
"""
from __future__ import annotations

import argparse
import os
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig

import hf_sparse  # noqa: F401  (registers attn_implementation="star")
from hf_sparse import star_attention
from hf_sparse.config import StarConfig
from hf_sparse.tools.default_model import load_default_model

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


#: Random-weight shapes (``--random-model``): Llama-3.2-1B and Llama-3-8B.
SHAPES = {
    "llama3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
}


def random_model(device: torch.device, dtype: torch.dtype, seed: int, shape: str = "llama3.2-1b",
                 layers: int | None = None):
    """``shape`` (:data:`SHAPES`; ``layers`` of them, default all) with random weights from ``seed``: built on
    ``device`` with the same seed on every rank, so all ranks hold the same weights."""
    fields = dict(SHAPES[shape], **({"num_hidden_layers": layers} if layers else {}))
    config = LlamaConfig(vocab_size=128256, max_position_embeddings=1048576, rope_theta=500000.0, **fields)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="star").eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


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
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed runs of both phases; the fastest is reported, every run listed (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--time-dense", action="store_true", help="also time a dense (sdpa) prefill of the context")
    parser.add_argument("--save", help="write the generated token ids and logits here (rank 0; torch.save of a dict)")
    parser.add_argument("--random-model", nargs="?", const="llama3.2-1b", default=None, choices=sorted(SHAPES),
                        help="a model of this shape (default llama3.2-1b) with random weights and random token ids "
                             "(no download)")
    parser.add_argument("--layers", type=int, default=None, help="--random-model: this many layers (default: all)")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default=None,
                        help="default: bfloat16 on CUDA, float32 on CPU")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")

    rank, world_size, device = setup()
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    config = StarConfig(block_size=args.block_size, anchor_size=args.anchor_size)
    if args.random_model:
        model, tokenizer, key = random_model(device, dtype, args.seed, args.random_model, args.layers), None, None
        weights = sum(p.float().sum().item() for p in list(model.parameters())[:4])  # same on every rank
        ids = torch.randint(0, model.config.vocab_size, (1, args.tokens + 16),
                            generator=torch.Generator().manual_seed(args.seed + 1))
        context, query = ids[:, : args.tokens].to(device), ids[:, args.tokens :].to(device)
        print(f"[rank {rank}] random model, weight checksum {weights:.6f}", flush=True)
    else:
        model, tokenizer = load_default_model(attn_implementation="star", dtype=dtype, device=str(device))
        prompt, key = passkey_prompt(tokenizer, args.tokens, args.seed)
        cut = prompt.index(QUESTION)
        context = tokenizer(prompt[:cut], return_tensors="pt", add_special_tokens=False).input_ids.to(device)
        query = tokenizer(prompt[cut:], return_tensors="pt", add_special_tokens=False).input_ids.to(device)
    if rank == 0:
        print(f"{world_size} rank(s) on {device.type}, context {context.shape[1]} tokens, query {query.shape[1]}, "
              f"pass key {key}, {config}")

    if device.type == "cuda":  # compile the Triton kernels outside the timed region
        warm = context[:, : 2 * config.block_size * world_size]
        star_attention.generate(model, warm, query, config=config, max_new_tokens=2, do_sample=False)
        torch.cuda.reset_peak_memory_stats(device)
    runs = []  # (phase 1, phase 2) seconds per run: the first may still compile kernels the warm-up did not launch
    for _ in range(args.repeats):
        encoded = output = None  # the last run's cache goes before the next one is made
        sync(device)
        start = time.perf_counter()
        encoded = star_attention.encode_context(model, context, config=config,
                                                reserve_tokens=query.shape[1] + args.new_tokens)
        sync(device)
        phase1 = time.perf_counter() - start
        output = star_attention.generate_from_context(model, encoded, query, max_new_tokens=args.new_tokens,
                                                      do_sample=False, return_dict_in_generate=True, output_logits=True)
        sync(device)
        runs.append((phase1, time.perf_counter() - start - phase1))
    phase1, phase2 = min(run[0] for run in runs), min(run[1] for run in runs)
    tokens = output.sequences[0, query.shape[1]:]
    logits = torch.stack([step[0].float() for step in output.logits])  # [new tokens, vocab]
    kept_tokens, kept_bytes = kv_kept(encoded.cache)
    peak = f", peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB" if device.type == "cuda" else ""
    print(f"[rank {rank}] context tokens {encoded.shard[0]}..{encoded.shard[1]}, context KV kept: "
          f"{kept_tokens} tokens, {kept_bytes / 2**20:.1f} MiB{peak}; phase 1 {phase1:.3f} s, phase 2 {phase2:.3f} s "
          f"(fastest of {len(runs)}: {', '.join(f'{a:.3f} / {b:.3f}' for a, b in runs)}); "
          f"tokens {tokens.tolist()}", flush=True)

    if args.time_dense and rank == 0:
        model.set_attn_implementation("sdpa")
        with torch.no_grad():
            model(context, logits_to_keep=1)  # warm-up
            sync_local = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
            sync_local()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            model(context, logits_to_keep=1, use_cache=True)
            sync_local()
            dense = time.perf_counter() - start
        peak = f", peak GPU memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB" if device.type == "cuda" else ""
        print(f"dense (sdpa) prefill of the context on one device: {dense:.3f} s{peak}")
        model.set_attn_implementation("star")
    if rank == 0 and tokenizer is not None:
        answer = tokenizer.decode(tokens, skip_special_tokens=True).strip()
        print(f"answer {answer!r}: {'correct' if key in answer else 'wrong'}")
    if rank == 0 and args.save:
        torch.save({"tokens": tokens.cpu(), "logits": logits.cpu()}, args.save)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
