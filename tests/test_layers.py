"""The package's two layers: the runtime (every module outside hf_sparse.tools) never imports a tool, the imports
between our modules form no circle, and no module imports inside a function (docs/architecture.md)."""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "hf_sparse"
TOOLS = "hf_sparse.tools"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
RUNTIME = sorted(name for name in MODULES if name != TOOLS and not name.startswith(TOOLS + "."))


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str, inside_functions: bool | None = None) -> list[tuple[int, str]]:
    """``(line, module)`` for each of our modules that ``name`` imports (``inside_functions``: only those inside a
    function, only those outside, or both)."""
    tree = ast.parse(MODULES[name].read_text())
    in_function = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            in_function.update(id(sub) for sub in ast.walk(node) if sub is not node)
    package = name if _is_package(name) else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if inside_functions is not None and (id(node) in in_function) != inside_functions:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            # "from X import y": the submodule X.y where there is one, else X itself
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        found.extend((node.lineno, target) for target in targets if target in MODULES)
    return found


def test_no_runtime_module_imports_a_tool_even_inside_a_function():
    offending = [f"{name}:{line} imports {target}" for name in RUNTIME for line, target in _imports(name)
                 if target == TOOLS or target.startswith(TOOLS + ".")]
    assert not offending, "the runtime imports the tools layer:\n" + "\n".join(offending)


def test_importing_the_runtime_loads_no_tool_module():
    """A fresh interpreter imports every runtime module; sys.modules then holds no module of hf_sparse.tools (the
    public tool names, hf_sparse.train_gates and the like, load on first use)."""
    script = ("import importlib, json, sys\n"
              f"for name in {RUNTIME!r}:\n"
              "    importlib.import_module(name)\n"
              f"print(json.dumps(sorted(m for m in sys.modules if m == {TOOLS!r} or m.startswith({TOOLS + '.'!r}))))\n")
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                            cwd=PACKAGE.parent)
    assert result.returncode == 0, result.stderr[-2000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []
    assert len(RUNTIME) > 25 and "hf_sparse.kernels.sparse_prefill" in RUNTIME


def test_the_public_tool_names_load_on_first_use():
    import hf_sparse
    from hf_sparse.tools import gate_eval, gate_training, hub

    assert hf_sparse.train_gates is gate_training.train_gates
    assert hf_sparse.GateTrainingConfig is gate_training.GateTrainingConfig
    assert hf_sparse.evaluate_gates is gate_eval.evaluate_gates
    assert hf_sparse.push_gates_to_hub is hub.push_gates_to_hub
    assert set(hf_sparse.__all__) <= set(dir(hf_sparse))
    with pytest.raises(AttributeError, match="no attribute 'not_a_name'"):
        hf_sparse.not_a_name  # noqa: B018


def test_our_imports_form_no_circle():
    graph = {name: sorted({target for _, target in _imports(name, inside_functions=False) if target != name})
             for name in MODULES}
    # A package's submodule imports its package first (Python's rule), so an edge from a package to its own
    # submodule is how a package exposes it, not a circle: leave out only the implicit child -> parent edge,
    # which the graph never holds.
    visiting, done, circle = set(), set(), []

    def visit(name: str, path: list[str]) -> None:
        if circle or name in done:
            return
        if name in visiting:
            circle.extend(path[path.index(name):] + [name])
            return
        visiting.add(name)
        for target in graph[name]:
            visit(target, path + [target])
        visiting.discard(name)
        done.add(name)

    for name in MODULES:
        visit(name, [name])
    assert not circle, "import circle: " + " -> ".join(circle)


def test_no_module_imports_inside_a_function():
    """Imports sit at the top of a module, where a reader and tools see them (an optional dependency is imported
    at the top under try/except ImportError, as kernels/__init__.py does for Triton)."""
    offending = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                offending.extend(f"{name}:{sub.lineno}" for sub in ast.walk(node)
                                 if isinstance(sub, (ast.Import, ast.ImportFrom)))
    assert not offending, "imports inside functions: " + ", ".join(offending)
