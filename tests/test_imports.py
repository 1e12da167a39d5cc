"""The package's import graph has no circle, lazy (function-level) imports included.

A module a reader cannot place above or below its neighbours is one nobody dares to change; a
lazy import hides a circle from Python, not from a reader. This walks every ``looped_hf`` module's
``import`` statements with ``ast`` (``TYPE_CHECKING`` blocks aside: they never run) and fails on
the first circle, naming it, so the next one is caught when it is made.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "looped_hf"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    return skip


def import_graph() -> dict[str, set[str]]:
    """module -> the looped_hf modules it imports (``from pkg import sub`` counts as ``pkg.sub``
    when ``sub`` is a module, else as ``pkg``)."""
    files = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = _type_checking_nodes(tree)
        is_package = path.name == "__init__.py"
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                subs = [f"{module}.{alias.name}" for alias in node.names if f"{module}.{alias.name}" in files]
                targets = subs if len(subs) == len(node.names) else [module, *subs]
            for target in targets:
                while target and target not in files:  # `import looped_hf.x.y` -> the deepest known module
                    target = target.rpartition(".")[0]
                if target.startswith("looped_hf") and target != name:
                    graph[name].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_import_graph_walker_sees_lazy_and_relative_imports():
    graph = import_graph()
    assert "looped_hf.configuration_looped" in graph["looped_hf.modeling_looped"]  # relative
    assert "looped_hf.train" in graph["looped_hf.sweep.execution"]  # inside a function
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_looped_hf_has_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_the_sweep_command_describes_itself_with_the_package_docstring():
    import looped_hf.sweep as sweep
    from looped_hf.sweep.cli import DESCRIPTION

    assert sweep.__doc__.split("\n\n")[0] == DESCRIPTION


def test_plotting_reads_only_the_scaling_leaves_so_fit_plot_stays_acyclic():
    # ScalingLawFit.plot() imports looped_hf.plotting on use; plotting must therefore never import
    # the scaling package or its fit module (the circle this walk first caught).
    assert not {"looped_hf.scaling", "looped_hf.scaling.fit"} & import_graph()["looped_hf.plotting"]
