"""Imports run down the tree: the command line (`toolkit/commands/`) and the studio (`toolkit/studio/`) are
the top floors, and nothing below them imports either; what they share with lower floors lives down there
(loading a model to generate with in `model/`, a checkpoint's export in `checkpoint/`)."""

import ast
from pathlib import Path

TOOLKIT = Path(__file__).resolve().parents[2] / "toolkit"
TOP_FLOORS = ("commands", "studio")


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def test_no_lower_floor_imports_the_command_line_or_the_studio():
    below = [p for p in TOOLKIT.rglob("*.py") if p.relative_to(TOOLKIT).parts[0] not in TOP_FLOORS]
    assert len(below) > 100
    reaching_up = {
        str(path.relative_to(TOOLKIT)): sorted(
            m for m in imported_modules(path) if m.split(".")[:2] in (["toolkit", f] for f in TOP_FLOORS)
        )
        for path in below
    }
    assert {path: mods for path, mods in reaching_up.items() if mods} == {}
