"""Environments: which verifiers taskset to run, with which arguments, on how many examples."""

import dataclasses
import json


@dataclasses.dataclass
class EnvConfig:
    id: str = "reverse_text"
    """Taskset id: reverse_text, alphabet_sort, or any installed verifiers taskset."""
    args: str = "{}"
    """JSON object of taskset arguments, e.g. '{"min_turns": 3}'."""
    num_examples: int = -1
    """How many dataset examples to use (-1 = all the taskset provides)."""
    seed: int = 0
    """Seed of the dataset order and of synthetic data."""

    def __post_init__(self):
        try:
            parsed = json.loads(self.args)
        except json.JSONDecodeError as error:
            raise ValueError(f"env.args is not valid JSON ({error.msg}): {self.args}") from None
        if not isinstance(parsed, dict):
            raise ValueError(f"env.args must be a JSON object, got {self.args}.")
        if self.num_examples == 0 or self.num_examples < -1:
            raise ValueError("env.num_examples must be -1 (all) or positive.")

    @property
    def kwargs(self) -> dict:
        return json.loads(self.args)
