"""Each layer's prefill decision for PLAS or XAttention (``--method``) at given prompt lengths, three ways: the default
configuration, no density fallback (every layer's full selection density) and ``dense_above_density=0.85``; density
memory off, so every forward decides afresh. One line per (length, configuration): ``layer:density`` for a sparse
layer, ``layer:P<d>`` for one the probe sent dense at probe density ``d``, ``layer:F<d>`` for one whose full
selection ``d`` did, ``layer:D`` for a dense layer by configuration (``dense_layers``, ``dense_below``).

A diagnostic (decisions quoted in docs/benchmarks.md), not a tool. From the repository root (it imports
benchmarks/_common.py):

    python studies/probe_layers.py --model smollm2 --lengths 32768 131072 [--method xattn]

``--configs NAME ...`` decides with these configurations instead (method names as ``bench_generate.py`` takes them,
e.g. ``plas plas-query_stride=4-prefill_top_k=[52:63]``). Needs CUDA (the density fallback applies there only), or
``--cpu``: the trained SmolLM2 in float32 on the CPU, the PyTorch reference kernels deciding as the GPU's path does
(slow: about 6 minutes a configuration at 32K on two cores).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

# benchmarks/_common.py: the helpers the benchmark scripts share
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from _common import LoadedModel, add_model_arguments, load_model, method_name, sparse_config  # noqa: E402


def cell(record) -> str:
    """One layer's decision as ``layer:density``, ``layer:P<probe density>``, ``layer:F<density>`` or ``layer:D``."""
    if record.dense_reason is None:
        return f"{record.layer_idx}:{float(record.attended_blocks) / max(float(record.causal_blocks), 1.0):.2f}"
    words = record.dense_reason.split()
    if record.dense_reason.startswith("probe density"):
        return f"{record.layer_idx}:P{words[2]}"
    if record.dense_reason.startswith("density"):
        return f"{record.layer_idx}:F{words[1]}"
    return f"{record.layer_idx}:D"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser, default="smollm2")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072], help="prompt lengths in tokens")
    parser.add_argument("--method", choices=["plas", "xattn"], default="plas", help="(default: %(default)s)")
    parser.add_argument("--configs", nargs="+", type=method_name, metavar="NAME",
                        help="decide with these configurations (plas / xattn method names) instead")
    parser.add_argument("--cpu", action="store_true",
                        help="--model smollm2 in float32 on the CPU, the reference kernels deciding as on CUDA")
    args = parser.parse_args()
    if any(name in ("sdpa", "sdpa-static") for name in args.configs or ()):
        parser.error("--configs: sdpa and sdpa-static make no sparse decisions; name plas / xattn configurations")
    import dataclasses

    import hf_sparse

    if args.cpu:
        if args.model != "smollm2" or args.gguf:
            raise SystemExit("probe_layers.py --cpu runs the default model only (--model smollm2, no --gguf)")
        from hf_sparse import density
        from hf_sparse.tools.default_model import load_default_model

        density.falls_back_by_density = lambda query: True  # the decisions CUDA's path makes
        model, tokenizer = load_default_model(attn_implementation="sdpa", dtype=torch.float32, device="cpu")
        loaded = LoadedModel(model.eval(), tokenizer, "SmolLM2-135M-Instruct in float32 on the CPU (reference kernels)")
    elif not torch.cuda.is_available():
        raise SystemExit("probe_layers.py needs CUDA (the density fallback it reports applies on CUDA only) or --cpu")
    else:
        loaded = load_model(args)
    if args.configs:
        configs = {name: dataclasses.replace(sparse_config(name), density_memory=False) for name in args.configs}
    else:
        config_class = hf_sparse.PLASConfig if args.method == "plas" else hf_sparse.XAttnConfig
        configs = {"default": config_class(density_memory=False),
                   "no fallback": config_class(dense_above_density=None, density_memory=False),
                   "dense_above_density=0.85": config_class(dense_above_density=0.85, density_memory=False)}
    print(loaded.description, "|", args.method if not args.configs else "--configs")
    for length in args.lengths:
        ids = loaded.prompt(length, device="cpu" if args.cpu else "cuda")
        for name, config in configs.items():
            hf_sparse.configure(loaded.model, config)
            with torch.no_grad(), hf_sparse.record_sparsity() as recorder:
                loaded.model(input_ids=ids, logits_to_keep=1)
            cells = [cell(record) for record in recorder.records if record.phase == "prefill"]
            print(f"{length} | {name} | density {recorder.density('prefill'):.3f} | {' '.join(cells)}", flush=True)


if __name__ == "__main__":
    main()
