"""Demo: a pass key hidden in ~4K tokens of filler, answered with dense "sdpa" and with sparse "plas".

Runs on the embedded SmolLM2-135M-Instruct (CPU, or the GPU when present) and prints both answers, wall
time and the measured attention density per phase (fraction of causal key blocks attended). On CPU the sparse
path is the PyTorch reference, which shows fidelity, not speed (the demo says so).
"""
from __future__ import annotations

import argparse
import random
import time

import torch

import hf_sparse
from hf_sparse.tools.default_model import load_default_model
from hf_sparse.tools.eval import PASSKEY_FILLER as FILLER, PASSKEY_INSTRUCTION, PASSKEY_QUESTION, passkey_needle


def passkey_prompt(tokenizer, target_tokens: int, seed: int) -> tuple[str, str]:
    """A chat prompt of about ``target_tokens`` tokens with a random 5-digit pass key at a random depth."""
    rng = random.Random(seed)
    key = str(rng.randint(10000, 99999))
    needle = passkey_needle(key)
    per_filler = len(tokenizer(FILLER).input_ids)
    repeats = max(1, (target_tokens - 60) // per_filler)
    depth = rng.randint(repeats // 5, 4 * repeats // 5)
    text = FILLER * depth + needle + FILLER * (repeats - depth)
    question = PASSKEY_INSTRUCTION + text + PASSKEY_QUESTION
    messages = [{"role": "user", "content": question}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return prompt, key


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=4096, help="approximate prompt length")
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model, tokenizer = load_default_model(attn_implementation="sdpa", dtype=dtype, device=device)
    prompt, key = passkey_prompt(tokenizer, args.tokens, args.seed)
    inputs = tokenizer(prompt, return_tensors="pt").to(device)
    length = inputs.input_ids.shape[1]
    # The default PLAS config (block 128, top-k 55-66) keeps a 4K prompt dense; this demo config makes both
    # phases sparse at 4K so the effect is visible.
    config = hf_sparse.PLASConfig(block_size=64, prefill_top_k=(5, 7), decode_top_k=(8, 10), query_union=64,
                                  dense_below=0)
    print(f"device {device}, prompt {length} tokens, hidden pass key {key}")
    print(f"PLAS config: {config}")
    rows = []
    for method in ("sdpa", "plas"):
        if method == "plas":
            hf_sparse.configure(model, config)
        with torch.no_grad(), hf_sparse.record_sparsity() as recorder:
            start = time.perf_counter()
            output = model.generate(**inputs, max_new_tokens=args.new_tokens, do_sample=False)
            elapsed = time.perf_counter() - start
        answer = tokenizer.decode(output[0, length:], skip_special_tokens=True).strip()
        if method == "plas":
            density = f"prefill {recorder.density('prefill'):.3f}, decode {recorder.density('decode'):.3f}"
            dense = sorted(set(recorder.dense_layers().values()))
            density += f" (dense layers: {', '.join(dense)})" if dense else ""
        else:
            density = "1.000 (dense)"
        rows.append((method, answer, elapsed, density, key in answer))
    for method, answer, elapsed, density, correct in rows:
        print(f"\n[{method}] {elapsed:.2f} s   density: {density}\n  answer: {answer!r}   "
              f"{'correct' if correct else 'wrong'}")
    if device == "cpu":
        print("\nOn CPU hf_sparse runs its PyTorch reference (the readable spec its Triton kernels are tested "
              "against), not a fast path: the times above show that the answers match, not speed. The speed-ups "
              "come from the Triton kernels on a GPU (Hopper figures: docs/benchmarks.md).")


if __name__ == "__main__":
    main()
