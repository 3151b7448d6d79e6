"""plainrl_arithmetic: integer arithmetic answered in plain text, scored 1 for the exact value in <answer> tags.

A verifiable task with no tools and no partial credit, sized so that a small instruction-tuned model
gets some answers right before any training (SmolLM2-135M-Instruct: docs/smollm2.md, the RL-first
recipe), which gives RL groups with a reward spread from the first step. Metrics: `tagged` (the reply
has an <answer> block) and `last_number_correct` (the last number the reply writes is the value, tags
or not), which tell a format failure from a wrong sum. Endless by default (`num_examples -1`): the tasks
come from a seeded generator, as many as a run takes.
"""

import itertools
import random
import re
import zlib
from typing import Literal

import verifiers.v1 as vf
from pydantic import model_validator

from lib.config import UserError

SYSTEM_PROMPT = "Solve the arithmetic problem. Give only the final number in <answer></answer> tags."
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
NUMBER = re.compile(r"-?\d[\d,]*")


def as_int(text: str) -> int | None:
    """`text` as an integer ("1,024" and " 12 " too), or None when it is not one."""
    text = text.strip().replace(",", "")
    return int(text) if re.fullmatch(r"-?\d+", text) else None


def parse_answer(reply: str) -> int | None:
    """The integer in the first <answer> block; without a block, the last integer the reply writes; else None."""
    match = ANSWER.search(reply)
    return as_int(match.group(1)) if match else last_number(reply)


def last_number(reply: str) -> int | None:
    """The last integer the reply writes anywhere, or None."""
    numbers = NUMBER.findall(reply)
    return as_int(numbers[-1]) if numbers else None


def in_split(expression: str, split: str) -> bool:
    """Whether `expression` belongs to `split`: a hash of its text, the same on every machine and run."""
    test = zlib.crc32(expression.encode()) % 5 == 0
    return split == "all" or test == (split == "test")


def problem(rng: random.Random, max_operand: int, operations: str, num_operands: int) -> tuple[str, int]:
    """A random expression like "37 + 48" and its value, evaluated left to right as written (+, -, *)."""
    numbers = [rng.randint(1, max_operand) for _ in range(num_operands)]
    signs = [rng.choice(operations) for _ in range(num_operands - 1)]
    text = str(numbers[0])
    for sign, number in zip(signs, numbers[1:]):
        text += f" {sign} {number}"
    return text, eval(text.replace(" ", ""))  # digits and + - * only: built above, never user text


class ArithmeticConfig(vf.TasksetConfig):
    num_examples: int = -1
    """Tasks to generate (-1 = endless)."""
    seed: int = 0
    """Seed of the problems (held-out evaluations use another)."""
    max_operand: int = 99
    """Largest operand (the smallest is 1)."""
    operations: str = "+-"
    """The signs drawn from, any of + - *."""
    num_operands: int = 2
    """Operands of each problem."""
    split: Literal["all", "train", "test"] = "all"
    """Which problems: all, or a fixed split by the expression (test: about one in five, train: the rest), so
    that an evaluation on test never shows a problem that RL on train saw."""

    @model_validator(mode="after")
    def _check(self):
        if self.num_examples == 0 or self.num_examples < -1:
            raise UserError("num_examples must be -1 (endless) or positive.")
        if self.max_operand < 1 or self.num_operands < 2:
            raise UserError("need max_operand >= 1 and num_operands >= 2.")
        if not self.operations or set(self.operations) - set("+-*"):
            raise UserError(f"operations takes some of + - *, got {self.operations!r}.")
        return self


class ArithmeticData(vf.TaskData):
    expression: str
    """The expression, as the prompt shows it."""
    answer: int
    """Its value."""


class ArithmeticTask(vf.Task[ArithmeticData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, task: ArithmeticData, trace: vf.Trace) -> float:
        return float(parse_answer(trace.last_reply or "") == task.answer)

    @vf.metric
    async def tagged(self, task: ArithmeticData, trace: vf.Trace) -> float:
        return float(ANSWER.search(trace.last_reply or "") is not None)

    @vf.metric
    async def last_number_correct(self, task: ArithmeticData, trace: vf.Trace) -> float:
        return float(last_number(trace.last_reply or "") == task.answer)


def reference_conversation(data) -> list[dict]:
    """The ideal episode (SFT data, and the answer of a perfect model)."""
    return [
        {"role": "system", "content": data.system_prompt},
        {"role": "user", "content": data.prompt},
        {"role": "assistant", "content": f"<answer>{data.answer}</answer>"},
    ]


class ArithmeticTaskset(vf.Taskset[ArithmeticTask, ArithmeticConfig]):
    """Seeded random expressions, forever unless num_examples bounds them."""

    def __init__(self, config: ArithmeticConfig) -> None:
        super().__init__(config)
        self.INFINITE = config.num_examples < 0

    def load(self):
        config = self.config
        rng = random.Random(config.seed)
        indices = itertools.count() if config.num_examples < 0 else range(config.num_examples)
        for index in indices:
            text, value = problem(rng, config.max_operand, config.operations, config.num_operands)
            while not in_split(text, config.split):
                text, value = problem(rng, config.max_operand, config.operations, config.num_operands)
            data = ArithmeticData(
                id=f"arithmetic-{index}",
                prompt=f"What is {text}?",
                system_prompt=SYSTEM_PROMPT,
                expression=text,
                answer=value,
            )
            yield ArithmeticTask(data, config.task)


__all__ = ["ArithmeticConfig", "ArithmeticData", "ArithmeticTask", "ArithmeticTaskset"]
