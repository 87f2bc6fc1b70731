"""pytest plugin: transformers' own model tests with the default attention implementation resolved to ours.

Loaded with ``pytest -p hf_sparse.peer_tests`` from a transformers checkout (``scripts/peer_tests.py`` runs the
llama / qwen2 / mistral tests under every mode and writes the comparison; ``docs/peer_tests.md``)::

    --hf-sparse-method {plas,xattn}   a model that asks for no implementation, or for "sdpa", gets the method
    --hf-sparse-full-density          ... configured to run the sparse path on the tests' tiny inputs, every
                                      block selected (block 16, dense_below=0, no dense layers)
    --hf-sparse-report PATH           one JSON: counts, wall time, the outcome and error line of every test

What is resolved, and why that is the fair comparison: transformers resolves a model's implementation in
``PreTrainedModel.get_correct_attn_implementation`` (None -> "sdpa", at model init, ``from_pretrained``,
``_from_config`` and ``set_attn_implementation``, for the model and each sub-model). hf_sparse claims to be a
drop-in for sdpa, and the tests use "sdpa" as the default fast path (``test_eager_matches_sdpa_inference`` compares
it with eager, ``test_sdpa_padding_matches_padding_free_with_position_ids`` runs it on packed sequences), so both
None and "sdpa" resolve to the method. "eager" stays eager: it is the reference the tests compare against.
Flash and flex attention are left alone (they skip on the CPU). A test that asserts the name "sdpa" then fails by
design; one that assigns ``config._attn_implementation`` without building a model is not affected.

The patch is the one method of transformers' that does the resolution, made in ``pytest_configure`` and undone
at the session's end.
"""
from __future__ import annotations

import json
import linecache
import time
from typing import Any

import pytest
import transformers
from transformers import PreTrainedModel

from ..config import CONFIG_KEY, PLASConfig, XAttnConfig, stored_config

#: The implementation requests resolved to the method (None: the test asked for none).
RESOLVED = (None, "sdpa")

_ORIGINAL: dict[str, Any] = {}


def full_density_config(method: str) -> PLASConfig | XAttnConfig:
    """A configuration whose sparse path runs on any input and selects every causal block: it must equal dense
    attention (``tests/conftest.py``'s ``full_density()`` for PLAS; XAttention at threshold 1.0)."""
    if method == "plas":
        return PLASConfig(block_size=16, prefill_top_k=(10_000, 10_000), decode_top_k=(10_000, 10_000),
                          dense_below=0, dense_layers=(), query_union=32)
    return XAttnConfig(block_size=16, stride=4, threshold=1.0, decode_threshold=1.0, dense_last=0, dense_below=0,
                       dense_layers=())


def install(method: str, full_density: bool = False) -> None:
    """Resolve the default and "sdpa" implementation requests to ``method`` (idempotent; :func:`uninstall`)."""
    if "resolve" in _ORIGINAL:
        return
    original = PreTrainedModel.get_correct_attn_implementation
    stored = full_density_config(method).to_dict() if full_density else None

    def get_correct_attn_implementation(self, requested_attention: str | None, is_init_check: bool = False) -> str:
        if requested_attention not in RESOLVED:
            return original(self, requested_attention, is_init_check)
        if stored is not None:
            text_config = self.config.get_text_config(decoder=True)
            for target in {id(self.config): self.config, id(text_config): text_config}.values():
                if stored_config(target) is None:
                    setattr(target, CONFIG_KEY, dict(stored))
        return original(self, method, is_init_check)

    _ORIGINAL["resolve"] = original
    PreTrainedModel.get_correct_attn_implementation = get_correct_attn_implementation


def uninstall() -> None:
    """Undo :func:`install`."""
    if "resolve" in _ORIGINAL:
        PreTrainedModel.get_correct_attn_implementation = _ORIGINAL.pop("resolve")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("hf_sparse", "hf_sparse: transformers' tests under a sparse attention implementation")
    group.addoption("--hf-sparse-method", choices=("plas", "xattn"), default=None,
                    help="resolve the default (and 'sdpa') attention implementation to this method")
    group.addoption("--hf-sparse-full-density", action="store_true", default=False,
                    help="configure the method to run its sparse path on tiny inputs, every block selected")
    group.addoption("--hf-sparse-report", default=None, metavar="PATH",
                    help="write this run's counts and per-test outcomes as JSON")


class _Report:
    """Outcome of every test of the run (setup errors and call failures alike), written at the session's end."""

    def __init__(self, path: str, mode: dict[str, Any]) -> None:
        self.path, self.mode, self.start = path, mode, time.monotonic()
        self.outcomes: dict[str, str] = {}
        self.errors: dict[str, str] = {}

    @pytest.hookimpl
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # A test's first failure decides (a failed subtest, or an error in setup or teardown, outlives a passing
        # call); a skip counts only where nothing else was reported (a skipped subtest does not skip its test).
        nodeid, failed = report.nodeid, self.outcomes.get(report.nodeid) in ("failed", "error")
        if report.failed and not failed:
            self.outcomes[nodeid] = "failed" if report.when == "call" else "error"
            self.errors[nodeid] = _error_line(report)
        elif report.skipped:
            self.outcomes.setdefault(nodeid, "xfailed" if hasattr(report, "wasxfail") else "skipped")
        elif report.passed and report.when == "call" and not failed:
            self.outcomes[nodeid] = "xpassed" if hasattr(report, "wasxfail") else "passed"

    @pytest.hookimpl
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        counts: dict[str, int] = {}
        for outcome in self.outcomes.values():
            counts[outcome] = counts.get(outcome, 0) + 1
        result = {**self.mode, "transformers": transformers.__version__, "exit_status": int(exitstatus),
                  "wall_s": round(time.monotonic() - self.start, 1), "counts": counts,
                  "outcomes": dict(sorted(self.outcomes.items())), "errors": dict(sorted(self.errors.items()))}
        with open(self.path, "w") as handle:
            json.dump(result, handle, indent=1)


def _error_line(report: pytest.TestReport) -> str:
    """The line a failure is known by: pytest's crash message (first line) and the statement that raised it in the
    innermost test-file frame (``AssertionError: False is not true`` alone names nothing), else the report's last
    line."""
    crash = getattr(report.longrepr, "reprcrash", None)
    if crash is None:
        lines = [line for line in str(report.longrepr).splitlines() if line.strip()]
        return lines[-1][:400] if lines else ""
    message = (crash.message.strip().splitlines() or [""])[0]
    statement = ""
    for entry in reversed(getattr(getattr(report.longrepr, "reprtraceback", None), "reprentries", None) or []):
        location = getattr(entry, "reprfileloc", None)
        if location is None or "/tests/" not in f"/{location.path}":
            continue
        source = " ".join(line[1:].strip() for line in getattr(entry, "lines", []) if line.startswith(">"))
        source = source or linecache.getline(location.path, location.lineno).strip()  # a short-style entry
        statement = f" [{location.path.split('tests/')[-1]}:{location.lineno}: {source[:200]}]"
        break
    return (message[:300] + statement)[:500]


def pytest_configure(config: pytest.Config) -> None:
    method = config.getoption("hf_sparse_method")
    full_density = config.getoption("hf_sparse_full_density")
    if full_density and method is None:
        raise pytest.UsageError("--hf-sparse-full-density needs --hf-sparse-method")
    if method is not None:
        install(method, full_density)
        config.add_cleanup(uninstall)
    path = config.getoption("hf_sparse_report")
    if path and not hasattr(config, "workerinput"):  # the xdist controller (or a run without workers) writes it
        mode = {"implementation": method or "sdpa", "full_density": bool(full_density)}
        config.pluginmanager.register(_Report(path, mode), "hf_sparse_report")


def pytest_report_header(config: pytest.Config) -> str:
    method = config.getoption("hf_sparse_method")
    if method is None:
        return "hf_sparse.peer_tests: transformers' own resolution (default sdpa)"
    density = ", full density" if config.getoption("hf_sparse_full_density") else ""
    return f"hf_sparse.peer_tests: default and 'sdpa' attention resolved to {method!r}{density}"
