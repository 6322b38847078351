"""The tree tells the architecture: a small root in toolkit/, no import circles anywhere (bench included),
no module too long to read in one sitting."""

import ast
from pathlib import Path

import pytest
from helpers import REPO

ROOT_MODULES = 10
MODULE_LINES = 450


def modules() -> dict[str, Path]:
    """Dotted name -> file for the package, the recipes and the bench scripts (which import each other by
    their bare names, bench/ being on their path)."""
    found = {}
    for path in sorted(REPO.glob("toolkit/**/*.py")) + sorted(REPO.glob("recipes/*.py")):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    for path in sorted(REPO.glob("bench/*.py")):
        found[path.stem] = path
    return found


def imported(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Modules of `known` that `path` imports anywhere in it (inside functions too: they are circles all
    the same, only later)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            # `from package import module` enters the module; `from module import name`, the module.
            targets.update(
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names
            )
    resolved = set()
    for target in targets:
        while target and target not in known:
            target = target.rpartition(".")[0]
        if target and target != name:
            resolved.add(target)
    return resolved


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, groups, counter = {}, {}, [], set(), [], [0]

    def visit(start):
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while not group or group[-1] != node:
                        group.append(stack.pop())
                        on_stack.discard(group[-1])
                    if len(group) > 1:
                        groups.append(sorted(group))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return groups


def test_no_import_circles_in_the_package_the_recipes_or_bench():
    known = modules()
    graph = {name: imported(name, path, known) for name, path in known.items()}
    assert circles(graph) == []


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]


def test_the_package_root_keeps_only_what_everything_shares():
    root = [p.name for p in (REPO / "toolkit").glob("*.py") if p.name != "__init__.py"]
    assert len(root) <= ROOT_MODULES, sorted(root)


@pytest.mark.parametrize("folder", ["toolkit", "recipes", "bench", "scripts"])
def test_no_module_is_too_long_to_read(folder):
    long = {
        str(p.relative_to(REPO)): n
        for p in (REPO / folder).rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MODULE_LINES
    }
    assert long == {}
