"""lib/ imports run one way: no cycle, and the builtin server (lib/server/) stays a program of its own."""

import ast
from pathlib import Path

from conftest import ROOT

LIB = ROOT / "lib"


def module_names() -> dict[str, Path]:
    """Module name -> file for lib/ and the tasksets under lib/tasksets (installed as top-level packages)."""
    names = {}
    for path in LIB.rglob("*.py"):
        relative = path.relative_to(LIB)
        if relative.parts[0] == "tasksets":
            parts = list(relative.parts[1:])
        else:
            parts = ["lib", *relative.parts]
        parts[-1] = parts[-1].removesuffix(".py")
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imports_of(path: Path, module: str, known: set[str]) -> set[str]:
    """The known modules that `path` imports anywhere in its body, at the top or inside a function."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(
                    package.split(".")[: len(package.split(".")) - node.level + 1] + [base]
                ).strip(".")
            # `from lib import envs` imports the module lib.envs; `from lib.envs import x` imports lib.envs.
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != module and target != "lib":
                found.add(target)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph as a path [a, b, ..., a], or None."""
    state = {}  # module -> "open" while on the depth-first path, "done" after

    def visit(module: str, path: list[str]) -> list[str] | None:
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target, [*path, target])):
                return cycle
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module, [module])):
            return cycle
    return None


def test_lib_imports_form_no_cycle():
    names = module_names()
    graph = {module: imports_of(path, module, set(names)) for module, path in names.items()}
    assert "lib.envs" in graph["lib.producer"], "the walk must see imports"
    # Tasksets before episodes, and loading a model needs no SFT data code.
    assert "lib.envs" not in graph["lib.tasks"] and "lib.data" not in graph["lib.model"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_walk_finds_a_cycle_made_inside_a_function(tmp_path):
    path = tmp_path / "tasks.py"
    path.write_text("import json\n\n\ndef f():\n    from lib import envs\n")
    assert imports_of(path, "lib.tasks", {"lib.envs", "lib.tasks"}) == {"lib.envs"}
    graph = {
        "lib.tasks": {"lib.envs"},
        "lib.envs": {"lib.producer"},
        "lib.producer": {"lib.tasks"},
        "lib.a": set(),
    }
    assert find_cycle(graph) == ["lib.envs", "lib.producer", "lib.tasks", "lib.envs"]


# What the builtin server may take from the trainer's side: its errors, model loading, sampling settings and
# the weight fingerprint that both sides of a reload compute, the group an in-memory transfer runs over.
SERVER_MAY_IMPORT = {"lib.config", "lib.fingerprint", "lib.group", "lib.model", "lib.sampling"}


def test_the_builtin_server_is_a_package_apart():
    names = module_names()
    graph = {module: imports_of(path, module, set(names)) for module, path in names.items()}
    server = {module for module in names if module.startswith("lib.server")}
    assert {"lib.server.engine", "lib.server.routes", "lib.server.decode", "lib.server.protocol"} <= server
    for module in names.keys() - server:
        if module.startswith("lib."):
            assert not graph[module] & server, (
                f"{module} imports the builtin server: {graph[module] & server}"
            )
    for module in server:
        outside = {target for target in graph[module] - server if target.startswith("lib.")}
        assert outside <= SERVER_MAY_IMPORT, f"{module} imports {outside - SERVER_MAY_IMPORT} from lib/"


def test_library_docstrings_stay_short():
    # What a long docstring explains belongs beside the code it explains (scripts' manuals are exempt).
    long = []
    for path in LIB.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in [tree, *ast.walk(tree)]:
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                docstring = ast.get_docstring(node, clean=False) or ""
                if docstring.count("\n") + 1 > 15:
                    long.append(f"{path.relative_to(ROOT)}:{getattr(node, 'name', 'module')}")
    assert not long, f"docstrings over 15 lines: {long}"
