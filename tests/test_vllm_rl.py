"""rl.py and eval.py against real vLLM 0.32 (its CPU build) on the trained tiny model.

Most tests share the session's vLLM server (tests/conftest.py); the one that needs rl.py to start its own
server also covers kill -9 and --resume, so it pays for two starts, not four.
"""

import json
import os
import subprocess
import sys
import time

import psutil
import pytest
import torch
from conftest import ROOT, load_script, recorded_layouts
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from lib import endpoint
from lib.config import parse

pytestmark = [pytest.mark.slow, pytest.mark.vllm]
rl = load_script("rl")
FIXTURES = ROOT / "tests" / "fixtures"
THREE_TURNS = {"min_turns": 3, "max_turns": 3, "min_names_per_turn": 1, "max_names_per_turn": 4}
SHORT_RUN = ["--examples-per-step", "2", "--rollouts-per-example", "4", "--sampling.max-tokens", "24"]
SHORT_RUN += ["--env.id", "letter_taskset", "--max-async-level", "0"]


def run_args(model, out, *extra) -> list[str]:
    preset = ["@", str(ROOT / "configs/tiny/rl.toml"), "--model.name", str(model), "--output-dir", str(out)]
    return [*preset, *SHORT_RUN, *extra]


def scalars(run_dir, tag: str) -> dict[int, float]:
    events = EventAccumulator(str(run_dir / "tb")).Reload()
    return {event.step: event.value for event in events.Scalars(tag)}


def test_rl_starts_its_own_vllm_survives_kill_9_and_resumes(vllm_installed, trained_tiny, tmp_path):
    out = tmp_path / "run"
    command = [sys.executable, str(ROOT / "scripts/rl.py"), *run_args(trained_tiny, out)]
    command += [
        "--inference.engine",
        "vllm",
        "--steps",
        "4",
        "--checkpoint-every",
        "2",
        "--keep-weights",
        "4",
    ]
    env = {**os.environ, "PYTHONPATH": str(FIXTURES), "VLLM_CPU_KVCACHE_SPACE": "1"}
    with open(tmp_path / "job.out", "w") as stdout:
        job = subprocess.Popen(command, cwd=tmp_path, stdout=stdout, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 600
        while not (out / "checkpoints" / "step_2").is_dir():
            assert job.poll() is None, (tmp_path / "job.out").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint after 10 minutes"
            time.sleep(0.2)
        started = psutil.Process(job.pid).children(recursive=True)  # the server: serve.py became vLLM
        assert any("lib.inference.vllm" in " ".join(p.cmdline()) for p in started), [
            p.cmdline() for p in started
        ]
        job.kill()
        job.wait()
        gone, alive = psutil.wait_procs(started, timeout=60)
        assert not alive, [p.cmdline() for p in alive]  # no vLLM process outlives its controller
    finally:
        if job.poll() is None:
            job.kill()
    resumed = subprocess.run(command + ["--resume"], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and (out / "weights" / "step_4").is_dir()
    ratios = scalars(out, "train/importance_ratio")
    assert abs(ratios[1] - 1.0) < 1e-3, ratios  # on-policy at step 1: vLLM's logprobs are the trainer's
    assert sum(scalars(out, "rollouts/errors").values()) == 0
    # After each reload (the last one included, before the server stopped) vLLM served exactly the
    # weights the trainer had: its logprobs on the probe are the trainer's, to fp32 rounding.
    differences = scalars(out, "sync/probe_logprob_difference")
    assert sorted(differences) == [1, 2, 3, 4] and max(differences.values()) < 1e-4, differences


def test_an_attached_vllm_server_gets_the_runs_starting_weights(
    vllm_server, tiny_dir, trained_tiny, tmp_path
):
    from lib.inference.weights import reload

    # Leave the server on other weights (the untrained tiny model), as an earlier run would.
    other = tmp_path / "other"
    other.symlink_to(tiny_dir, target_is_directory=True)
    reload.reload_weights([vllm_server.url], other, None, "other")
    args = run_args(trained_tiny, tmp_path / "run", "--inference.urls", vllm_server.url, "--steps", "1")
    result = rl.main(parse(rl.Config, args))
    metrics = result["history"][0]
    assert abs(metrics["train/importance_ratio"] - 1.0) < 1e-3, metrics
    assert metrics["sync/probe_logprob_difference"] < 1e-4


def test_shared_prompts_train_vllm_rollouts_on_policy(vllm_server, trained_tiny, tmp_path, monkeypatch):
    # Packed rows on a CPU share each group's prompt (share_prompts auto) of the rollouts vLLM sampled.
    layouts = recorded_layouts(monkeypatch)
    args = run_args(trained_tiny, tmp_path / "run", "--inference.urls", vllm_server.url, "--steps", "1")
    result = rl.main(parse(rl.Config, [*args, "--packing"]))
    assert layouts and all(shared and in_rows < whole for shared, in_rows, whole in layouts), layouts
    metrics = result["history"][0]
    assert abs(metrics["train/importance_ratio"] - 1.0) < 1e-3, metrics


def test_eval_against_vllm_with_the_seed_recipes_flags(vllm_server, tmp_path):
    evaluate = load_script("eval")
    args = ["alphabet_sort", "-m", endpoint.served_model(vllm_server.url), "-b", vllm_server.url, "-n", "4"]
    args += ["-r", "3", "--max-tokens", "768", "--output-dir", str(tmp_path / "eval")]
    flags = {**THREE_TURNS, "similarity_power": 8, "power_per_turn": False}
    evaluate.main(parse(evaluate.Config, [*args, "--env-args", json.dumps(flags)]))
    summary = json.loads(next((tmp_path / "eval").rglob("summary.json")).read_text())
    assert summary["num_rollouts"] == 12 and summary["num_errors"] == 0, summary
    rows = [json.loads(line) for line in next((tmp_path / "eval").rglob("results.jsonl")).open()]
    assert all(sum(m["role"] == "assistant" for m in row["messages"]) == 3 for row in rows)


def test_three_turn_training_tokens_are_the_ones_vllm_echoed(vllm_server, trained_tiny, monkeypatch):
    import asyncio

    import renderers.client

    from lib.orchestrator import envs
    from lib.sampling import SamplingConfig

    echoed = []
    parse_response = renderers.client.parse_generate_response
    monkeypatch.setattr(
        renderers.client,
        "parse_generate_response",
        lambda raw: echoed.append(parse_response(raw)) or echoed[-1],
    )
    env = envs.EnvConfig(id="alphabet_sort", args=json.dumps(THREE_TURNS), num_examples=1)
    vf_env = envs.load_env(env)
    task = envs.load_tasks(vf_env, env)[0]
    name = endpoint.served_model(vllm_server.url)
    ctx = envs.model_context(
        vllm_server.url, name, SamplingConfig(max_tokens=64), train=True, tokenizer=trained_tiny
    )

    async def one():
        async with envs.serving(vf_env):
            return await envs.run_episode(vf_env, task, ctx)

    samples, error = envs.training_samples(asyncio.run(one()))
    assert error is None and 1 <= len(samples) <= 3 and len(echoed) == 3
    turns = [(answer["prompt_token_ids"], answer["choices"][0]["token_ids"]) for answer in echoed]
    # A later turn's echoed prompt holds the earlier turns, so one sample carries all three, unless the chat
    # re-rendered a reply to other tokens than were sampled (a reply cut at max_tokens can re-tokenise
    # differently): then the episode splits into samples at that turn. Either way each turn is the prefix
    # of one sample, with exactly its sampled tokens trained, and the last request with its completion is
    # the last sample.
    assert samples[-1].token_ids == turns[-1][0] + turns[-1][1]
    for prompt, completion in turns:
        (sample,) = [
            s for s in samples if s.token_ids[: len(prompt) + len(completion)] == prompt + completion
        ][:1]
        assert sample.loss_mask[len(prompt) : len(prompt) + len(completion)] == [True] * len(completion)
    assert sum(sum(s.loss_mask) for s in samples) == sum(len(completion) for _, completion in turns)


def test_a_lora_step_reaches_vllm_as_merged_weights(vllm_server, trained_tiny, tmp_path):
    from lib.inference.weights import probing

    args = run_args(trained_tiny, tmp_path / "run", "--inference.urls", vllm_server.url, "--steps", "1")
    args += ["--lora.rank", "4", "--optim.lr", "5e-2", "--inference.lora-sync", "merged"]
    result = rl.main(parse(rl.Config, args))
    assert result["history"][0]["sync/probe_logprob_difference"] < 1e-4  # vLLM serves what the trainer has
    # ... and that is not the base model: the probe's logprobs under the base weights differ.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(trained_tiny)
    prompt = tokenizer.encode(probing.PROBE_TEXT, add_special_tokens=False)
    served = probing.probe(vllm_server.url, endpoint.served_model(vllm_server.url), prompt, None)
    base = AutoModelForCausalLM.from_pretrained(trained_tiny, dtype=torch.float32).eval()
    ids = torch.tensor([prompt + served.completion_ids])
    with torch.no_grad():
        logits = base(ids).logits[0, :-1] / probing.PROBE_TEMPERATURE
    base_logprobs = logits.log_softmax(-1).gather(-1, ids[0, 1:, None])[len(prompt) - 1 :, 0]
    assert max(abs(a - b) for a, b in zip(served.logprobs, base_logprobs.tolist())) > 1e-3
