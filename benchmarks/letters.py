"""A one-file environment (docs/environments.md) whose reward varies even for a random model: the share of the
reply's characters that are lowercase letters (about a quarter of a random tiny or Qwen-shaped model's), so a
group is seldom flat and every RL step trains. The GPU check's and bench_real_shape.py's runs play it."""

import string


def examples():
    for index in range(16):
        yield {"prompt": f"Say aaa {index}."}


def reward(completion: str, example: dict) -> float:
    return sum(character in string.ascii_lowercase for character in completion) / max(1, len(completion))
