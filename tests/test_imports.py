"""Imports run one way: from the entry points down to the core, with no cycles.

The import graph is read from the source with `ast` (every `import` statement, also those inside
functions), at module granularity: `from pkg import name` imports the module `pkg.name` when
there is one, else `pkg`. Importing `a.b.c` from outside package `a` also runs `a/__init__` and
`a/b/__init__`, so those count as imported too; that is how a facade package re-exporting its
entry points closes a cycle with a module that only wanted its data types.
"""
from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("planner", "xla_hooks", "zoo")
# The library's layers, bottom first: a module imports only from its own layer and the layers below.
# Each is a folder of one step of the flow (a module name stands for itself and its submodules).
LAYERS = (
    ("data records", ("planner.core",)),
    ("the graph", ("planner.graph",)),
    ("the cost model", ("planner.cost_model",)),
    ("the per-mesh ILP", ("planner.ilp",)),
    ("the search over meshes", ("planner.search",)),
    ("hand configurations", ("planner.configs",)),
    ("pipeline stages", ("planner.stages",)),
    ("memory levers", ("planner.levers",)),
    ("emission", ("planner.emit",)),
    ("planning a step", ("planner.planning",)),
    ("presentation", ("planner.present",)),
    ("the public API", ("planner.api", "planner")),
    ("the command line", ("planner.cli",)),
)
ZOO = "zoo"
# What xla_hooks may build on: the plan's data types, the graph and the ring formulas that say how
# many bytes a collective moves.
XLA_HOOKS_MAY_IMPORT = ("planner.core", "planner.graph", "planner.cost_model")


def _modules() -> dict[str, str]:
    """Module name -> file path, for every module of the project's packages."""
    out = {}
    for package in PACKAGES:
        for root, dirs, files in os.walk(os.path.join(REPO, package)):
            dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__pycache__")))
            parts = os.path.relpath(root, REPO).split(os.sep)
            for f in sorted(files):
                if f.endswith(".py"):
                    name = parts if f == "__init__.py" else parts + [f[:-3]]
                    out[".".join(name)] = os.path.join(root, f)
    return out


MODULES = _modules()


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _is_package(name: str) -> bool:
    return MODULES.get(name, "").endswith("__init__.py")


def _explicit_imports(name: str) -> set[str]:
    """Project modules `name` names in an import statement."""
    tree = ast.parse(open(MODULES[name]).read(), MODULES[name])
    here = name if _is_package(name) else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:  # `import planner.graph.trace.x`-style names: the longest module prefix
                t = t.rpartition(".")[0]
            if t:
                out.add(t)
    return out - {name}


def _graph() -> dict[str, set[str]]:
    """Module -> modules whose code importing it runs (explicit imports plus the packages they enter)."""
    graph = {}
    for name in MODULES:
        edges = set()
        own = set(_ancestors(name)) | ({name} if _is_package(name) else set())
        for t in _explicit_imports(name):
            edges.add(t)
            edges.update(a for a in _ancestors(t) if a not in own and a in MODULES)
        graph[name] = edges - {name}
    return graph


GRAPH = _graph()


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state:
                found = visit(m)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def _reachable(name: str) -> set[str]:
    seen, todo = set(), [name]
    while todo:
        for m in GRAPH[todo.pop()]:
            if m not in seen:
                seen.add(m)
                todo.append(m)
    return seen


def layer_of(name: str) -> int:
    """Index in LAYERS of the most specific prefix naming `name` (the facade `planner` is its own)."""
    best, length = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > length:
                best, length = i, len(p)
    return best


def test_the_graph_sees_the_packages():
    assert {"planner", "planner.api", "planner.core.plan", "planner.cli.commands", "zoo"} <= set(MODULES)
    assert "planner.core.plan" in GRAPH["planner.search.mesh_plan"]
    assert "planner" in GRAPH["zoo.registry"]  # entering the planner package runs its facade


def test_every_library_module_has_a_layer():
    for name in (m for m in MODULES if m.split(".")[0] == "planner"):
        assert layer_of(name) >= 0, f"{name} is in no layer of LAYERS"


def test_no_import_cycles():
    cycle = _find_cycle(GRAPH)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_imports_run_only_downward():
    for name in (m for m in MODULES if m.split(".")[0] == "planner"):
        for dep in sorted(m for m in GRAPH[name] if m.split(".")[0] == "planner"):
            assert layer_of(dep) <= layer_of(name), (
                f"{name} ({LAYERS[layer_of(name)][0]}) imports {dep} ({LAYERS[layer_of(dep)][0]}), "
                "a layer above it")


def test_the_layer_order_reads_as_the_flow():
    assert layer_of("planner.cli.commands") > layer_of("planner.api") > layer_of("planner.emit.single")
    assert layer_of("planner.emit.pipeline.runtime") == layer_of("planner.emit")
    assert layer_of("planner.core.plan") == 0


def test_the_library_never_imports_the_zoo():
    """Only the command line, which plans zoo models by name, may."""
    for name in (m for m in MODULES if m.split(".")[0] == "planner" and not m.startswith("planner.cli")):
        assert not any(m.split(".")[0] == ZOO for m in _reachable(name)), f"{name} imports the zoo"


def test_xla_hooks_builds_on_the_plan_data_types_only():
    for name in (m for m in MODULES if m.startswith("xla_hooks")):
        planner_imports = {m for m in _explicit_imports(name) if m.split(".")[0] == "planner"}
        bad = sorted(m for m in planner_imports if not m.startswith(XLA_HOOKS_MAY_IMPORT))
        assert not bad, f"{name} imports {bad}"
    for name in (m for m in MODULES if m.split(".")[0] == "planner"):
        assert not any(m.startswith("xla_hooks") for m in GRAPH[name]), f"{name} imports xla_hooks"


def test_every_module_imports_alone():
    """Each module imported first, in a fresh set of project modules (JAX and the other
    dependencies stay loaded: one interpreter, so the test stays fast). Importing a submodule first
    runs its top package's `__init__` first, so every module that `__init__` loads is imported
    exactly as the package itself is: the package is imported once for all of them, and each other
    module on its own."""
    script = textwrap.dedent("""
        import importlib, sys, traceback
        failed, covered = [], set()
        def fresh_import(name):
            for loaded in [m for m in sys.modules if m.split(".")[0] in {packages!r}]:
                del sys.modules[loaded]
            try:
                importlib.import_module(name)
            except Exception:
                failed.append(name + ": " + traceback.format_exc(limit=-2).strip().splitlines()[-1])
                return False
            return True
        for name in sys.argv[1:]:
            top = name.split(".")[0]
            if top not in covered:
                covered.add(top)
                if fresh_import(top):
                    covered.update(m for m in sys.modules if m.split(".")[0] == top)
            if name not in covered:
                fresh_import(name)
        print("\\n".join(failed))
        sys.exit(1 if failed else 0)
    """).format(packages=set(PACKAGES))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": REPO}
    proc = subprocess.run([sys.executable, "-c", script, *sorted(m for m in MODULES if not m.endswith("__main__"))], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
