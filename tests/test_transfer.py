"""In-memory weight sync (lib/inference/weights/transfer.py): rl.py broadcasts each step's weights into the servers' memory over a
group (the builtin engine, vLLM's CPU build with plainrl's gloo engine), checked by the fingerprint; a server
killed or frozen mid-transfer, and a trainer killed mid-transfer, end in bounded time."""

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch
from conftest import ROOT, load_script

from lib.config import parse
from lib.inference import launch
from lib.inference.weights import group, sync, transfer
from lib.models.load import load_tokenizer

rl = load_script("rl")
sys.path.insert(0, str(ROOT / "tests" / "fixtures"))  # letter_taskset
# Up to 5 s to the next health check, its 5 s timeout and the shutdown; twice that on a loaded machine.
NOTICE_S = 40.0


def memory_args(model, out, url, *extra) -> list[str]:
    args = ["@", str(ROOT / "configs/tiny/rl.toml"), "--model.name", str(model), "--output-dir", str(out)]
    args += ["--inference.urls", url, "--env.id", "letter_taskset", "--examples-per-step", "2"]
    args += ["--rollouts-per-example", "4", "--sampling.max-tokens", "24", "--max-async-level", "0"]
    return [*args, "--steps", "2", "--inference.weight-sync", "memory", *extra]


def test_a_lora_run_asking_for_memory_sync_is_refused_before_any_work(tiny_dir, tmp_path):
    args = memory_args(tiny_dir, tmp_path / "run", "http://127.0.0.1:9/v1", "--lora.rank", "8")
    with pytest.raises(ValueError, match="LoRA runs sync their adapter from the disk"):
        rl.main(parse(rl.Config, args))
    assert not (tmp_path / "run").exists()


def test_auto_sends_in_memory_to_a_server_rl_starts_on_a_cpu_and_from_the_disk_elsewhere(tiny_dir, tmp_path):
    out = tmp_path / "run"
    args = memory_args(tiny_dir, out, "http://127.0.0.1:9/v1")[:-2]  # weight_sync left at auto
    attached = parse(rl.Config, args)
    assert attached.inference.weight_sync == "auto"
    assert sync.weight_sync_mode(attached, "cpu", adapter=False) == "disk"  # attached: a file
    own = parse(rl.Config, [arg for arg in args if arg not in ("--inference.urls", "http://127.0.0.1:9/v1")])
    assert sync.weight_sync_mode(own, "cpu", adapter=False) == "memory"
    assert sync.weight_sync_mode(own, "cpu", adapter=True) == "disk"  # a LoRA adapter
    assert sync.weight_sync_mode(own, "cuda:0", adapter=False) == "disk"  # one GPU, two NCCL ranks
    own.inference.weight_sync = "disk"
    assert sync.weight_sync_mode(own, "cpu", adapter=False) == "disk"  # asked for: kept
    # A run that starts its own builtin server goes in memory: weights/step_1 is never written.
    own.inference.weight_sync = "auto"
    own.inference.engine, own.checkpoint_every = "torch", 5
    result = rl.main(own)
    assert len(result["history"]) == 2
    assert all(m.get("sync/probe_logprob_difference", 0.0) < 1e-3 for m in result["history"])
    assert sorted(path.name for path in (out / "weights").iterdir()) == ["step_0", "step_2"]
    assert 'weight_sync = "memory"' in (out / "config.toml").read_text()


@pytest.fixture(scope="module")
def elsewhere(tiny_dir, tmp_path_factory):
    """A builtin engine that can load no run directory from the disk (its weights root is a directory of its
    own), as a server on another machine without a shared file system."""
    root = tmp_path_factory.mktemp("elsewhere")
    with launch.running_server(str(tiny_dir), engine="torch", weights_root=root / "own") as server:
        yield server


def served_logprobs(url: str, model: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 1.0, "logprobs": 0, "seed": 3}
    choice = httpx.post(f"{url}/completions", json=body | {"return_token_ids": True}, timeout=60).json()
    return choice["choices"][0]["token_ids"], choice["choices"][0]["logprobs"]["token_logprobs"]


@pytest.mark.slow
@pytest.mark.parametrize("async_level", ["0", "1"])
def test_memory_sync_needs_no_shared_directory_and_serves_the_trainers_weights(
    async_level, elsewhere, tiny_dir, tmp_path
):
    """On-policy, and beside the next step's training (lib/inference/weights/sync.py Reloader), the default."""
    out = tmp_path / "run"
    args = memory_args(
        tiny_dir, out, elsewhere.url, "--checkpoint-every", "5", "--max-async-level", async_level
    )
    result = rl.main(parse(rl.Config, args))
    assert len(result["history"]) == 2
    for metrics in result["history"]:  # probed after each in-memory update, the fingerprint having passed
        assert metrics.get("sync/probe_logprob_difference", 0.0) < 1e-3, metrics
    # weights/step_N at the start, the checkpoints and the last step only: step 1 went in memory alone.
    written = sorted(path.name for path in (out / "weights").iterdir())
    assert written == ["step_0", "step_2"], written
    # The server computes what a forward pass of the trained weights computes.
    tokenizer = load_tokenizer(str(result["weights"]))
    prompt = tokenizer("Reverse: hello")["input_ids"]
    tokens, logprobs = served_logprobs(elsewhere.url, str(tiny_dir), prompt)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(result["weights"]).eval()
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logp = model(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
    assert max(abs(a - b) for a, b in zip(logprobs, logp[len(prompt) - 1 :].tolist())) < 1e-4


@pytest.mark.slow
def test_two_servers_on_two_loopback_nodes_without_a_shared_directory_take_every_step(
    elsewhere, tiny_dir, tmp_path
):
    """A second "node": a builtin engine bound to 127.0.0.2 with a weights root of its own, beside the one on
    127.0.0.1; the group spans both (ranks 1 and 2) and each server is fingerprinted after every step."""
    port = launch.free_port()
    command = [
        sys.executable,
        str(ROOT / "scripts/serve.py"),
        "--model.name",
        str(tiny_dir),
        "--engine",
        "torch",
    ]
    command += ["--host", "127.0.0.2", "--port", str(port), "--weights-root", str(tmp_path / "own")]
    log = open(tmp_path / "second.log", "wb")
    second = subprocess.Popen(
        command, stdout=log, stderr=subprocess.STDOUT, env=launch.server_environment(None, 1)
    )
    url = f"http://127.0.0.2:{port}/v1"
    try:
        deadline = time.monotonic() + 120
        while not launch.is_healthy(url, None):
            assert second.poll() is None and time.monotonic() < deadline, (
                tmp_path / "second.log"
            ).read_text()
            time.sleep(0.2)
        args = memory_args(tiny_dir, tmp_path / "run", elsewhere.url, "--checkpoint-every", "5")
        args[args.index("--inference.urls") + 1 : args.index("--inference.urls") + 2] = [elsewhere.url, url]
        result = rl.main(parse(rl.Config, args))
        # Both servers answer with the trained weights: the same tokens and logprobs for the same seed.
        prompt = load_tokenizer(str(result["weights"]))("Reverse: hello")["input_ids"]
        answers = [served_logprobs(u, str(tiny_dir), prompt) for u in (elsewhere.url, url)]
    finally:
        second.terminate()
        second.wait(30)
        log.close()
    assert len(result["history"]) == 2
    assert all(m["sync/probe_logprob_difference"] < 1e-3 for m in result["history"]), result["history"]
    (tokens, first), (again, later) = answers
    assert tokens == again and max(abs(a - b) for a, b in zip(first, later)) < 1e-4
    assert sorted(path.name for path in (tmp_path / "run" / "weights").iterdir()) == ["step_0", "step_2"]


def test_a_resumed_run_forms_the_group_again_and_goes_on_in_memory(elsewhere, tiny_dir, tmp_path):
    """The first run leaves the server's group (or dies in it); --resume forms a new one with the same server."""
    out = tmp_path / "run"
    rl.main(parse(rl.Config, memory_args(tiny_dir, out, elsewhere.url, "--checkpoint-every", "1")))
    args = memory_args(tiny_dir, out, elsewhere.url, "--checkpoint-every", "1", "--resume")
    args[args.index("--steps") + 1] = "3"
    result = rl.main(parse(rl.Config, args))
    assert len(result["history"]) == 1 and result["history"][0]["sync/probe_logprob_difference"] < 1e-3
    assert (out / "checkpoints" / "step_3").is_dir()


@pytest.mark.slow
def test_an_attached_server_restarted_between_steps_is_found_and_the_group_formed_again(
    tiny_dir, tmp_path, monkeypatch, capsys
):
    """A server restarted between two syncs holds no group: the next sync says the server restarted, forms
    the group again as at the start, and the run goes on in memory (a disk sync survives the same restart)."""
    port, root = launch.free_port(), tmp_path / "own"

    def start(name: str) -> launch.Server:
        return launch.start_server(
            str(tiny_dir), port, engine="torch", weights_root=root, log_path=tmp_path / f"{name}.log"
        )

    servers, send = [start("first")], transfer.Sender.send

    def restarting_send(self, tensors):
        if len(servers) == 1 and self.group is not None:  # step 1's weights: the server restarts first
            servers[0].stop()
            servers.append(start("second"))
        return send(self, tensors)

    monkeypatch.setattr(transfer.Sender, "send", restarting_send)
    try:
        args = memory_args(tiny_dir, tmp_path / "run", servers[0].url, "--checkpoint-every", "5")
        result = rl.main(parse(rl.Config, args))
    finally:
        servers[-1].stop()
    assert len(servers) == 2 and len(result["history"]) == 2
    # The fingerprint passed on the new server, then the probe: it serves step 1's weights, then step 2's.
    assert all(m["sync/probe_logprob_difference"] < 1e-3 for m in result["history"]), result["history"]
    root_url = servers[0].url.removesuffix("/v1")
    said = capsys.readouterr().out
    assert f"the inference server {root_url} restarted since the weight-transfer group formed" in said, said


def test_the_rendezvous_listens_on_loopback_alone_when_every_server_is_local():
    """The group's store and gloo's own listener take no connection from another machine when every server
    is on this machine's loopback (127.0.0.0/8, localhost, ::1): they have no authentication."""
    import psutil

    local = ["http://127.0.0.1:8000/v1", "http://127.0.0.2:8001/v1", "http://localhost:8002/v1"]
    assert transfer.rendezvous_address([*local, "http://[::1]:8003/v1"]) == "127.0.0.1"
    port = launch.free_port()
    member = group.join("127.0.0.1", port, rank=0, world_size=1, backend="gloo", timeout_s=30)
    listening = {c.laddr for c in psutil.Process().net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    assert ("127.0.0.1", port) in listening, listening
    assert {address.ip for address in listening} == {"127.0.0.1"}, listening
    tensor = torch.ones(3)
    group.broadcast(member, tensor)  # the group works as before
    assert tensor.tolist() == [1.0, 1.0, 1.0]


def midway(monkeypatch, act) -> dict:
    """Calls act() once the trainer has sent the first weight of its second update (step 1's)."""
    sent, broadcast = {"count": 0, "updates": 0}, group.broadcast
    update = transfer.Sender.send

    def counting_send(self, tensors):
        sent["updates"] += 1
        return update(self, tensors)

    def acting_broadcast(group_, tensor, timeout_s=group.TIMEOUT_S):
        broadcast(group_, tensor, timeout_s)
        sent["count"] += 1
        if sent["updates"] == 2 and "at" not in sent:
            act()
            sent["at"] = time.monotonic()

    monkeypatch.setattr(transfer.Sender, "send", counting_send)
    monkeypatch.setattr(group, "broadcast", acting_broadcast)
    return sent


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["kill", "freeze"])
def test_a_server_killed_or_frozen_mid_transfer_ends_the_run_in_one_sentence(
    fault, tiny_dir, tmp_path, monkeypatch
):
    with launch.running_server(str(tiny_dir), engine="torch", weights_root=tmp_path / "own") as server:
        stop = signal.SIGKILL if fault == "kill" else signal.SIGSTOP
        sent = midway(monkeypatch, lambda: os.kill(server.process.pid, stop))
        try:
            with pytest.raises(ValueError) as ended:
                rl.main(parse(rl.Config, memory_args(tiny_dir, tmp_path / "run", server.url)))
        finally:
            os.kill(server.process.pid, signal.SIGCONT)
    seconds, sentence = time.monotonic() - sent["at"], str(ended.value)
    assert server.url.removesuffix("/v1") in sentence, sentence
    assert "\n" not in sentence and seconds < NOTICE_S, (seconds, sentence)
    print(f"\nserver {fault} mid-transfer: the run ended {seconds:.1f} s after it: {sentence}")


def test_an_update_that_moved_nothing_stops_at_the_fingerprint(elsewhere, tiny_dir, monkeypatch):
    """A transfer that says it succeeded and moved nothing (what vLLM #57022 reports of vLLM's nccl engine on
    CPUs) leaves the server on its old weights: the fingerprint after the update names the server."""
    from safetensors.torch import load_file

    tensors = {name: value + 0.01 for name, value in load_file(tiny_dir / "model.safetensors").items()}
    monkeypatch.setattr(transfer.Sender, "send", lambda self, tensors: None)
    sender = transfer.Sender([elsewhere.url], None, "cpu", transfer.GLOO)
    with pytest.raises(ValueError) as stopped:
        transfer.update_in_memory(sender, tensors, tied=False, label="step_1", pause_mode="wait")
    sentence = str(stopped.value)
    root = elsewhere.url.removesuffix("/v1")
    assert sentence.startswith(
        f"the inference server {root} does not compute with the weights sent to it in memory for step_1: in its engine 0 the first differing weight is"
    ), sentence
    assert httpx.get(f"{root}/is_paused", timeout=10).json() == {"is_paused": False}  # resumed all the same


TRAINER = """
import os, sys, torch
sys.path.insert(0, {root!r})
from lib.inference.weights import group
g = group.join("127.0.0.1", {port}, 0, 2, "gloo", 30)
group.broadcast(g, torch.zeros({shape}, dtype=torch.{dtype}))
os._exit(0)  # killed mid-transfer: the rest never comes
"""


def test_a_trainer_gone_mid_transfer_leaves_the_server_serving_and_ready_for_a_new_group(elsewhere, tiny_dir):
    url, root = elsewhere.url, elsewhere.url.removesuffix("/v1")
    from safetensors.torch import load_file

    weights = load_file(tiny_dir / "model.safetensors")
    names = list(weights)
    info = {
        "names": names,
        "dtype_names": [str(weights[n].dtype).removeprefix("torch.") for n in names],
        "shapes": [list(weights[n].shape) for n in names],
    }
    port = launch.free_port()
    first = weights[names[0]]
    script = TRAINER.format(
        root=str(ROOT), port=port, shape=tuple(first.shape), dtype=str(first.dtype).removeprefix("torch.")
    )
    trainer = subprocess.Popen([sys.executable, "-c", script])
    init = {
        "master_address": "127.0.0.1",
        "master_port": port,
        "rank_offset": 1,
        "world_size": 2,
        "timeout_s": 30,
    }
    assert (
        httpx.post(f"{root}/init_weight_transfer_engine", json={"init_info": init}, timeout=60).status_code
        == 200
    )
    assert httpx.post(f"{root}/start_weight_update", timeout=10).status_code == 200
    began = time.monotonic()
    answer = httpx.post(f"{root}/update_weights", json={"update_info": info}, timeout=60)
    trainer.wait(30)
    assert answer.status_code == 400 and "after 1 weights" in answer.text, answer.text
    assert time.monotonic() - began < 30
    # Still serving on the weights it had, and a new group forms (a resumed trainer's).
    assert httpx.get(f"{root}/health", timeout=10).status_code == 200
    sender = transfer.Sender([url], None, "cpu", transfer.GLOO)
    tensors = {name: value.clone() for name, value in weights.items()}
    transfer.update_in_memory(sender, tensors, tied=False, label="again", pause_mode="wait")
    sender.close()


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_takes_the_weights_in_memory_through_plainrls_gloo_engine(vllm_server, trained_tiny, tmp_path):
    """Against real vLLM (its CPU build): the engine registered by plainrl, driven over vLLM's own routes."""
    from lib.inference.weights import reload

    out = tmp_path / "run"
    try:
        result = rl.main(
            parse(rl.Config, memory_args(trained_tiny, out, vllm_server.url, "--checkpoint-every", "5"))
        )
        assert len(result["history"]) == 2
        for metrics in result["history"]:  # the fingerprint passed, then the probe
            assert metrics["sync/probe_logprob_difference"] < 1e-3, metrics
        assert sorted(path.name for path in (out / "weights").iterdir()) == ["step_0", "step_2"]
    finally:
        reload.reload_weights([vllm_server.url], trained_tiny, None, "default")  # back for the other tests


@pytest.mark.slow
@pytest.mark.vllm
def test_vllms_own_nccl_engine_on_the_cpu_build_stops_the_run_naming_the_server(
    vllm_installed, tiny_dir, tmp_path
):
    """vLLM's nccl engine on its CPU build: reported to broadcast nothing and say nothing (vLLM #57022); in
    vLLM 0.32 over HTTP it fails to join instead (it asks torch for an accelerator). The run stops before
    training in one sentence naming the server; a join that passed and moved nothing would meet the
    fingerprint (test_an_update_that_moved_nothing_stops_at_the_fingerprint)."""
    extra = ["--model.dtype", "float32", "--vllm.cpu-kv-cache-gib", "1", "--max-model-len", "1024"]
    extra += ["--vllm.weight-transfer-backend", "nccl"]
    with launch.running_server(
        str(tiny_dir), engine="vllm", log_path=tmp_path / "vllm.log", extra_args=extra
    ) as server:
        args = memory_args(
            tiny_dir, tmp_path / "run", server.url, "--inference.vllm-transfer-backend", "nccl"
        )
        with pytest.raises(ValueError) as stopped:
            rl.main(parse(rl.Config, [*args, "--optim.lr", "3e-2"]))
        # The server still serves, and never took a step's weights.
        assert httpx.get(f"{server.url.removesuffix('/v1')}/health", timeout=10).status_code == 200
    sentence, root = str(stopped.value), server.url.removesuffix("/v1")
    assert f"the inference server {root}" in sentence and "\n" not in sentence, sentence
    assert "Cannot access accelerator device" in sentence and "plainrl_gloo" in sentence, sentence
    assert not (tmp_path / "run" / "checkpoints").exists() or not any(
        (tmp_path / "run" / "checkpoints").iterdir()
    )
    print(f"\nvLLM's nccl engine on the CPU build: {sentence}")


@pytest.mark.vllm
def test_the_plugin_entry_point_registers_plainrls_engine_with_vllm(vllm_installed):
    """What vLLM's load_general_plugins runs in each of its processes, read from pyproject.toml (an editable
    install made before the entry point existed does not list it, so lib/inference/weights/vllm_worker.py registers it as
    well)."""
    import importlib
    import tomllib

    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    entry = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"][
        "vllm.general_plugins"
    ]
    module, _, function = entry[transfer.GLOO].partition(":")
    register = getattr(importlib.import_module(module), function)
    register()
    register()  # every vLLM process runs it; twice is harmless
    engine = WeightTransferEngineFactory._registry[transfer.GLOO]()
    assert (
        engine.__name__ == "GlooWeightTransferEngine"
        and engine.init_info_cls(
            master_address="127.0.0.1", master_port=1, rank_offset=1, world_size=2
        ).timeout_s
        == group.TIMEOUT_S
    )
