"""The README's multi-node recipe run for real: two `make` launches on 127.0.0.1 as node 0 and node 1.

Each launch is `make sft|rl NNODES=2 NODE_RANK=0|1 NPROC=1 RDZV_ENDPOINT=127.0.0.1:PORT`, one trainer
process per "node", gloo over loopback. tests/fixtures/hooks (on PYTHONPATH) counts the directories
each rank writes and, for rl.py, replays fixed batches so a one-process run can be compared (one rl.py
test keeps the live producer, to follow its task counter across a resume).
"""

import contextlib
import json
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, load_script
from safetensors.torch import load_file

from lib import endpoint
from lib.config import parse
from lib.inference import launch
from lib.inference.launch import free_port, free_ports

FIXTURES = ROOT / "tests" / "fixtures"
HOOKS = FIXTURES / "hooks"
rl = load_script("rl")
sft = load_script("sft")


def node_env(tmp_path: Path, **extra) -> dict:
    # Under `make test` the outer make's variables would leak into the inner one.
    env = {
        k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")
    }
    return {
        **env,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": f"{ROOT}:{FIXTURES}:{HOOKS}",
        "PLAINRL_TEST_WRITES": str(tmp_path / "writes.txt"),
        **extra,
    }


def start_node(target: str, node_rank: int, port: int, out: Path, args: list[str], env: dict, **variables):
    """`make TARGET ... NNODES=2 NODE_RANK=node_rank NPROC=1 RDZV_ENDPOINT=127.0.0.1:port` in a
    process group of its own, output to out/../node{node_rank}.{out,err}."""
    command = ["make", "--no-print-directory", "-o", ".venv/.installed", target, "ENV=tiny"]
    command += ["NNODES=2", f"NODE_RANK={node_rank}", "NPROC=1", f"RDZV_ENDPOINT=127.0.0.1:{port}"]
    command += [f"{k}={v}" for k, v in variables.items()]
    command += [f"OUTPUT_DIR={out}", f"ARGS={shlex.join(args)}"]
    logs = out.parent / f"node{node_rank}"
    with open(f"{logs}.out", "a") as stdout, open(f"{logs}.err", "a") as stderr:
        return subprocess.Popen(
            command, cwd=ROOT, env=env, start_new_session=True, stdout=stdout, stderr=stderr
        )


def descendants(pid: int) -> list[int]:
    """pid's children, grandchildren, ... (torchrun starts its workers in sessions of their own)."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        children = parents.get(todo.pop(), [])
        found += children
        todo += children
    return found


def worker(node: subprocess.Popen) -> int:
    """The trainer process (scripts/*.py under torchrun) of a node."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for pid in descendants(node.pid):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if any(arg.startswith(b"scripts/") for arg in cmdline) and not any(
                b"torchrun" in a for a in cmdline
            ):
                return pid
        time.sleep(0.1)
    raise AssertionError("no trainer process appeared")


def kill_all(nodes: list[subprocess.Popen]) -> None:
    """Every process the launches started, stopped or not, killed (a failed test leaves nothing)."""
    for node in nodes:
        for pid in [*descendants(node.pid), node.pid]:
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
        node.wait(timeout=30)


def run_nodes(target, out, args, env, timeout=300, **variables) -> list[str]:
    """Both nodes to the end; returns node 0's stdout."""
    port = free_port()
    nodes = [start_node(target, rank, port, out, args, env, **variables) for rank in (0, 1)]
    try:
        for node in nodes:
            node.wait(timeout=timeout)
        errors = [(out.parent / f"node{rank}.err").read_text()[-3000:] for rank in (0, 1)]
        assert [node.returncode for node in nodes] == [0, 0], errors
    finally:
        kill_all(nodes)
    return (out.parent / "node0.out").read_text()


def writes(tmp_path: Path) -> list[tuple[str, str]]:
    lines = (tmp_path / "writes.txt").read_text().splitlines()
    return [tuple(line.split(" ", 1)) for line in lines]


def assert_written_once_by_rank_0(tmp_path: Path, out: Path, expected: set[str]) -> None:
    records = writes(tmp_path)
    assert {rank for rank, _ in records} == {"0"}, records
    paths = [str(Path(path).relative_to(out)) for _, path in records]
    assert sorted(paths) == sorted(set(paths)) and set(paths) == expected, paths


# ---------------------------------------------------------------- sft


def sft_args(tiny_dir, *extra) -> list[str]:
    return [
        "--model.name", str(tiny_dir), "--steps", "2", "--batch-size", "8", "--micro-batch-size", "2",
        "--seq-len", "256", "--data.num-examples", "16", "--checkpoint-every", "1", "--keep-checkpoints", "5",
        "--optim.lr", "1e-3", *extra,
    ]  # fmt: skip


def test_sft_refuses_a_batch_that_does_not_split_over_the_ranks(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it: the default tiny preset, two nodes
    preset = ["@", str(ROOT / "configs/tiny/sft.toml"), "--model.name", str(tiny_dir)]
    cfg = parse(sft.Config, [*preset, "--output-dir", str(tmp_path)])
    with pytest.raises(ValueError, match="batch_size 32 is not divisible by micro_batch_size 32 x 2 ranks"):
        sft.main(cfg)


@pytest.mark.slow
def test_two_node_make_sft_matches_one_process_and_rank_0_writes(tiny_dir, tmp_path):
    out = tmp_path / "two"
    stdout = run_nodes("sft", out, sft_args(tiny_dir), node_env(tmp_path))
    assert "2 x cpu" in stdout
    preset = ["@", str(ROOT / "configs/tiny/sft.toml")]  # what `make sft ENV=tiny` passes first
    one = sft.main(parse(sft.Config, [*preset, *sft_args(tiny_dir), "--output-dir", str(tmp_path / "one")]))
    expected = {f"{kind}/step_{n}" for kind in ("weights", "checkpoints") for n in (1, 2)}
    assert_written_once_by_rank_0(tmp_path, out, expected)
    a = load_file(one["weights"] / "model.safetensors")
    b = load_file(out / "weights" / "step_2" / "model.safetensors")
    start = load_file(tiny_dir / "model.safetensors")
    assert any(not torch.equal(a[k], start[k]) for k in a)  # the steps did move the weights
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-5)


# ---------------------------------------------------------------- rl


@pytest.fixture(scope="module")
def servers(tiny_dir, tmp_path_factory):
    """Two independent builtin-engine servers of the tiny model."""
    root = tmp_path_factory.getbasetemp()
    with (
        launch.running_server(str(tiny_dir), engine="torch", weights_root=root, log_path=root / "a.log") as a,
        launch.running_server(str(tiny_dir), engine="torch", weights_root=root, log_path=root / "b.log") as b,
    ):
        yield a, b


PRESET_RL = ["@", str(ROOT / "configs/tiny/rl.toml")]  # what `make rl ENV=tiny` passes first


def rl_args(tiny_dir, *extra) -> list[str]:
    """A short tiny-model run on fixed replayed batches (the env only feeds the unused prompts)."""
    return [
        "--model.name", str(tiny_dir), "--steps", "2", "--env.id", "letter_taskset", "--examples-per-step", "4",
        "--rollouts-per-example", "4", "--sampling.max-tokens", "40", "--micro-batch-size", "1",
        "--seq-len", "64", "--max-async-level", "0", "--checkpoint-every", "1", "--keep-checkpoints", "5",
        "--keep-weights", "5", *extra,
    ]  # fmt: skip


@pytest.mark.slow
def test_two_node_make_rl_matches_one_process_and_rank_0_writes(tiny_dir, servers, tmp_path, monkeypatch):
    from replay_rl import ReplayProducer

    import lib.orchestrator.producer

    url = servers[0].url
    out = tmp_path / "two"
    # Rank 0 takes 8 s over step 1's batch, longer than the 4 s peer timeout: a busy rank 0 is not a lost one.
    env = node_env(tmp_path, PLAINRL_TEST_REPLAY="1", PLAINRL_TEST_TAKE_DELAY="8")
    stdout = run_nodes("rl", out, rl_args(tiny_dir, "--peer-timeout", "4"), env, INFERENCE_URL=url)
    assert "run dir" in stdout
    expected = {f"{kind}/step_{n}" for kind in ("weights", "checkpoints") for n in (1, 2)} | {
        "weights/step_0"
    }
    assert_written_once_by_rank_0(tmp_path, out, expected)
    monkeypatch.setattr(lib.orchestrator.producer, "Producer", ReplayProducer)
    one = rl.main(
        parse(
            rl.Config,
            [*PRESET_RL, *rl_args(tiny_dir), "--output-dir", str(tmp_path / "one"), "--inference.urls", url],
        )
    )
    a = load_file(one["weights"] / "model.safetensors")
    b = load_file(out / "weights" / "step_2" / "model.safetensors")
    start = load_file(tiny_dir / "model.safetensors")
    assert any(not torch.equal(a[k], start[k]) for k in a)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-5)


@pytest.mark.slow
def test_two_node_rl_with_live_rollouts_resumes_the_task_counter(tiny_dir, servers, tmp_path):
    """The real producer on rank 0 (the replay one always draws task 0): a resume on both nodes goes on
    with the tasks after those the checkpoint counted as started, not from the first task again."""
    out = tmp_path / "run"
    env = node_env(tmp_path)
    args = rl_args(tiny_dir, "--seq-len", "256")
    url = servers[0].url
    run_nodes("rl", out, args, env, INFERENCE_URL=url)
    index = json.loads((out / "checkpoints" / "step_2" / "progress.json").read_text())["task_index"]
    assert index >= 8, index  # 2 steps of 4 tasks were started, and maybe the next step's
    started = [
        json.loads(line)["task_id"] for n in (1, 2) for line in open(out / "rollouts" / f"step_{n}.jsonl")
    ]
    assert set(started) <= {f"letter-{i}" for i in range(index)}, started
    run_nodes("rl", out, [*args, "--steps", "3", "--resume"], env, INFERENCE_URL=url)
    assert "(step 2)" in (tmp_path / "node0.out").read_text()
    resumed = [json.loads(line)["task_id"] for line in open(out / "rollouts" / "step_3.jsonl")]
    # letter_taskset has 16 tasks; with max_async_level 0 step 3 draws the 4 after the counter.
    assert resumed and set(resumed) <= {f"letter-{i % 16}" for i in range(index, index + 4)}, (index, resumed)


@pytest.mark.slow
def test_rl_spreads_rollouts_over_two_servers_and_reloads_both(tiny_dir, servers, tmp_path, monkeypatch):
    import httpx
    from transformers import AutoModelForCausalLM

    from lib.orchestrator.producer import Producer

    used = []
    group = Producer._group

    async def counted_group(self, source, task, context):
        used.append(self.contexts.index(context))
        return await group(self, source, task, context)

    monkeypatch.setattr(Producer, "_group", counted_group)
    urls = [server.url for server in servers]
    flags = [*PRESET_RL, *rl_args(tiny_dir), "--output-dir", str(tmp_path / "run"), "--inference.urls", *urls]
    result = rl.main(parse(rl.Config, flags))
    assert used.count(0) >= 4 and used.count(1) >= 4, used  # 8 groups over 2 steps, round robin
    prompt = list(range(5, 15))
    model = AutoModelForCausalLM.from_pretrained(result["weights"]).eval()
    for url in urls:  # each server answers with weights/step_2: its logprobs are a forward pass of them
        body = {"model": str(tiny_dir), "prompt": prompt, "max_tokens": 6, "temperature": 1.0, "logprobs": 0,
                "seed": 1, "return_token_ids": True}  # fmt: skip
        choice = httpx.post(f"{url}/completions", json=body, timeout=60).json()["choices"][0]
        ids = torch.tensor([prompt + choice["token_ids"]])
        with torch.no_grad():
            logp = model(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
        served = torch.tensor(choice["logprobs"]["token_logprobs"])
        torch.testing.assert_close(served, logp[len(prompt) - 1 :], rtol=0, atol=1e-4)


# ---------------------------------------------------------------- vLLM data parallel over two "nodes"


def start_serve(name: str, out: Path, **variables) -> subprocess.Popen:
    """`make serve ENGINE=vllm ...` in a process group of its own, output to out/name.log."""
    env = {
        k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS", "MAKEOVERRIDES")
    }
    env |= {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    command = ["make", "--no-print-directory", "-o", ".venv/.installed", "serve", "ENGINE=vllm"]
    command += [f"{k}={v}" for k, v in variables.items()]
    with open(out / f"{name}.log", "a") as log:
        return subprocess.Popen(
            command, cwd=ROOT, env=env, start_new_session=True, stdout=log, stderr=subprocess.STDOUT
        )


def stop_serve(nodes: list[subprocess.Popen]) -> None:
    """SIGTERM to each launch's process group (vLLM stops its engines), SIGKILL to what is left after 30 s."""
    for node in nodes:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(node.pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    for node in nodes:
        with contextlib.suppress(ProcessLookupError):
            while time.monotonic() < deadline:
                os.killpg(node.pid, 0)
                time.sleep(0.2)
            os.killpg(node.pid, signal.SIGKILL)
        node.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_head_and_headless_node_both_serve_every_reload(vllm_installed, tiny_dir, tmp_path):
    """The README's vLLM data-parallel recipe on one machine (vLLM's CPU build): `make serve DP=2 DP_LOCAL=1
    DP_ADDRESS=127.0.0.1 DP_RPC_PORT=P` is the head (API server, engine 0), the same with `DP_START_RANK=1
    HEADLESS=1` a second node (engine 1 only, which connects to tcp://127.0.0.1:P). rl.py attached to the
    head runs 3 steps. vLLM sends /pause, reload_weights, the weight label, /reset_prefix_cache and /resume to
    every engine, and runs a request with `X-data-parallel-rank: N` on engine N: both must answer with the
    trainer's last weights. Then a second run sends its weights in memory (both launches have plainrl's gloo
    weight-transfer engine): the group is rank 0 and the two engines (world size 3 from /get_world_size, the
    headless engine's rank from its data parallel index), and both engines answer with that run's weights."""
    import httpx
    from transformers import AutoModelForCausalLM

    port, rpc_port = free_ports(2)
    args = ["--model.dtype", "float32", "--max-model-len", "256", "--vllm.cpu-kv-cache-gib", "1"]
    args += ["--vllm.weight-transfer-backend", "plainrl_gloo"]
    dp = {"MODEL": tiny_dir, "PORT": port, "DP": 2, "DP_LOCAL": 1, "DP_ADDRESS": "127.0.0.1"}
    dp |= {"DP_RPC_PORT": rpc_port, "ARGS": shlex.join(args)}
    nodes = [
        start_serve("head", tmp_path, **dp),
        start_serve("node1", tmp_path, **dp, DP_START_RANK=1, HEADLESS=1),
    ]
    url = f"http://127.0.0.1:{port}/v1"
    prompt = list(range(5, 15))

    def logs() -> str:
        return "\n".join(
            f"{name}: ...{(tmp_path / f'{name}.log').read_text()[-2000:]}" for name in ("head", "node1")
        )

    def generate(rank: int) -> httpx.Response:
        """8 tokens sampled by engine `rank` (vLLM reads the header on every generate route)."""
        params = {"max_tokens": 8, "temperature": 1.0, "logprobs": 0, "seed": 1, "ignore_eos": True}
        body = {"model": endpoint.served_model(url), "token_ids": prompt, "sampling_params": params}
        generate_url = f"{endpoint.root_url(url)}/inference/v1/generate"
        return httpx.post(generate_url, json=body, headers={"X-data-parallel-rank": str(rank)}, timeout=60)

    try:
        deadline = time.monotonic() + 600  # the head answers once both engines are up: 2-4 minutes on 2 cores
        while not endpoint.is_healthy(url):
            assert all(node.poll() is None for node in nodes), logs()
            assert time.monotonic() < deadline, logs()
            time.sleep(1)
        start = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()

        def both_engines_serve(result: dict, label: str) -> None:
            trained = AutoModelForCausalLM.from_pretrained(result["weights"], dtype=torch.float32).eval()
            for rank in (0, 1):
                choice = generate(rank).json()["choices"][0]
                assert choice["weight_versions"][-1]["version"] == label, (rank, choice["weight_versions"])
                ids = torch.tensor([prompt + choice["token_ids"]])
                served = torch.tensor([entry["logprob"] for entry in choice["logprobs"]["content"]])
                for weights, name in ((trained, "trained"), (start, "start")):
                    with torch.no_grad():
                        logp = weights(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
                    difference = (served - logp[len(prompt) - 1 :]).abs().max().item()
                    print(f"{label}, engine {rank}: max |logprob difference| {difference:.2g} from {name}")
                    assert (difference < 1e-4) == (name == "trained"), (rank, name, difference)

        flags = [*PRESET_RL, *rl_args(tiny_dir, "--steps", "3"), "--inference.urls", url]
        result = rl.main(parse(rl.Config, [*flags, "--output-dir", str(tmp_path / "run")]))
        assert len(result["history"]) == 3
        both_engines_serve(result, "step_3")

        memory = ["--inference.weight-sync", "memory", "--inference.vllm-transfer-backend", "plainrl_gloo"]
        flags = [
            *PRESET_RL,
            *rl_args(tiny_dir, "--seed", "1", "--checkpoint-every", "2"),
            "--inference.urls",
            url,
            *memory,
        ]
        result = rl.main(parse(rl.Config, [*flags, "--output-dir", str(tmp_path / "memory")]))
        assert len(result["history"]) == 2
        assert not (tmp_path / "memory/weights/step_1").exists()  # sent in memory, not written
        both_engines_serve(result, "step_2")
        outside = generate(2)  # the header is read, not ignored
        assert outside.status_code == 400 and "out of range [0, 2)" in outside.text, outside.text
    finally:
        stop_serve(nodes)
    # vllm/entrypoints/cli/serve.py run_headless logs it: engine 1 ran in the second launch, at the head's port.
    line = f"in headless mode, with head node address tcp://127.0.0.1:{rpc_port}"
    assert line in (tmp_path / "node1.log").read_text()


# ---------------------------------------------------------------- node failure


def checkpoints(out: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in (out / "checkpoints").glob("step_*"))


@pytest.mark.slow
@pytest.mark.parametrize("lost,failure", [(1, "kill -9"), (1, "SIGSTOP"), (0, "kill -9")])
def test_a_lost_node_ends_the_other_then_resume_on_both_continues(tiny_dir, servers, tmp_path, lost, failure):
    """Node 0 runs the controller and hosts torchrun's store, so losing it is not losing node 1: both end
    the surviving node in seconds with one line, and `--resume` on both continues."""
    out = tmp_path / "run"
    env = node_env(tmp_path, PLAINRL_TEST_REPLAY="1")
    args = rl_args(tiny_dir, "--steps", "200", "--checkpoint-every", "2", "--keep-checkpoints", "2")
    url = servers[0].url
    port = free_port()
    nodes = [
        start_node("rl", rank, port, out, [*args, "--peer-timeout", "5"], env, INFERENCE_URL=url)
        for rank in (0, 1)
    ]
    survivor = 1 - lost
    try:
        deadline = time.monotonic() + 240
        while len(checkpoints(out)) < 1:
            assert nodes[0].poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.05)
        trainer = worker(nodes[lost])
        began = time.monotonic()
        if failure == "kill -9":
            os.kill(trainer, signal.SIGKILL)
        else:  # the whole node freezes: its torchrun and its trainer
            for pid in [*descendants(nodes[lost].pid), nodes[lost].pid]:
                os.kill(pid, signal.SIGSTOP)
        nodes[survivor].wait(timeout=60)
        took = time.monotonic() - began
    finally:
        kill_all(nodes)
    survivor_err = (tmp_path / f"node{survivor}.err").read_text()
    assert nodes[survivor].returncode != 0, survivor_err[-3000:]
    assert took < 30, took  # peer timeout 5 s, then torchrun's own shutdown
    if failure == "SIGSTOP":  # nothing closes: the heartbeat tells
        assert f"error: rank {lost} sent no heartbeat" in survivor_err, survivor_err[-3000:]
    else:  # the broken connection tells first, unless the heartbeat does
        lines = (f"error: rank {survivor} lost a peer", f"error: rank {lost} sent no heartbeat")
        assert any(line in survivor_err for line in lines), survivor_err[-3000:]
    print(f"node {survivor} ended {took:.1f} s after {failure} of node {lost}")
    last = checkpoints(out)[-1]
    assert last < 200
    (tmp_path / "node0.out").write_text("")
    run_nodes("rl", out, [*args, "--steps", str(last + 2), "--resume"], env, INFERENCE_URL=url)
    assert f"(step {last})" in (tmp_path / "node0.out").read_text()
    assert checkpoints(out)[-1] == last + 2
    assert [p.name for p in out.rglob(".tmp-*")] == []


def test_a_collective_broken_by_a_dead_peer_is_one_line_and_other_errors_stay(monkeypatch):
    from lib.dist import peer_lost

    broken = RuntimeError("[pair.cc:537] Read error [127.0.0.1]:39564: Connection reset by peer. GLHF!")
    assert peer_lost(broken) is None  # one process: no peer to lose
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    line = peer_lost(broken)
    assert line.startswith("error: rank 0 lost a peer in a collective") and "--resume" in line
    assert peer_lost(RuntimeError("CUDA out of memory")) is None  # a bug or OOM keeps its traceback
