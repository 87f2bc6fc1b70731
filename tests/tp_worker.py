"""The worker of ``tests/test_multi_gpu.py``'s tensor-parallel test: run under ``torchrun`` (one process per GPU),
it loads the test's tiny model with ``tp_plan="auto"`` under sdpa, plas and xattn, compares them, and rank 0
writes the comparison as JSON (``--out``)."""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM

import hf_sparse
from hf_sparse.distributed import tensor_parallel_kwargs
from hf_sparse.peer_tests import full_density_config

from conftest import graph_config  # this script's folder is on sys.path (python tests/tp_worker.py)


def generate(model, ids, mask):
    return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                          output_scores=True, return_dict_in_generate=True)


def max_diff(a, b) -> float:
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a, b))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    def load(attn: str):
        return AutoModelForCausalLM.from_pretrained(args.model, attn_implementation=attn, dtype=torch.float32,
                                                    **tensor_parallel_kwargs()).eval()

    dense = load("sdpa")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = dense.device
    ids = torch.randint(0, 128, (2, 300), generator=torch.Generator().manual_seed(4)).to(device)
    mask = torch.ones_like(ids)
    mask[0, :17] = 0
    with torch.no_grad():
        dense_logits = dense(input_ids=ids, attention_mask=mask).logits
    dense_run = generate(dense, ids, mask)
    report = {"world_size": world, "full_density": {}, "sparse": {}}
    tokens = [dense_run.sequences.cpu()]
    for method in ("plas", "xattn"):
        model = load(method)
        hf_sparse.configure(model, full_density_config(method))
        with torch.no_grad():
            logits = model(input_ids=ids, attention_mask=mask).logits
        run = generate(model, ids, mask)
        report["full_density"][method] = {
            "prefill_max_diff": float((logits - dense_logits).abs().max()),
            "scores_max_diff": max_diff(run.scores, dense_run.scores),
            "tokens_equal": bool(torch.equal(run.sequences, dense_run.sequences)),
        }
        runs = {}
        for graphs in (False, True):
            hf_sparse.configure(model, graph_config(method, decode_cuda_graph=graphs))
            runs[graphs] = generate(model, ids, mask)
        stats = hf_sparse.graphs.stats(model)
        report["sparse"][method] = {
            "graph_tokens_equal_eager": bool(torch.equal(runs[True].sequences, runs[False].sequences)),
            "scores_max_diff": max_diff(runs[True].scores, runs[False].scores),
            "replays": stats.replays if stats else 0, "captures": stats.captures if stats else 0,
            "disabled_reason": stats.disabled_reason if stats else "no graph stats",
        }
        tokens += [run.sequences.cpu(), runs[True].sequences.cpu()]
        del model
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
