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
# An integer as people write one: digits, commas only between groups of three ("1,024", never "1,2"), and a
# decimal part that is all zeros ("12.0"). A number with any other decimal part is no integer at all.
INTEGER = r"-?\d{1,3}(?:,\d{3})+(?:\.0+)?|-?\d+(?:\.0+)?"
# A number as written in a reply, commas between digits included: "1,234" is one number, and "1,2" or "12,34"
# is one that as_int refuses (no answer), never the "2" or "34" after its comma.
NUMBER = re.compile(r"-?\d+(?:,\d+)*(?:\.\d+)?")
# Draws in a row that give no new problem of the split before its generator takes the split as exhausted
# (the test split gives each problem once). A given problem is one of max_operand**num_operands * 3**(n-1)
# ways of writing: at max_operand 20 the last new one comes within ~10,000 draws.
EXHAUSTED_AFTER = 100_000


def as_int(text: str) -> int | None:
    """`text` as an integer (" 1,024 " and "12.0" too), or None when it is not one ("1,2", "12.5", "seven")."""
    text = text.strip()
    if not re.fullmatch(INTEGER, text):
        return None
    return int(text.replace(",", "").split(".")[0])


def parse_answer(reply: str) -> int | None:
    """The integer in the first <answer> block; without a block, the last integer the reply writes; else None."""
    match = ANSWER.search(reply)
    return as_int(match.group(1)) if match else last_number(reply)


def last_number(reply: str) -> int | None:
    """The last number the reply writes anywhere, when it is an integer ("1,234" too); else None ("1,2")."""
    numbers = NUMBER.findall(reply)
    return as_int(numbers[-1]) if numbers else None


def canonical(expression: str) -> str:
    """One name for every way of writing the same problem, so that no two fall on opposite sides of the split:
    a product's operands in order ("3 * 12" for "12 * 3"); a sum's and difference's signed operands as one
    multiset, the added ones in order, then the subtracted ones ("2 + 3 - 1" for "3 - 1 + 2"), which names a
    problem of two operands as before ("3 + 12", "12 - 3"); a product beside a sum or difference as written."""
    parts = expression.split(" ")
    operands, signs = parts[::2], parts[1::2]
    if set(signs) == {"*"}:
        return " * ".join(sorted(operands, key=int))
    if "*" in signs:
        return expression
    added = [operands[0]] + [operand for sign, operand in zip(signs, operands[1:]) if sign == "+"]
    subtracted = [operand for sign, operand in zip(signs, operands[1:]) if sign == "-"]
    return " + ".join(sorted(added, key=int)) + "".join(f" - {n}" for n in sorted(subtracted, key=int))


def in_split(expression: str, split: str) -> bool:
    """Whether `expression` belongs to `split`: a hash of its canonical text, the same on every machine and
    run, so that no test problem is a training one written the other way round."""
    test = zlib.crc32(canonical(expression).encode()) % 5 == 0
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
    """Which problems: all, or a fixed split by the problem (test: about one in five, train: the rest), so
    that an evaluation on test never shows a problem that training on train saw. The test split gives each
    distinct problem once (it ends when there are no more), so an evaluation's standard error counts
    problems, not repeats."""

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
    """The ideal episode (SFT data, and the answer of a perfect model): the problem written out with its value,
    then the value in tags. Writing "14 + 20 = 34" first is how a small pretrained model gets values right (it
    has read many such lines): SmolLM2-135M-Instruct after 60 SFT steps on these answered 0.24 of the held-out
    sums up to 30 right, sampled, against 0.06 after the same SFT on the bare tagged value (docs/smollm2.md)."""
    reply = f"{data.expression} = {data.answer}\n<answer>{data.answer}</answer>"
    return [
        {"role": "system", "content": data.system_prompt},
        {"role": "user", "content": data.prompt},
        {"role": "assistant", "content": reply},
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
        given = set()  # the test split's canonical problems so far
        for index in indices:
            for _ in range(EXHAUSTED_AFTER):
                text, value = problem(rng, config.max_operand, config.operations, config.num_operands)
                if in_split(text, config.split) and not (config.split == "test" and canonical(text) in given):
                    break
            else:
                return  # every test problem has been given (the rest of the draws would repeat them)
            if config.split == "test":
                given.add(canonical(text))
            data = ArithmeticData(
                id=f"arithmetic-{index}",
                prompt=f"What is {text}?",
                system_prompt=SYSTEM_PROMPT,
                expression=text,
                answer=value,
            )
            yield ArithmeticTask(data, config.task)


__all__ = ["ArithmeticConfig", "ArithmeticData", "ArithmeticTask", "ArithmeticTaskset"]
