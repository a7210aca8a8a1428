"""The package's layering, checked from its source: which subpackage may import which, no
import cycles (module-level or inside functions), no private names across subpackages.

Units are the subpackages and top-level modules of ``qkgeom``. Data flows one way: config
-> data + model -> arch -> geometry -> training (+ callbacks) -> run folder -> analysis ->
report; features (control, monitor, checkpoints) plug in from above; the CLI and the
composition root (``launch``) sit on top. ``analysis`` reads files only and never needs
torch; ``training`` knows no feature; the monitor is not built on the E4 code.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "qkgeom"

BASE = {"errors", "version", "_lazy"}
ALLOWED: dict[str, set[str]] = {
    "errors": set(), "version": set(), "_lazy": set(),
    "io": {"errors"}, "config": {"errors"}, "seeding": set(), "ui": set(),
    "metrics": set(), "alerts": {"errors", "metrics"},
    "data": {"io"},
    "model": {"config"},
    "runs": {"io", "config"},
    "arch": {"model"},
    "geometry": {"arch", "metrics"},
    "training": {"config", "data", "model", "geometry", "runs", "seeding", "io", "ui"},
    "control": {"arch", "config", "geometry", "io", "runs", "training"},
    "launch": {"config", "training", "control"},
    "monitor": {"alerts", "arch", "config", "control", "data", "geometry", "io", "metrics",
                "runs", "training", "ui"},
    "checkpoints": {"arch", "data", "geometry", "io", "runs", "training", "ui"},
    # the paper's experiments end to end: train (launch), measure families (checkpoints),
    # write the report (analysis)
    "experiments": {"analysis", "checkpoints", "config", "data", "io", "launch", "runs",
                    "training", "ui"},
    "analysis": {"alerts", "config", "io", "metrics", "runs"},
    "cli": {"analysis", "checkpoints", "config", "data", "experiments", "launch", "monitor",
            "runs", "training", "ui"},
}
# What must never happen, named for the reader (each is also outside ALLOWED).
NEVER = [("training", "control"), ("training", "monitor"), ("training", "launch"),
         ("geometry", "training"), ("monitor", "checkpoints"), ("arch", "geometry"),
         *(("analysis", u) for u in ("arch", "geometry", "model", "training", "control",
                                      "monitor", "checkpoints", "launch", "data"))]


def _module(path: Path) -> str:
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(("qkgeom", *parts)).removesuffix(".__init__")


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "qkgeom"


def _imports() -> list[tuple[str, str, list[str], int]]:
    """(importing module, imported module, names, line) for every qkgeom import anywhere in
    a file: module level, in functions, under TYPE_CHECKING."""
    known = {_module(p) for p in SRC.rglob("*.py")}
    out = []
    for path in sorted(SRC.rglob("*.py")):
        me = _module(path)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module and not node.level \
                    and node.module.split(".")[0] == "qkgeom":
                names = [a.name for a in node.names]
                # ``from qkgeom.x import y`` may name a submodule y
                subs = [f"{node.module}.{n}" for n in names if f"{node.module}.{n}" in known]
                for target in subs or [node.module]:
                    out.append((me, target, names, node.lineno))
            elif isinstance(node, ast.Import):
                out += [(me, a.name, [], node.lineno) for a in node.names
                        if a.name.split(".")[0] == "qkgeom"]
    return out


def test_every_unit_is_known() -> None:
    units = {_unit(_module(p)) for p in SRC.rglob("*.py")} - {"qkgeom"}
    assert units == set(ALLOWED), units ^ set(ALLOWED)


def test_subpackages_import_only_what_their_layer_allows() -> None:
    bad = [f"{me}:{line} imports {target}" for me, target, _, line in _imports()
           if _unit(me) not in ("qkgeom", _unit(target)) and _unit(target) not in BASE
           and _unit(target) not in ALLOWED[_unit(me)]]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("source, target", NEVER)
def test_forbidden_dependencies(source: str, target: str) -> None:
    assert target not in ALLOWED[source]
    hits = [f"{me}:{line}" for me, t, _, line in _imports()
            if _unit(me) == source and _unit(t) == target]
    assert not hits, hits


def test_no_import_cycles_between_modules() -> None:
    """Module graph, function-level imports included; the package root (lazy re-exports)
    and the ``__init__`` faces of subpackages importing their own modules are left out."""
    graph: dict[str, set[str]] = defaultdict(set)
    for me, target, _, _ in _imports():
        if me == "qkgeom" or target == "qkgeom" or me == target:
            continue
        if me.endswith(tuple(f".{u}" for u in ALLOWED)) and target.startswith(me + "."):
            continue  # a subpackage's __init__ re-exporting its own modules
        graph[me].add(target)
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state:
            cycle = visit(node)
            assert cycle is None, " -> ".join(cycle)


def test_no_private_names_across_subpackages() -> None:
    bad = [f"{me}:{line} takes {n} from {target}" for me, target, names, line in _imports()
           for n in names if n.startswith("_") and not n.startswith("__")
           and _unit(me) != _unit(target)]
    assert not bad, "\n".join(bad)


def test_the_checker_sees_function_level_imports() -> None:
    """It must see an import hidden in a function (how the old trainer reached the control)."""
    found = [(me, t) for me, t, _, _ in _imports()
             if me == "qkgeom.launch" and t.startswith("qkgeom.control")]
    assert found, "launch builds the key-control callback inside a function"
