"""XAttention fidelity on the embedded SmolLM2-135M-Instruct: density, next-token KL and top-1 agreement vs sdpa.

Input: the first ``--tokens`` tokens of the standard library's ``*.py`` files in sorted order (the input of
docs/fidelity.md). KL(dense || sparse) and top-1 agreement are taken over the last 256 positions of one
prefill; density is attended / causal key blocks over the sparse layers. With ``--passkey`` it instead asks the
pass-key question of examples/generate.py with dense and with each sparse setting and prints the answers.

    PYTHONPATH=. python examples/xattn_fidelity.py --thresholds 0.8 0.9 0.95
    PYTHONPATH=. python examples/xattn_fidelity.py --passkey --thresholds 0.9 --decode-threshold 0.99
"""
from __future__ import annotations

import argparse
import time

import torch

import hf_sparse
from hf_sparse.config import XAttnConfig
from hf_sparse.tools.default_model import load_default_model
from hf_sparse.tools.eval import stdlib_text


def use(model, config: XAttnConfig | None) -> None:
    """Switch ``model`` to sdpa (``None``) or to XAttention with ``config``."""
    if config is None:
        model.set_attn_implementation("sdpa")
        return
    hf_sparse.configure(model, config)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.8, 0.9, 0.95])
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--decode-threshold", type=float, default=None)
    parser.add_argument("--stride", type=int, default=8)
    parser.add_argument("--gqa-reduce", default="any", choices=["any", "vote"])
    parser.add_argument("--last-n", type=int, default=256)
    parser.add_argument("--passkey", action="store_true", help="answer the pass-key prompt instead")
    args = parser.parse_args()

    model, tokenizer = load_default_model(attn_implementation="sdpa")
    configs = [XAttnConfig(block_size=args.block_size, stride=args.stride, threshold=t, gqa_reduce=args.gqa_reduce,
                           decode_threshold=args.decode_threshold) for t in args.thresholds]
    if args.passkey:
        passkey(model, tokenizer, configs, args.tokens)
        return
    ids = tokenizer(stdlib_text(40 * args.tokens // 4), return_tensors="pt").input_ids[:, : args.tokens]
    positions = min(args.last_n, ids.shape[1])
    start = time.perf_counter()
    dense_lp = torch.log_softmax(model(ids, logits_to_keep=positions).logits.float(), -1)
    print(f"SmolLM2-135M, {ids.shape[1]} tokens, last {positions} positions; dense {time.perf_counter() - start:.1f} s")
    print("| threshold | stride | gqa_reduce | density | top-1 agreement | next-token KL | time (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for config in configs:
        use(model, config)
        start = time.perf_counter()
        with hf_sparse.record_sparsity() as rec:
            sparse_lp = torch.log_softmax(model(ids, logits_to_keep=positions).logits.float(), -1)
        elapsed = time.perf_counter() - start
        use(model, None)
        kl = (dense_lp.exp() * (dense_lp - sparse_lp)).sum(-1).mean().item()
        top1 = (dense_lp.argmax(-1) == sparse_lp.argmax(-1)).float().mean().item()
        print(f"| {config.threshold} | {config.stride} | {config.gqa_reduce} | {rec.density('prefill'):.3f} | "
              f"{top1:.4f} | {kl:.5f} | {elapsed:.1f} |")


def passkey(model, tokenizer, configs: list[XAttnConfig], tokens: int) -> None:
    """Greedy answers to the pass-key prompt of examples/generate.py, dense first, then each config."""
    from generate import passkey_prompt  # examples/generate.py (this script's folder is on sys.path)

    prompt, key = passkey_prompt(tokenizer, tokens, seed=0)
    inputs = tokenizer(prompt, return_tensors="pt")
    for config in [None, *configs]:
        use(model, config)
        cache = None if config is None else hf_sparse.SparseCache(model.config)
        with hf_sparse.record_sparsity() as rec:
            out = model.generate(**inputs, past_key_values=cache, max_new_tokens=12, do_sample=False)
        use(model, None)
        answer = tokenizer.decode(out[0, inputs.input_ids.shape[1]:], skip_special_tokens=True).strip()
        label = "dense" if config is None else \
            f"threshold {config.threshold} (decode {config.mass_threshold('decode')}), {config.gqa_reduce}"
        density = "" if config is None else \
            f" (density prefill {rec.density('prefill'):.3f}, decode {rec.density('decode'):.3f})"
        print(f"pass key {key} in {inputs.input_ids.shape[1]} tokens, {label}: {answer!r}{density}")


if __name__ == "__main__":
    main()
