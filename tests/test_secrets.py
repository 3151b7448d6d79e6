"""The API key travels to the servers plainrl starts through their environment only, and reaches no file."""

import contextlib
import subprocess
import sys

import pytest
from conftest import ROOT, load_script

from lib import inference
from lib.config import parse

KEY = "sk-plainrl-test-7c1d9e"
FIXTURES = ROOT / "tests" / "fixtures"


def files_holding(directory, secret: str) -> list[str]:
    return [str(p) for p in directory.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def test_a_run_keeps_the_key_off_every_command_line_and_out_of_every_file(tiny_dir, tmp_path, monkeypatch):
    rl = load_script("rl")
    monkeypatch.syspath_prepend(str(FIXTURES))  # letter_taskset
    monkeypatch.setenv("PLAINRL_API_KEY", KEY)
    monkeypatch.setenv("WANDB_MODE", "offline")
    started = []

    class RecordingPopen(subprocess.Popen):
        def __init__(self, command, **kwargs):
            if any(str(arg).endswith("serve.py") for arg in command):
                started.append((command, kwargs["env"]))
            super().__init__(command, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", RecordingPopen)
    out = tmp_path / "run"
    flags = ["@", str(ROOT / "configs/tiny/rl.toml"), "--model.name", str(tiny_dir), "--output-dir", str(out)]
    flags += ["--steps", "1", "--env.id", "letter_taskset", "--examples-per-step", "2"]
    flags += ["--rollouts-per-example", "2", "--sampling.max-tokens", "8", "--inference.engine", "torch"]
    flags += ["--wandb.project", "p", "--wandb.offline"]
    rl.main(parse(rl.Config, flags))  # the server it starts requires the key: every request carried it

    ((command, env),) = started
    assert not any(KEY in arg for arg in command), command
    assert env["PLAINRL_API_KEY"] == KEY
    assert (out / "wandb").is_dir() and (out / "server.log").is_file()
    assert files_holding(out, KEY) == []


def test_serve_hands_vllm_the_key_in_its_environment_only(tiny_dir, monkeypatch):
    import lib.vllm

    serve = load_script("serve")
    launched = []
    monkeypatch.setattr(lib.vllm, "exec_vllm", lambda command, env: launched.append((command, env)))
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

    monkeypatch.setattr(inference, "running_server", running_server)
    argv = ["reverse_text", "-m", str(tiny_dir), "-n", "1", "--output-dir", str(tmp_path)]
    with pytest.raises(SystemExit):
        eval_script.main(parse(eval_script.Config, argv))
    assert given == [None]
