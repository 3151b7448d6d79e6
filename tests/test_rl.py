"""rl.py end to end on the tiny model: on-policy ratio, weight sync, staleness, kill -9 and resume."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import pytest
import torch
from conftest import ROOT, eventually, load_script, recorded_layouts, tensorboard_scalars, wandb_history

from lib.config import UserError, parse
from lib.inference import launch
from lib.inference.weights import probing
from lib.models.load import load_tokenizer

rl = load_script("rl")
FIXTURES = ROOT / "tests" / "fixtures"
sys.path.insert(0, str(FIXTURES))  # letter_taskset: a reward that varies even for the untrained tiny model


@pytest.fixture(scope="module")
def server(tiny_dir, tmp_path_factory):
    root = tmp_path_factory.getbasetemp()
    with launch.running_server(
        str(tiny_dir),
        engine="torch",
        weights_root=root,
        log_path=root / "serve.log",
        extra_args=["--max-lora-rank", "8"],  # LoRA runs load their adapter at run time
    ) as s:
        yield s


def on_base_weights(url: str, tiny_dir) -> None:
    """Puts the shared server back on the tiny model's weights, as a LoRA run needs: it loads only its
    adapter, on top of whatever the server holds, where a full run reloads every weight first."""
    from lib.inference.weights import reload

    reload.reload_weights([url], tiny_dir, None, "default")


def learned(metrics: dict) -> bool:
    """Whether a step had a learning signal: a gradient, not a loss, says so. On policy, GSPO's and GRPO's
    loss (one ratio of 1 a rollout, the group's advantages summing to 0) is 0 up to rounding."""
    return metrics.get("train/grad_norm", 0.0) > 0.0


def rl_config(model, out, url, *extra):
    return parse(rl.Config, rl_config_args(model, out, url, *extra))


def rl_config_args(model, out, url, *extra) -> list[str]:
    """Flags of a short tiny-model run on letter_taskset against the server at `url`."""
    return [
        "@",
        str(ROOT / "configs/tiny/rl.toml"),
        "--model.name",
        str(model),
        "--output-dir",
        str(out),
        "--inference.urls",
        url,
        "--steps",
        "2",
        "--env.id",
        "letter_taskset",
        "--examples-per-step",
        "4",
        "--rollouts-per-example",
        "4",
        "--sampling.max-tokens",
        "40",
        *extra,
    ]


def test_the_server_rl_starts_gets_its_share_of_the_gpu_and_the_trainers_length(
    tiny_dir, tmp_path, monkeypatch
):
    from lib.inference.vllm import vllm_command

    serve = load_script("serve")

    def start_server(model, *args, **kwargs):
        raise RuntimeError(kwargs["extra_args"])

    def vllm_flags(*flags) -> list[str]:
        preset = ["@", str(ROOT / "configs/tiny/rl.toml"), "--model.name", str(tiny_dir)]
        config = parse(rl.Config, [*preset, "--output-dir", str(tmp_path / "run"), *flags])
        with pytest.raises(RuntimeError) as started:
            rl.main(config)
        served = parse(serve.Config, ["--model.name", str(tiny_dir), *started.value.args[0]])
        return vllm_command(
            str(tiny_dir),
            "m",
            "127.0.0.1",
            8000,
            "auto",
            0,
            served.vllm,
            20,
            served.max_model_len,
            served.max_lora_rank,
        )

    monkeypatch.setattr(launch, "start_server", start_server)
    command = vllm_flags("--inference.gpu-memory-utilization", "0.25", "--seq-len", "1024")
    assert command[command.index("--gpu-memory-utilization") + 1] == "0.25"  # not vLLM's 0.9 default
    assert (
        command[command.index("--max-model-len") + 1] == "1024"
    )  # the trainer's rows, not the model's limit
    command = vllm_flags("--seq-len", "4096")
    assert command[command.index("--max-model-len") + 1] == "2048"  # the tiny model's own limit is lower
    assert "--enable-lora" not in command
    # A LoRA run's server takes its adapter at run time, at a rank vLLM accepts (4 -> 8).
    command = vllm_flags("--lora.rank", "4")
    assert command[command.index("--enable-lora") + 1 :][:4] == ["--max-lora-rank", "8", "--max-loras", "1"]
    assert "--enable-lora" not in vllm_flags("--lora.rank", "4", "--inference.lora-sync", "merged")


@pytest.mark.slow
def test_an_attached_server_may_serve_the_model_under_another_name(tiny_dir, server, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(tiny_dir, copy)  # the run's model.name differs from the name the server answers to
    result = rl.main(rl_config(copy, tmp_path / "run", server.url, "--steps", "1"))
    assert len(result["history"]) == 1


def test_rl_trains_on_an_environment_from_one_python_file(tiny_dir, server, tmp_path):
    from conftest import docs_env_file

    path = docs_env_file(tmp_path)  # docs/environments.md's example, as a user copies it
    short = ["--examples-per-step", "4", "--sampling.max-tokens", "16", "--max-async-level", "0"]
    result = rl.main(rl_config(tiny_dir, tmp_path / "run", server.url, "--env.id", str(path), *short))
    assert len(result["history"]) == 2 and any(learned(m) for m in result["history"])
    assert all(m["rollouts/errors"] == 0 for m in result["history"])
    rollouts = [(tmp_path / "run" / "rollouts" / f"step_{step}.jsonl").read_text() for step in (1, 2)]
    records = [json.loads(line) for text in rollouts for line in text.splitlines()]
    assert "Add the two numbers" in records[0]["prompt"]
    # the file's graded reward reached the rollouts: a random model's near misses score between 0 and 1
    assert any(0.0 < record["reward"] < 1.0 for record in records)


def test_a_run_whose_every_episode_fails_stops_with_the_error(tiny_dir, server, tmp_path, monkeypatch):
    import lib.orchestrator.producer

    monkeypatch.setattr(lib.orchestrator.producer, "FAILURE_PATIENCE_S", 2.0)  # 60 s in a run
    failing = ["--env.id", "toy_taskset", "--env.args", '{"fail_in_reward": true}']
    with pytest.raises(ValueError, match="no group of rollouts succeeded for .*toy reward exploded"):
        rl.main(rl_config(tiny_dir, tmp_path / "run", server.url, *failing))


def test_top_p_and_top_k_train_over_a_bounded_kept_set():
    # Each token is scored over its kept set (tests/test_kept_sets.py); top_p alone gets top_k 512, so a kept
    # set never holds ~10^5 of Qwen's ids.
    from lib.sampling import KEPT_SET_BOUND, SamplingConfig, bounded

    top_p, top_k = SamplingConfig(top_p=0.9), SamplingConfig(top_k=20)
    both = SamplingConfig(top_p=0.95, top_k=20)
    for sampling in (top_p, top_k, both):
        assert rl.Config(sampling=sampling, kept_set="recomputed").sampling == sampling
    assert bounded(top_p).top_k == KEPT_SET_BOUND == 512
    assert bounded(both) == both and bounded(top_k) == top_k and bounded(SamplingConfig()).top_k == -1
    for bad in ({"top_p": 0.0}, {"top_p": 1.5}, {"top_k": 0}):
        with pytest.raises(ValueError, match="sampling.top_"):
            SamplingConfig(**bad)
    rl.Config(sampling=SamplingConfig(temperature=0.7))  # temperature alone is matched exactly


def test_greedy_sampling_is_refused_for_training():
    from lib.sampling import SamplingConfig

    with pytest.raises(ValueError, match="temperature > 0"):
        rl.Config(sampling=SamplingConfig(temperature=0))


def test_a_preset_whose_sft_stage_has_not_run_names_the_command_that_makes_it(tmp_path, monkeypatch):
    from lib.models.load import check_model_name

    monkeypatch.chdir(tmp_path)  # a fresh checkout: no outputs/
    for env in ("reverse_text", "tiny"):
        config = parse(rl.Config, ["@", str(ROOT / f"configs/{env}/rl.toml")])
        with pytest.raises(ValueError, match=f"run `make sft ENV={env}` to create it"):
            check_model_name(config.model.name)


def test_a_server_whose_weights_root_lacks_the_run_directory_says_so(tiny_dir, server, tmp_path):
    import tempfile

    with tempfile.TemporaryDirectory() as outside:  # not under the server's --weights-root
        with pytest.raises(
            ValueError,
            match=r"loads weights only from under its --weights-root .* start it \(scripts/serve.py\) with --weights-root",
        ):
            rl.main(rl_config(tiny_dir, f"{outside}/run", server.url, "--steps", "1"))


def test_lora_dropout_is_refused_for_training():
    # Dropout in the trainer's forward scores other weights than the servers sample with: measured
    # on-policy with --lora.dropout 0.5, a ratio of 0.9915-0.9994 and a mismatch KL of 0.004-0.005.
    from lib.trainer.trainable import LoraConfig

    with pytest.raises(ValueError, match="lora.dropout = 0"):
        rl.Config(lora=LoraConfig(rank=8, dropout=0.5))
    rl.Config(lora=LoraConfig(rank=8))


def test_shared_prompts_need_packed_sdpa_rows():
    from lib.models.load import ModelConfig

    with pytest.raises(ValueError, match="share_prompts on needs packing"):
        rl.Config(share_prompts="on", packing=False)
    with pytest.raises(ValueError, match="share_prompts on needs packing"):
        rl.Config(share_prompts="on", model=ModelConfig(attn_implementation="eager"))
    rl.Config(share_prompts="on")


def test_shared_prompts_train_on_policy_with_a_ratio_of_one(tiny_dir, server, tmp_path, monkeypatch):
    # Packed rows on a CPU share each group's prompt (share_prompts auto): fewer tokens in the rows, and
    # every sampled token still scored as the server sampled it.
    built = recorded_layouts(monkeypatch)
    result = rl.main(rl_config(tiny_dir, tmp_path / "run", server.url, "--max-async-level", "0", "--packing"))
    assert built and all(shared and in_rows < whole for shared, in_rows, whole in built), built
    trained = [m for m in result["history"] if learned(m)]
    assert trained, "no step had a learning signal"
    for metrics in trained:
        assert abs(metrics["train/importance_ratio"] - 1.0) < 1e-3, metrics


def test_lora_training_scores_on_policy_tokens_with_the_servers_weights(tiny_dir, server, tmp_path):
    # On-policy, every step's tokens are scored by the weights that sampled them: a ratio of exactly 1
    # and no mismatch, in the loss (train/*) as in the probe (sync/*).
    flags = ("--lora.rank", "8", "--optim.lr", "3e-2", "--max-async-level", "0")
    on_base_weights(server.url, tiny_dir)
    result = rl.main(rl_config(tiny_dir, tmp_path / "run", server.url, *flags))
    for metrics in result["history"]:
        assert metrics["sync/probe_logprob_difference"] < 1e-3, metrics
        assert abs(metrics["train/importance_ratio"] - 1) < 1e-3 and metrics["train/mismatch_kl"] < 1e-5, (
            metrics
        )


@pytest.mark.slow
def test_rollout_errors_are_logged_per_step_with_a_running_total(
    tiny_dir, server, tmp_path, monkeypatch, capsys
):
    import dataclasses

    import lib.orchestrator.envs

    # The real producer, whose first episode of each task asks a port where no server listens: one
    # real episode error per group. On-policy, a step's groups all finish before the step takes them.
    run_episode, asked = lib.orchestrator.envs.run_episode, set()

    async def first_episode_fails(vf_env, task, context):
        if task.data.id not in asked:
            asked.add(task.data.id)
            dead = context.client.model_copy(update={"base_url": "http://127.0.0.1:9/v1"})
            context = dataclasses.replace(context, client=dead)
        return await run_episode(vf_env, task, context)

    monkeypatch.setattr(lib.orchestrator.envs, "run_episode", first_episode_fails)
    result = rl.main(
        rl_config(tiny_dir, tmp_path / "run", server.url, "--steps", "3", "--max-async-level", "0")
    )
    assert [m["rollouts/errors"] for m in result["history"]] == [4, 4, 4]  # 4 groups a step
    assert "4 rollout errors (12 in the run)" in capsys.readouterr().out


def test_on_policy_ratio_is_one_and_the_server_gets_each_step_weights(tiny_dir, server, tmp_path):
    # An earlier run leaves the attached server on other weights: the next run must start it on its own.
    rl.main(rl_config(tiny_dir, tmp_path / "earlier", server.url, "--steps", "1", "--optim.lr", "3e-2"))
    result = rl.main(rl_config(tiny_dir, tmp_path / "run", server.url, "--max-async-level", "0"))
    trained = [m for m in result["history"] if learned(m)]
    assert trained, "no step had a learning signal"
    for metrics in trained:  # sampled and trained by the same weights: only numerics separate them
        assert abs(metrics["train/importance_ratio"] - 1.0) < 1e-3, metrics
        assert metrics["rollouts/staleness_max"] == 0
    # The server now answers with weights/step_2: its logprobs match a forward pass of those weights.
    assert result["weights"].name == "step_2" and result["weights"].is_dir()
    tokenizer = load_tokenizer(str(result["weights"]))
    prompt = tokenizer("Reverse: hello")["input_ids"]
    body = {
        "model": str(tiny_dir),
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 1.0,
        "logprobs": 0,
        "seed": 3,
        "return_token_ids": True,
    }
    choice = httpx.post(f"{server.url}/completions", json=body, timeout=60).json()["choices"][0]
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(result["weights"]).eval()
    ids = torch.tensor([prompt + choice["token_ids"]])
    with torch.no_grad():
        logp = model(ids).logits[0, :-1].log_softmax(-1).gather(-1, ids[0, 1:, None])[:, 0]
    expected = logp[len(prompt) - 1 :].tolist()
    assert max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], expected)) < 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("compiled", ["off", "on"])
def test_bf16_autocast_on_cpu_keeps_the_on_policy_ratio_within_bf16_tolerance(
    compiled, tiny_dir, server, tmp_path
):
    # The trainer's matmuls in bf16 over float32 master weights, the server's in float32 on the float32
    # weights written: only bf16's rounding separates them, as on a GPU (docs/metrics.md: 1 +- 0.01). The
    # same with the trainer's norms and MLPs compiled (model.compile, auto on a wide model's bf16 CPU run).
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    flags = ("--max-async-level", "0", "--model.autocast", "on", "--model.compile", compiled)
    result = rl.main(rl_config(tiny_dir, tmp_path / "run", server.url, *flags))
    assert (counters["stats"]["unique_graphs"] > 0) == (compiled == "on")
    trained = [m for m in result["history"] if learned(m)]
    assert trained, "no step had a learning signal"
    for metrics in trained:
        assert abs(metrics["train/importance_ratio"] - 1.0) < 1e-2, metrics
        assert metrics["train/mismatch_kl"] < 1e-3, metrics
    # Within the bf16 probe tolerance, and far from float32's agreement (~1e-6): the trainer did score in bf16.
    differences = [m["sync/probe_logprob_difference"] for m in result["history"]]
    assert 1e-4 < max(differences) < probing.BF16_PROBE_TOLERANCE, differences


@pytest.mark.slow
def test_eval_during_rl_scores_held_out_tasks_and_every_record_reaches_wandb(
    tiny_dir, server, tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run"
    evaluation = ("--eval.every", "2", "--eval.num-examples", "4", "--eval.rollouts-per-example", "2")
    wandb = ("--wandb.project", "p", "--wandb.name", "n", "--wandb.offline")
    rl.main(rl_config(tiny_dir, out, server.url, "--steps", "3", *evaluation, *wandb))

    # At the start, every 2 steps and at the end; sampled with pass@2, and greedy.
    scalars = tensorboard_scalars(out)
    for tag in ("eval/reward", "eval/reward_greedy", "eval/pass@2", "eval/seconds"):
        assert scalars[tag].keys() == {0, 2, 3}, tag
    assert scalars["reward/mean"].keys() == {1, 2, 3}
    # wandb got every scalar of every step, with tensorboard's values (which are float32).
    logged = wandb_history(out)
    assert set(logged) == set(scalars)
    for tag, steps in scalars.items():
        assert logged[tag] == pytest.approx(steps, rel=1e-6), tag

    # Held out by task id: the last 4 of letter_taskset's 16, never among the trained rollouts.
    trained = [json.loads(line) for path in (out / "rollouts").glob("step_*.jsonl") for line in path.open()]
    assert {r["task_id"] for r in trained} <= {f"letter-{i}" for i in range(12)}
    assert all(r["prompt"].startswith("[user] Say aaa") and "completion" in r for r in trained)
    for step in (0, 2, 3):
        for kind, count in (("sampled", 8), ("greedy", 4)):
            records = [json.loads(line) for line in (out / f"eval/step_{step}/{kind}.jsonl").open()]
            assert len(records) == count
            assert {r["task_id"] for r in records} == {f"letter-{i}" for i in range(12, 16)}

    assert (out / "reward_curve.png").read_bytes()[:4] == b"\x89PNG"
    provenance = json.loads((out / "provenance.json").read_text())
    assert provenance["servers"] == [{"url": server.url, "command": None, "engine": "plainrl"}]

    # metrics.jsonl: a line per step with tensorboard's scalars, the evaluation's in its step's line.
    lines = [json.loads(line) for line in (out / "metrics.jsonl").open()]
    assert [line["step"] for line in lines] == [0, 1, 2, 3]
    for line in lines:
        logged = {tag: steps[line["step"]] for tag, steps in scalars.items() if line["step"] in steps}
        assert {tag: line[tag] for tag in logged} == pytest.approx(logged, rel=1e-6)
    # The console: a short line per step, a sample at the last step, and a summary that ends the run.
    console = capsys.readouterr().out.splitlines()
    steps = [line for line in console if line.startswith("step ")]
    assert [line.split()[1] for line in steps] == ["1/3", "2/3", "3/3"]
    assert all(len(line) <= 100 and "reward" in line and "s: rollouts" in line for line in steps), steps
    (sample,) = [i for i, line in enumerate(console) if line.startswith("sample at step 3, reward ")]
    assert console[sample + 1].startswith("  user: Say aaa"), console[sample + 1]
    assert console[sample + 2].startswith("  completion:"), console[sample + 2]
    summary = "\n".join(console[-10:])
    assert f"reward/mean {lines[1]['reward/mean']:.3f} -> {lines[3]['reward/mean']:.3f}" in summary
    assert f"eval, sampled {lines[0]['eval/reward']:.3f} -> {lines[3]['eval/reward']:.3f}" in summary
    for path in ("metrics.jsonl", "reward_curve.png", "weights/step_3", "tb"):
        assert str(out / path) in summary, path
    assert console[-1] == f"run dir: {out}"
    assert {"torch", "transformers", "verifiers", "vllm"} <= set(provenance["packages"])


def test_activation_checkpointing_keeps_the_step_on_policy(tiny_dir, server, tmp_path):
    flags = ("--max-async-level", "0", "--steps", "1", "--activation-checkpointing")
    (metrics,) = rl.main(rl_config(tiny_dir, tmp_path / "run", server.url, *flags))["history"]
    assert learned(metrics) and abs(metrics["train/importance_ratio"] - 1.0) < 1e-3, metrics


def test_async_level_two_runs_and_logs_staleness(tiny_dir, server, tmp_path):
    result = rl.main(
        rl_config(tiny_dir, tmp_path / "run", server.url, "--max-async-level", "2", "--steps", "3")
    )
    assert len(result["history"]) == 3
    for metrics in result["history"]:
        assert 0 <= metrics["rollouts/staleness_max"] <= 2 and "time/wait_rollouts" in metrics
        # Beside training only the weight check runs after a reload, no logprob probe: no figure for it.
        assert "sync/probe_logprob_difference" not in metrics, metrics
    assert (tmp_path / "run" / "rollouts" / "step_3.jsonl").is_file()
    assert (tmp_path / "run" / "tb").is_dir() and (tmp_path / "run" / "config.toml").is_file()


def own_server_command(tiny_dir, out, *extra) -> list[str]:
    """A short run on letter_taskset that starts its own server, as `make rl ENV=tiny` does."""
    return [
        sys.executable,
        str(ROOT / "scripts/rl.py"),
        "@",
        str(ROOT / "configs/tiny/rl.toml"),
        "--model.name",
        str(tiny_dir),
        "--output-dir",
        str(out),
        "--keep-weights",
        "2",
        "--examples-per-step",
        "2",
        "--rollouts-per-example",
        "4",
        "--sampling.max-tokens",
        "32",
        "--inference.engine",
        "torch",
        "--env.id",
        "letter_taskset",
        *extra,
    ]


def start_job_until(command: list[str], cwd, ready, env) -> subprocess.Popen:
    """Starts the command as a shell starts a job (a process group of its own, output to cwd/job.out
    and cwd/job.err) and returns once the path `ready` exists."""
    with open(cwd / "job.out", "w") as out, open(cwd / "job.err", "w") as err:
        process = subprocess.Popen(command, cwd=cwd, start_new_session=True, stdout=out, stderr=err, env=env)
    deadline = time.monotonic() + 240
    while not ready.exists():  # a run on the disk keeps weights two steps (keep_weights 2): look often
        assert process.poll() is None and time.monotonic() < deadline, f"no {ready} appeared"
        time.sleep(0.01)
    return process


def kill_at_step_6_then_resume(command: list[str], cwd, out, env) -> subprocess.CompletedProcess:
    """Runs `command` (checkpoints every 4 steps) until step 6 has trained (its rollouts file, written with
    either weight sync), kill -9s its process group, checks that checkpoint 4 is the newest, and resumes
    it to step 8."""
    process = start_job_until(command, cwd, out / "rollouts" / "step_6.jsonl", env)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    newest = max(int(p.name[5:]) for p in (out / "checkpoints").glob("step_*"))
    assert newest == 4, newest
    resumed = subprocess.run(
        command + ["--steps", "8", "--resume"], cwd=cwd, capture_output=True, text=True, timeout=300, env=env
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return resumed


@pytest.mark.slow
@pytest.mark.parametrize("weight_sync", ["memory", "disk"])  # memory: what its own server on a CPU takes
def test_kill_9_then_resume_continues_from_the_last_checkpoint(weight_sync, tiny_dir, tmp_path):
    out = tmp_path / "run"
    sync = ("--inference.weight-sync", weight_sync)
    command = own_server_command(tiny_dir, out, "--steps", "40", "--checkpoint-every", "4", *sync)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{FIXTURES}"}  # this checkout's lib, not an installed one
    # Killed two steps past checkpoint 4 (on the disk, weights/step_5 and step_6 exist, newer than what
    # resumes; in memory the group with the dead trainer's server is formed again with a new one).
    # Killed with its process group, as a killed job would be; the server it started (in a group of its
    # own) follows through PR_SET_PDEATHSIG.
    resumed = kill_at_step_6_then_resume(command, tmp_path, out, env)
    assert "(step 4)" in resumed.stdout
    # The killed run's steps past checkpoint 4 left metrics.jsonl when the resumed run logged them again.
    assert [json.loads(line)["step"] for line in (out / "metrics.jsonl").open()] == list(range(1, 9))
    assert (out / "weights" / "step_8").is_dir() and (out / "checkpoints" / "step_8").is_dir()
    leftovers = [p.name for p in out.rglob(".tmp-*")]
    assert leftovers == [], leftovers


@pytest.mark.slow
def test_a_run_killed_before_its_first_checkpoint_restarts_in_its_directory(tiny_dir, tmp_path):
    from conftest import tensorboard_scalars

    out = tmp_path / "run"
    # On the disk, where the dead run's weights/step_N are what the rerun must move aside.
    sync = ("--inference.weight-sync", "disk")
    command = own_server_command(tiny_dir, out, "--steps", "40", "--checkpoint-every", "10", *sync)
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{FIXTURES}"}
    process = start_job_until(command, tmp_path, out / "weights" / "step_3", env)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert not list((out / "checkpoints").glob("step_*"))
    # Before, the rerun published weights/step_0, pruned it beside the dead run's step_2..3 and died in
    # reload_weights with a traceback. Now it starts over and says so in one line (without --resume too:
    # tests/test_checkpoint.py).
    rerun = subprocess.run(
        command + ["--steps", "2", "--resume"], cwd=tmp_path, capture_output=True, text=True, env=env
    )
    assert rerun.returncode == 0 and "Traceback" not in rerun.stderr, rerun.stderr[-3000:]
    assert f"no checkpoint in {out}: starting at step 0" in rerun.stdout, rerun.stdout
    (moved,) = (out / "restarted").iterdir()
    assert (moved / "weights" / "step_3").is_dir() and (moved / "tb").is_dir()
    assert sorted(p.name for p in (out / "weights").iterdir()) == ["step_1", "step_2"]
    assert set(tensorboard_scalars(out)["reward/mean"]) == {1, 2}  # the new run's steps alone


def test_a_restart_sets_aside_everything_a_run_and_its_export_wrote(tiny_dir, tmp_path):
    # Seen (#77 item 4): after a demo rerun, rl/exported/step_2 held the old run's weights while its export.json
    # named the new run's checkpoint: a restart left exported/ where it was.
    from lib import rundir

    out = tmp_path / "run"
    flags = [
        "--steps",
        "2",
        "--eval.every",
        "2",
        "--eval.num-examples",
        "2",
        "--eval.rollouts-per-example",
        "1",
    ]
    rl.main(parse(rl.Config, own_server_command(tiny_dir, out, *flags)[2:]))
    export = load_script("export")
    export.main(parse(export.Config, [str(out / "checkpoints" / "step_2")]))
    wrote = {p.name for p in out.iterdir()}
    assert {"server.log", "eval", "rollouts", "exported", "reward_curve.png"} <= wrote, wrote
    moved = rundir.set_aside(out)
    # What stays: the lock and the new run's config.toml and base.json (rewritten; copies go with the rest).
    assert sorted(p.name for p in out.iterdir()) == ["base.json", "config.toml", "restarted", "run.lock"]
    assert {p.name for p in moved.iterdir()} == wrote - {"run.lock", "restarted"}


@pytest.mark.slow
def test_wandb_keeps_every_step_tensorboard_has_across_kill_9_and_resume(tiny_dir, tmp_path):
    out = tmp_path / "run"
    wandb = ("--wandb.project", "p", "--wandb.offline", "--checkpoint-every", "4")
    command = own_server_command(tiny_dir, out, "--steps", "40", *wandb)
    # A wandb service an earlier test in this process started is not this run's.
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    env |= {"PYTHONPATH": f"{ROOT}:{FIXTURES}", "WANDB_MODE": "offline"}
    kill_at_step_6_then_resume(command, tmp_path, out, env)  # wandb's own process lives on
    # Steps 1-4 come from the killed run, 5-8 from the resumed one, which logged again from step 5.
    scalars, logged = tensorboard_scalars(out), wandb_history(out)
    assert scalars["reward/mean"].keys() == set(range(1, 9))
    for tag, steps in scalars.items():
        assert {step: logged.get(tag, {}).get(step) for step in steps} == pytest.approx(steps, rel=1e-6), tag


@pytest.mark.slow
def test_ctrl_c_checkpoints_the_step_it_is_on_then_resume_continues(tiny_dir, tmp_path):
    out = tmp_path / "run"
    command = own_server_command(tiny_dir, out, "--steps", "40", "--checkpoint-every", "100")
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{FIXTURES}"}  # this checkout's lib, not an installed one
    process = start_job_until(command, tmp_path, out / "rollouts" / "step_3.jsonl", env)
    os.killpg(process.pid, signal.SIGINT)  # a terminal's Ctrl-C goes to the job's whole process group
    process.wait(timeout=120)
    stdout, stderr = (tmp_path / "job.out").read_text(), (tmp_path / "job.err").read_text()
    assert process.returncode == 130, stderr[-3000:]
    assert "--resume" in stderr and "Traceback" not in stderr, stderr[-3000:]
    stopped_at = [int(p.name[5:]) for p in (out / "checkpoints").glob("step_*")]
    assert len(stopped_at) == 1 and 3 <= stopped_at[0] < 40, stopped_at  # the step it was on, not step 100
    assert f"stopped after step {stopped_at[0]}" in stdout
    resumed = subprocess.run(
        own_server_command(tiny_dir, out, "--steps", str(stopped_at[0] + 2), "--resume"),
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"(step {stopped_at[0]})" in resumed.stdout
    assert (out / "checkpoints" / f"step_{stopped_at[0] + 2}").is_dir()


def test_three_turn_alphabet_sort_runs_end_to_end_and_warns_when_flat(tiny_dir, server, tmp_path, capsys):
    args = '{"min_turns": 3, "max_turns": 3, "max_names_per_turn": 2}'
    cfg = rl_config(
        tiny_dir,
        tmp_path / "run",
        server.url,
        "--env.id",
        "alphabet_sort",
        "--env.args",
        args,
        "--steps",
        "1",
        "--examples-per-step",
        "2",
        "--rollouts-per-example",
        "2",
        "--sampling.max-tokens",
        "16",
    )
    result = rl.main(cfg)
    (metrics,) = result["history"]
    assert metrics["rollouts/errors"] == 0
    # The untrained model never writes the answer tags: every group is flat, and the run says so.
    assert metrics["rollouts/flat_groups"] == 2
    output = capsys.readouterr().out
    assert "no learning signal" in output
    # A turn cut at max_tokens (no end token) makes the next turn's render fork the token graph: such an
    # episode yields one training sample per branch, so there are at least as many records as episodes.
    lines = (tmp_path / "run" / "rollouts" / "step_1.jsonl").read_text().splitlines()
    assert len(lines) >= 4
    # Each record holds its whole episode, as eval.py's results do: every turn's messages, whichever branch
    # (a branch cut at turn 1 held the first user message and one completion only), and its tokens.
    for record in map(json.loads, lines):
        roles = [message["role"] for message in record["messages"]]
        assert roles.count("user") == roles.count("assistant") == record["num_turns"] == 3, record
        assert roles[-1] == "assistant" and len(record["finish_reasons"]) == 3, record
        assert 0 < record["num_sampled_tokens"] < record["num_tokens"], record
    # The console's sample is the episode's last turn.
    assert "(turn 3 of 3)" in output and "Now sort ALL of these names" in output, output


# The loss's sequence-level options: GSPO's ratio, per-rollout means, a sequence mismatch mask, overlong
# masking (the replayed rollouts of 18 or more sampled tokens count as cut) and the step's std.
SEQUENCE_LEVEL = [
    *("--loss.variant", "ppo", "--loss.ratio-level", "sequence", "--loss.aggregation", "sequence_mean"),
    *("--loss.mismatch-correction", "mask", "--loss.mismatch-level", "sequence"),
    *("--loss.mismatch-cap", "1.05", "--loss.mask-truncated", "--advantage.normalize", "step"),
]
KL_AND_ENTROPY = ["--loss.kl-coef", "0.1", "--loss.entropy-coef", "0.01"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [[], ["--lora.rank", "4", "--optim.lr", "1e-2"], SEQUENCE_LEVEL, KL_AND_ENTROPY],
    ids=["full", "lora", "sequence_level", "kl_and_entropy"],
)
def test_two_cpu_processes_match_one_on_the_same_batches(tiny_dir, server, tmp_path, monkeypatch, extra):
    """Full fine-tuning; LoRA, whose adapter the two processes gather from their shards and sync; and the
    sequence-level options, whose per-rollout quantities and step-wide counts must not depend on the ranks."""
    lora = "--lora.rank" in extra
    from replay_rl import REPLAY_CHUNK_TOKENS, ReplayProducer
    from safetensors.torch import load_file
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import lib.orchestrator.producer
    import lib.trainer.head

    flags = ["--steps", "2", "--micro-batch-size", "1", "--seq-len", "64", "--max-async-level", "0", *extra]
    monkeypatch.setattr(lib.orchestrator.producer, "Producer", ReplayProducer)
    monkeypatch.setattr(
        lib.trainer.head, "CHUNK_TOKENS", REPLAY_CHUNK_TOKENS
    )  # the output layer in several chunks
    if lora:
        on_base_weights(server.url, tiny_dir)
    one = rl.main(rl_config(tiny_dir, tmp_path / "one", server.url, *flags))
    port = str(launch.free_port())  # other test runs may share this machine
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", port]
    args = rl_config_args(tiny_dir, tmp_path / "two", server.url, *flags)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{ROOT}:{FIXTURES}"}
    result = subprocess.run(
        [*torchrun, str(FIXTURES / "replay_rl.py"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    events = EventAccumulator(str(tmp_path / "two" / "tb")).Reload()
    two_losses = [event.value for event in events.Scalars("train/loss")]
    one_losses = [m["train/loss"] for m in one["history"]]
    assert all(loss != 0.0 for loss in one_losses)
    assert two_losses == pytest.approx(one_losses, rel=1e-4, abs=1e-6)
    if not lora:  # every loss metric and step-wide count, as the one process logged them
        tags = [tag for tag in one["history"][0] if tag.startswith("train/")]
        two_values = {(tag, i): event.value for tag in tags for i, event in enumerate(events.Scalars(tag))}
        one_values = {(tag, i): m[tag] for tag in tags for i, m in enumerate(one["history"])}
        assert two_values == pytest.approx(one_values, rel=1e-4, abs=1e-6)
    if extra == KL_AND_ENTROPY:  # a reference sharded like the policy; the entropy's gradient over the ranks
        assert one["history"][0]["train/ref_kl"] == pytest.approx(0, abs=1e-7)
        assert one["history"][1]["train/ref_kl"] > 1e-6
    if extra == SEQUENCE_LEVEL:  # the options really acted
        assert all(
            0 < m["train/mismatch_masked"] < 1 and m["train/truncated_masked"] > 0 for m in one["history"]
        )
    merged = "merged/" if lora else ""  # a LoRA run's last step: its adapter, and the merged model
    a = load_file(tmp_path / "one" / "weights" / "step_2" / f"{merged}model.safetensors")
    b = load_file(tmp_path / "two" / "weights" / "step_2" / f"{merged}model.safetensors")
    start = load_file(tiny_dir / "model.safetensors")
    assert any(not torch.equal(a[k], start[k]) for k in a)  # the steps did move the weights
    # LoRA: Adam's first steps from B = 0 are near lr x sign(gradient), which magnifies the last bits of a
    # sum taken in another order (1.4e-5 seen on one of 512 entries, against steps of 1e-2).
    atol = 1e-4 if lora else 1e-5
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=atol)
    if lora:
        a, b = (
            load_file(tmp_path / run / "weights" / "step_1" / "adapter_model.safetensors")
            for run in ("one", "two")
        )
        assert a.keys() == b.keys() and len(a) == 2 * 7 * 2  # A and B of 7 layers in each of 2 blocks
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=atol)


def test_rl_runs_an_upstream_shaped_endless_taskset_with_a_tool(tiny_dir, server, tmp_path):
    """upstream_taskset (its own Env class, settings under "task", `idx` ids, endless, a tool offered):
    rl.py draws its tasks lazily, in order, and every episode runs (the untrained model's groups are flat)."""
    cfg = rl_config(
        tiny_dir,
        tmp_path / "run",
        server.url,
        "--env.id",
        "upstream_taskset",
        "--env.args",
        '{"task": {"exact": false}}',
        "--examples-per-step",
        "2",
        "--rollouts-per-example",
        "2",
        "--sampling.max-tokens",
        "16",
    )
    result = rl.main(cfg)
    assert [m["rollouts/errors"] for m in result["history"]] == [0, 0]
    records = [
        json.loads(line)
        for step in (1, 2)
        for line in (tmp_path / "run" / "rollouts" / f"step_{step}.jsonl").read_text().splitlines()
    ]
    # 2 steps of 2 groups, at most one step ahead: tasks 0-5 at most were drawn, each played twice.
    ids = [record["task_id"] for record in records]
    assert len(ids) == 8 and set(ids) <= {str(i) for i in range(6)} and all(ids.count(i) == 2 for i in ids)
    assert all("reply with the sum only" in json.dumps(record["prompt"]) for record in records)


@pytest.mark.slow
def test_at_async_level_one_the_next_step_trains_while_the_servers_reload(
    tiny_dir, server, tmp_path, monkeypatch
):
    import lib.trainer.head
    from lib.inference.weights import reload

    reloads, trained = {}, []
    reload_weights, score = reload.reload_weights, lib.trainer.head.next_token_scores
    followed = {"step_1", "step_2", "step_3"}  # reloads a later step of the 4 could train beside

    def slow_reload(urls, directory, api_key, label, **kwargs):
        # A slow file system or a large model: the reload lasts until training has begun again (bounded),
        # so the overlap does not depend on how fast this machine samples the next step's rollouts. A
        # controller that waited for the reload before training would sit out the bound and fail below.
        began, calls = time.monotonic(), len(trained)
        if label in followed:
            eventually(lambda: len(trained) > calls, 20)
        reload_weights(urls, directory, api_key, label, **kwargs)
        reloads[label] = (began, time.monotonic())

    def timed_scores(*args, **kwargs):
        trained.append(time.monotonic())
        return score(*args, **kwargs)

    monkeypatch.setattr(reload, "reload_weights", slow_reload)
    monkeypatch.setattr(lib.trainer.head, "next_token_scores", timed_scores)
    result = rl.main(
        rl_config(tiny_dir, tmp_path / "run", server.url, "--steps", "4", "--max-async-level", "1")
    )
    history = result["history"]
    assert sorted(reloads) == ["step_0", "step_1", "step_2", "step_3", "step_4"]  # the last one waited for
    # Step N+1 trained while reload N was still running (before, every reload sat between two steps).
    overlapping = [
        label for label, (began, ended) in reloads.items() if any(began < t < ended for t in trained)
    ]
    assert sorted(overlapping) == sorted(followed), (reloads, trained)
    assert all(m["rollouts/staleness_max"] <= 1 for m in history), history
    assert history[0]["time/wait_sync"] < 2.0 and "time/wait_sync" in history[-1]
    assert result["weights"] == tmp_path / "run" / "weights" / "step_4"


def test_a_reload_that_fails_beside_training_still_stops_the_run(tiny_dir, server, tmp_path, monkeypatch):
    from lib.inference.weights import reload

    reload_weights = reload.reload_weights

    def failing_reload(urls, directory, api_key, label, **kwargs):
        if label == "step_2":
            raise UserError(f"the inference server {urls[0]} could not load {directory}")
        reload_weights(urls, directory, api_key, label, **kwargs)

    monkeypatch.setattr(reload, "reload_weights", failing_reload)
    with pytest.raises(UserError, match="could not load .*step_2"):
        rl.main(rl_config(tiny_dir, tmp_path / "run", server.url, "--steps", "4", "--max-async-level", "1"))


def test_one_reload_at_a_time(monkeypatch, tiny_dir):
    from lib.inference.weights import probing, reload, sync

    monkeypatch.setattr(reload, "reload_weights", lambda *args, **kwargs: time.sleep(0.5))
    monkeypatch.setattr(probing, "probe", lambda *args: probing.Probe("http://x/v1", [], [], None))
    loaded = []
    reloader = sync.Reloader(
        sync.Servers(["http://x/v1"], ["m"]), load_tokenizer(str(tiny_dir)), loaded.append
    )
    try:
        reloader.start(1, tiny_dir)
        assert reloader.in_flight()
        with pytest.raises(AssertionError, match="one sync at a time"):
            reloader.start(2, tiny_dir)
        waited, took = reloader.wait()
        assert loaded == [1] and took >= 0.5 and not reloader.in_flight()
    finally:
        reloader.close()


REPLAY_FLAGS = ["--micro-batch-size", "1", "--seq-len", "64", "--max-async-level", "0"]


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_reference_kl_is_zero_at_the_first_step_and_grows_after(
    tiny_dir, server, tmp_path, monkeypatch, lora
):
    """The reference is the starting weights: a frozen copy (full), the adapter off (LoRA: no model more)."""
    from replay_rl import ReplayProducer

    import lib.models.load
    import lib.orchestrator.producer

    loaded, load_trainable = [], lib.trainer.trainable.load_trainable

    def counted(*args, **kwargs):
        loaded.append(load_trainable(*args, **kwargs))
        return loaded[-1]

    monkeypatch.setattr(lib.orchestrator.producer, "Producer", ReplayProducer)
    monkeypatch.setattr(lib.trainer.trainable, "load_trainable", counted)
    lora_flags = ["--lora.rank", "4", "--optim.lr", "1e-2"] if lora else ["--optim.lr", "3e-2"]
    if lora:
        on_base_weights(server.url, tiny_dir)
    flags = ["--steps", "3", *REPLAY_FLAGS, "--loss.kl-coef", "0.1", *lora_flags]
    history = rl.main(rl_config(tiny_dir, tmp_path / "run", server.url, *flags))["history"]
    kl = [m["train/ref_kl"] for m in history]
    assert abs(kl[0]) < 1e-7 and 1e-6 < kl[1] < kl[2], kl  # identical weights, then apart, further apart
    assert len(loaded) == (1 if lora else 2)  # LoRA: no second model, so no parameter more


def test_a_resumed_run_rebuilds_the_reference_from_the_starting_weights(
    tiny_dir, server, tmp_path, monkeypatch
):
    """Its KL at steps 3 and 4 is the uninterrupted run's: a reference read from the checkpoint would be ~0."""
    from replay_rl import ReplayProducer

    import lib.orchestrator.producer

    class DiesAtStep3(ReplayProducer):
        def take(self, step: int, report=print, check=None):
            if step == 2:
                raise RuntimeError("the run dies before step 3")
            return super().take(step, report, check)

    flags = [
        "--steps",
        "4",
        "--checkpoint-every",
        "2",
        *REPLAY_FLAGS,
        "--loss.kl-coef",
        "0.1",
        "--optim.lr",
        "3e-2",
    ]
    monkeypatch.setattr(lib.orchestrator.producer, "Producer", ReplayProducer)
    whole = rl.main(rl_config(tiny_dir, tmp_path / "whole", server.url, *flags))["history"]
    monkeypatch.setattr(lib.orchestrator.producer, "Producer", DiesAtStep3)
    with pytest.raises(RuntimeError, match="dies before step 3"):
        rl.main(rl_config(tiny_dir, tmp_path / "resumed", server.url, *flags))
    monkeypatch.setattr(lib.orchestrator.producer, "Producer", ReplayProducer)
    resumed = rl.main(rl_config(tiny_dir, tmp_path / "resumed", server.url, *flags, "--resume"))["history"]
    assert len(resumed) == 2 and whole[2]["train/ref_kl"] > 1e-6
    for before, after in zip(whole[2:], resumed):
        assert after["train/ref_kl"] == pytest.approx(before["train/ref_kl"], rel=1e-5, abs=1e-9)
        assert after["train/loss"] == pytest.approx(before["train/loss"], rel=1e-5, abs=1e-9)


def test_a_seq_len_shorter_than_the_prompt_stops_before_any_rollout(tiny_dir, server, tmp_path, capsys):
    # letter_taskset's prompt, "Say aaa 0." in the tiny model's chat template, is ~40 characters (tokens).
    with pytest.raises(
        ValueError, match=r"its first prompt is \d+ tokens with the chat template, and seq_len 16 "
    ):
        rl.main(rl_config(tiny_dir, tmp_path / "run", server.url, "--seq-len", "16"))
    assert "rollout error" not in capsys.readouterr().out


def test_rl_py_reads_as_the_design_s_loop_in_under_400_lines():
    """Setup lives in the rooms (trainer/trainable load_policy, orchestrator/producer start_producer,
    inference/weights/sync open_servers, trainer/train train_step): main() reads as DESIGN.md's loop."""
    import ast

    source = (ROOT / "scripts" / "rl.py").read_text()
    assert len(source.splitlines()) < 400, len(source.splitlines())
    main = next(node for node in ast.parse(source).body if getattr(node, "name", None) == "main")
    assert main.end_lineno - main.lineno + 1 <= 160, main.end_lineno - main.lineno + 1
    sections = [
        line.strip("# -") for line in source.splitlines()[main.lineno : main.end_lineno] if "# ----" in line
    ]
    assert sections[:2] == ["config and run directory", "model, optimizer, loss"], sections
    assert {"train", "weight sync and evaluation", "log", "checkpoint"} <= set(sections), sections


def test_an_environment_file_whose_reward_is_nan_ends_the_run_before_any_step(tiny_dir, server, tmp_path):
    # Seen with --advantage.normalize none: one step, every weight NaN, the server loaded them, and the run
    # ended blaming the server.
    path = tmp_path / "nan_env.py"
    path.write_text(
        "def examples():\n    return [{'prompt': f'say {i}', 'id': f'n{i}'} for i in range(8)]\n\n"
        "def reward(completion, example):\n    return float('nan')\n"
    )
    flags = ["--env.id", str(path), "--advantage.normalize", "none", "--max-async-level", "0"]
    with pytest.raises(UserError, match=rf"environment file {path}: .* returned nan for example n\d"):
        rl.main(rl_config(tiny_dir, tmp_path / "run", server.url, *flags, "--sampling.max-tokens", "4"))
    assert not (tmp_path / "run" / "checkpoints").exists()
    assert not (tmp_path / "run" / "weights" / "step_1").exists()


def test_an_environment_file_with_fewer_examples_than_a_step_is_refused_before_the_run_directory(
    tiny_dir, tmp_path
):
    path = tmp_path / "two.py"
    path.write_text(
        "def examples():\n    return [{'prompt': 'a'}, {'prompt': 'b'}]\n\n"
        "def reward(completion, example):\n    return 1.0\n"
    )
    config = rl_config(tiny_dir, tmp_path / "run", "http://127.0.0.1:9/v1", "--env.id", str(path))
    with pytest.raises(UserError, match=r"gave 2 examples, and one step takes 4 \(examples_per_step\)"):
        rl.main(config)
    assert not (tmp_path / "run").exists()


def test_a_lora_resume_refuses_a_base_model_whose_weights_changed(tiny_dir, server, tmp_path):
    from safetensors.torch import load_file, save_file

    base = tmp_path / "base"
    shutil.copytree(tiny_dir, base)
    on_base_weights(server.url, tiny_dir)  # a LoRA run loads only its adapter onto what the server holds
    lora = ("--lora.rank", "4", "--max-async-level", "0", "--sampling.max-tokens", "8")
    rl.main(rl_config(base, tmp_path / "run", server.url, *lora, "--steps", "1"))
    weights = base / "model.safetensors"
    save_file({name: t + 0.5 for name, t in load_file(weights).items()}, weights, metadata={"format": "pt"})
    with pytest.raises(UserError, match=f"--resume: {tmp_path / 'run'} trained its LoRA adapters on {base}"):
        rl.main(rl_config(base, tmp_path / "run", server.url, *lora, "--steps", "2", "--resume"))


def test_wandb_starts_before_the_runs_threads(tiny_dir, server, tmp_path, monkeypatch):
    # Importing wandb defines pydantic models whose field docstrings pydantic reads with ast.parse; on Python
    # 3.11 two threads parsing at once can fail with "SystemError: AST constructor recursion depth mismatch",
    # which killed a run started with --wandb.project while its producer thread was already sampling.
    import threading

    from lib import log

    seen = []

    def start_wandb(*args, **kwargs):
        seen.append(sorted(t.name for t in threading.enumerate() if t is not threading.main_thread()))

    monkeypatch.setattr(log, "start_wandb", start_wandb)
    result = rl.main(
        rl_config(
            tiny_dir, tmp_path / "run", server.url, "--steps", "1", "--wandb.project", "p", "--wandb.offline"
        )
    )
    assert len(result["history"]) == 1
    assert seen and not [name for name in seen[0] if name.startswith(("rollout-producer", "weight-sync"))], (
        seen
    )
