"""plainrl_calculator: arithmetic the model must do with a `calculate` tool, then answer in <answer> tags.

Each task is an expression of two or three small integers; the model is told to call the tool and
answer with its result. Reward 1 when the answer is the expression's value, else 0; the metric
`tool_called` says whether a tool result reached the model. Endless by default (`num_examples -1`):
the tasks are drawn from a seeded generator, as many as a run takes.
"""

import itertools
import random
import re

import verifiers.v1 as vf
from pydantic import model_validator

from plainrl_calculator.tools import CalculatorToolset, calculate

SYSTEM_PROMPT = "Use the calculate tool, then give its result in <answer></answer> tags."
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def parse_answer(reply: str) -> str:
    """The stripped content of the first <answer> block, or "" when there is none."""
    match = ANSWER.search(reply)
    return match.group(1).strip() if match else ""


def expression(rng: random.Random, max_operand: int, max_operands: int) -> str:
    """A random expression like "37*4+12" of 2..max_operands operands in 1..max_operand."""
    count = rng.randint(2, max_operands)
    parts = [str(rng.randint(1, max_operand))]
    for _ in range(count - 1):
        parts += [rng.choice("+-*"), str(rng.randint(1, max_operand))]
    return "".join(parts)


def reference_conversation(data) -> list[dict]:
    """The ideal episode: the tool call with the task's expression, its result, and the answer."""
    call = {
        "id": "call_0",
        "type": "function",
        "function": {"name": "calculate", "arguments": {"expression": data.expression}},
    }
    return [
        {"role": "system", "content": data.system_prompt},
        {"role": "user", "content": data.prompt},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": data.answer},
        {"role": "assistant", "content": f"<answer>{data.answer}</answer>"},
    ]


def reference_tools() -> list[dict]:
    """The tool list an episode offers (for SFT data: the model learns with the same system turn)."""
    return [
        {
            "type": "function",
            "function": {
                "name": "calculate",
                "description": 'Evaluate an integer arithmetic expression (+, -, *, parentheses), e.g. "12*(3+4)".',
                "parameters": {
                    "properties": {"expression": {"title": "Expression", "type": "string"}},
                    "required": ["expression"],
                    "title": "calculateArguments",
                    "type": "object",
                },
            },
        }
    ]


class CalculatorConfig(vf.TasksetConfig):
    tools: vf.SharedToolsetConfig = vf.SharedToolsetConfig()
    """Where the calculator server runs (default: a local subprocess, one for the run)."""
    num_examples: int = -1
    """Tasks to generate (-1 = endless)."""
    seed: int = 0
    """Seed of the expressions."""
    max_operand: int = 20
    """Largest operand."""
    max_operands: int = 2
    """Most operands of an expression (at least 2)."""

    @model_validator(mode="after")
    def _check(self):
        if self.num_examples == 0 or self.num_examples < -1:
            raise ValueError("num_examples must be -1 (endless) or positive.")
        if self.max_operand < 1 or self.max_operands < 2:
            raise ValueError("need max_operand >= 1 and max_operands >= 2.")
        return self


class CalculatorData(vf.TaskData):
    expression: str
    """The expression to evaluate."""
    answer: str
    """Its value, as the tool writes it."""


class CalculatorTask(vf.Task[CalculatorData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def correct(self, task: CalculatorData, trace: vf.Trace) -> float:
        return float(parse_answer(trace.last_reply or "") == task.answer)

    @vf.metric
    async def tool_called(self, task: CalculatorData, trace: vf.Trace) -> float:
        return float(any(message.role == "tool" for message in trace.messages))


class CalculatorTaskset(vf.Taskset[CalculatorTask, CalculatorConfig]):
    """Seeded random expressions, forever unless num_examples bounds them."""

    def __init__(self, config: CalculatorConfig) -> None:
        super().__init__(config)
        self.INFINITE = config.num_examples < 0

    @classmethod
    def toolsets(cls, config: CalculatorConfig) -> list[vf.Toolset]:
        return [CalculatorToolset(config.tools)]

    def load(self):
        config = self.config
        rng = random.Random(config.seed)
        indices = itertools.count() if config.num_examples < 0 else range(config.num_examples)
        for index in indices:
            text = expression(rng, config.max_operand, config.max_operands)
            data = CalculatorData(
                id=f"calculator-{index}",
                prompt=f"What is {text}?",
                system_prompt=SYSTEM_PROMPT,
                expression=text,
                answer=calculate(text),
            )
            yield CalculatorTask(data, config.task)


__all__ = ["CalculatorConfig", "CalculatorData", "CalculatorTask", "CalculatorTaskset"]
