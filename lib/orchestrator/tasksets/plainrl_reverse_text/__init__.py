"""plainrl_reverse_text (id reverse_text): reverse a text character by character, scored by similarity to the true reversal."""

import random
import re
from difflib import SequenceMatcher
from typing import Literal

import verifiers.v1 as vf
from pydantic import model_validator

from lib.config import UserError
from lib.orchestrator.tasks import hf_rows

SYSTEM_PROMPT = "Reverse the text character-by-character. Put your answer in <reversed_text> tags."
ANSWER = re.compile(r"<reversed_text>(.*?)</reversed_text>", re.DOTALL)
NUM_SYNTHETIC = 1000


def parse_answer(reply: str) -> str:
    """The stripped content of the first <reversed_text> block, or "" when there is none."""
    match = ANSWER.search(reply)
    return match.group(1).strip() if match else ""


def score(reply: str, text: str) -> float:
    """The public environment's reward: difflib ratio of the parsed answer to the reversed text."""
    return SequenceMatcher(None, parse_answer(reply), text[::-1]).ratio()


def reference_reply(text: str) -> str:
    """The ideal assistant reply (the SFT target and the answer of a perfect model)."""
    return f"<reversed_text>\n{text[::-1]}\n</reversed_text>"


def reference_conversation(data) -> list[dict]:
    """The chat an episode shows the model, answered ideally."""
    return [
        {"role": "system", "content": data.system_prompt},
        {"role": "user", "content": data.text},
        {"role": "assistant", "content": reference_reply(data.text)},
    ]


def synthetic_texts(num: int, seed: int, min_chars: int, max_chars: int) -> list[str]:
    """English-looking snippets of min_chars..max_chars characters, cut at a word boundary when possible."""
    from faker import Faker

    fake = Faker("en_US")
    fake.seed_instance(seed)
    rng = random.Random(seed)
    texts = []
    for _ in range(num):
        length = rng.randint(min_chars, max_chars)
        words = []
        while len(" ".join(words)) < length:
            words += fake.sentence().split()
        text = ""
        for word in words:
            if len(text) + len(word) + 1 > length:
                break
            text = f"{text} {word}" if text else word
        # A first word longer than the budget: cut it instead of returning too short a snippet.
        texts.append(text if len(text) >= min_chars else " ".join(words)[:length])
    return texts


class ReverseTextConfig(vf.TasksetConfig):
    source: Literal["auto", "hf", "synthetic"] = "auto"
    """Where the texts come from: the HF dataset, synthetic snippets, or auto (HF when reachable)."""
    dataset: str = "PrimeIntellect/Reverse-Text-RL"
    """HF dataset with a `prompt` column of texts to reverse."""
    split: str = "train"
    """Split of the HF dataset."""
    num_examples: int = -1
    """Examples to load (-1 = the whole HF dataset, or 1000 synthetic snippets)."""
    seed: int = 0
    """Seed of the HF row order and of the synthetic snippets."""
    min_chars: int = 10
    """Shortest synthetic snippet, in characters."""
    max_chars: int = 40
    """Longest synthetic snippet, in characters."""

    @model_validator(mode="after")
    def _check(self):
        if not 1 <= self.min_chars <= self.max_chars:
            raise UserError(f"need 1 <= min_chars <= max_chars, got {self.min_chars} and {self.max_chars}.")
        if self.num_examples == 0 or self.num_examples < -1:
            raise UserError("num_examples must be -1 (all) or positive.")
        return self


class ReverseTextData(vf.TaskData):
    text: str
    """The text to reverse (also the user prompt)."""


class ReverseTextTask(vf.Task[ReverseTextData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def lcs_reward(self, task: ReverseTextData, trace: vf.Trace) -> float:
        return score(trace.last_reply or "", task.text)


class ReverseTextTaskset(vf.Taskset[ReverseTextTask, ReverseTextConfig]):
    """Texts of the HF dataset PrimeIntellect/Reverse-Text-RL (column `prompt`) when it loads, else faker snippets."""

    def load(self):
        config = self.config
        rows = hf_rows("reverse_text", config.dataset, config.split, config.source)
        if rows is not None:
            texts = [row["prompt"] for row in rows]
            random.Random(config.seed).shuffle(texts)
            texts = texts if config.num_examples < 0 else texts[: config.num_examples]
        else:
            num = NUM_SYNTHETIC if config.num_examples < 0 else config.num_examples
            texts = synthetic_texts(num, config.seed, config.min_chars, config.max_chars)
        for index, text in enumerate(texts):
            data = ReverseTextData(
                id=f"reverse_text-{index}", prompt=text, system_prompt=SYSTEM_PROMPT, text=text
            )
            yield ReverseTextTask(data, config.task)


__all__ = ["ReverseTextConfig", "ReverseTextData", "ReverseTextTask", "ReverseTextTaskset"]
