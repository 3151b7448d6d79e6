"""trl_bench_taskset: the prompts and reward of bench_trl_grpo.py as a verifiers taskset, for plainrl's side.

Same system prompt, texts (make_prompts with the same seed and count, in the same order) and reward
function as the TRL baseline, so both frameworks train on identical chats and scores.
"""

import verifiers.v1 as vf
from bench_trl_grpo import SYSTEM_PROMPT, make_prompts, reward


class TrlBenchConfig(vf.TasksetConfig):
    num_examples: int = 176
    """How many prompts (the TRL side makes steps x prompts per step of them)."""


class TrlBenchData(vf.TaskData):
    text: str
    """The text to reverse (also the user prompt)."""


class TrlBenchTask(vf.Task[TrlBenchData, vf.State, vf.TaskConfig]):
    @vf.reward(weight=1.0)
    async def reverse_ratio(self, task: TrlBenchData, trace: vf.Trace) -> float:
        return reward(trace.last_reply or "", task.text)


class TrlBenchTaskset(vf.Taskset[TrlBenchTask, TrlBenchConfig]):
    def load(self):
        for index, prompt in enumerate(make_prompts(self.config.num_examples)):
            data = TrlBenchData(
                id=f"trl_bench-{index}",
                prompt=prompt["text"],
                system_prompt=SYSTEM_PROMPT,
                text=prompt["text"],
            )
            yield TrlBenchTask(data, self.config.task)


__all__ = ["TrlBenchConfig", "TrlBenchData", "TrlBenchTask", "TrlBenchTaskset"]
