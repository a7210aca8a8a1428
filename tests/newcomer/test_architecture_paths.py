"""docs/architecture.md's data paths name real code: every ``file.py:name`` hop there is a
module under src/qkgeom/ defining ``name``, and every other code name in backticks
(``Trainer._probe``, ``runs.finished_state``) is defined somewhere in the package, so a
rename that forgets the page fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "qkgeom"
HOP = re.compile(r"([\w/]+\.py):([\w.]+)")
NAME = re.compile(r"[A-Za-z_]\w*(\.\w+)*")
NOT_CODE = {"e3", "none"}  # an experiment's and an arm's name
FILES = (".json", ".parquet", ".py")


def _defined(tree: ast.Module) -> set[str]:
    """Functions, classes and module-level names at any depth (a CLI command is defined
    inside its ``register``), and ``Class.member`` for every method and annotated field."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        if isinstance(node, ast.ClassDef):
            for member in node.body:
                if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(f"{node.name}.{member.name}")
                elif isinstance(member, ast.AnnAssign) and isinstance(member.target, ast.Name):
                    names.add(f"{node.name}.{member.target.id}")
    return names


def _section() -> list[str]:
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    return re.findall(r"`([^`]+)`", text.split("## Data paths", 1)[1].split("\n## ", 1)[0])


def _missing(tokens: list[str]) -> list[str]:
    everywhere = set().union(*(_defined(ast.parse(p.read_text(encoding="utf-8")))
                               for p in SRC.rglob("*.py")))
    missing = []
    for token in tokens:
        hop = HOP.fullmatch(token)
        if hop:
            module = SRC / hop[1]
            if not module.is_file():
                missing.append(f"{token} (no such file)")
            elif hop[2] not in _defined(ast.parse(module.read_text(encoding="utf-8"))):
                missing.append(token)
        elif NAME.fullmatch(token) and token not in NOT_CODE and not token.endswith(FILES):
            parts = token.split(".")
            if ".".join(parts[-2:]) not in everywhere and parts[-1] not in everywhere:
                missing.append(token)
    return missing


def test_every_name_in_the_data_paths_is_in_the_code() -> None:
    tokens = _section()
    assert sum(bool(HOP.fullmatch(t)) for t in tokens) >= 20, "the data paths lost their hops"
    missing = _missing(tokens)
    assert not missing, f"docs/architecture.md names code that is not there: {missing}"


def test_a_wrong_name_is_caught() -> None:
    assert _missing(["training/trainer.py:Trainer.run", "Trainer._probe"]) == []
    assert _missing(["training/trainer.py:Trainer.fly", "Trainer._fly", "gone.py:run"]) == [
        "training/trainer.py:Trainer.fly", "Trainer._fly", "gone.py:run (no such file)"]
