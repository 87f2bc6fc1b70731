"""Run transformers' own model tests under sdpa, plas and xattn (and plas / xattn at full density) and compare.

    python scripts/peer_tests.py --transformers /path/to/transformers [--out peer_results] [--jobs 2]
        [--models llama qwen2 mistral] [--modes sdpa plas xattn plas-full xattn-full] [--reuse]
        [-- extra pytest args]

``make peer-test TRANSFORMERS_TESTS=/path/to/transformers`` runs it with the defaults. Each (model, mode) is one
pytest run of ``tests/models/<model>/test_modeling_<model>.py`` inside the checkout with the
``hf_sparse.tools.peer_tests`` plugin; each writes ``<out>/<model>_<mode>.json``, and the comparison goes to
``<out>/summary.json`` and ``<out>/summary.md``: counts and wall time per model and mode, and every test that
passes under sdpa but not under a method, with its error line. What the plugin resolves, and the checkout the
figures in docs/peer_tests.md came from: docs/peer_tests.md.

Nothing reaches the network: ``HF_HUB_OFFLINE=1``; the pipeline tests (they load tiny checkpoints from the Hub) are
skipped with ``RUN_PIPELINE_TESTS=0``, the slow integration tests (real checkpoints) stay skipped (``RUN_SLOW``
unset), and the tensor-parallel / FSDP mixins (one process per device) are deselected by marker.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MODELS = ("llama", "qwen2", "mistral")
#: mode name -> the plugin's options
MODES = {
    "sdpa": [],
    "plas": ["--hf-sparse-method", "plas"],
    "xattn": ["--hf-sparse-method", "xattn"],
    "plas-full": ["--hf-sparse-method", "plas", "--hf-sparse-full-density"],
    "xattn-full": ["--hf-sparse-method", "xattn", "--hf-sparse-full-density"],
}
DESELECT = "not is_tensor_parallel_test and not is_fsdp_test"
ENVIRONMENT = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "RUN_PIPELINE_TESTS": "0", "RUN_SLOW": "0"}
PASSING = ("passed", "xfailed", "xpassed")


def run(checkout: Path, model: str, mode: str, out: Path, jobs: int, extra: list[str]) -> dict:
    """One pytest run; its report (written by the plugin)."""
    report = out / f"{model}_{mode}.json"
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "log_cli=false",
               "-p", "hf_sparse.tools.peer_tests", *MODES[mode], "--hf-sparse-report", str(report), "-m", DESELECT,
               f"tests/models/{model}/test_modeling_{model}.py", *extra]
    if jobs > 1:
        command += ["-n", str(jobs)]
    log = out / f"{model}_{mode}.log"
    start = time.monotonic()
    with open(log, "w") as handle:
        subprocess.run(command, cwd=checkout, env={**os.environ, **ENVIRONMENT}, stdout=handle,
                       stderr=subprocess.STDOUT, check=False)
    if not report.exists():
        raise SystemExit(f"{model} / {mode}: pytest wrote no report; see {log}")
    result = json.loads(report.read_text())
    result["run_s"] = round(time.monotonic() - start, 1)  # the whole pytest process, collection included
    report.write_text(json.dumps(result, indent=1))
    print(f"{model:8s} {mode:11s} {result['counts']} {result['run_s']:.0f} s", flush=True)
    return result


def compare(results: dict[tuple[str, str], dict]) -> dict:
    """For each model and method mode: the tests that pass under sdpa and do not under it (outcome, error line)."""
    regressions: dict[str, dict[str, dict[str, list[str]]]] = {}
    for (model, mode), result in results.items():
        baseline = results.get((model, "sdpa"))
        if mode == "sdpa" or baseline is None:
            continue
        lost = {}
        for test, outcome in baseline["outcomes"].items():
            now = result["outcomes"].get(test, "not run")
            if outcome in PASSING and now not in PASSING:
                lost[test.split("::")[-1]] = [now, result["errors"].get(test, "")]
        regressions.setdefault(model, {})[mode] = lost
    return regressions


def markdown(results: dict[tuple[str, str], dict], regressions: dict) -> str:
    lines = ["| model | mode | passed | failed | errors | skipped | wall (s) |", "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for (model, mode), result in results.items():
        counts = result["counts"]
        lines.append(f"| {model} | {mode} | {counts.get('passed', 0)} | {counts.get('failed', 0)} | "
                     f"{counts.get('error', 0)} | {counts.get('skipped', 0)} | {result.get('run_s', result['wall_s']):.0f} |")
    for model, modes in regressions.items():
        for mode, lost in modes.items():
            lines += ["", f"## {model} / {mode}: {len(lost)} pass under sdpa and not here", ""]
            lines += [f"- `{test}` ({outcome}): {error}" for test, (outcome, error) in sorted(lost.items())]
    for (model, mode), result in results.items():
        failing = [test.split("::")[-1] for test, outcome in result["outcomes"].items() if outcome in ("failed", "error")]
        if mode == "sdpa" and failing:
            lines += ["", f"## {model} / sdpa: {len(failing)} fail under sdpa itself", ""]
            lines += [f"- `{test}`: {result['errors'].get(test, '')}" for test in failing]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transformers", type=Path, required=True, help="a transformers checkout (its tests/)")
    parser.add_argument("--out", type=Path, default=Path("peer_results"))
    parser.add_argument("--models", nargs="+", default=list(MODELS))
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    parser.add_argument("--jobs", type=int, default=1, help="pytest-xdist workers per run")
    parser.add_argument("--reuse", action="store_true", help="keep the reports already in --out; run the others")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to every pytest run (e.g. -k ...)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {}
    for model in args.models:
        for mode in args.modes:
            report = args.out / f"{model}_{mode}.json"
            results[model, mode] = (json.loads(report.read_text()) if args.reuse and report.exists() else
                                    run(args.transformers.resolve(), model, mode, args.out.resolve(), args.jobs,
                                        args.pytest_args))
    regressions = compare(results)
    summary = {"runs": {f"{model}/{mode}": {key: result.get(key) for key in ("counts", "run_s", "transformers")}
                        for (model, mode), result in results.items()},
               "regressions": regressions}
    (args.out / "summary.json").write_text(json.dumps(summary, indent=1))
    (args.out / "summary.md").write_text(markdown(results, regressions))
    print(f"summary: {args.out / 'summary.md'}")


if __name__ == "__main__":
    main()
