"""Nothing a local run starts listens beyond loopback: every TCP socket that rl.py (either engine, weights sent
in memory) or a data-parallel vLLM head listens on, in any of its processes, is bound to a loopback address.
Neither the servers' admin routes nor torch.distributed's stores and gloo's pairs check who connects. torch's
TCPStore listens on every interface unless handed a socket, gloo on the address the host name resolves to."""

import contextlib
import ipaddress
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from conftest import ROOT

from lib.endpoint import is_healthy
from lib.inference import launch

FIXTURES = ROOT / "tests" / "fixtures"


def listeners(root: psutil.Process) -> set[tuple[str, int, str]]:
    """(address, port, command line) of each TCP socket listening in `root` or any process under it."""
    found = set()
    for process in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.ZombieProcess):
            command = " ".join(process.cmdline()).strip()[:160]
            for connection in process.net_connections("tcp"):
                if connection.status == psutil.CONN_LISTEN:
                    found.add((connection.laddr.ip, connection.laddr.port, command))
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


def outside(seen: set[tuple[str, int, str]]) -> list[tuple[str, int, str]]:
    """The listeners in `seen` that take connections from beyond loopback."""
    return sorted(listener for listener in seen if not is_loopback(listener[0]))


def watch(process: subprocess.Popen, done, seconds: float, log) -> set[tuple[str, int, str]]:
    """Every listener seen in `process`'s tree, sampled until done() or the process ends (failing the test
    after `seconds`): stores that live only while engines start are seen too."""
    seen, root = set(), psutil.Process(process.pid)
    deadline = time.monotonic() + seconds
    while process.poll() is None and not done():
        with contextlib.suppress(psutil.NoSuchProcess):
            seen |= listeners(root)
        assert time.monotonic() < deadline, (
            f"not done after {seconds:.0f} s; end of its log:\n{log()[-3000:]}"
        )
        time.sleep(0.02)
    return seen


def run_and_watch(tiny_dir, tmp_path, *extra: str, seconds: float = 600.0) -> set[tuple[str, int, str]]:
    """A 2-step rl.py run on the tiny model that starts its own server and sends each step's weights in memory
    (a group whose store rank 0 hosts), its listeners sampled all along."""
    out = tmp_path / "run"
    command = [sys.executable, str(ROOT / "scripts/rl.py"), "@", str(ROOT / "configs/tiny/rl.toml")]
    command += ["--model.name", str(tiny_dir), "--output-dir", str(out), "--steps", "2"]
    command += ["--examples-per-step", "2", "--rollouts-per-example", "4", "--sampling.max-tokens", "16"]
    command += ["--env.id", "letter_taskset", "--max-async-level", "0", "--inference.weight-sync", "memory"]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(FIXTURES), os.environ.get("PYTHONPATH", "")]),
    }
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    log_path = tmp_path / "job.out"
    with open(log_path, "w") as log:
        job = subprocess.Popen(
            [*command, *extra], cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT, env=env
        )
    try:
        seen = watch(job, lambda: False, seconds, log_path.read_text)
        assert job.wait(timeout=60) == 0, log_path.read_text()[-3000:]
    finally:
        if job.poll() is None:
            job.kill()
    assert (out / "rollouts" / "step_2.jsonl").is_file()
    return seen


@pytest.mark.slow
def test_a_local_run_on_the_builtin_engine_listens_on_loopback_alone(tiny_dir, tmp_path):
    seen = run_and_watch(tiny_dir, tmp_path, "--inference.engine", "torch")
    assert any("serve.py" in command for _, _, command in seen), seen  # the server's routes were seen
    assert len({port for _, port, _ in seen}) >= 2, seen  # and the transfer group's store
    assert not outside(seen), outside(seen)


@pytest.mark.slow
@pytest.mark.vllm
def test_a_local_run_on_vllm_listens_on_loopback_alone(vllm_installed, tiny_dir, tmp_path):
    seen = run_and_watch(tiny_dir, tmp_path, "--inference.engine", "vllm")
    assert any("lib.inference.vllm" in command for _, _, command in seen), seen
    assert not outside(seen), outside(seen)


def serve_and_watch(command: list[str], env: dict, port: int, log_path: Path) -> set:
    """Starts a server, collects its process tree's listeners until it answers on `port`, and stops it."""
    url = f"http://127.0.0.1:{port}/v1"
    with open(log_path, "w") as log:
        server = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    started = []
    try:
        seen = watch(server, lambda: is_healthy(url), 600, log_path.read_text)
        assert server.poll() is None, log_path.read_text()[-3000:]
        seen |= listeners(psutil.Process(server.pid))
        started = psutil.Process(server.pid).children(recursive=True)
    finally:
        launch.Server(server, url, log_path).stop(timeout=60)
        for process in psutil.wait_procs(started, timeout=60)[1]:  # vLLM stops its engines on SIGTERM
            process.kill()
    return seen


@pytest.mark.slow
@pytest.mark.vllm
def test_a_data_parallel_vllm_head_listens_on_loopback_alone(vllm_installed, tiny_dir, tmp_path):
    """serve.py with two data-parallel engines on this machine. While they start, vLLM's head holds a torch
    TCPStore for their coordination (vllm/v1/engine/utils.py), which listened on every interface (`*:PORT`)
    until plainrl's registration handed it a socket bound to loopback."""
    port = launch.free_port()
    command = [sys.executable, str(ROOT / "scripts/serve.py"), "--model.name", str(tiny_dir)]
    command += ["--port", str(port), "--engine", "vllm", "--model.dtype", "float32", "--max-model-len", "256"]
    command += ["--vllm.cpu-kv-cache-gib", "1", "--vllm.data-parallel-size", "2"]
    command += ["--vllm.weight-transfer-backend", "plainrl_gloo"]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    seen = serve_and_watch(command, env, port, tmp_path / "serve.log")
    head = {p for _, p, command in seen if "lib.inference.vllm serve" in command}
    assert port in head and len(head) >= 2, sorted(seen)  # its routes and the engines' coordination store
    assert not outside(seen), outside(seen)


@pytest.mark.vllm
def test_vllms_stores_listen_on_their_loopback_host_alone(vllm_installed):
    """What the data-parallel head runs, in this process: vLLM's create_tcp_store as a master on 127.0.0.1,
    port 0 as vLLM asks (vllm/v1/engine/utils.py, vllm/distributed/parallel_state.py), once plainrl's
    vllm.general_plugins entry point has run."""
    import vllm.distributed.parallel_state as parallel_state
    import vllm.distributed.utils as distributed_utils

    from lib.inference.weights.vllm_transfer import register

    register()
    me = psutil.Process()
    for create in (distributed_utils.create_tcp_store, parallel_state.create_tcp_store):
        before = listeners(me)
        store = create("127.0.0.1", 0, is_master=True, world_size=-1, wait_for_workers=False)
        new = listeners(me) - before
        assert {port for _, port, _ in new} == {store.port}, new
        assert not outside(new), new
        client = create("127.0.0.1", store.port, is_master=False, wait_for_workers=False)
        client.set("key", "value")  # the store works as before
        assert store.get("key") == b"value"


def network_address() -> str | None:
    """One of this machine's IPv4 addresses beyond loopback, None if it has none."""
    for addresses in psutil.net_if_addrs().values():
        for address in addresses:
            if address.family == socket.AF_INET and not is_loopback(address.address):
                return address.address
    return None


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"), reason="names the host in a namespace")
def test_a_vllm_server_on_loopback_keeps_gloo_there_where_the_host_name_is_a_network_address(
    vllm_installed, tiny_dir, tmp_path
):
    """gloo's default listener binds the address this machine's name resolves to (torch 2.13), beyond
    loopback on many machines, and vLLM's CPU build joins every group of its engine over gloo. The server
    runs in a namespace whose host name is this machine's network address."""
    address = network_address()
    if address is None:
        pytest.skip("this machine has no network address beyond loopback")
    port = launch.free_port()
    command = ["unshare", "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', address, sys.executable]
    command += [str(ROOT / "scripts/serve.py"), "--model.name", str(tiny_dir), "--port", str(port)]
    command += ["--engine", "vllm", "--model.dtype", "float32", "--max-model-len", "256"]
    command += ["--vllm.cpu-kv-cache-gib", "1", "--vllm.weight-transfer-backend", "plainrl_gloo"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    seen = serve_and_watch(command, env, port, tmp_path / "serve.log")
    assert len({p for _, p, command in seen if "VLLM" in command}) >= 1, sorted(seen)  # the engine's gloo
    assert not outside(seen), outside(seen)
