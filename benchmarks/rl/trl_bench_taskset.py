"""trl_bench_taskset: the prompts of bench_trl_grpo.py as a verifiers taskset, for plainrl's side.

Same system prompt and texts (make_prompts with the same seed and count, in the same order) as the
TRL baseline. The tasks are reverse_text's own: its reward is the baseline's formula (difflib ratio of
the stripped first <reversed_text> block to the reversed text).
"""

import verifiers.v1 as vf
from bench_trl_grpo import SYSTEM_PROMPT, make_prompts
from plainrl_reverse_text import ReverseTextData, ReverseTextTask


class TrlBenchConfig(vf.TasksetConfig):
    num_examples: int = 176
    """How many prompts (the TRL side makes steps x prompts per step of them)."""


class TrlBenchTaskset(vf.Taskset[ReverseTextTask, TrlBenchConfig]):
    def load(self):
        for index, prompt in enumerate(make_prompts(self.config.num_examples)):
            text = prompt["text"]
            data = ReverseTextData(
                id=f"trl_bench-{index}", prompt=text, system_prompt=SYSTEM_PROMPT, text=text
            )
            yield ReverseTextTask(data, self.config.task)


__all__ = ["TrlBenchConfig", "TrlBenchTaskset"]
