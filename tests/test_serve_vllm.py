"""The exact `vllm serve` command lines serve.py starts (vLLM itself is not needed)."""

import pytest
from conftest import load_script

from lib.config import parse
from lib.vllm import VllmConfig, vllm_command, vllm_environment

MODEL = "Qwen/Qwen3-4B"
ENGINE_TAIL = ["--logprobs-mode", "processed_logprobs", "--generation-config", "vllm", "--enable-scale-out"]
ENGINE_TAIL += ["--max-logprobs", "20", "--worker-extension-cls", "lib.vllm.ServedWeights"]
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
    import lib.vllm

    serve = load_script("serve")
    started = {}
    monkeypatch.setattr(lib.vllm, "exec_vllm", lambda cmd, env: started.update(command=cmd, env=env))
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


def test_exec_runs_the_vllm_cli_through_plainrls_entry(monkeypatch):
    import os
    import sys

    import lib.vllm

    calls = []
    monkeypatch.setattr(lib.vllm.importlib.util, "find_spec", lambda name: object())
    monkeypatch.setattr(os, "execve", lambda path, argv, env: calls.append((path, argv, env)))
    lib.vllm.exec_vllm(["vllm", "serve", MODEL, "--port", "1"], {"A": "1"})
    assert calls == [
        (sys.executable, [sys.executable, "-m", "lib.vllm", "serve", MODEL, "--port", "1"], {"A": "1"})
    ]
    monkeypatch.setattr(lib.vllm.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="vllm is not installed"):
        lib.vllm.exec_vllm(["vllm", "serve", MODEL], {})


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_cli_starts_on_the_installed_build(vllm_installed):
    """The `vllm` command of the CPU build fails on its distribution name; plainrl's entry does not."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "lib.vllm", "--version"], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().startswith("0.32.0"), done.stdout
