"""Whether PLAS's sparse decode alone loses a pass key: the long-context default model, a filler haystack of
``--length`` tokens with the key at depths 0.1 / 0.5 / 0.9 (the keys ``bench_quality.py`` hides), greedy answers
under sdpa and under PLAS with each ``--decode-top-k`` range (the prefill as PLAS's defaults run it: dense below
32K). One line per (setting, depth): found or not, the answer, the decode density, seconds.

A diagnostic (quoted in docs/quality.md), not a tool. From the repository root:

    python studies/decode_share_passkeys.py --length 8192 --decode-top-k 16:20 8:10 4:5

On the CPU (float32, PyTorch reference kernels) about 2 minutes a prompt at 8K on two cores; on CUDA in bfloat16.
"""
from __future__ import annotations

import argparse
import time

import torch

import hf_sparse
from hf_sparse.tools.default_model import load_default_model
from hf_sparse.tools.eval import filler_ids, passkey_found, passkey_prompt

KEYS = {0.1: "67303", 0.5: "26015", 0.9: "94609"}


def _range(text: str) -> tuple[int, int]:
    left, _, right = text.partition(":")
    try:
        return int(left), int(right or left)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a decode top-k range is LEFT:RIGHT (e.g. 8:10), got {text!r}") from None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=8192, help="prompt tokens")
    parser.add_argument("--decode-top-k", type=_range, nargs="+", default=[(16, 20), (8, 10), (4, 5)])
    parser.add_argument("--new-tokens", type=int, default=10)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    model, tokenizer = load_default_model("plas", dtype=torch.bfloat16 if cuda else torch.float32,
                                          device="cuda" if cuda else None, long_context=True,
                                          max_length=args.length + args.new_tokens)
    haystack = filler_ids(tokenizer, args.length)
    prompts = {depth: passkey_prompt(tokenizer, haystack, args.length, depth, key) for depth, key in KEYS.items()}
    settings = [("sdpa", None), ("plas (defaults)", hf_sparse.PLASConfig())]
    settings += [(f"plas decode_top_k={r}", hf_sparse.PLASConfig(decode_top_k=r)) for r in args.decode_top_k]
    for name, config in settings:
        model.set_attn_implementation("sdpa" if config is None else "plas")
        if config is not None:
            hf_sparse.configure(model, config)
        for depth, prompt in prompts.items():
            ids = prompt.input_ids.to(model.device)
            start = time.perf_counter()
            with torch.no_grad(), hf_sparse.record_sparsity() as recorder:
                out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.new_tokens,
                                     do_sample=False)
            answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            print(f"{name:28s} depth {depth}: found {passkey_found(answer, prompt.key)!s:5s} {answer!r}, "
                  f"decode density {recorder.density('decode'):.3f}, {time.perf_counter() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
