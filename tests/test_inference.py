"""lib/inference/launch.py and serve.py's start: engine choice, the default binding, a server that fails to start."""

import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
from conftest import ROOT, load_script, until_decoding

from lib import endpoint
from lib.config import parse
from lib.inference import launch


def test_auto_engine_picks_vllm_only_with_vllm_and_cuda(monkeypatch):
    import importlib.util

    serve = load_script("serve")
    assert serve.choose_engine("torch") == ("torch", "--engine torch")
    for has_vllm, has_cuda, expected in [
        (False, True, "torch"),
        (True, False, "torch"),
        (True, True, "vllm"),
    ]:
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, v=has_vllm: object() if v else None)
        monkeypatch.setattr(torch.cuda, "is_available", lambda c=has_cuda: c)
        assert serve.choose_engine("auto")[0] == expected


def test_vllm_only_flags_on_the_builtin_engine_are_refused_by_name_before_any_model_loads(tiny_dir, tmp_path):
    # `make serve ENGINE=torch DP=2 DP_LOCAL=1` served one builtin engine and said nothing of the flags it dropped.
    parallel = ["--vllm.data-parallel-size", "2", "--vllm.data-parallel-size-local", "1", "--vllm.headless"]
    parallel += ["--vllm.data-parallel-address", "10.0.0.1", "--vllm.data-parallel-start-rank", "1"]
    serve = [sys.executable, str(ROOT / "scripts/serve.py"), "--model.name", str(tiny_dir), "--port", "8999"]
    # auto on a machine without CUDA (this one: the builtin engine) is refused alike, saying why it chose it
    for engine, why in [("torch", "--engine torch"), ("auto", "auto: ")]:
        result = subprocess.run(
            [*serve, "--engine", engine, *parallel], capture_output=True, text=True, cwd=tmp_path, timeout=60
        )
        lines = result.stderr.splitlines()
        assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.stderr
        for flag in ["data-parallel-size", "data-parallel-size-local", "headless", "data-parallel-address"]:
            assert f"--vllm.{flag} " in lines[0] or f"--vllm.{flag}," in lines[0], (flag, lines[0])
        assert why in lines[0] and "--engine vllm" in lines[0], lines[0]
    # What rl.py passes every server it starts, whatever the engine, still serves.
    shared = ["--vllm.gpu-memory-utilization", "0.5", "--vllm.weight-transfer-backend", "plainrl_gloo"]
    serve_script = load_script("serve")
    config = parse(serve_script.Config, ["--model.name", "m", *shared, "--vllm.cpu-kv-cache-gib", "1"])
    assert serve_script.vllm_only_flags(config.vllm) == []


def test_sigterm_while_a_request_decodes_ends_the_server_promptly_without_a_traceback(tiny_dir, tmp_path):
    # A kept server stopped while a finished run's last generate request still ran printed a 40-line
    # CancelledError traceback (uvicorn cancels what is left after timeout_graceful_shutdown).
    log = tmp_path / "serve.log"
    server = launch.start_server(str(tiny_dir), engine="torch", log_path=log, threads=1)
    body = {"token_ids": [5, 6], "sampling_params": {"max_tokens": 1900, "ignore_eos": True}}
    answers = []

    def long_request():
        try:
            url = endpoint.root_url(server.url) + "/inference/v1/generate"
            answers.append(httpx.post(url, json=body, timeout=120).status_code)
        except httpx.HTTPError as error:  # the connection closed: an answer as well
            answers.append(type(error).__name__)

    client = threading.Thread(target=long_request)
    client.start()
    try:
        until_decoding(server.url)
        # Held where it is (a pause that keeps it), it cannot finish within the shutdown's grace on a fast machine.
        assert httpx.post(endpoint.root_url(server.url) + "/pause?mode=keep", timeout=60).status_code == 200
        stopped = time.monotonic()
        server.process.terminate()
        server.process.wait(timeout=60)
        stop_seconds = time.monotonic() - stopped
    finally:
        server.stop()
        client.join(timeout=60)
    text = log.read_text()
    assert "Traceback" not in text and "CancelledError" not in text, text[-3000:]
    assert stop_seconds < 30, stop_seconds  # its 3 s of grace, and the rest
    assert answers and answers[0] != 200, answers  # the client sees an error, not silence or a success
    after_serving = text.split("serving ", 1)[1].splitlines()[1:]
    assert len(after_serving) <= 1, after_serving  # one line at most says what happened


def listening_addresses(port: int) -> list[str]:
    """The local addresses of every TCP socket listening on `port` (/proc/net/tcp and tcp6, state 0A)."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            address, hex_port = local.rsplit(":", 1)
            if state == "0A" and int(hex_port, 16) == port:
                found.append(address)
    return found


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the listening sockets from /proc")
def test_serve_binds_loopback_and_reloads_only_under_outputs_by_default(tiny_dir, tmp_path, monkeypatch):
    """serve.py with neither --host nor --weights-root, started in a directory of its own: it listens on
    127.0.0.1 alone, and reloads a directory under ./outputs but refuses one anywhere else (403)."""
    import shutil
    import socket

    import httpx

    shutil.copytree(tiny_dir, tmp_path / "outputs" / "run" / "weights" / "step_1")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "outputs" / "link").symlink_to(tmp_path / "elsewhere")  # a way out of outputs/
    monkeypatch.chdir(tmp_path)  # outputs/ is the server's working directory's
    monkeypatch.delenv("PLAINRL_API_KEY", raising=False)
    port = launch.free_port()
    with launch.running_server(str(tiny_dir), port=port, engine="torch", log_path=tmp_path / "serve.log"):
        assert listening_addresses(port) == ["0100007F"]  # 127.0.0.1, no IPv6, no 0.0.0.0
        with socket.socket() as other, pytest.raises(ConnectionRefusedError):
            other.connect(("127.0.0.2", port))  # another local address: reached on 0.0.0.0, refused here

        def reload(path) -> httpx.Response:
            body = {"method": "reload_weights", "kwargs": {"weights_path": str(path)}}
            return httpx.post(f"http://127.0.0.1:{port}/collective_rpc", json=body, timeout=120)

        for outside in (tiny_dir, "outputs/../elsewhere", tmp_path / "elsewhere", "outputs/link"):
            refused = reload(outside)
            assert refused.status_code == 403 and "must be under" in refused.text, (outside, refused.text)
        assert reload("outputs/run/weights/step_1").status_code == 200
        assert reload(tmp_path / "outputs" / "run" / "weights" / "step_1").status_code == 200


def test_start_server_raises_the_end_of_the_log_when_the_server_exits(tmp_path):
    log = tmp_path / "serve.log"
    with pytest.raises(RuntimeError, match=r"(?s)exited with code 2.*no/such/model") as failed:
        launch.start_server(str(tmp_path / "no/such/model"), engine="torch", log_path=log, timeout=120)
    assert str(log) in str(failed.value)


def test_health_checks_build_one_certificate_context(monkeypatch):
    """httpx builds a certificate context per client or httpx.get unless given one (0.02-0.13 s of CPU each
    on 2 cores); the loop's calls to its servers reuse lib.endpoint.ssl_context()."""
    import ssl

    built = []
    create = ssl.create_default_context
    monkeypatch.setattr(ssl, "create_default_context", lambda *a, **k: built.append(1) or create(*a, **k))
    endpoint.ssl_context.cache_clear()
    port = launch.free_port()  # nothing listens there
    for _ in range(3):
        assert not endpoint.is_healthy(f"http://127.0.0.1:{port}/v1", timeout=0.5)
    assert len(built) == 1
    endpoint.ssl_context.cache_clear()


def test_free_ports_are_distinct():
    # Ports taken one at a time repeat often (here 28 of 200 draws of 64 held a repeat; a SLURM cluster's
    # four once shared one, and its controller could not bind).
    for _ in range(20):
        ports = launch.free_ports(64)
        assert len(set(ports)) == 64


@pytest.mark.parametrize("on_policy, trainer, server", [(False, 1, 1), (True, 2, 2)])
def test_rl_splits_two_cores_between_trainer_and_server_only_when_they_work_at_once(
    on_policy, trainer, server, tmp_path, monkeypatch
):
    """Asynchronous, the trainer and the server it starts compute at once: a core each. On-policy they take
    turns, so each takes both cores in its turn (a server held to one thread left a core idle while it
    generated)."""
    import contextlib
    import os

    from lib.inference.launch import InferenceConfig
    from lib.models.load import ModelConfig

    started, set_threads = {}, []

    class Started(Exception):
        pass

    def start_server(*args, threads=None, **kwargs):
        started["threads"] = threads
        raise Started

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(launch, "start_server", start_server)
    monkeypatch.setattr(torch, "set_num_threads", set_threads.append)
    with pytest.raises(Started), contextlib.ExitStack() as cleanup:
        launch.start_or_attach(
            InferenceConfig(),
            model=ModelConfig(name="unused"),
            trainer_dtype="float32",
            model_limit=2048,
            seq_len=512,
            device="cpu",
            on_policy=on_policy,
            run_dir=tmp_path,
            api_key=None,
            cleanup=cleanup,
        )
    assert (set_threads, started["threads"]) == ([trainer], server)
