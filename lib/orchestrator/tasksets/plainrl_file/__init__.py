"""plainrl_file: an environment from one Python file of yours (`--env.id path/to/my_env.py`).

The file defines `examples()`, an iterable of dicts with a `prompt` (text, or a list of chat messages) and
whatever else its reward needs (an `answer` there is also SFT's target), and `reward(completion, example)`,
the score of the model's last reply given its example, a finite number of any numeric kind, NumPy's and torch's
scalars too (plain or async; a bool is 0 or 1).
A module-level `SYSTEM_PROMPT` (or an example's `system_prompt`) is shown first. docs/environments.md has an
example.
"""

import inspect
import math
import numbers
import reprlib

import verifiers.v1 as vf
from pydantic import model_validator

from lib.config import UserError
from lib.orchestrator.tasks import env_file, file_examples, told


class FileConfig(vf.TasksetConfig):
    path: str = ""
    """The Python file that defines examples() and reward(completion, example)."""
    num_examples: int = -1
    """Examples to take from the file's examples() (-1 = all)."""

    @model_validator(mode="after")
    def _check(self):
        env_file(self.path)  # a missing file or function fails here, in one sentence
        if self.num_examples == 0 or self.num_examples < -1:
            raise UserError("num_examples must be -1 (all) or positive.")
        return self


class FileData(vf.TaskData):
    path: str
    """The environment's file (its reward function scores the task)."""
    example: dict
    """The example as examples() gave it."""
    answer: str | None = None
    """The example's `answer`, when it has one as text: SFT's reference reply."""


class FileTask(vf.Task[FileData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def file_reward(self, task: FileData, trace: vf.Trace) -> float:
        """The file's reward, a finite real number of any numeric kind (real_number; a bool counts as 0 or 1).
        One that raises, or is anything else (NaN, inf, 10**400, the text "1.0", None), ends the run in one
        sentence before any step trains on it: verifiers records the UserError on the episode, and
        lib/orchestrator/envs.py raise_user_error raises it again."""
        where = f"environment file {task.path}: reward(completion, example)"
        try:
            score = env_file(task.path).reward(trace.last_reply or "", task.example)
            if inspect.isawaitable(score):
                score = await score
        except Exception as error:  # the file's own bug, told with its message
            raise UserError(f"{where} raised {told(error)} on example {task.id}") from None
        value = real_number(score)
        if value is None:
            raise UserError(
                f"{where} returned {reprlib.repr(score)} for example {task.id}, not a finite number that fits a "
                "float (a float, an int or a bool, or one of NumPy's or torch's as a scalar)."
            )
        return value


def real_number(score) -> float | None:
    """`score` as a float when it is one finite real number of any numeric kind (an int, a bool, a Fraction,
    a NumPy scalar or 0-d array, a 0-d torch tensor); None for anything else, 10**400 included."""
    if getattr(score, "ndim", None) == 0 and hasattr(score, "item"):  # NumPy's and torch's scalars
        score = score.item()
    if not isinstance(score, numbers.Real):
        return None
    try:
        value = float(score)
    except OverflowError:  # an int beyond float's range
        return None
    return value if math.isfinite(value) else None


class FileTaskset(vf.Taskset[FileTask, FileConfig]):
    """The tasks of the file's examples(), in its order."""

    def load(self):
        module = env_file(self.config.path)
        system_prompt = getattr(module, "SYSTEM_PROMPT", None)
        for index, example in enumerate(file_examples(self.config.path)):
            if 0 <= self.config.num_examples <= index:
                return
            if not isinstance(example, dict) or "prompt" not in example:
                raise UserError(
                    f"{self.config.path}: examples() must give dicts with a `prompt`, got {example!r}."
                )
            answer = example.get("answer")
            data = FileData(
                id=str(example.get("id", index)),
                prompt=example["prompt"],
                system_prompt=example.get("system_prompt", system_prompt),
                path=self.config.path,
                example=example,
                answer=answer if isinstance(answer, str) else None,
            )
            yield FileTask(data, self.config.task)


__all__ = ["FileConfig", "FileData", "FileTask", "FileTaskset"]
