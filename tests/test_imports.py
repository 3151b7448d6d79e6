"""lib/ imports run one way: no cycle, and the builtin server (lib/inference/server/) stays a program of its own."""

import ast
from pathlib import Path

from conftest import ROOT

LIB = ROOT / "lib"


def module_names() -> dict[str, Path]:
    """Module name -> file for lib/ and its tasksets (lib/orchestrator/tasksets, installed as top-level packages)."""
    names = {}
    for path in LIB.rglob("*.py"):
        relative = path.relative_to(LIB)
        if relative.parts[:2] == ("orchestrator", "tasksets"):
            parts = list(relative.parts[2:])
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
            # `from lib.trainer import loss` imports the module lib.trainer.loss; so does `from lib.trainer.loss import x`.
            targets = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known]
            targets = targets or [base]  # names from a module, or modules from a package
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
    assert "lib.orchestrator.envs" in graph["lib.orchestrator.producer"], "the walk must see imports"
    # Tasksets before episodes, and loading a model needs no SFT data code.
    assert (
        "lib.orchestrator.envs" not in graph["lib.orchestrator.tasks"]
        and "lib.orchestrator.data" not in graph["lib.models.load"]
    )
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_walk_finds_a_cycle_made_inside_a_function(tmp_path):
    path = tmp_path / "tasks.py"
    path.write_text("import json\n\n\ndef f():\n    from lib.orchestrator import envs\n")
    assert imports_of(
        path, "lib.orchestrator.tasks", {"lib.orchestrator.envs", "lib.orchestrator.tasks"}
    ) == {"lib.orchestrator.envs"}
    graph = {
        "lib.orchestrator.tasks": {"lib.orchestrator.envs"},
        "lib.orchestrator.envs": {"lib.orchestrator.producer"},
        "lib.orchestrator.producer": {"lib.orchestrator.tasks"},
        "lib.a": set(),
    }
    assert find_cycle(graph) == [
        "lib.orchestrator.envs",
        "lib.orchestrator.producer",
        "lib.orchestrator.tasks",
        "lib.orchestrator.envs",
    ]


# What the builtin server may take from the trainer's side: its errors, model loading, sampling settings and
# the weight fingerprint that both sides of a reload compute, the group an in-memory transfer runs over.
SERVER_MAY_IMPORT = {
    "lib.config",
    "lib.inference.weights.fingerprint",
    "lib.inference.weights.group",
    "lib.models.load",
    "lib.sampling",
}


def test_the_builtin_server_is_a_package_apart():
    names = module_names()
    graph = {module: imports_of(path, module, set(names)) for module, path in names.items()}
    server = {module for module in names if module.startswith("lib.inference.server")}
    assert {
        "lib.inference.server.engine",
        "lib.inference.server.routes",
        "lib.inference.server.decode",
        "lib.inference.server.protocol",
    } <= server
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


# The rooms, in the order data flows through them: a module may import its own room and any room before it.
ROOMS = ["ground", "models", "orchestrator", "trainer", "inference"]


def room_of(module: str) -> str:
    """The room of a lib module (tasksets are the orchestrator's); the ground is lib/*.py itself."""
    if not module.startswith("lib."):
        return "orchestrator"
    parts = module.split(".")
    return parts[1] if parts[1] in ROOMS else "ground"


def test_imports_follow_the_rooms_order():
    names = module_names()
    graph = {module: imports_of(path, module, set(names)) for module, path in names.items()}
    rooms = {module: room_of(module) for module in names}
    assert {"ground", "models", "orchestrator", "trainer", "inference"} == set(rooms.values())
    assert (
        rooms["lib.inference.weights.sync"] == "inference" and rooms["plainrl_arithmetic"] == "orchestrator"
    )
    against = [
        f"{module} ({rooms[module]}) imports {target} ({rooms[target]})"
        for module, targets in sorted(graph.items())
        for target in sorted(targets)
        if ROOMS.index(rooms[target]) > ROOMS.index(rooms[module])
    ]
    assert not against, "imports against the rooms' order:\n" + "\n".join(against)
    ground = sorted(module for module, room in rooms.items() if room == "ground" and module != "lib")
    assert len(ground) <= 14, f"the ground has grown to {len(ground)} modules: {ground}"


def test_the_walk_sees_an_import_against_the_order(tmp_path):
    path = tmp_path / "load.py"
    path.write_text("def f():\n    from lib.trainer import loss\n")
    assert imports_of(path, "lib.models.load", {"lib.models.load", "lib.trainer.loss"}) == {
        "lib.trainer.loss"
    }
    assert ROOMS.index(room_of("lib.trainer.loss")) > ROOMS.index(room_of("lib.models.load"))


def test_package_faces_import_nothing():
    # vLLM's workers import lib.inference.weights.vllm_worker, the builtin server weights' fingerprint and group:
    # an __init__ that imported anything would pull the trainer into both.
    for path in LIB.rglob("__init__.py"):
        if "tasksets" in path.parts:
            continue
        body = ast.parse(path.read_text()).body
        assert len(body) == 1 and isinstance(body[0], ast.Expr), (
            f"{path.relative_to(ROOT)} holds more than a docstring"
        )


def test_pyproject_lists_every_lib_package():
    # The editable install finds a missing package anyway; a wheel would not have it.
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    packages = {
        ".".join(path.parent.relative_to(ROOT).parts)
        for path in LIB.rglob("__init__.py")
        if "tasksets" not in path.parts
    }
    assert packages <= listed, f"pyproject.toml's packages lack {sorted(packages - listed)}"
    tasksets = {path.parent.name for path in (LIB / "orchestrator" / "tasksets").glob("*/__init__.py")}
    assert tasksets <= listed, f"pyproject.toml's packages lack {sorted(tasksets - listed)}"
