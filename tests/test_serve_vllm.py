"""The exact `vllm serve` command lines serve.py starts (vLLM itself is not needed)."""

import pytest
from conftest import load_script

from lib.config import parse
from lib.inference.vllm import VllmConfig, vllm_command, vllm_environment

MODEL = "Qwen/Qwen3-4B"
ENGINE_TAIL = ["--logprobs-mode", "processed_logprobs", "--generation-config", "vllm", "--enable-scale-out"]
ENGINE_TAIL += [
    "--max-logprobs",
    "20",
    "--worker-extension-cls",
    "lib.inference.weights.vllm_worker.ServedWeights",
]
COMMON_TAIL = [*ENGINE_TAIL, "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]  # an API server's


def command(config: VllmConfig, host: str = "127.0.0.1", max_model_len: int | None = None) -> list[str]:
    return vllm_command(MODEL, "policy", host, 8000, "bfloat16", 0, config, max_model_len=max_model_len)


def test_single_gpu():
    assert command(VllmConfig()) == [
        "vllm", "serve", MODEL,
        "--served-model-name", "policy", "--host", "127.0.0.1", "--port", "8000",
        "--dtype", "bfloat16", "--seed", "0", "--gpu-memory-utilization", "0.9",
        "--tensor-parallel-size", "1", "--data-parallel-size", "1",
        *COMMON_TAIL,
    ]  # fmt: skip


def test_tensor_parallel_with_context_and_memory_caps():
    config = VllmConfig(tensor_parallel_size=4, gpu_memory_utilization=0.45)
    assert command(config, max_model_len=8192) == [
        "vllm", "serve", MODEL,
        "--served-model-name", "policy", "--host", "127.0.0.1", "--port", "8000",
        "--dtype", "bfloat16", "--seed", "0", "--gpu-memory-utilization", "0.45", "--max-model-len", "8192",
        "--tensor-parallel-size", "4", "--data-parallel-size", "1",
        *COMMON_TAIL,
    ]  # fmt: skip


def test_data_parallel_on_one_node():
    assert command(VllmConfig(data_parallel_size=8)) == [
        "vllm", "serve", MODEL,
        "--served-model-name", "policy", "--host", "127.0.0.1", "--port", "8000",
        "--dtype", "bfloat16", "--seed", "0", "--gpu-memory-utilization", "0.9",
        "--tensor-parallel-size", "1", "--data-parallel-size", "8",
        *COMMON_TAIL,
    ]  # fmt: skip


def test_multi_node_head_and_headless_node():
    shared = dict(
        tensor_parallel_size=2,
        data_parallel_size=8,
        data_parallel_size_local=4,
        data_parallel_address="10.0.0.1",
        data_parallel_rpc_port=13345,
    )
    assert command(VllmConfig(**shared), host="0.0.0.0") == [
        "vllm", "serve", MODEL,
        "--served-model-name", "policy", "--host", "0.0.0.0", "--port", "8000",
        "--dtype", "bfloat16", "--seed", "0", "--gpu-memory-utilization", "0.9",
        "--tensor-parallel-size", "2", "--data-parallel-size", "8",
        "--data-parallel-size-local", "4", "--data-parallel-address", "10.0.0.1", "--data-parallel-rpc-port", "13345",
        *COMMON_TAIL,
    ]  # fmt: skip
    headless = VllmConfig(**shared, data_parallel_start_rank=4, headless=True, extra_args=["--enforce-eager"])
    assert command(headless) == [
        "vllm", "serve", MODEL,
        "--dtype", "bfloat16", "--seed", "0", "--gpu-memory-utilization", "0.9",
        "--tensor-parallel-size", "2", "--data-parallel-size", "8",
        "--data-parallel-size-local", "4", "--data-parallel-address", "10.0.0.1", "--data-parallel-rpc-port", "13345",
        "--data-parallel-start-rank", "4", "--headless",
        *ENGINE_TAIL, "--enforce-eager",
    ]  # fmt: skip


def test_tool_parsing_can_be_turned_off():
    assert command(VllmConfig(tool_call_parser=None))[-len(ENGINE_TAIL) :] == ENGINE_TAIL


def test_environment_turns_on_dev_routes_and_carries_the_key_out_of_the_process_list():
    env = vllm_environment("secret", base={"PATH": "/usr/bin"})
    assert env == {"PATH": "/usr/bin", "VLLM_SERVER_DEV_MODE": "1", "VLLM_API_KEY": "secret"}
    assert "VLLM_API_KEY" not in vllm_environment(None, base={})
    assert vllm_environment(None, VllmConfig(cpu_kv_cache_gib=2), base={})["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert not any("secret" in part for part in command(VllmConfig()))


def test_a_server_on_loopback_with_every_engine_here_keeps_gloo_on_the_loopback_interface():
    import socket

    import psutil

    loopback = next(
        name
        for name, addresses in psutil.net_if_addrs().items()
        if any(a.family == socket.AF_INET and a.address.startswith("127.") for a in addresses)
    )
    for host in ("127.0.0.1", "localhost", "::1"):
        assert vllm_environment(None, VllmConfig(), base={}, host=host)["GLOO_SOCKET_IFNAME"] == loopback
    two_here = VllmConfig(data_parallel_size=2, data_parallel_address="127.0.0.1")
    assert vllm_environment(None, two_here, base={}, host="127.0.0.1")["GLOO_SOCKET_IFNAME"] == loopback
    # Engines that may be elsewhere, or a choice of the user's: gloo left as torch or the user sets it.
    nodes = VllmConfig(data_parallel_size=2, data_parallel_address="10.0.0.1")
    elsewhere = [("0.0.0.0", VllmConfig()), ("127.0.0.1", nodes)]
    elsewhere += [("127.0.0.1", VllmConfig(extra_args=["--nnodes", "2"]))]
    for host, config in elsewhere:
        assert "GLOO_SOCKET_IFNAME" not in vllm_environment(None, config, base={}, host=host)
    own = vllm_environment(None, VllmConfig(), base={"GLOO_SOCKET_IFNAME": "eth1"}, host="127.0.0.1")
    assert own["GLOO_SOCKET_IFNAME"] == "eth1"


@pytest.mark.parametrize(
    "kwargs",
    [
        {"gpu_memory_utilization": 0},
        {"tensor_parallel_size": 0},
        {"data_parallel_size": 2, "data_parallel_size_local": 3},
        {"headless": True, "data_parallel_address": "10.0.0.1"},  # no start rank
    ],
)
def test_bad_vllm_settings_are_one_sentence_errors(kwargs):
    with pytest.raises(ValueError, match=r"^vllm\..*\.$"):
        VllmConfig(**kwargs)


def test_serve_main_hands_the_process_to_vllm_with_the_config(monkeypatch):
    import torch

    import lib.inference.vllm
    import lib.orchestrator.tasks

    serve = load_script("serve")
    started = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # GPU vLLM: no CPU KV cache sizing
    monkeypatch.setattr(
        lib.models.load, "hub_reachable", lambda: True
    )  # a GPU machine with the hub: MODEL is an id
    monkeypatch.setattr(
        lib.inference.vllm, "exec_vllm", lambda cmd, env: started.update(command=cmd, env=env)
    )
    monkeypatch.setenv("PLAINRL_API_KEY", "from-env")
    argv = ["--model.name", MODEL, "--engine", "vllm", "--port", "9000", "--model.dtype", "bfloat16"]
    argv += ["--vllm.tensor-parallel-size", "2", "--vllm.gpu-memory-utilization", "0.5"]
    serve.main(parse(serve.Config, argv))
    assert started["command"] == [
        "vllm", "serve", MODEL,
        "--served-model-name", MODEL, "--host", "127.0.0.1", "--port", "9000",
        "--dtype", "bfloat16", "--seed", "0", "--gpu-memory-utilization", "0.5",
        "--tensor-parallel-size", "2", "--data-parallel-size", "1",
        *COMMON_TAIL,
    ]  # fmt: skip
    assert started["env"]["VLLM_API_KEY"] == "from-env" and started["env"]["VLLM_SERVER_DEV_MODE"] == "1"


def start_on_cpu(monkeypatch, argv: list[str], free_bytes: int = 16 * 2**30) -> dict:
    """What serve.py hands to vLLM on a machine without CUDA (the CPU build) with `free_bytes` of free memory."""
    import psutil
    import torch

    import lib.inference.vllm

    serve = load_script("serve")
    started = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(
        lib.inference.vllm, "exec_vllm", lambda cmd, env: started.update(command=cmd, env=env)
    )
    free = psutil.virtual_memory()._replace(available=free_bytes)
    monkeypatch.setattr(psutil, "virtual_memory", lambda: free)
    serve.main(parse(serve.Config, ["--engine", "vllm", *argv]))
    return started


def flag(command: list[str], name: str) -> str | None:
    return command[command.index(name) + 1] if name in command else None


def test_the_cpu_build_serves_the_trainers_dtype_with_a_kv_cache_sized_to_the_model(tiny_dir, monkeypatch):
    from lib.inference.vllm import CPU_KV_CACHE_FLOOR

    per_token = 2 * 2 * 2 * 32 * 4  # keys and values x 2 layers x 2 heads x 32 wide x float32
    command = start_on_cpu(monkeypatch, ["--model.name", str(tiny_dir), "--max-model-len", "2048"])["command"]
    # auto is the builtin engine's and the trainer's dtype on a CPU (vLLM's own auto would serve bfloat16).
    assert flag(command, "--dtype") == "float32"
    assert flag(command, "--max-num-seqs") == "64"  # --max-batch-size, as the builtin engine's
    assert per_token * 2048 * 64 < CPU_KV_CACHE_FLOOR  # the tiny model gets the floor
    assert flag(command, "--kv-cache-memory-bytes") == str(CPU_KV_CACHE_FLOOR)
    argv = ["--model.name", str(tiny_dir), "--max-model-len", "2048", "--max-batch-size", "512"]
    command = start_on_cpu(monkeypatch, argv)["command"]
    assert flag(command, "--kv-cache-memory-bytes") == str(per_token * 2048 * 512)
    # Short of memory, the cache shrinks to half of what is free beside the weights, never below one sequence.
    weights = sum(path.stat().st_size for path in tiny_dir.glob("*.safetensors"))
    command = start_on_cpu(monkeypatch, argv, free_bytes=weights + 2 * 2**29)["command"]
    assert flag(command, "--kv-cache-memory-bytes") == str(2**29)
    command = start_on_cpu(monkeypatch, [*argv, "--model.dtype", "bfloat16"])["command"]
    assert flag(command, "--dtype") == "bfloat16"
    assert flag(command, "--kv-cache-memory-bytes") == str(per_token // 2 * 2048 * 512)


def test_a_cpu_build_without_the_memory_it_needs_stops_in_one_sentence(tiny_dir, monkeypatch):
    from lib.config import UserError

    for argv, free_bytes in (
        (["--vllm.cpu-kv-cache-gib", "100000"], 16 * 2**30),  # an absurd request
        ([], 2**20),  # the weights and one sequence's KV cache take more than is free
    ):
        with pytest.raises(UserError) as error:
            start_on_cpu(monkeypatch, ["--model.name", str(tiny_dir), *argv], free_bytes)
        message = str(error.value)
        assert message.startswith("vLLM's CPU build cannot start:") and "GiB of memory is free" in message
        assert "\n" not in message


def test_exec_runs_the_vllm_cli_through_plainrls_entry(monkeypatch):
    import os
    import sys

    import lib.inference.vllm

    calls = []
    monkeypatch.setattr(lib.inference.vllm.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(os, "execve", lambda path, argv, env: calls.append((path, argv, env)))
    lib.inference.vllm.exec_vllm(["vllm", "serve", MODEL, "--port", "1"], {"A": "1"})
    assert calls == [
        (
            sys.executable,
            [sys.executable, "-m", "lib.inference.vllm", "serve", MODEL, "--port", "1"],
            {"A": "1"},
        )
    ]
    monkeypatch.setattr(lib.inference.vllm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="vllm is not installed"):
        lib.inference.vllm.exec_vllm(["vllm", "serve", MODEL], {})


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_cli_starts_on_the_installed_build(vllm_installed):
    """The `vllm` command of the CPU build fails on its distribution name; plainrl's entry does not."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "lib.inference.vllm", "--version"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().startswith("0.32.0"), done.stdout
