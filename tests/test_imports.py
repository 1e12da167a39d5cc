"""The package's import graph has no circle: lazy (function-level) imports and the parent packages
every submodule import executes included.

A module a reader cannot place above or below its neighbours is one nobody dares to change; a
lazy import hides a circle from Python, not from a reader, and so does a type-only one (an
``if TYPE_CHECKING:`` import never runs, but a reader, and a type checker, still have to place
both modules). This walks every ``looped_hf`` module's ``import`` statements with ``ast``,
``TYPE_CHECKING`` blocks included, and fails on the first circle, naming it, so the next one is
caught when it is made.

Importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` before ``a/b/c``, so an import of a
submodule is also an edge to each package above it. The one exception is a package that encloses
the importing module itself: it is already executing (or done) when its submodule runs, so
importing a sibling never re-enters it.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "looped_hf"


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    return skip


def _imported_modules(
    node: ast.Import | ast.ImportFrom, name: str, is_package: bool, files: set[str]
) -> list[str]:
    """The modules one import statement names (``from pkg import sub`` names ``pkg.sub`` when ``sub``
    is a module, and ``pkg`` always: its ``__init__`` runs first)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level:
        base = name.split(".") if is_package else name.split(".")[:-1]
        base = base[: len(base) - (node.level - 1)]
        module = ".".join(base + ([node.module] if node.module else []))
    else:
        module = node.module or ""
    return [module, *(f"{module}.{a.name}" for a in node.names if f"{module}.{a.name}" in files)]


def _executed(target: str, files: set[str]) -> list[str]:
    """``a.b.c`` -> the known modules an import of it runs: ``a``, ``a.b``, ``a.b.c``."""
    while target and target not in files:  # `import a.b.Name` -> the deepest known module
        target = target.rpartition(".")[0]
    parts = target.split(".") if target else []
    return [m for m in (".".join(parts[: i + 1]) for i in range(len(parts))) if m in files]


def import_graph(root: Path = PACKAGE, *, type_checking: bool = True) -> dict[str, set[str]]:
    """module -> the modules of ``root``'s package that importing it names, module-level, lazy and
    (``type_checking``) ``TYPE_CHECKING``-only imports alike, with the parent packages of each (the
    importer's own enclosing packages aside)."""
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    files = set(paths)
    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        skip = set() if type_checking else _type_checking_nodes(tree)
        is_package = path.name == "__init__.py"
        enclosing = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        for node in ast.walk(tree):
            if id(node) in skip or not isinstance(node, ast.Import | ast.ImportFrom):
                continue
            for target in _imported_modules(node, name, is_package, files):
                graph[name].update(m for m in _executed(target, files) if m != name and m not in enclosing)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _plant(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text), encoding="utf-8")
    return root


# The circle this test first missed, in miniature: plotting imports only a scaling *leaf* at module
# level, but that import runs scaling/__init__, which imports fit, which imports plotting lazily.
PLANTED = {
    "top/__init__.py": "",
    "top/plotting.py": "from top.scaling.leaf import helper\n",
    "top/scaling/__init__.py": "from .fit import Fit\n",
    "top/scaling/leaf.py": "def helper():\n    return 1\n",
    "top/scaling/fit.py": """
        from .leaf import helper


        class Fit:
            def plot(self):
                from top.plotting import helper as h

                return h()
        """,
}


def test_a_planted_circle_through_a_parent_package_is_found(tmp_path: Path):
    root = _plant(tmp_path, PLANTED) / "top"
    graph = import_graph(root)
    assert graph["top.plotting"] == {"top.scaling", "top.scaling.leaf"}  # the parent-package edge
    assert "top.plotting" in graph["top.scaling.fit"]  # the lazy edge
    assert "top.scaling" not in graph["top.scaling.fit"]  # its own package is already running
    cycle = find_cycle(graph)
    assert cycle is not None and cycle[0] == cycle[-1]
    assert {"top.plotting", "top.scaling", "top.scaling.fit"} == set(cycle)


def test_the_planted_circle_is_gone_when_the_dependency_is_one_way(tmp_path: Path):
    files = dict(PLANTED)
    files["top/scaling/fit.py"] = "from .leaf import helper\n\n\nclass Fit:\n    pass\n"
    assert find_cycle(import_graph(_plant(tmp_path, files) / "top")) is None


def test_siblings_in_a_package_are_no_circle(tmp_path: Path):
    # pkg/__init__ imports a, a imports b, b imports the package's name: ordinary and acyclic.
    root = _plant(tmp_path, {
        "pkg/__init__.py": "from .a import A\n",
        "pkg/a.py": "from .b import B\n\nA = B\n",
        "pkg/b.py": "import pkg.sub.c\n\nB = 1\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/c.py": "",
    }) / "pkg"  # fmt: skip
    graph = import_graph(root)
    assert graph["pkg.b"] == {"pkg.sub", "pkg.sub.c"}
    assert find_cycle(graph) is None


def test_the_import_graph_walker_sees_lazy_and_relative_imports():
    graph = import_graph()
    assert "looped_hf.configuration_looped" in graph["looped_hf.modeling_looped"]  # relative
    assert "looped_hf.train" in graph["looped_hf.sweep.execution"]  # inside a function
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_looped_hf_has_no_import_circle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def test_a_type_only_circle_is_found(tmp_path: Path):
    # The scaling circle this test once let through: the result type beside the fitting code, read
    # by a diagnosis the fit runs, which names the type only under TYPE_CHECKING.
    root = _plant(tmp_path, {
        "top/__init__.py": "",
        "top/fit.py": "from .diagnose import diagnose\n\n\nclass Fit:\n    pass\n",
        "top/diagnose.py": """
            from typing import TYPE_CHECKING

            if TYPE_CHECKING:
                from .fit import Fit


            def diagnose(fit: "Fit") -> None:
                pass
            """,
    }) / "top"  # fmt: skip
    assert find_cycle(import_graph(root, type_checking=False)) is None  # what Python runs: no circle
    assert set(find_cycle(import_graph(root)) or []) == {"top.fit", "top.diagnose"}


def test_the_scaling_result_type_imports_nothing_that_reads_it():
    graph = import_graph()
    readers = {"looped_hf.scaling.fit", "looped_hf.scaling.diagnose", "looped_hf.scaling.compare",
               "looped_hf.plotting", "looped_hf.scaling"}  # fmt: skip
    assert "looped_hf.scaling.result" in graph["looped_hf.scaling.diagnose"]  # the type-only edge
    assert not graph["looped_hf.scaling.result"] & readers


def test_the_sweep_command_describes_itself_with_the_package_docstring():
    import looped_hf.sweep as sweep
    from looped_hf.sweep.cli import DESCRIPTION

    assert sweep.__doc__.split("\n\n")[0] == DESCRIPTION


def test_the_scaling_package_never_imports_plotting():
    # plotting draws fits, so it depends on the scaling package (and runs its __init__); the
    # dependency is one-way: nothing the scaling package's __init__ runs may import plotting.
    graph = import_graph()
    seen, todo = set(), ["looped_hf.scaling"]
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph[node])
    assert "looped_hf.plotting" not in seen


# --- every module imports where fcntl does not exist (Windows) ----------------------------------
# Run in a fresh process: fcntl is made unimportable before anything is imported, each module of
# `package` (its directory on sys.path first) is imported, and the failures are printed as JSON.
IMPORT_ALL = """
import importlib, json, pkgutil, sys
sys.modules['fcntl'] = None
root, package = sys.argv[1], sys.argv[2]
sys.path.insert(0, root)
top = importlib.import_module(package)
failed, imported = {}, 0
for info in pkgutil.walk_packages(top.__path__, package + '.'):
    if info.name.endswith('.__main__'):
        continue  # runs the command line
    try:
        importlib.import_module(info.name)
        imported += 1
    except Exception as err:
        failed[info.name] = [type(err).__name__, getattr(err, 'name', None), str(err)]
print(json.dumps({'failed': failed, 'imported': imported, 'fcntl': repr(sys.modules.get('fcntl'))}))
"""

# Extras a module may need and this environment may lack (the vLLM model needs vLLM).
OPTIONAL = {"vllm", "lm_eval", "submitit"}


def _import_all(root: Path, package: str) -> dict:
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(root)}
    out = subprocess.run([sys.executable, "-c", IMPORT_ALL, str(root), package], capture_output=True,
                         text=True, env=env, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _not_optional(failed: dict) -> dict:
    return {
        m: e
        for m, e in failed.items()
        if not (e[0] == "ModuleNotFoundError" and str(e[1]).split(".")[0] in OPTIONAL)
    }


def test_the_fcntl_check_catches_a_module_that_needs_fcntl(tmp_path: Path):
    root = _plant(
        tmp_path, {"plain/__init__.py": "", "plain/ok.py": "import os\n", "plain/posix.py": "import fcntl\n"}
    )
    found = _import_all(root, "plain")
    assert found["imported"] == 1 and set(_not_optional(found["failed"])) == {"plain.posix"}


def test_every_module_imports_without_fcntl():
    found = _import_all(PACKAGE.parent, "looped_hf")
    assert _not_optional(found["failed"]) == {}
    assert found["fcntl"] == "None"  # still unimportable at the end: nothing put it back
    assert found["imported"] > 60  # the walk saw the package (78 modules today), not an empty folder


LAUNCHER = PACKAGE.parent / "looped_hf_launcher" / "__init__.py"


def test_the_launcher_imports_looped_hf_only_after_it_decided_and_nothing_imports_it():
    # The console script's launcher must set `defer_registration` before `looped_hf/__init__` runs, so
    # its module level imports nothing of the package; and the package knows it by name only
    # (sys.modules), so the dependency runs one way, launcher -> package.
    tree = ast.parse(LAUNCHER.read_text(encoding="utf-8"))
    top_level = {alias.name for node in tree.body if isinstance(node, ast.Import) for alias in node.names}
    top_level |= {node.module or "" for node in tree.body if isinstance(node, ast.ImportFrom)}
    assert not {m for m in top_level if m.split(".")[0] == "looped_hf"}, top_level
    lazy = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert "looped_hf.cli" in lazy  # inside main(), after the decision
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not any(n.split(".")[0] == "looped_hf_launcher" for n in names), path


def _names_from_own_package(root: Path = PACKAGE) -> dict[str, list[str]]:
    """module -> the names it takes from a package that encloses it (``from . import NAME``, NAME
    not a submodule): an edge into that package's ``__init__``, which ``import_graph`` leaves out
    (the package is executing already), but a reader still has to place the two."""
    paths = {module_name(p, root): p for p in root.rglob("*.py")}
    found: dict[str, list[str]] = {}
    for name, path in paths.items():
        is_package = path.name == "__init__.py"
        enclosing = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                module = _imported_modules(node, name, is_package, set(paths))[0]
                names = [a.name for a in node.names if f"{module}.{a.name}" not in paths]
                if module in enclosing and names:
                    found.setdefault(name, []).extend(names)
    return found


def test_the_serving_package_has_no_circle_through_its_own_init():
    """The serving package's ``__init__`` imports ``engine`` (lazily), whose names came from the
    ``__init__`` (as did ``plugin``'s and ``cpu_norm``'s): a circle. The shared names live in the
    leaf ``servable``; no serving module takes a name from the package itself."""
    serving = {
        m: names for m, names in _names_from_own_package().items() if m.startswith("looped_hf.serving")
    }
    assert serving == {}
    graph = import_graph()
    assert graph["looped_hf.serving.servable"] <= {
        "looped_hf.serving.loop_lora_vllm",
        "looped_hf.loop_lora_looped",
        "looped_hf.serving.parcae_vllm",
        "looped_hf.parcae_looped",
    }
