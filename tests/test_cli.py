"""The command lines, frozen: every flag of every script with its type and default, and a docstring
under every config field (the docstring is the flag's --help text).

A flag renamed, removed or given a new default breaks users' TOML presets and scripts without a
word; this test makes such a change deliberate. To accept one, rewrite the frozen copy:
    PLAINRL_FREEZE_CLI=1 pytest tests/test_cli.py
and commit tests/fixtures/cli.txt with the change.
"""

import ast
import dataclasses
import os
import typing
from pathlib import Path

from conftest import ROOT, load_script

from lib.foreign import dataclass_type

SCRIPTS = ["tiny", "sft", "serve", "eval", "rl", "demo", "export"]
FROZEN = ROOT / "tests" / "fixtures" / "cli.txt"


def type_name(annotation) -> str:
    return (getattr(annotation, "__name__", None) if isinstance(annotation, type) else None) or str(
        annotation
    ).replace("typing.", "").replace("pathlib.", "")


def flags(config_class: type, prefix: str = "") -> list[str]:
    """One line per flag: --name: type = default (nested configs as --table.name)."""
    hints = typing.get_type_hints(config_class)
    lines = []
    for field in dataclasses.fields(config_class):
        if not field.init:
            continue
        name = f"{prefix}{field.name.replace('_', '-')}"
        nested = dataclass_type(hints[field.name])
        if nested is not None:
            lines += flags(nested, f"{name}.")
            continue
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            default = "(required)"
        default = str(default) if isinstance(default, Path) else repr(default)
        lines.append(f"--{name}: {type_name(hints[field.name])} = {default}")
    return lines


def current_cli() -> str:
    sections = []
    for script in SCRIPTS:
        sections.append(f"# scripts/{script}.py\n" + "\n".join(flags(load_script(script).Config)))
    return "\n\n".join(sections) + "\n"


def test_the_command_lines_are_the_frozen_ones():
    current = current_cli()
    if os.environ.get("PLAINRL_FREEZE_CLI"):
        FROZEN.write_text(current)
    frozen = FROZEN.read_text()
    changed = sorted(set(current.splitlines()) ^ set(frozen.splitlines()))
    assert current == frozen, (
        "the command line changed (lines only in one of the two: "
        f"{changed}); if on purpose, run PLAINRL_FREEZE_CLI=1 pytest tests/test_cli.py and commit "
        "tests/fixtures/cli.txt"
    )


def test_every_config_field_has_a_docstring():
    missing = []
    for path in sorted([*ROOT.glob("scripts/*.py"), *ROOT.glob("lib/*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.ClassDef) and node.name.endswith("Config")):
                continue
            body = node.body
            for i, statement in enumerate(body):
                if isinstance(statement, ast.AnnAssign):
                    following = body[i + 1] if i + 1 < len(body) else None
                    documented = isinstance(following, ast.Expr) and isinstance(
                        getattr(following, "value", None), ast.Constant
                    )
                    if not documented:
                        missing.append(f"{path.relative_to(ROOT)}: {node.name}.{statement.target.id}")
    assert missing == [], f"config fields without a docstring (their --help is empty): {missing}"
