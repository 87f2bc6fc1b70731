"""The worker of the tensor-parallel tests (``tests/test_multi_gpu.py`` on two GPUs, ``tests/test_tensor_parallel_cpu.py``
on two CPU processes under gloo): run under ``torchrun`` (one process per rank), it loads the tests' tiny model with
tensor parallelism (``hf_sparse.distributed.tensor_parallel_kwargs``: ``tp_plan="auto"`` up to transformers 5.17,
``distributed_config=DistributedConfig(tp_plan="auto")`` from 5.18) under sdpa, plas, xattn and star, compares them,
and rank 0 writes the comparison as JSON (``--out``). PLAS also runs with gate weights (a gate file loaded on the
sharded model: each rank keeps its chunk of the KV heads). Runs on the GPUs where the process sees them, else on the CPU
(transformers picks the device and backend: nccl or gloo)."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import transformers
from transformers import AutoModelForCausalLM

import hf_sparse
from hf_sparse import fusion
from hf_sparse.cache import CACHE_KWARG
from hf_sparse.distributed import tensor_parallel_kwargs, tensor_parallel_rank_and_size
from hf_sparse.tools.peer_tests import full_density_config

from conftest import selecting_config  # this script's folder is on sys.path (python tests/tp_worker.py)

#: Star's configuration here: blocks that split the tiny prompt into a context phase and a query phase.
STAR = hf_sparse.StarConfig(block_size=64, anchor_size=32, dense_below=0)


def generate(model, ids, mask, **kwargs):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                          output_scores=True, return_dict_in_generate=True, **kwargs)


def max_diff(a, b) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))


def sharding(model, ids) -> dict:
    """How the loaded model is split: the projections' weight type (``DTensor`` from transformers 5.18 on), the
    query and key heads its attention function receives, and what ``hf_sparse.fusion`` would fuse (it must
    leave the split layers and head alone)."""
    seen = []
    with torch.no_grad(), hf_sparse.attention_probe(model, lambda module, q, k, v, mask: seen.append(
            (q.shape[1], k.shape[1]))):
        model(input_ids=ids[:, :32])
    layers = model.model.layers
    return {"weight_type": type(layers[0].self_attn.q_proj.weight).__name__,
            "attention_heads": list(seen[0]),
            "model_heads": [model.config.num_attention_heads, model.config.num_key_value_heads],
            "fusable_layers": sum(fusion.fusable_layer(layer) for layer in layers),
            "fusable_head": fusion.fusable_head(model.lm_head)}


def fused_step(model, ids, mask) -> dict:
    """One decode step inside ``fusion.fused_modules`` (the modules a captured step swaps: compiled norms and MLPs,
    whose projections are the tensor-parallel ones) against the same step without it."""
    step = torch.tensor([[5], [7]], device=ids.device)
    step_mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    logits, swapped = [], 0
    for fused in (False, True):
        cache = hf_sparse.SparseCache(model.config)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, **{CACHE_KWARG: cache})
            with fusion.fused_modules(model, enabled=fused) as count:
                swapped = max(swapped, count)
                logits.append(model(input_ids=step, attention_mask=step_mask, **{CACHE_KWARG: cache}).logits)
    # fusion runs a module eagerly, from then on, where its compiled code fails: count those, or eager could be
    # compared with eager
    eager_fallbacks = sum(compiled is None for compiled in fusion._COMPILED.values())
    return {"swapped": swapped, "max_diff": float((logits[0] - logits[1]).abs().max()),
            "eager_fallbacks": eager_fallbacks, "compiled": len(fusion._COMPILED)}


def gated(model, whole, ids, mask, mean_pooled_logits, folder: Path) -> tuple[dict, torch.Tensor]:
    """PLAS with the same random gates on the sharded and the whole model (both configured to select): written from
    the whole model (``save_gates``), loaded on the sharded one (``load_gates``: each rank keeps its chunk of the KV
    heads), saved back from the sharded one (gathered); prefill logits and greedy decode compared. Also whether the
    rank's ``k_proj`` rows are the whole model's rows of the same heads. Returns the report and the gated tokens."""
    rank = dist.get_rank()
    tp_rank, tp_size = tensor_parallel_rank_and_size(model)
    spec = hf_sparse.gates.gate_spec(whole)
    generator = torch.Generator().manual_seed(7)  # the same gates on every rank
    gates = {layer: torch.rand(spec.shape, generator=generator) * (2 / spec.block_size) for layer in spec.gated_layers}
    hf_sparse.gates.set_gates(whole, gates)
    written = hf_sparse.save_gates(whole, folder / f"gates_whole_rank{rank}")
    hf_sparse.load_gates(model, written, strict=True)
    heads = spec.kv_heads // tp_size
    chunk = slice(tp_rank * heads, (tp_rank + 1) * heads)
    attached = hf_sparse.gates.get_gates(model)
    key_weight = model.model.layers[0].self_attn.k_proj.weight
    key_weight = key_weight.to_local() if hasattr(key_weight, "to_local") else key_weight  # a DTensor from 5.18 on
    rows = key_weight.shape[0]
    with torch.no_grad(), hf_sparse.record_sparsity() as recorder:
        logits = model(input_ids=ids, attention_mask=mask).logits
        whole_logits = whole(input_ids=ids, attention_mask=mask).logits
    run, whole_run = generate(model, ids, mask), generate(whole, ids, mask)
    from safetensors.torch import load_file

    resaved = load_file(hf_sparse.save_gates(model, folder / f"gates_sharded_rank{rank}"))
    checks = {  # this rank's
        "tp_rank": tp_rank, "attached_shape": [list(attached[i].shape) for i in sorted(attached)],
        "attached_is_rank_chunk": sorted(attached) == sorted(gates) and all(
            torch.equal(attached[i].cpu(), gates[i][chunk]) for i in gates),
        "key_rows_are_rank_chunk": bool(torch.equal(
            key_weight.detach().cpu(), whole.model.layers[0].self_attn.k_proj.weight.detach().cpu()[
                tp_rank * rows:(tp_rank + 1) * rows])),
        "resaved_equal": sorted(resaved) == sorted(hf_sparse.gate_files.gate_tensor_name(i) for i in gates) and all(
            torch.equal(resaved[hf_sparse.gate_files.gate_tensor_name(i)], gates[i]) for i in gates),
    }
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, checks)
    report = {
        "tp_size": tp_size, "layers": sorted(gates), "ranks": ranks,
        "prefill_density": recorder.density("prefill"),
        "mean_pooling_prefill_max_diff": float((logits - mean_pooled_logits).abs().max()),
        "unsharded_prefill_max_diff": float((logits - whole_logits).abs().max()),
        "unsharded_scores_max_diff": max_diff(run.scores, whole_run.scores),
        "unsharded_tokens_equal": bool(torch.equal(run.sequences, whole_run.sequences)),
    }
    hf_sparse.gates.set_gates(model, None)
    hf_sparse.gates.set_gates(whole, None)
    return report, run.sequences.cpu()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    def load(attn: str, parallel: bool = True):
        kwargs = tensor_parallel_kwargs() if parallel else {}
        model = AutoModelForCausalLM.from_pretrained(args.model, attn_implementation=attn, dtype=torch.float32,
                                                     **kwargs).eval()
        return model if parallel else model.to(device)

    dense = load("sdpa")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = dense.device
    ids = torch.randint(0, 128, (2, 300), generator=torch.Generator().manual_seed(4)).to(device)
    mask = torch.ones_like(ids)
    mask[0, :17] = 0
    with torch.no_grad():
        dense_logits = dense(input_ids=ids, attention_mask=mask).logits
    dense_run = generate(dense, ids, mask)
    report = {"world_size": world, "transformers": transformers.__version__, "device": device.type,
              "backend": dist.get_backend(), "tp_size": getattr(dense, "tp_size", None),
              "sharding": sharding(dense, ids), "full_density": {}, "sparse": {}}
    tokens = [dense_run.sequences.cpu()]
    for method in ("plas", "xattn"):
        model = load(method)
        hf_sparse.configure(model, full_density_config(method))
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
        run = generate(model, ids, mask)
        static = generate(model, ids, mask, cache_implementation="static")  # the storage graph decode replays over
        report["full_density"][method] = {
            "prefill_max_diff": float((logits - dense_logits).abs().max()),
            "scores_max_diff": max_diff(run.scores, dense_run.scores),
            "tokens_equal": bool(torch.equal(run.sequences, dense_run.sequences)),
            "static_scores_max_diff": max_diff(static.scores, dense_run.scores),
            "static_tokens_equal": bool(torch.equal(static.sequences, dense_run.sequences)),
        }
        if method == "plas":
            report["fused_step"] = fused_step(model, ids, mask)
        runs = {}
        for graphs in (False, True):  # selection that skips blocks (no density probe: it would run these dense)
            hf_sparse.configure(model, selecting_config(method, decode_cuda_graph=graphs))
            runs[graphs] = generate(model, ids, mask)
        stats = hf_sparse.graphs.stats(model)
        with torch.no_grad(), hf_sparse.record_sparsity() as recorder:
            logits = model(input_ids=ids, attention_mask=mask).logits
        # The same selection on the whole model in this process: selection is per head, so splitting the heads over
        # the ranks changes nothing.
        whole = load(method, parallel=False)
        hf_sparse.configure(whole, selecting_config(method, decode_cuda_graph=False))
        with torch.no_grad():
            whole_logits = whole(input_ids=ids, attention_mask=mask).logits
        whole_run = generate(whole, ids, mask)
        report["sparse"][method] = {
            "graph_tokens_equal_eager": bool(torch.equal(runs[True].sequences, runs[False].sequences)),
            "scores_max_diff": max_diff(runs[True].scores, runs[False].scores),
            "replays": stats.replays if stats else 0, "captures": stats.captures if stats else 0,
            "disabled_reason": stats.disabled_reason if stats else "no graph stats",
            "prefill_density": recorder.density("prefill"),
            "unsharded_prefill_max_diff": float((logits - whole_logits).abs().max()),
            "unsharded_scores_max_diff": max_diff(runs[False].scores, whole_run.scores),
            "unsharded_tokens_equal": bool(torch.equal(runs[False].sequences, whole_run.sequences)),
        }
        tokens += [run.sequences.cpu(), runs[True].sequences.cpu()]
        if method == "plas":
            report["gates"], gated_tokens = gated(model, whole, ids, mask, logits, Path(args.out).parent)
            tokens.append(gated_tokens)
        del model, whole
    # Star through model.generate() (context and query phases in each rank's heads) against the whole model; its
    # context sharding over the same ranks is refused.
    star_ids, star_mask = ids, torch.ones_like(ids)  # Star's generate() path takes left padding; keep it unpadded
    runs, logits = {}, {}
    for parallel in (True, False):
        model = load("star", parallel)
        hf_sparse.configure(model, STAR)
        with torch.no_grad():
            logits[parallel] = model(input_ids=star_ids, attention_mask=star_mask).logits
        runs[parallel] = generate(model, star_ids, star_mask)
        if parallel:
            try:
                hf_sparse.star_attention.encode_context(model, star_ids[:, :256])
                refused = None
            except ValueError as error:
                refused = str(error)
        del model
    report["star"] = {"unsharded_prefill_max_diff": float((logits[True] - logits[False]).abs().max()),
                      "unsharded_scores_max_diff": max_diff(runs[True].scores, runs[False].scores),
                      "unsharded_tokens_equal": bool(torch.equal(runs[True].sequences, runs[False].sequences)),
                      "context_sharding_refused": refused}
    tokens.append(runs[True].sequences.cpu())
    gathered = [None] * world
    dist.all_gather_object(gathered, tokens)
    report["ranks_agree"] = all(all(torch.equal(a, b) for a, b in zip(other, gathered[0])) for other in gathered)
    if rank == 0:
        out = Path(args.out)
        partial = out.with_name(out.name + ".partial")
        partial.write_text(json.dumps(report, indent=1))
        os.replace(partial, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
