"""Import rules, read from the source (the AST of every file; nothing is imported):

1. Benchmarks are clients. No module of the core (but the ``bench`` package itself and
   ``testing``) and no module of a plugin (but its own ``bench`` module) imports benchmark code:
   ``rollout_engines.bench``, a plugin's ``bench`` module, or the ``benchmarks/`` scripts. A
   backend's direct baseline is named by a string in its ``BackendEntry`` and imported by the
   benchmark alone.
2. No two files of the core import each other. Imports inside functions count (a lazy import
   still makes the two modules one unit), ``if TYPE_CHECKING:`` imports do not (they never run).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core"
PLUGINS = ROOT / "plugins"


def _module_name(path: Path, base: Path) -> str:
    parts = list(path.relative_to(base).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _package_files() -> dict[str, Path]:
    """Every module of the core and of each plugin package: dotted name -> file."""
    out = {_module_name(p, CORE): p for p in (CORE / "rollout_engines").rglob("*.py")}
    for package in PLUGINS.glob("*/rollout_engines_*"):
        if package.is_dir() and not package.name.endswith(".egg-info"):
            out.update({_module_name(p, package.parent): p for p in package.rglob("*.py")})
    return out


FILES = _package_files()


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _import_nodes(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement that can run: module level or in a function, not under TYPE_CHECKING."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and _is_type_checking(node):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def imports_of(module: str, path: Path) -> set[str]:
    """The absolute names ``module`` imports; ``from pkg import name`` yields ``pkg.name`` where
    that is a module, else ``pkg``."""
    is_package = path.name == "__init__.py"
    out: set[str] = set()
    for node in _import_nodes(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
            continue
        if node.level:
            anchor = module.split(".") if is_package else module.split(".")[:-1]
            anchor = anchor[: len(anchor) - (node.level - 1)]
            base = ".".join(anchor + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        for alias in node.names:
            full = f"{base}.{alias.name}"
            out.add(full if full in FILES else base)
    return out


def _is_bench(name: str) -> bool:
    parts = name.split(".")
    return parts[0] == "benchmarks" or (parts[0].startswith("rollout_engines") and "bench" in parts[1:])


def test_no_engine_module_imports_benchmark_code():
    assert "rollout_engines.bench.generate" in FILES and "rollout_engines_vllm.engine" in FILES
    offenders = []
    for module, path in sorted(FILES.items()):
        if _is_bench(module) or module.startswith("rollout_engines.testing"):
            continue
        bad = sorted(name for name in imports_of(module, path) if _is_bench(name))
        if bad:
            offenders.append(f"{path.relative_to(ROOT)} imports {', '.join(bad)}")
    assert not offenders, "benchmark code imported outside the benchmarks:\n" + "\n".join(offenders)


def test_no_two_files_of_the_core_import_each_other():
    core = {m: p for m, p in FILES.items() if m.split(".")[0] == "rollout_engines"}
    graph = {m: {n for n in imports_of(m, p) if n in core and n != m} for m, p in core.items()}
    cycles = sorted({tuple(sorted((a, b))) for a, targets in graph.items() for b in targets if a in graph[b]})
    assert not cycles, "import cycles between two files of the core:\n" + "\n".join(f"{a} <-> {b}" for a, b in cycles)


def test_the_rules_see_what_they_should():
    """The checks above would notice a violation (the parser resolves relative and lazy imports)."""
    engine = FILES["rollout_engines.backends.transformers.engine"]
    assert "rollout_engines.engine" in imports_of("rollout_engines.backends.transformers.engine", engine)
    factory = imports_of("rollout_engines.bench.generate", FILES["rollout_engines.bench.generate"])
    assert "rollout_engines.factory" in factory  # imported inside run()
    assert _is_bench("rollout_engines.bench.push") and _is_bench("rollout_engines_vllm.bench")
    assert not _is_bench("rollout_engines.weights.buckets")
