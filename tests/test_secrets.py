"""The API key travels to the servers plainrl starts through their environment only, and reaches no file."""

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT, load_script

from lib import endpoint
from lib.config import parse
from lib.inference import launch

KEY = "sk-plainrl-test-7c1d9e"
FIXTURES = ROOT / "tests" / "fixtures"


def files_holding(directory, secret: str) -> list[str]:
    return [str(p) for p in directory.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def make_environment(**extra) -> dict[str, str]:
    """This environment without an outer make's variables (under `make test` they would leak in)."""
    leaking = ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES", "PLAINRL_API_KEY", "API_KEY")
    return {**{k: v for k, v in os.environ.items() if k not in leaking}, **extra}


def descendants(root: int) -> list[int]:
    """`root` and every process under it, from /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def read_process(pid: int) -> tuple[list[str], dict[str, str]] | None:
    """A process's argv and environment, or None when it has already gone."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:-1]
        pairs = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    return argv, dict(pair.split("=", 1) for pair in pairs if "=" in pair)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads the process tree from /proc")
def test_a_run_keeps_the_key_off_every_command_line_and_out_of_every_file(tiny_dir, tmp_path):
    """`make rl` as the README runs it, the key exported: make, its shells, rl.py, the server it starts and
    every other child are read from /proc while they run, argv and MAKEFLAGS; then every file of the run."""
    out = tmp_path / "run"
    args = ["--steps", "1", "--env.id", "letter_taskset", "--examples-per-step", "2"]
    args += ["--rollouts-per-example", "2", "--sampling.max-tokens", "8", "--inference.engine", "torch"]
    args += ["--wandb.project", "p", "--wandb.offline"]
    command = ["make", "--no-print-directory", "-o", ".venv/.installed", "rl", "ENV=tiny"]
    command += [f"MODEL={tiny_dir}", f"OUTPUT_DIR={out}", f"ARGS={' '.join(args)}"]
    env = make_environment(
        PLAINRL_API_KEY=KEY, WANDB_MODE="offline", PYTHONPATH=str(FIXTURES)
    )  # letter_taskset
    seen: dict[tuple[int, tuple[str, ...]], dict[str, str]] = {}
    with subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    ) as make:
        deadline = time.monotonic() + 600
        while make.poll() is None:
            for pid in descendants(make.pid):
                if (process := read_process(pid)) is not None:
                    seen[(pid, tuple(process[0]))] = process[1]
            if time.monotonic() > deadline:
                make.kill()  # else leaving the with block waits for it
                raise AssertionError("`make rl` still ran after 10 minutes")
            time.sleep(0.05)
        output = make.stdout.read().decode(errors="replace")
    assert make.returncode == 0, output[-3000:]
    # A process caught between fork and exec, or already a zombie, shows an empty argv.
    programs = " ".join(argv[0] + " " + " ".join(argv[1:2]) for _, argv in seen if argv)
    assert "make" in programs and "scripts/rl.py" in programs and "scripts/serve.py" in programs, programs
    for (_, argv), environ in seen.items():
        assert not any(KEY in arg for arg in argv), argv
        assert KEY not in environ.get("MAKEFLAGS", "") and KEY not in environ.get("MFLAGS", ""), argv
    servers = [
        environ for (_, argv), environ in seen.items() if any(a.endswith("scripts/serve.py") for a in argv)
    ]
    assert servers and all(environ.get("PLAINRL_API_KEY") == KEY for environ in servers)  # it got the key
    assert KEY not in output
    assert (out / "wandb").is_dir() and (out / "server.log").is_file()
    assert files_holding(out, KEY) == []
    # The recipes themselves: what make hands its shell for each target names no key.
    for target in ("rl", "serve", "eval"):
        dry = subprocess.run(
            ["make", "-n", "--no-print-directory", "-o", ".venv/.installed", target],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        assert "scripts/" in dry.stdout and KEY not in dry.stdout + dry.stderr, dry.stdout


def test_make_refuses_a_key_on_its_command_line_in_one_sentence_that_does_not_repeat_it():
    """`make rl API_KEY=...` would show the key in ps for make's lifetime and copy it into MAKEFLAGS."""
    for target in ("rl", "serve", "eval"):
        refused = subprocess.run(
            ["make", "-n", "--no-print-directory", "-o", ".venv/.installed", target, f"API_KEY={KEY}"],
            cwd=ROOT,
            env=make_environment(),
            capture_output=True,
            text=True,
        )
        assert refused.returncode != 0 and refused.stdout == "", refused.stdout
        (line,) = refused.stderr.strip().splitlines()
        assert "export PLAINRL_API_KEY" in line and KEY not in line, line


def test_serve_hands_vllm_the_key_in_its_environment_only(tiny_dir, monkeypatch):
    import lib.inference.vllm

    serve = load_script("serve")
    launched = []
    monkeypatch.setattr(lib.inference.vllm, "exec_vllm", lambda command, env: launched.append((command, env)))
    monkeypatch.setenv("PLAINRL_API_KEY", KEY)
    serve.main(parse(serve.Config, ["--model.name", str(tiny_dir), "--engine", "vllm"]))
    monkeypatch.delenv("PLAINRL_API_KEY")
    serve.main(parse(serve.Config, ["--model.name", str(tiny_dir), "--engine", "vllm", "--api-key", KEY]))
    for command, env in launched:  # from the environment, and typed by the user
        assert not any(KEY in arg for arg in command) and "--api-key" not in command, command
        assert env["VLLM_API_KEY"] == KEY


def test_a_key_typed_on_the_command_line_is_redacted_in_config_and_provenance(tmp_path, monkeypatch):
    from lib.config import to_dict, write_config
    from lib.provenance import write_provenance

    rl = load_script("rl")
    argv = ["scripts/rl.py", "--inference.api-key", KEY, f"--inference.api-key={KEY}"]
    monkeypatch.setattr(sys, "argv", argv)
    config = parse(rl.Config, argv[1:3])
    assert config.inference.api_key == KEY  # the run itself uses it
    write_config(config, tmp_path / "config.toml")
    server = {"url": "http://127.0.0.1:1/v1", "command": ["serve.py", "--api-key", KEY]}
    write_provenance(tmp_path, [server], KEY)
    assert files_holding(tmp_path, KEY) == []
    assert "<redacted>" in (tmp_path / "config.toml").read_text()
    assert to_dict(config)["inference"]["api_key"] == "<redacted>"  # also what wandb's config gets
    # Repeating the run with `@ config.toml` takes the key from the environment, not the placeholder.
    from lib.config import given_api_key

    again = parse(rl.Config, ["@", str(tmp_path / "config.toml")])
    monkeypatch.setenv("PLAINRL_API_KEY", "from-the-environment")
    assert given_api_key(again.inference.api_key) == "from-the-environment"
    monkeypatch.delenv("PLAINRL_API_KEY")
    assert given_api_key(again.inference.api_key) is None


def test_eval_sends_openai_api_key_only_to_an_endpoint_the_user_named(tiny_dir, tmp_path, monkeypatch):
    eval_script = load_script("eval")
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.delenv("PLAINRL_API_KEY", raising=False)
    given = []

    @contextlib.contextmanager
    def running_server(model, **kwargs):
        given.append(kwargs["api_key"])
        raise RuntimeError("no server in this test")
        yield

    monkeypatch.setattr(launch, "running_server", running_server)
    argv = ["reverse_text", "-m", str(tiny_dir), "-n", "1", "--output-dir", str(tmp_path)]
    with pytest.raises(SystemExit):
        eval_script.main(parse(eval_script.Config, argv))
    assert given == [None]


def test_a_server_rl_starts_without_a_key_given_gets_one_of_its_own(tiny_dir, tmp_path, monkeypatch):
    import httpx

    from lib.inference.weights import sync

    monkeypatch.delenv("PLAINRL_API_KEY", raising=False)
    rl = load_script("rl")
    answers = {}
    publish = sync.publish

    def publish_and_knock(*args, **kwargs):
        result = publish(*args, **kwargs)
        servers = kwargs["servers"]
        models = endpoint.root_url(servers.urls[0]) + "/v1/models"
        answers["without"] = httpx.get(models).status_code
        answers["with"] = httpx.get(models, headers=endpoint.headers(servers.api_key)).status_code
        answers["key"] = servers.api_key
        return result

    monkeypatch.setattr(sync, "publish", publish_and_knock)
    argv = ["@", str(ROOT / "configs/tiny/rl.toml"), "--model.name", str(tiny_dir), "--steps", "1"]
    argv += [
        "--output-dir",
        str(tmp_path / "run"),
        "--env.id",
        "letter_taskset",
        "--inference.engine",
        "torch",
    ]
    argv += ["--examples-per-step", "2", "--rollouts-per-example", "2", "--sampling.max-tokens", "8"]
    rl.main(parse(rl.Config, argv))
    # Before, any local user could pause it or reload another directory into it.
    key = answers.pop("key")
    assert answers == {"without": 401, "with": 200} and len(key) >= 24
    assert files_holding(tmp_path / "run", key) == []
    # Its key lived in this process's environment for the run only: left there, every server a later caller
    # starts from that environment would demand it.
    assert "PLAINRL_API_KEY" not in os.environ


def test_a_server_started_without_a_key_says_who_can_use_it():
    serve = load_script("serve")
    (local,) = serve.key_warnings("127.0.0.1", 8000, None)
    assert "no API key ($PLAINRL_API_KEY unset): every local user can use and reload it" in local
    assert "~/.plainrl_key" in local
    public = serve.key_warnings("0.0.0.0", 8000, None)
    assert len(public) == 2 and "anyone who can reach 0.0.0.0:8000" in public[1]
    assert serve.key_warnings("127.0.0.1", 8000, "k") == []
