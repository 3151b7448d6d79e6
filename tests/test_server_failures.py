"""rl.py when a server fails, on both engines alike: one that cannot see the run directory stops the run
before training; one that is killed, or frozen (SIGSTOP), mid-run or in an evaluation, ends it within
seconds with one sentence; `--resume` then continues from the last checkpoint.

The servers run in a mount namespace of their own in which the directory `hidden/` is an empty tmpfs,
as a server on another machine would see a run directory that is not on a shared file system.
"""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import ROOT, load_script

from lib import endpoint
from lib.config import parse
from lib.inference import launch

pytestmark = pytest.mark.slow
rl = load_script("rl")
FIXTURES = ROOT / "tests" / "fixtures"
# How long rl.py may take to notice a dead or frozen server: up to 5 s to the next health check, its 5 s
# timeout, the step the trainer is on and the shutdown; twice that on a loaded 2-core machine (one CI run
# took 20.3 s). A run that hangs never ends, so the bound still tells the two apart.
NOTICE_S = 40.0
ENGINES = ["torch", pytest.param("vllm", marks=pytest.mark.vllm)]


def start_hidden(engine: str, model, root, name: str) -> launch.Server:
    """A server whose mount namespace hides `root/hidden` behind an empty tmpfs (tests run as root)."""
    port = launch.free_port()
    hidden = root / "hidden"
    hidden.mkdir(exist_ok=True)
    serve = [sys.executable, str(ROOT / "scripts/serve.py"), "--model.name", str(model), "--port", str(port)]
    serve += ["--engine", engine, "--model.dtype", "float32", "--weights-root", str(root)]
    serve += ["--vllm.cpu-kv-cache-gib", "1", "--max-model-len", "1024"]
    shell = f"mount -t tmpfs none {hidden} && exec {' '.join(serve)}"
    log = root / f"{name}.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c", shell],
            stdout=out,
            stderr=subprocess.STDOUT,
            process_group=0,
            preexec_fn=launch.die_with_parent,
        )
    server = launch.Server(process, f"http://127.0.0.1:{port}/v1", log)
    deadline = time.monotonic() + 600
    while not endpoint.is_healthy(server.url):
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    return server


@pytest.fixture(scope="module", params=ENGINES)
def engine(request):
    if request.param == "vllm":
        request.getfixturevalue("vllm_installed")
    return request.param


@pytest.fixture(scope="module")
def hidden_server(engine, trained_tiny, tmp_path_factory):
    """The module's server and its root, as a function: a server a test killed is replaced on the next call
    (a vLLM start takes a minute, so the kill test kills this one rather than start its own)."""
    root = tmp_path_factory.mktemp(f"failures-{engine}")
    servers = []

    def live() -> tuple[launch.Server, object]:
        if not servers or servers[-1].process.poll() is not None:
            servers.append(start_hidden(engine, trained_tiny, root, f"hidden-server-{len(servers)}"))
        return servers[-1], root

    yield live
    for server in servers:
        if server.process.poll() is None:
            os.killpg(server.process.pid, signal.SIGCONT)
        server.stop()


def run_args(model, out, url, *extra) -> list[str]:
    args = ["@", str(ROOT / "configs/tiny/rl.toml"), "--model.name", str(model), "--output-dir", str(out)]
    args += ["--inference.urls", url, "--env.id", "letter_taskset", "--examples-per-step", "2"]
    args += ["--rollouts-per-example", "4", "--sampling.max-tokens", "24", "--max-async-level", "0"]
    return [*args, "--steps", "40", "--checkpoint-every", "2", *extra]


def run_until_failure(args, ready, act) -> tuple[str, float]:
    """Runs rl.py in this process; once the directory `ready` exists, calls `act()`. Returns the one
    sentence the run ended with and the seconds from `act()` to the end."""
    acted = {}

    def watch():
        while not ready.is_dir():
            time.sleep(0.05)
        act()
        acted["at"] = time.monotonic()

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    with pytest.raises(ValueError) as ended:
        rl.main(parse(rl.Config, args))
    return str(ended.value), time.monotonic() - acted["at"]


def last_checkpoint(out) -> int:
    return max(int(path.name.removeprefix("step_")) for path in (out / "checkpoints").glob("step_*"))


def resume(model, out, url, steps: int) -> dict:
    args = run_args(model, out, url, "--resume")
    args[args.index("--steps") + 1] = str(steps)
    return rl.main(parse(rl.Config, args))


def test_a_frozen_server_ends_the_run_in_seconds_and_resume_continues(hidden_server, trained_tiny, capsys):
    server, root = hidden_server()
    out = root / "frozen"
    freeze = lambda: os.killpg(server.process.pid, signal.SIGSTOP)  # noqa: E731 (engine processes too)
    sentence, seconds = run_until_failure(
        run_args(trained_tiny, out, server.url), out / "checkpoints" / "step_2", freeze
    )
    os.killpg(server.process.pid, signal.SIGCONT)
    assert "did not answer" in sentence and "frozen" in sentence, sentence
    assert seconds < NOTICE_S, seconds
    with capsys.disabled():  # the figure, in the test log (capsys holds the rest for the resume check)
        print(f"\nfrozen server: the run ended {seconds:.1f} s after SIGSTOP: {sentence}")
    checkpoint = last_checkpoint(out)
    result = resume(trained_tiny, out, server.url, checkpoint + 2)
    assert len(result["history"]) == 2 and (out / "checkpoints" / f"step_{checkpoint + 2}").is_dir()
    assert f"resumed from {out / 'checkpoints' / f'step_{checkpoint}'}" in capsys.readouterr().out


def test_a_server_frozen_during_an_evaluation_ends_the_run_in_seconds(hidden_server, trained_tiny):
    """The verifiers client has no read timeout: only the evaluation's own health checks end it."""
    server, root = hidden_server()
    out = root / "frozen-eval"
    evaluation = ["--eval.every", "3", "--eval.num-examples", "4", "--eval.rollouts-per-example", "4"]
    freeze = lambda: os.killpg(server.process.pid, signal.SIGSTOP)  # noqa: E731
    try:
        sentence, seconds = run_until_failure(
            run_args(trained_tiny, out, server.url, *evaluation), out / "eval" / "step_3", freeze
        )
    finally:
        os.killpg(server.process.pid, signal.SIGCONT)
    assert "did not answer" in sentence and "frozen" in sentence, sentence
    assert seconds < NOTICE_S, seconds
    # It ended inside step 3's evaluation: 16 sampled and 4 greedy records make a finished one.
    records = sum(len(path.read_text().splitlines()) for path in (out / "eval" / "step_3").glob("*.jsonl"))
    assert records < 16 + 4 and last_checkpoint(out) == 2, records
    print(f"\nserver frozen in an evaluation: the run ended {seconds:.1f} s after SIGSTOP: {sentence}")


def test_a_server_that_cannot_see_the_run_directory_stops_it_before_training(hidden_server, trained_tiny):
    server, root = hidden_server()
    out = root / "hidden" / "run"  # written here, invisible to the server
    began = time.monotonic()
    with pytest.raises(ValueError) as stopped:
        rl.main(parse(rl.Config, run_args(trained_tiny, out, server.url)))
    seconds = time.monotonic() - began
    sentence = str(stopped.value)
    assert "could not load" in sentence and "visible on that server's machine" in sentence, sentence
    assert str(out / "weights" / "step_0") in sentence and server.url.removesuffix("/v1") in sentence
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())  # no training
    print(f"\nunseen run directory: stopped {seconds:.1f} s after the run began: {sentence}")


def test_a_killed_server_ends_the_run_in_seconds_and_resume_continues(
    engine, hidden_server, trained_tiny, request, capfd, caplog
):
    server, root = hidden_server()
    out = root / "killed"
    kill = lambda: os.killpg(server.process.pid, signal.SIGKILL)  # noqa: E731
    sentence, seconds = run_until_failure(
        run_args(trained_tiny, out, server.url), out / "checkpoints" / "step_2", kill
    )
    assert "not reachable" in sentence or "did not answer" in sentence, sentence
    # The sentence alone says why: no traceback above it, printed or logged (cancelled episodes, asyncio).
    printed = "".join(capfd.readouterr())
    assert "Traceback" not in printed, printed[-3000:]
    assert not [record for record in caplog.records if record.exc_info], caplog.text[-3000:]
    assert seconds < NOTICE_S, seconds
    print(f"\nkilled server: the run ended {seconds:.1f} s after kill -9: {sentence}")
    checkpoint = last_checkpoint(out)
    if (
        engine == "vllm"
    ):  # the session's vLLM server takes over (rl.py loads the checkpoint's weights into it)
        replacement = request.getfixturevalue("vllm_server")
        result = resume(trained_tiny, out, replacement.url, checkpoint + 2)
    else:
        with launch.running_server(str(trained_tiny), engine="torch", weights_root=root) as replacement:
            result = resume(trained_tiny, out, replacement.url, checkpoint + 2)
    assert len(result["history"]) == 2 and (out / "checkpoints" / f"step_{checkpoint + 2}").is_dir()
