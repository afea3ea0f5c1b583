"""The import graph, drawn from the code's own imports (function-local and ``TYPE_CHECKING``
ones included): no file cycle, no folder cycle, no arrow from a lower layer up to a higher one.

The layers, bottom up, as docs/architecture.md ("Layers") states them:

====  ==========================================================  ===================================
rank  modules                                                     what
====  ==========================================================  ===================================
0     ``schemas``                                                 the event contract
1     ``common``                                                  code both planes share
2     ``data_plane``                                              engines, KVBM, transfers, workers
3     ``control_plane``                                           router, index, planner, metrics,
                                                                  admin, replay: the runtime
4     ``workloads``                                               the workload generator
5     ``ops`` (stack, demo, chaos, security)                      tooling: the local stack, the demo,
                                                                  fault injection, the security check
6     ``benchmarks``                                              the benches
7     ``switchyard``                                              the command: composes everything
====  ==========================================================  ===================================

A folder is a unit of the folder graph with everything under it (``control_plane/admin`` holds
``admin/routes`` and ``admin/console``); a module directly in a top-level package
(``control_plane/streaming.py``, ``common/settings.py``) is a unit of its own.

``from package import name`` is an arrow to ``package.name`` when that is a module, else to the
package (its ``__init__``); importing a module runs its parents' ``__init__`` too, which is
Python's doing, not an arrow.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("schemas", "common", "data_plane", "control_plane", "workloads", "ops", "benchmarks", "switchyard")

#: Cycles that remain, each with why (sorted module names of the cycle -> reason).
KNOWN_FILE_CYCLES: dict[tuple[str, ...], str] = {
    ("benchmarks.planner_bench", "benchmarks.planner_dynamo", "benchmarks.planner_oracle"):
        "bench-only: the Dynamo and oracle comparisons reuse the planner bench's simulator, which "
        "prints their rows; not product code",
}
#: Arrows from a lower layer to a higher one that remain (importer, imported) -> reason.
KNOWN_UPWARD: dict[tuple[str, str], str] = {}


def layer(module: str) -> int:
    return {"schemas": 0, "common": 1, "data_plane": 2, "control_plane": 3, "workloads": 4, "ops": 5, "benchmarks": 6,
            "switchyard": 7}[module.split(".")[0]]


@dataclass(frozen=True)
class Arrow:
    src: str
    dst: str
    line: int
    local: bool  # inside a function


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Every module of the runtime, the tooling, the benches and the command, by dotted name."""
    out = {}
    for pkg in PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


def arrows(mods: dict[str, Path]) -> list[Arrow]:
    """Every import of project code, module level or not."""

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    out = []
    for mod, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        local = {id(n) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(fn) if isinstance(n, (ast.Import, ast.ImportFrom))}
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for t in targets:
                dst = resolve(t)
                if dst is not None and dst != mod:
                    out.append(Arrow(mod, dst, node.lineno, id(node) in local))
    return out


def unit(module: str, mods: dict[str, Path]) -> str:
    """The folder a module belongs to in the folder graph (see the module docstring)."""
    parts = module.split(".")
    is_pkg = mods[module].name == "__init__.py"
    if len(parts) == 1 or (len(parts) == 2 and not is_pkg):
        return module
    return ".".join(parts[:2])


def cycles(edges: dict[str, set[str]]) -> list[tuple[str, ...]]:
    """The strongly connected components of more than one node (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[tuple[str, ...]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(tuple(sorted(comp)))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


MODS = modules()
ARROWS = arrows(MODS)


def _why(a: str, b: str) -> str:
    return "; ".join(f"{x.src}:{x.line} -> {x.dst}{' (in a function)' if x.local else ''}"
                     for x in ARROWS if x.src == a and x.dst == b)


def test_the_graph_is_read() -> None:
    """The reader sees the imports it must: a module-level one, a function-local one."""
    assert Arrow("control_plane.router.view", "schemas.events", 0, False).dst in {
        a.dst for a in ARROWS if a.src == "control_plane.router.view"}
    assert any(a.local for a in ARROWS)
    assert len(MODS) > 200


def test_no_file_cycle() -> None:
    edges: dict[str, set[str]] = defaultdict(set)
    for a in ARROWS:
        edges[a.src].add(a.dst)
    found = cycles(edges)
    unknown = [c for c in found if c not in KNOWN_FILE_CYCLES]
    assert not unknown, "file cycles:\n" + "\n".join(
        " <-> ".join(c) + "\n  " + "\n  ".join(_why(x, y) for x in c for y in c if _why(x, y)) for c in unknown)
    stale = [c for c in KNOWN_FILE_CYCLES if c not in found]
    assert not stale, f"known cycles that are gone (remove them from KNOWN_FILE_CYCLES): {stale}"


def test_no_folder_cycle() -> None:
    edges: dict[str, set[str]] = defaultdict(set)
    why: dict[tuple[str, str], list[Arrow]] = defaultdict(list)
    for a in ARROWS:
        s, d = unit(a.src, MODS), unit(a.dst, MODS)
        if s != d:
            edges[s].add(d)
            why[s, d].append(a)
    # A known file cycle among modules that are units of their own (``benchmarks/*.py``) is
    # the same cycle here.
    found = [c for c in cycles(edges) if c not in KNOWN_FILE_CYCLES]

    def explain(c: tuple[str, ...]) -> str:
        return "\n".join(f"  {x.src}:{x.line} -> {x.dst}" for s in c for d in c for x in why.get((s, d), ()))

    assert not found, "folder cycles:\n" + "\n".join(" <-> ".join(c) + "\n" + explain(c) for c in found)


def test_no_arrow_runs_up_a_layer() -> None:
    up = {(a.src, a.dst): a for a in ARROWS if layer(a.src) < layer(a.dst)}
    unknown = [a for k, a in sorted(up.items()) if k not in KNOWN_UPWARD]
    assert not unknown, "arrows up a layer:\n" + "\n".join(
        f"  {a.src}:{a.line} (layer {layer(a.src)}) -> {a.dst} (layer {layer(a.dst)})" for a in unknown)
    stale = [k for k in KNOWN_UPWARD if k not in up]
    assert not stale, f"known upward arrows that are gone (remove them from KNOWN_UPWARD): {stale}"


def test_every_function_local_import_of_project_code_says_why() -> None:
    """An import of project code inside a function is a cycle hidden from the module graph
    unless it has a reason to be there: a one-line ``# lazy: <why>`` comment right above it
    (an optional heavy dependency, start-up time, the CLI's ``--help``)."""
    missing = []
    for a in ARROWS:
        if not a.local:
            continue
        lines = MODS[a.src].read_text().splitlines()
        said = lines[a.line - 2].strip().startswith("# lazy:") if a.line >= 2 else False
        if not said:
            missing.append(f"{MODS[a.src].relative_to(ROOT)}:{a.line} imports {a.dst}")
    assert not missing, "function-local imports without a '# lazy: <why>' line above:\n  " + "\n  ".join(
        sorted(set(missing)))
