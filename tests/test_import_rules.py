"""The layout's rules, read from the source: which package may import which (docs/architecture.md).

Imports are read with `ast`; those under `if TYPE_CHECKING:` are erased at run time and only
count where a rule says so. An import inside a function must say why (`# lazy: ...`, a heavy or
optional library loaded only when used), never to dodge a cycle. The edge and the proxy are
also imported for real in a fresh interpreter, which must not load torch.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "triton", "llguidance")


@dataclass(frozen=True, slots=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module, as written (absolute)
    line: int
    in_function: bool
    type_only: bool


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _function_lines(tree: ast.Module) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            lines.update(range(node.lineno + 1, (node.end_lineno or node.lineno) + 1))
    return lines


@cache
def imports() -> tuple[Import, ...]:
    found: list[Import] = []
    for path in sorted([*ROOT.glob("gateway/**/*.py"), *ROOT.glob("adapters/**/*.py")]):
        module = _module_name(path)
        tree = ast.parse(path.read_text(), str(path))
        typed, inside = _type_checking_lines(tree), _function_lines(tree)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base])
                targets = [base]
                # `from gateway import api` imports the subpackage
                targets += [f"{base}.{alias.name}" for alias in node.names if _is_module(f"{base}.{alias.name}")]
            for target in targets:
                found.append(Import(module, target.strip("."), node.lineno, node.lineno in inside,
                                    node.lineno in typed))
    return tuple(found)


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def unit(module: str) -> str:
    """The package a module belongs to for the rules: `gateway.<sub>` for a subpackage, the module
    itself for a top-level module of gateway, `adapters` for all of adapters."""
    parts = module.split(".")
    if parts[0] != "gateway":
        return parts[0]
    if len(parts) >= 2 and (ROOT / "gateway" / parts[1]).is_dir():
        return f"gateway.{parts[1]}"
    return module


def _ours(name: str) -> bool:
    return name.split(".")[0] in ("gateway", "adapters")


def _graph(*, with_functions: bool) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for imp in imports():
        if imp.type_only or (imp.in_function and not with_functions) or not _ours(imp.target):
            continue
        source, target = unit(imp.source), unit(imp.target)
        if source != target and target != "gateway":
            graph.setdefault(source, set()).add(target)
    return graph


def _reaches(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def _imported_names(prefix: str, *, with_types: bool = False) -> list[Import]:
    return [i for i in imports() if i.source.startswith(prefix) and (with_types or not i.type_only)]


@pytest.mark.parametrize("package", ["gateway.edge", "gateway.proxy"])
def test_the_edge_and_the_proxy_never_reach_the_engine_serving_or_torch(package: str) -> None:
    graph = _graph(with_functions=True)
    reached = _reaches(graph, package) | {package}
    assert not reached & {"gateway.engine", "gateway.serving", "gateway.api", "gateway.kvcache"}, reached
    heavy = [i for i in imports() if unit(i.source) in reached and not i.type_only
             and i.target.split(".")[0] in HEAVY]
    assert not heavy, heavy


def test_kvcache_never_imports_the_engine_even_for_types() -> None:
    bad = [i for i in _imported_names("gateway.kvcache", with_types=True)
           if i.target.startswith(("gateway.engine", "gateway.serving", "gateway.api"))]
    assert not bad, bad


def test_the_engine_never_imports_serving_or_the_http_layer() -> None:
    bad = [i for i in _imported_names("gateway.engine", with_types=True)
           if unit(i.target) in {"gateway.serving", "gateway.api", "gateway.edge", "gateway.proxy", "gateway.cli",
                                 "gateway.bench", "gateway.serve_ray"}]
    assert not bad, bad


def test_the_bench_never_imports_its_lab_but_to_run_it() -> None:
    """The lab (gateway/bench/lab) builds on the bench a user runs, never the other way: only the
    command line's dispatch to `--lab` imports it, lazily."""
    bad = [i for i in _imported_names("gateway.bench", with_types=True)
           if not i.source.startswith("gateway.bench.lab") and i.target.startswith("gateway.bench.lab")
           and not (i.source == "gateway.bench.options" and i.in_function)]
    assert not bad, bad


def test_serving_owns_its_grammars_and_takes_the_engines_job_types_from_its_package() -> None:
    """The grammars' text and compiled cache are serving's (gateway/serving/output_grammar.py,
    grammars.py); what a job carries (SamplingParams, Constraint, TokenLogprob, Tokenizer) serving
    takes from `gateway.engine`, never from the engine's sampling, constraints or prefix_index modules."""
    internal = {"gateway.engine.sampling", "gateway.engine.constraints", "gateway.engine.prefix_index",
                "gateway.engine.grammar_text"}
    bad = [i for i in _imported_names("gateway.serving", with_types=True) if i.target in internal]
    assert not bad, bad
    assert not (ROOT / "gateway/engine/grammar_text.py").exists()


def test_nothing_imports_the_command_line() -> None:
    bad = [i for i in imports() if unit(i.target) == "gateway.cli" and unit(i.source) != "gateway.cli"]
    assert not bad, bad


def test_no_cycles_between_packages() -> None:
    graph = _graph(with_functions=True)
    cycles = sorted(f"{a} <-> {b}" for a in graph for b in graph[a] if a < b and a in graph.get(b, ()))
    loops = sorted(a for a in graph if a in _reaches(graph, a))
    assert not cycles and not loops, (cycles, loops)


def test_an_import_inside_a_function_says_why() -> None:
    unexplained = []
    for imp in imports():
        if imp.in_function and not imp.type_only and _ours(imp.target):
            path = ROOT / (imp.source.replace(".", "/") + ".py")
            if not path.is_file():
                path = ROOT / imp.source.replace(".", "/") / "__init__.py"
            lines = path.read_text().splitlines()
            window = " ".join(lines[max(0, imp.line - 5): imp.line + 1])  # the line, or a comment above the imports
            if "# lazy:" not in window:
                unexplained.append(f"{imp.source}:{imp.line} imports {imp.target}")
    assert not unexplained, unexplained


@pytest.mark.parametrize("module", ["gateway.proxy.app", "gateway.edge.handlers", "gateway.edge.server"])
def test_importing_the_edge_or_the_proxy_loads_no_torch(module: str) -> None:
    code = (f"import sys, {module}; heavy = [m for m in {HEAVY!r} if m in sys.modules]; "
            "print(heavy); raise SystemExit(1 if heavy else 0)")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
