"""Several environments in one run: which one each draw takes, their task counters and evaluations.

A mixture is `[env]` (the first environment) plus `env.mix`, one JSON object per further environment
with EnvConfig's keys (`id`, `args` as an object, `num_examples`, `seed`, `ratio`):

    [env]
    id = "reverse_text"
    ratio = 2
    mix = ['{"id": "alphabet_sort", "args": {"max_turns": 2}}', '{"id": "plainrl_calculator", "num_examples": 300}']

`--env.mix '{"id": ...}' '{"id": ...}'` says the same on the command line. Draw i takes environment `random.Random(f"{seed}:{i}")`'s weighted
choice by ratio: a function of (seed, i) alone, so a resumed run continues the same sequence. Each
environment keeps its own task counter (the n-th draw of an environment plays its task n), and a
checkpoint saves the draw count and every counter.
"""

import dataclasses
import random
import threading
from pathlib import Path

from lib.config import UserError
from lib.orchestrator.tasks import TaskStream, env_configs


@dataclasses.dataclass
class Source:
    """One environment of a mixture: its verifiers Env, its tasks by index, its ratio and tasks drawn so far."""

    name: str
    env: object
    tasks: object
    ratio: float = 1.0
    count: int = 0


class Mixture:
    """Draws (source, task) pairs: draw i's source is a seeded weighted choice, its task the source's next."""

    def __init__(self, sources: list[Source], seed: int = 0, draws: int = 0):
        assert sources, "a mixture needs at least one environment"
        self.sources, self.seed, self.draws = sources, seed, draws
        self.lock = threading.Lock()  # the producer's thread draws while the trainer's saves the state

    def choose(self, index: int) -> Source:
        """The source of draw `index`: a function of (seed, index) only."""
        if len(self.sources) == 1:
            return self.sources[0]
        weights = [source.ratio for source in self.sources]
        return random.Random(f"{self.seed}:{index}").choices(self.sources, weights)[0]

    def draw(self) -> tuple[Source, object]:
        with self.lock:
            source = self.choose(self.draws)
            self.draws += 1
            source.count += 1
            index = source.count - 1
        return source, source.tasks[index]

    def state(self) -> dict:
        """What a checkpoint saves: draws so far (`task_index`, as single-environment runs always saved) and
        each environment's task counter."""
        with self.lock:
            return {"task_index": self.draws, "env_tasks": {s.name: s.count for s in self.sources}}

    def restore(self, progress: dict, default_draws: int) -> None:
        """Continues from a checkpoint's state (checkpoints from before mixtures: `default_draws` draws)."""
        self.draws = progress.get("task_index", default_draws)
        counts = progress.get("env_tasks", {self.sources[0].name: self.draws})
        for source in self.sources:
            source.count = counts.get(source.name, 0)

    def describe(self) -> str:
        total = sum(s.ratio for s in self.sources)
        return "; ".join(f"env {s.name} ({s.ratio / total:.0%}): {s.tasks.describe()}" for s in self.sources)


def load_mixture(cfg, url: str, model: str, api_key: str | None, out: Path, progress: dict):
    """rl.py's environments: (the Mixture, resumed from `progress`, and the evaluation callable or None).

    With cfg.eval.every, each environment holds out its last eval.num_examples tasks (an endless one
    needs num_examples); a single environment logs eval/*, a mixture eval/<id>/* per environment.
    """
    from lib.orchestrator.envs import load_env, load_tasks
    from lib.orchestrator.evaluation import Evaluator, split_held_out

    sources, evaluators = [], {}
    configs = env_configs(cfg.env)
    for config in configs:
        env = load_env(config)
        tasks = load_tasks(env, config)
        if cfg.eval.every:
            if tasks.endless:
                raise UserError(
                    f"eval.every needs a finite taskset to hold examples out of: give {config.id} num_examples."
                )
            train, held_out = split_held_out(list(tasks), cfg.eval.num_examples)
            tasks = TaskStream(train, config.id)
            prefix, where = ("eval", out) if len(configs) == 1 else (f"eval/{config.id}", out / config.id)
            evaluators[prefix] = Evaluator(cfg, held_out, url, model, api_key, where, config, prefix)
        sources.append(Source(config.id, env, tasks, config.ratio))
    check_prompts_fit(sources, cfg, url, api_key)
    mixture = Mixture(sources, cfg.seed)
    mixture.restore(progress, progress.get("step", 0) * cfg.examples_per_step)
    if len(configs) == 1:
        return mixture, evaluators.get("eval")
    return mixture, (Evaluations(list(evaluators.values())) if evaluators else None)


class Evaluations:
    """Every environment's Evaluator as one: calling it evaluates each and merges their eval/<id>/* scalars."""

    def __init__(self, evaluators: list):
        self.evaluators = evaluators
        self.history: list[tuple[int, dict]] = []

    def __call__(self, step: int) -> dict:
        metrics = {}
        for evaluator in self.evaluators:
            metrics.update(evaluator(step))
        # The plot's eval points: the mean over environments.
        rewards = {
            key: [v for k, v in metrics.items() if k.endswith(f"/{key}")]
            for key in ("reward", "reward_greedy")
        }
        self.history.append((step, {f"eval/{key}": sum(v) / len(v) for key, v in rewards.items() if v}))
        return metrics


def check_prompts_fit(sources: list[Source], cfg, url: str, api_key: str | None) -> None:
    """A one-sentence UserError, before any rollout, when an environment's first prompt (rendered with the
    model's chat template) leaves no room for a reply in seq_len or in the server's max_model_len: every
    rollout of the run would fail on it."""
    from lib.endpoint import model_card
    from lib.models.load import load_tokenizer
    from lib.orchestrator.tasks import prompt_messages

    tokenizer = load_tokenizer(cfg.model.name)
    served = model_card(url, api_key).get("max_model_len") or cfg.seq_len
    room = f"seq_len {cfg.seq_len}" if cfg.seq_len <= served else f"{url} (max_model_len {served})"
    for source in sources:
        stream = source.tasks
        task = next(iter(stream.taskset.take(1))) if stream.endless else stream[0]
        encoded = tokenizer.apply_chat_template(
            prompt_messages(task.data), add_generation_prompt=True, tokenize=True, return_dict=True
        )
        length = len(encoded["input_ids"])
        if length >= min(cfg.seq_len, served):
            raise UserError(
                f"environment {source.name}: its first prompt is {length} tokens with the chat template, and "
                f"{room} leaves no room for a reply: raise --seq-len to at least {length + 1} "
                f"({length + cfg.sampling.max_tokens} for replies of sampling.max_tokens)"
            )
