"""A server someone left paused: eval.py and rl.py stop with one sentence instead of waiting forever (on both
engines), rl.py's own pauses never trip the check, and SIGTERM stops a paused builtin server."""

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import ROOT, load_script

from lib import endpoint
from lib.config import UserError, parse
from lib.inference import launch
from lib.inference.weights import sync

ENGINES = ["torch", pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.slow])]


@pytest.fixture(scope="module")
def builtin(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("paused")
    with launch.running_server(
        str(tiny_dir), engine="torch", weights_root=root, log_path=root / "s.log"
    ) as server:
        yield server, root


@pytest.fixture
def paused_server(request, builtin):
    """The engine's server, paused as a controller killed mid-sync leaves it; resumed after the test."""
    server = builtin[0] if request.param == "torch" else request.getfixturevalue("vllm_server")
    root = endpoint.root_url(server.url)
    assert httpx.post(f"{root}/pause?mode=keep", timeout=30).status_code == 200
    try:
        yield server
    finally:
        httpx.post(f"{root}/resume", timeout=30)


@pytest.mark.slow
@pytest.mark.parametrize("paused_server", ENGINES, indirect=True)
def test_eval_against_a_paused_server_stops_with_one_sentence(paused_server, monkeypatch, tmp_path):
    # Before, eval.py waited in silence until killed (seen: still waiting after 100 s).
    monkeypatch.setattr(endpoint, "PAUSED_PATIENCE_S", 2.0)
    monkeypatch.setattr(endpoint, "HEALTH_EVERY_S", 0.5)
    assert httpx.get(endpoint.root_url(paused_server.url) + "/health").status_code == 200  # looks alive
    eval_script = load_script("eval")
    name = endpoint.served_model(paused_server.url)
    argv = ["reverse_text", "-m", name, "-b", paused_server.url, "-n", "1", "-r", "1"]
    argv += ["--output-dir", str(tmp_path), "--name", "run"]
    began = time.monotonic()
    with pytest.raises(UserError, match=r"has been paused for \d+ s by another client.*/resume"):
        eval_script.main(parse(eval_script.Config, argv))
    assert time.monotonic() - began < 30


def test_rl_stops_when_another_client_pauses_its_server_between_syncs(
    builtin, trained_tiny, monkeypatch, tmp_path
):
    import lib.orchestrator.producer

    rl = load_script("rl")
    server, weights_root = builtin
    root = endpoint.root_url(server.url)
    monkeypatch.setattr(endpoint, "PAUSED_PATIENCE_S", 2.0)
    monkeypatch.setattr(lib.orchestrator.producer, "HEALTH_EVERY_S", 0.5)
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


@pytest.mark.slow
def test_sigterm_stops_a_paused_builtin_server_and_its_waiting_clients_get_an_error(tiny_dir, tmp_path):
    port = launch.free_port()
    command = [sys.executable, str(ROOT / "scripts/serve.py"), "--model.name", str(tiny_dir)]
    command += ["--port", str(port), "--engine", "torch"]
    keyless = {k: v for k, v in os.environ.items() if k != "PLAINRL_API_KEY"}
    with open(tmp_path / "serve.log", "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=keyless)
    try:
        root = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while not endpoint.is_healthy(f"{root}/v1"):
            assert process.poll() is None and time.monotonic() < deadline, (
                tmp_path / "serve.log"
            ).read_text()
            time.sleep(0.2)
        assert httpx.post(f"{root}/pause?mode=keep").status_code == 200
        outcome, sent = {}, threading.Event()

        def ask():
            body = {"model": endpoint.served_model(f"{root}/v1"), "prompt": "abc", "max_tokens": 4}
            trace = {"trace": lambda name, info: name == "http11.send_request_body.complete" and sent.set()}
            try:
                with httpx.Client(timeout=60) as http:
                    outcome["status"] = http.post(
                        f"{root}/v1/completions", json=body, extensions=trace
                    ).status_code
            except httpx.HTTPError as error:
                outcome["error"] = type(error).__name__

        waiting = threading.Thread(target=ask)
        waiting.start()
        assert sent.wait(timeout=60)
        deadline = time.monotonic() + 60
        while unread_bytes(port):  # the request waits on the paused engine once the server has read it
            assert time.monotonic() < deadline, "the server did not read the request in 60 s"
            time.sleep(0.05)
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


def unread_bytes(port: int) -> int:
    """Bytes that clients sent to the local server on `port` and that it has not read yet (the rx_queue of its
    connections in /proc/net/tcp)."""
    unread = 0
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, queues = line.split()[1], line.split()[4]
            if int(local.rsplit(":", 1)[1], 16) == port:
                unread += int(queues.split(":")[1], 16)
    return unread


def test_an_evaluation_during_rl_against_a_paused_server_stops_with_one_sentence(
    builtin, tiny_dir, monkeypatch, tmp_path
):
    # Before, rl.py's evaluation watched /health only, which a paused server answers with 200: seen still
    # waiting after 100 s.
    import lib.orchestrator.evaluation
    from lib.orchestrator.mixture import load_mixture

    rl = load_script("rl")
    server, _ = builtin
    root = endpoint.root_url(server.url)
    monkeypatch.setattr(endpoint, "PAUSED_PATIENCE_S", 2.0)
    monkeypatch.setattr(lib.orchestrator.evaluation, "HEALTH_EVERY_S", 0.5)
    argv = ["@", str(ROOT / "configs/tiny/rl.toml"), "--model.name", str(tiny_dir), "--eval.every", "1"]
    argv += ["--eval.num-examples", "2", "--eval.rollouts-per-example", "1", "--sampling.max-tokens", "8"]
    argv += ["--env.num-examples", "8"]
    _, evaluate = load_mixture(
        parse(rl.Config, argv),
        url=server.url,
        model=endpoint.served_model(server.url),
        api_key=None,
        out=tmp_path,
        progress={},
    )
    assert httpx.post(f"{root}/pause?mode=keep", timeout=30).status_code == 200
    # Were the pause not seen, the evaluation would wait for ever: resumed after 30 s, it ends and the
    # test fails.
    resume_later = threading.Timer(30, lambda: httpx.post(f"{root}/resume", timeout=30))
    resume_later.start()
    try:
        began = time.monotonic()
        with pytest.raises(UserError, match=rf"{root} has been paused for \d+ s by another client"):
            evaluate(1)
        assert time.monotonic() - began < 30
    finally:
        resume_later.cancel()
        httpx.post(f"{root}/resume", timeout=30)


def test_brief_pauses_that_every_check_lands_in_do_not_add_up(monkeypatch):
    # Another run that reloads every step pauses the server briefly and often. At worst each check (every
    # HEALTH_EVERY_S) lands in a pause: before, the watch then saw nothing but pauses and stopped the client.
    from fastapi import FastAPI
    from oracle import serve

    pause_seconds, unpaused_seconds = 0.2, 0.3
    pause = {"began": None, "ended": -1e9}
    app = FastAPI()

    @app.get("/is_paused")
    def is_paused():
        now = time.monotonic()
        if pause["began"] is not None and now - pause["began"] >= pause_seconds:
            pause["began"], pause["ended"] = None, pause["began"] + pause_seconds
        if pause["began"] is None and now - pause["ended"] >= unpaused_seconds:
            pause["began"] = now  # the next pause begins just as a check asks
        return {"is_paused": pause["began"] is not None}

    async def rollouts():
        await asyncio.sleep(3.0)  # work that outlasts the patience below
        return "done"

    with serve(app) as url:
        watch = endpoint.PauseWatch([url], patience=1.5)
        assert asyncio.run(endpoint.unless_paused(rollouts(), watch, every=0.6)) == "done"


def test_a_client_stopped_while_a_server_stays_paused_stops_at_once():
    # The watch asks a paused server again and again in a thread; Ctrl-C (the waiting task cancelled) must
    # not wait for that thread until the patience runs out.
    from fastapi import FastAPI
    from oracle import serve

    asked = []
    app = FastAPI()

    @app.get("/is_paused")
    def is_paused():
        asked.append(time.monotonic())
        return {"is_paused": True}

    async def stopped_while_paused(url):
        watch = endpoint.PauseWatch([url], patience=60.0)
        waiting = asyncio.ensure_future(endpoint.unless_paused(asyncio.Event().wait(), watch, every=0.1))
        deadline = time.monotonic() + 30
        while len(asked) < 2:  # the watch is asking the paused server again
            assert time.monotonic() < deadline, "the watch never asked the server"
            await asyncio.sleep(0.02)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)

    with serve(app) as url:
        began = time.monotonic()
        asyncio.run(stopped_while_paused(url))  # returns once the executor's threads are done
        assert time.monotonic() - began < 15
