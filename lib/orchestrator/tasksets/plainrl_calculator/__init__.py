"""plainrl_calculator: arithmetic the model must do with a `calculate` tool, then answer in <answer> tags.

Each task is an expression of two or three small integers; the model is told to call the tool and
answer with its result. The reward has two halves: how close the expression of the model's first
`calculate` call is to the task's (difflib ratio, 0 without a call), and 1 when the answer is the
expression's value. A model that copies the expression and reads the result scores 1; the graded
first half gives a small model's RL a signal before its answers are right. Metrics: `correct` (the
answer alone) and `tool_called`. Endless by default (`num_examples -1`):
the tasks are drawn from a seeded generator, as many as a run takes.
"""

import itertools
import json
import random
import re
from difflib import SequenceMatcher

import verifiers.v1 as vf
from pydantic import model_validator

from lib.config import UserError
from plainrl_calculator.tools import CalculatorToolset, calculate

SYSTEM_PROMPT = "Use the calculate tool, then give its result in <answer></answer> tags."
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def parse_answer(reply: str) -> str:
    """The stripped content of the first <answer> block, or "" when there is none."""
    match = ANSWER.search(reply)
    return match.group(1).strip() if match else ""


def called_expression(messages) -> str:
    """The `expression` argument of the first calculate call among the messages, or "" if none."""
    for message in messages:
        for call in getattr(message, "tool_calls", None) or []:
            if call.name != "calculate":
                continue
            try:
                arguments = json.loads(call.arguments or "{}")
            except json.JSONDecodeError:
                return ""
            value = arguments.get("expression") if isinstance(arguments, dict) else None
            return value if isinstance(value, str) else ""
    return ""


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
    """The tool list an episode offers, as the episode renders it (for SFT data: the model learns with the
    same system turn, character for character)."""
    return [
        {
            "type": "function",
            "function": {
                "name": "calculate",
                "description": 'Evaluate an integer arithmetic expression (+, -, *, parentheses), e.g. "12*(3+4)".',
                "parameters": {  # in the key order the MCP server lists them: the prompt is the same text
                    "type": "object",
                    "properties": {"expression": {"title": "Expression", "type": "string"}},
                    "required": ["expression"],
                    "title": "calculateArguments",
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
            raise UserError("num_examples must be -1 (endless) or positive.")
        if self.max_operand < 1 or self.max_operands < 2:
            raise UserError("need max_operand >= 1 and max_operands >= 2.")
        return self


class CalculatorData(vf.TaskData):
    expression: str
    """The expression to evaluate."""
    answer: str
    """Its value, as the tool writes it."""


class CalculatorTask(vf.Task[CalculatorData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=0.5)
    async def expression_match(self, task: CalculatorData, trace: vf.Trace) -> float:
        return SequenceMatcher(None, called_expression(trace.messages), task.expression).ratio()

    @vf.reward(weight=0.5)
    async def answer_correct(self, task: CalculatorData, trace: vf.Trace) -> float:
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
