"""The package's layering, read from its source: every import points down, and no loops.

Floors, bottom to top: settings -> kernels -> dispatch -> layers -> engine (and the vLLM plugin
beside it) -> verify -> areal -> ab / agent -> cli -> the package root. A module may import its
own floor and the floors below; two packages on one floor do not import each other. Imports
inside functions count too (a lazy upward import is still upward), and so do loops between
modules at any floor.
"""
from __future__ import annotations

import ast
import os

import pytest

PKG = "areal_tik"
ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), PKG)

FLOORS = {"settings": 0, "kernels": 1, "dispatch": 2, "layers": 3, "engine": 4, "vllm_plugin": 4, "verify": 5,
          "areal": 6, "ab": 7, "agent": 7, "cli": 8}
TOP = 9   # the package root (__init__, __main__): the facade may reach everything


def modules() -> dict[str, str]:
    """Dotted module name -> file, for every .py file of the package."""
    out = {}
    for d, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), os.path.dirname(ROOT))[:-3].split(os.sep)
                if rel[-1] == "__init__":
                    rel = rel[:-1]
                out[".".join(rel)] = os.path.join(d, f)
    return out


def part(mod: str) -> str:
    """The floor's name of a module: its first component under the package ('' for the root)."""
    rest = mod.split(".")[1:]
    return rest[0] if rest else ""


def floor(mod: str) -> int:
    p = part(mod)
    if p in FLOORS:
        return FLOORS[p]
    if p.startswith("cli"):
        return FLOORS["cli"]
    if p in ("", "__main__"):
        return TOP
    raise AssertionError(f"{mod}: module outside every floor; add its package to FLOORS in {__file__}")


def imports_of(mod: str, path: str, known: set[str]) -> set[str]:
    """Package modules that ``mod`` imports (``from X import name`` resolves to X.name when that is a module)."""
    tree = ast.parse(open(path).read(), path)
    is_pkg = path.endswith("__init__.py")
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = mod.split(".") if is_pkg else mod.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for n in names:
            while n and n not in known:
                n = n.rpartition(".")[0]
            if n.startswith(PKG) and n != mod:
                out.add(n)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {m: imports_of(m, p, known) for m, p in mods.items()}


def test_every_module_sits_on_a_floor():
    for m in modules():
        floor(m)


def test_no_upward_or_sideways_import():
    bad = []
    for m, deps in sorted(graph().items()):
        for d in sorted(deps):
            if d == PKG:
                bad.append(f"{m} imports the package root (import the module that defines the name)")
            elif floor(d) > floor(m):
                bad.append(f"{m} (floor {floor(m)}) imports {d} (floor {floor(d)})")
            elif floor(d) == floor(m) and part(d) != part(m) and floor(m) != TOP:
                bad.append(f"{m} imports {d}: two packages on one floor")
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_no_import_loops():
    g = graph()
    # strongly connected components (Tarjan); a component of more than one module is a loop
    index, low, stack, on, comps, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in g:
                continue
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
                comps.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    # a package __init__ that re-exports its own submodules is not a loop with them
    loops = [c for c in comps if not all(x == c[0] or x.startswith(c[0] + ".") for x in c)]
    assert not loops, "import loops:\n" + "\n".join(" <-> ".join(c) for c in loops)


@pytest.mark.parametrize("upward", [True, False])
def test_the_checker_sees_an_upward_import(tmp_path, upward):
    """Negative control: a kernels module importing the engine is flagged, one importing dispatch's
    settings floor is not."""
    src = tmp_path / "x.py"
    src.write_text("from areal_tik.engine import llm_engine\n" if upward else "from areal_tik.settings import Settings\n")
    mods = modules()
    deps = imports_of("areal_tik.kernels.x", str(src), set(mods) | {"areal_tik.kernels.x"})
    flagged = [d for d in deps if floor(d) > floor("areal_tik.kernels.x")]
    assert bool(flagged) == upward
