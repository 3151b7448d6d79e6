"""The exact `vllm serve` command lines serve.py starts (vLLM itself is not needed)."""

import pytest
from conftest import load_script

from lib.config import parse
from lib.vllm import VllmConfig, vllm_command, vllm_environment

MODEL = "Qwen/Qwen3-4B"
COMMON_TAIL = ["--logprobs-mode", "processed_logprobs", "--generation-config", "vllm"]


def command(config: VllmConfig, host: str = "127.0.0.1") -> list[str]:
    return vllm_command(MODEL, "policy", host, 8000, "bfloat16", 0, config)


def test_single_gpu():
    assert command(VllmConfig()) == [
        "vllm", "serve", MODEL,
        "--served-model-name", "policy", "--host", "127.0.0.1", "--port", "8000",
        "--dtype", "bfloat16", "--seed", "0", "--gpu-memory-utilization", "0.9",
        "--tensor-parallel-size", "1", "--data-parallel-size", "1",
        *COMMON_TAIL,
    ]  # fmt: skip


def test_tensor_parallel_with_context_and_memory_caps():
    config = VllmConfig(tensor_parallel_size=4, max_model_len=8192, gpu_memory_utilization=0.45)
    assert command(config) == [
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
        *COMMON_TAIL, "--enforce-eager",
    ]  # fmt: skip


def test_environment_turns_on_dev_routes_and_carries_the_key_out_of_the_process_list():
    env = vllm_environment("secret", base={"PATH": "/usr/bin"})
    assert env == {"PATH": "/usr/bin", "VLLM_SERVER_DEV_MODE": "1", "VLLM_API_KEY": "secret"}
    assert "VLLM_API_KEY" not in vllm_environment(None, base={})
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
