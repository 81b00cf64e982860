"""The package's modules import one way: no import cycle among python/tequant/*.py.

Every relative import counts, also one inside a function (a lazy import is still a dependency),
so a module that the compiled path or the C extension calls back never imports its caller.
The subpackages (tequant.distributed, tequant.demo) sit above the core and are left out: they
import te.Linear, and linear.py loads tequant.distributed only when a module is built or run
tensor-parallel. Pure source analysis (ast): no import runs. The layering it checks is described
in the modules' docstrings (_plan.py, _compile.py, _compile_ops.py, _compile_linear.py).
"""
import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "python" / "tequant"


def _imports(path):
    """The core modules (file stems) that `path` imports, anywhere in the file."""
    core = {p.stem for p in PACKAGE.glob("*.py")}
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module is None:  # from . import a, b
                found |= {alias.name for alias in node.names if alias.name in core}
            elif node.module.split(".")[0] in core:
                found.add(node.module.split(".")[0])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "tequant" and len(parts) > 1 and parts[1] in core:
                    found.add(parts[1])
    return found - {"__init__", path.stem}


def _cycle(graph):
    """One import cycle as a list of modules, or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_core_modules_import_one_way():
    graph = {p.stem: _imports(p) for p in PACKAGE.glob("*.py") if p.stem != "__init__"}
    assert graph["linear"] >= {"_plan", "_compile_linear"}  # the analysis sees imports
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
