"""Evaluates a model on an environment through any OpenAI-compatible endpoint.

Runs `-n` examples x `-r` rollouts, prints average reward (with its standard deviation), perfect
rate, pass@k, completion tokens, errors and a few samples, and writes
outputs/eval/<name>/results.jsonl and summary.json. Without `-b`, starts the builtin server on the
local model and stops it afterwards.

Usage:
    python scripts/eval.py reverse_text -m outputs/models/tiny -n 20 -r 3               # CPU, own server
    python scripts/eval.py reverse_text -m Qwen/Qwen3-0.6B -b http://localhost:8000/v1 -n 100 -r 4
    python scripts/eval.py alphabet_sort -m M -b URL --env-args '{"min_turns": 3, "max_turns": 3}'
"""

import dataclasses
from pathlib import Path
from typing import Annotated

import tyro

from lib.config import parse
from lib.model import ModelConfig
from lib.sampling import SamplingConfig


@dataclasses.dataclass
class Config:
    env: tyro.conf.Positional[str] = "reverse_text"
    """Environment id: reverse_text, alphabet_sort, or any installed verifiers taskset."""
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    """Model name sent to the endpoint (-m), and the directory served when no -b is given."""
    base_url: Annotated[str | None, tyro.conf.arg(aliases=("-b",))] = None
    """OpenAI-compatible base URL such as http://localhost:8000/v1; None starts a builtin server."""
    api_key: str | None = None
    """API key for the endpoint (default: $OPENAI_API_KEY if set)."""
    num_examples: Annotated[int, tyro.conf.arg(aliases=("-n",))] = 20
    """Examples to evaluate (-1 = all)."""
    rollouts_per_example: Annotated[int, tyro.conf.arg(aliases=("-r",))] = 3
    """Rollouts per example; pass@k uses k = this."""
    env_args: str = "{}"
    """JSON object of environment arguments, e.g. '{"min_turns": 3}'."""
    sampling: SamplingConfig = dataclasses.field(default_factory=SamplingConfig)
    """Sampling settings (--max-tokens is short for --sampling.max-tokens)."""
    max_concurrent: int = 32
    """Most episodes in flight at once."""
    name: str | None = None
    """Run name under output_dir (default: <env>-<model>-<time>)."""
    output_dir: Path = Path("outputs/eval")
    """Where results.jsonl and summary.json go."""
    num_samples_shown: int = 3
    """Sample completions printed at the end."""
    seed: int = 0
    """Seed of the example order and synthetic data."""

    def __post_init__(self):
        if self.num_examples == 0 or self.num_examples < -1:
            raise ValueError("num_examples must be -1 (all) or positive.")
        if self.rollouts_per_example < 1:
            raise ValueError("rollouts_per_example must be at least 1.")
        if self.max_concurrent < 1:
            raise ValueError("max_concurrent must be at least 1.")


def main(cfg: Config) -> None:
    raise SystemExit("eval.py: evaluation is not built yet.")


if __name__ == "__main__":
    main(parse(Config, description=__doc__))
