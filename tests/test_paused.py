"""A server someone left paused: eval.py and rl.py stop with one sentence instead of waiting forever (on both
engines), rl.py's own pauses never trip the check, and SIGTERM stops a paused builtin server."""

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from conftest import ROOT, load_script

from lib import inference, sync
from lib.config import UserError, parse

ENGINES = ["torch", pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.slow])]


@pytest.fixture(scope="module")
def builtin(trained_tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("paused")
    with inference.running_server(
        str(trained_tiny), engine="torch", weights_root=root, log_path=root / "s.log"
    ) as server:
        yield server, root


@pytest.fixture
def paused_server(request, builtin):
    """The engine's server, paused as a controller killed mid-sync leaves it; resumed after the test."""
    server = builtin[0] if request.param == "torch" else request.getfixturevalue("vllm_server")
    root = inference.root_url(server.url)
    assert httpx.post(f"{root}/pause?mode=keep", timeout=30).status_code == 200
    try:
        yield server
    finally:
        httpx.post(f"{root}/resume", timeout=30)


@pytest.mark.parametrize("paused_server", ENGINES, indirect=True)
def test_eval_against_a_paused_server_stops_with_one_sentence(paused_server, monkeypatch, tmp_path):
    # Before, eval.py waited in silence until killed (seen: still waiting after 100 s).
    monkeypatch.setattr(inference, "PAUSED_PATIENCE_S", 2.0)
    monkeypatch.setattr(inference, "HEALTH_EVERY_S", 0.5)
    assert httpx.get(inference.root_url(paused_server.url) + "/health").status_code == 200  # looks alive
    eval_script = load_script("eval")
    name = inference.served_model(paused_server.url)
    argv = ["reverse_text", "-m", name, "-b", paused_server.url, "-n", "1", "-r", "1"]
    argv += ["--output-dir", str(tmp_path), "--name", "run"]
    began = time.monotonic()
    with pytest.raises(UserError, match=r"has been paused for \d+ s by another client.*/resume"):
        eval_script.main(parse(eval_script.Config, argv))
    assert time.monotonic() - began < 30


def test_rl_stops_when_another_client_pauses_its_server_between_syncs(
    builtin, trained_tiny, monkeypatch, tmp_path
):
    import lib.producer

    rl = load_script("rl")
    server, weights_root = builtin
    root = inference.root_url(server.url)
    monkeypatch.setattr(inference, "PAUSED_PATIENCE_S", 2.0)
    monkeypatch.setattr(lib.producer, "HEALTH_EVERY_S", 0.5)
    publish = sync.publish

    def publish_then_someone_pauses(*args, **kwargs):
        # rl.py's own pause and resume come first, inside publish: they never trip the check.
        result = publish(*args, **kwargs)
        if args[1] == 1:
            httpx.post(f"{root}/pause?mode=keep", timeout=30)
        return result

    monkeypatch.setattr(sync, "publish", publish_then_someone_pauses)
    argv = ["@", str(ROOT / "configs/tiny/rl.toml"), "--model.name", str(trained_tiny)]
    run_dir = weights_root / tmp_path.name  # the server loads only what is under its root
    argv += ["--output-dir", str(run_dir), "--inference.urls", server.url, "--steps", "3"]
    argv += ["--env.id", "letter_taskset", "--examples-per-step", "2", "--rollouts-per-example", "2"]
    argv += ["--max-async-level", "0", "--sampling.max-tokens", "16"]
    try:
        with pytest.raises(UserError, match=rf"{root} has been paused for \d+ s"):
            rl.main(parse(rl.Config, argv))
    finally:
        httpx.post(f"{root}/resume", timeout=30)
    assert (run_dir / "weights" / "step_1").is_dir()  # step 1 trained and synced normally


def test_sigterm_stops_a_paused_builtin_server_and_its_waiting_clients_get_an_error(tiny_dir, tmp_path):
    port = inference.free_port()
    command = [sys.executable, str(ROOT / "scripts/serve.py"), "--model.name", str(tiny_dir)]
    command += ["--port", str(port), "--engine", "torch"]
    keyless = {k: v for k, v in os.environ.items() if k != "PLAINRL_API_KEY"}
    with open(tmp_path / "serve.log", "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=keyless)
    try:
        root = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while not inference.is_healthy(f"{root}/v1"):
            assert process.poll() is None and time.monotonic() < deadline, (
                tmp_path / "serve.log"
            ).read_text()
            time.sleep(0.2)
        assert httpx.post(f"{root}/pause?mode=keep").status_code == 200
        outcome = {}

        def ask():
            body = {"model": inference.served_model(f"{root}/v1"), "prompt": "abc", "max_tokens": 4}
            try:
                outcome["status"] = httpx.post(f"{root}/v1/completions", json=body, timeout=60).status_code
            except httpx.HTTPError as error:
                outcome["error"] = type(error).__name__

        waiting = threading.Thread(target=ask)
        waiting.start()
        time.sleep(1.0)  # the request waits on the paused engine
        began = time.monotonic()
        process.send_signal(signal.SIGTERM)
        # Before: still alive 10 s and 21 s after the SIGTERM.
        process.wait(timeout=15)
        waiting.join(timeout=15)
        assert time.monotonic() - began < 10
        assert "error" in outcome or outcome.get("status", 200) >= 500, outcome
    finally:
        process.kill()
        process.wait()
