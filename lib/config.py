"""Config parsing: tyro dataclasses, `@ file.toml` presets (deep-merged, later wins), then dotted CLI flags.

    python scripts/rl.py @ configs/reverse_text/rl.toml @ mine.toml --model.name Qwen/Qwen3-0.6B

TOML tables map to nested dataclasses (`[sampling] temperature = 0.8` is `--sampling.temperature 0.8`).
The presets are turned into CLI flags placed before the user's own, so tyro checks every value the same
way and a later flag wins. Bad input (a UserError) ends with one sentence on stderr and exit code 2.
This module imports no torch: `--help` must stay fast.
"""

import contextlib
import dataclasses
import io
import json
import os
import re
import signal
import sys
import threading
import time
import tomllib
import types
import typing
from pathlib import Path

import tomli_w
import tyro

from lib import rundir
from lib.foreign import dataclass_type, leaves, plainrl_flag, plainrl_name, unknown_keys

# What a file or wandb gets in place of an API key.
REDACTED = "<redacted>"
KEY_VARIABLE = "PLAINRL_API_KEY"
USAGE = "Presets: `@ file.toml` (several, deep-merged, later wins) before any --flag; flags override them."


class UserError(ValueError):
    """A mistake in what the user gave (settings, files, servers, data): the run ends with its one sentence
    and exit code 2, no traceback. A ValueError, because tyro reports only that as a message when a
    config's `__post_init__` raises; any other exception, a ValueError from torch included, keeps its
    traceback."""


def given_api_key(given: str | None) -> str | None:
    """The key typed in a config or flag, else $PLAINRL_API_KEY. A config.toml written by a run holds REDACTED in
    the key's place, so repeating the run with `@ config.toml` takes the key from the environment again."""
    if given and given != REDACTED:
        return given
    return os.environ.get(KEY_VARIABLE) or None


def fail(message: str) -> typing.NoReturn:
    """Ends the program for a user mistake: one sentence, exit code 2. Under torchrun the sentence goes to
    the worker's error file as well: torchrun ends its own traceback with it, where it stays in sight."""
    print(f"error: {message}", file=sys.stderr)
    if error_file := os.environ.get("TORCHELASTIC_ERROR_FILE"):
        # The layout torch's @record writes (torch/distributed/elastic/multiprocessing/errors): torchrun
        # prints py_callstack as the failure's "traceback".
        info = {"py_callstack": f"error: {message}", "timestamp": str(int(time.time()))}
        Path(error_file).write_text(json.dumps({"message": {"message": message, "extraInfo": info}}))
    raise SystemExit(2)


def run_main(main, config, resume_dir: Path | None = None) -> None:
    """Runs a script's main(config). Bad input found after parsing (files, servers, data) ends as one
    sentence, exit 2; Ctrl-C as one line (saying how to resume when the run can), exit 130; a peer
    process lost in a collective as one line, exit 1. main's own `finally` has stopped its servers and
    threads by then; the process group is left here, on every path."""
    from lib import dist

    try:
        main(config)
    except UserError as error:
        message = str(error).rstrip(".")
        fail(message if message.endswith("?") else message + ".")
    except KeyboardInterrupt:
        hint = f": `--resume` continues from the last checkpoint in {resume_dir}" if resume_dir else ""
        print(f"\ninterrupted{hint}", file=sys.stderr)
        raise SystemExit(130) from None
    except RuntimeError as error:
        from lib.dist import peer_lost

        message = peer_lost(error)
        if message is None:
            raise
        print(message, file=sys.stderr)
        raise SystemExit(1) from None
    finally:
        dist.close()


class StopAfterStep:
    """Makes the first Ctrl-C a request (`requested`) that a training loop answers by checkpointing the
    step it is on and stopping; a second Ctrl-C stops at once, as usual. `close()` puts the usual
    handling back. Outside the main thread (where no signal handler can be set) it does nothing."""

    def __init__(self):
        self.requested = False
        self._previous = None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handle)

    def close(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print(
            "\nCtrl-C: stopping after this step, with a checkpoint (Ctrl-C again stops now)", file=sys.stderr
        )


def split_presets(argv: list[str]) -> tuple[list[Path], list[str]]:
    """Separates `@ a.toml`, `@b.toml` preset files from the remaining CLI flags."""
    files, rest, i = [], [], 0
    while i < len(argv):
        token = argv[i]
        if token == "@":
            if i + 1 >= len(argv):
                fail("`@` must be followed by a TOML file.")
            files.append(Path(argv[i + 1]))
            i += 2
        elif token.startswith("@") and token.endswith(".toml"):
            files.append(Path(token[1:]))
            i += 1
        else:
            rest.append(token)
            i += 1
    return files, rest


def deep_merge(base: dict, update: dict) -> dict:
    """Merges `update` into a copy of `base`; nested tables merge, everything else is replaced."""
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_presets(files: list[Path], config_class: type | None = None) -> dict:
    """The presets deep-merged, each first checked against `config_class` (its unknown keys named with it)."""
    merged: dict = {}
    for path in files:
        if not path.is_file():
            fail(f"config file {path} does not exist.")
        try:
            table = tomllib.loads(path.read_text())
        except tomllib.TOMLDecodeError as error:
            fail(f"{path} is not valid TOML ({error}).")
        if config_class is not None:
            preset_to_flags(config_class, table, source=str(path))
        merged = deep_merge(merged, table)
    return merged


def _is_bool(annotation) -> bool:
    return annotation is bool or (
        typing.get_origin(annotation) in (typing.Union, types.UnionType)
        and bool in typing.get_args(annotation)
    )


def preset_to_flags(
    config_class: type, table: dict, prefix: str = "", source: str = "the TOML presets"
) -> list[str]:
    """Turns a TOML table into tyro flags. Unknown keys end the program in one sentence that names them all
    (and `source`), each with plainrl's name for it where prime-rl, verifiers or TRL use it (lib/foreign.py)."""
    unknown: dict[str, list[str]] = {}
    flags = _table_flags(config_class, table, prefix, unknown)
    if len(unknown) == 1 and plainrl_name(config_class, *unknown) is None:
        [(path, valid)] = unknown.items()
        fail(f"unknown config key '{path}' in {source} (valid here: {', '.join(sorted(valid))}).")
    if unknown:
        fail(unknown_keys(config_class, list(unknown), source))
    return flags


def _table_flags(config_class: type, table: dict, prefix: str, unknown: dict[str, list[str]]) -> list[str]:
    """preset_to_flags' flags for `table`. Each key the config has no field for (a table's every key) goes to
    `unknown`, by its dotted path, with the names valid in its place."""
    hints = typing.get_type_hints(config_class)
    fields = {f.name: hints[f.name] for f in dataclasses.fields(config_class) if f.init}
    flags: list[str] = []
    for key, value in table.items():
        name = key.replace("-", "_")
        if name not in fields:
            unknown.update((path, list(fields)) for path in leaves(value, prefix + name))
            continue
        annotation = fields[name]
        nested = dataclass_type(annotation)
        if nested is not None:
            if not isinstance(value, dict):
                if not prefix and plainrl_name(config_class, name) is not None:
                    unknown[name] = list(fields)  # RLTrainer's `model = "..."`: plainrl's [model] name
                    continue
                fail(f"config key '{prefix}{key}' must be a table such as [{prefix}{key}].")
            flags += _table_flags(nested, value, f"{prefix}{name}.", unknown)
        elif isinstance(value, dict):
            fail(f"config key '{prefix}{key}' takes a single value, not a table.")
        elif _is_bool(annotation) and isinstance(value, bool):
            flags.append(f"--{prefix}{name}" if value else f"--{prefix}no-{name}")
        elif isinstance(value, list):
            flags += [f"--{prefix}{name}", *(str(v) for v in value)]
        else:
            flags += [f"--{prefix}{name}", str(value)]
    return flags


def _tyro_message(captured: str) -> str:
    """Pulls the sentence out of tyro's error message (boxed on a terminal, plain elsewhere), with the flags
    its "Perhaps you meant" offers."""
    rows = [line.strip().strip("│╭╮╰╯").strip() for line in captured.splitlines()]
    rows = [row for row in rows if row]

    def is_rule(row: str) -> bool:
        return re.fullmatch(r"[─━-]+", row) is not None

    if captured.lstrip().startswith("╭"):  # the box's title line
        rows = rows[1:]
    elif len(rows) > 1 and is_rule(rows[1]):  # a plain title and its rule
        rows = rows[2:]
    sections = [[]]
    for row in rows:
        if is_rule(row):
            sections.append([])
        else:
            sections[-1].append(row)
    lines = next((section for section in sections if section), [])
    text = " ".join(lines) or captured.strip() or "invalid arguments."
    meant = [s for s in sections if s and s[0].startswith("Perhaps you meant")]
    flags = [line.split()[0] for line in (meant[0][1:] if meant else []) if line.startswith("-")]
    if flags:
        text = f"{text.rstrip('.')} (did you mean {' or '.join(flags[:3])}?)"
    text = re.sub(r"^(Error parsing )?\w*Config: ", "", text).replace("Error parsing ", "")
    text = re.sub(
        r"^(\w+): (?=\1[._])", "", text
    )  # "sampling: sampling.top_p must ..." -> "sampling.top_p must ..."
    return text.rstrip(".") + "."


def wrap_help(text: str, width: int = 100) -> str:
    """tyro's --help with its long lines outside the option boxes (which fit the terminal) wrapped to `width`:
    tyro prints each paragraph of a script's docstring as one line."""
    import textwrap

    logical, hang = [], None  # a list item's own lines joined, to be wrapped under its text
    for line in text.splitlines():
        body = line.lstrip()
        if hang is not None and body and len(line) - len(body) == hang and not re.match(r"\d+\. |- ", body):
            logical[-1] += " " + body
            continue
        item = re.match(r"\d+\. |- ", body)
        hang = len(line) - len(body) + len(item.group()) if item else None
        logical.append(line)
    lines = []
    for line in logical:
        if len(line) > width:  # a command's aligned comment comes closer first
            line = re.sub(r"(\S) {3,}# ", r"\1  # ", line)
        body = line.lstrip()
        if len(line) <= width or body.startswith(("│", "╭", "╰")):
            lines.append(line)
            continue
        indent = len(line) - len(body)
        item = re.match(r"\d+\. |- ", body)  # a list item's lines go under its text; a command's further in
        hang = len(item.group()) if item else 4 if indent >= 4 else 0
        lines += textwrap.wrap(
            body,
            width,
            initial_indent=" " * indent,
            subsequent_indent=" " * (indent + hang),
            break_long_words=False,
            break_on_hyphens=False,
        )
    return "\n".join(lines) + "\n"


def parse(config_class: type, argv: list[str] | None = None, description: str | None = None):
    """Builds `config_class` from defaults < TOML presets (in order) < CLI flags. With --resume in a run
    directory, the run's own config takes the presets' place (resumed)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    files, rest = split_presets(argv)
    presets = load_presets(files, config_class)
    flags = preset_to_flags(config_class, presets) + rest
    if "-h" in rest or "--help" in rest:
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `--help | head` ends quietly, as other CLIs do
        captured = io.StringIO()
        try:
            with contextlib.redirect_stdout(captured):
                return tyro.cli(config_class, args=flags, description=f"{description or ''}\n\n{USAGE}")
        finally:
            sys.stdout.write(wrap_help(captured.getvalue()))
    config = _cli(config_class, flags, description)
    if getattr(config, "resume", False):
        try:
            if other := rundir.other_script(config.output_dir, config_class):  # before its fields meet ours
                raise UserError(other)
            saved = run_config(config.output_dir)
        except UserError as error:
            fail(str(error))
        if saved is not None:
            config = resumed(config_class, config, saved, presets, rest, description)
    return config


def _cli(config_class: type, flags: list[str], description: str | None):
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            return tyro.cli(config_class, args=flags, description=description)
    except SystemExit as exit_:
        if exit_.code in (0, None):
            raise
        fail(plainrl_flag(config_class, _tyro_message(captured.getvalue())))


def resumed(config_class: type, config, saved: dict, presets: dict, rest: list[str], description: str | None):
    """The config a --resume continues with: the run's own (run_config) < the CLI flags. The `@` presets
    are left out, since make and SLURM jobs pass them again on every resume; where one differs from the
    run's, one line on stderr (rank 0) says it was ignored. lib/trainer/checkpoint.py open_run says, records or
    refuses what the flags change."""
    run_dir = config.output_dir
    base = preset_to_flags(config_class, saved, source=f"{run_dir / rundir.CONFIG}")
    # The directory and --resume are the ones given now: a run moved elsewhere resumes there.
    final = _cli(config_class, [*base, "--output-dir", str(run_dir), "--resume", *rest], description)
    given, kept = flat(to_dict(config)), flat(to_dict(final))
    ignored = [
        f"{key} {given.get(key)!r} (the run's: {kept.get(key)!r})"
        for key in flat(presets)
        if key not in ("output_dir", "resume") and given.get(key) != kept.get(key)
    ]
    if ignored and os.environ.get("RANK", "0") == "0":
        print(
            f"--resume continues {run_dir} with its own config: ignored from the presets "
            f"{', '.join(ignored)} (a flag changes a value)",
            file=sys.stderr,
        )
    return final


def run_config(run_dir: Path) -> dict | None:
    """The config a resume of `run_dir` continues with: the last one resumes.jsonl records, else config.toml's;
    None when the directory holds neither."""
    resumes, path = run_dir / rundir.RESUMES, run_dir / rundir.CONFIG
    if resumes.is_file():
        lines = resumes.read_text().splitlines()
        if lines:
            return json.loads(lines[-1])["config"]
    if not path.is_file():
        return None
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as error:
        raise UserError(
            f"{path} is not valid TOML ({error}): --resume reads the run's config there."
        ) from None


def flat(table: dict, prefix: str = "") -> dict:
    """{"optim.lr": 3e-4, ...}: a nested config table's leaves by dotted field name."""
    leaves = {}
    for key, value in table.items():
        name = prefix + key.replace("-", "_")  # a TOML key may spell a field with dashes
        if isinstance(value, dict):
            leaves.update(flat(value, f"{name}."))
        else:
            leaves[name] = value
    return leaves


def to_dict(config) -> dict:
    """The config as plain TOML-ready data (None values are left out: TOML has no null), API keys
    redacted: it goes to config.toml and to wandb."""

    def clean(value):
        if isinstance(value, dict):
            return {k: REDACTED if k == "api_key" else clean(v) for k, v in value.items() if v is not None}
        if isinstance(value, tuple | list):
            return [clean(v) for v in value]
        if isinstance(value, Path):
            return str(value)
        return value

    return clean(dataclasses.asdict(config))


def write_config(config, path: Path) -> None:
    """Writes the resolved config; it can be passed back with `@ path` to repeat the run. Written under
    another name, then renamed: a run killed meanwhile leaves no half of it for --resume to read."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, rundir.CONFIG_HEADER + tomli_w.dumps(to_dict(config)))


def write_atomically(path: Path, text: str) -> None:
    """Writes `text` to a hidden name beside `path`, then renames it into place: a process killed meanwhile
    leaves the old file whole, never half of the new one."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text)
    partial.replace(path)
