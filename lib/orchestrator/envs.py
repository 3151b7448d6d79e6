"""Episodes: a taskset played in-process (plainrl_chat harness) against a server, and the rollouts they give."""

import asyncio
import contextlib
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from lib.config import KEY_VARIABLE, UserError
from lib.orchestrator import patches
from lib.orchestrator.rollouts import Rollout

# json_object and sft_conversations: eval.py and tests import them through lib.orchestrator.envs too.
from lib.orchestrator.tasks import (  # noqa: F401
    EnvConfig,
    TaskStream,
    bad_arguments,
    json_object,
    resolve_id,
    sft_conversations,
    taskset_args,
)

# verifiers takes ~3 s to import: it is imported inside the functions, so the scripts' --help stays fast.
if TYPE_CHECKING:
    import verifiers.v1 as vf

    from lib.sampling import SamplingConfig

# verifiers' stop conditions for an episode ended at a token limit (its max_turns limit counts no tokens).
TOKEN_LIMIT_STOPS = ("max_input_tokens", "max_output_tokens", "max_total_tokens")


def vf_env_config(env: EnvConfig) -> dict:
    """verifiers' env config: the taskset by id with its arguments, played through plainrl_chat in-process.

    The subprocess runtime only makes a scratch directory and plainrl_chat only makes HTTP calls to
    verifiers' interception server: no sandbox, container or package download.
    """
    # A pooled connection the server closes as it is reused fails the call (the train client says
    # "Connection error", the eval relay answers 503); rerunning the rollout is safe.
    retries = {
        "rules": [
            {"type": "ProviderError", "message": "Connection error", "max_retries": 2},
            {"type": "ProviderError", "status_code": [503], "max_retries": 2},
        ]
    }
    return {
        "taskset": {"id": resolve_id(env.id), **taskset_args(env)},
        # Without these pins verifiers would start a remote sandbox and its `bash` harness.
        "agent": {"harness": {"id": "plainrl_chat"}, "runtime": {"type": "subprocess"}},
        # Whole episodes (run_episode): verifiers' agent does not retry a multi-turn exchange.
        "retries": retries,
        "interception": {"type": "server"},
    }


def load_env(env: EnvConfig) -> "vf.Env":
    """The verifiers Env for `env`; its tasks are `list(load_tasks(...))`. Bad arguments fail here, in one sentence."""
    import pydantic
    import verifiers.v1 as vf

    try:
        config = vf.resolve_env_config(vf_env_config(env))
    except ModuleNotFoundError:
        raise UserError(f"environment {env.id} is not an installed verifiers taskset.") from None
    except (AttributeError, TypeError) as error:  # a module by that name that is no taskset
        raise UserError(f"environment {env.id} is not a verifiers taskset ({error})") from None
    except pydantic.ValidationError as error:
        raise bad_arguments(env.id, error) from None
    patches.use_aiohttp_transport()
    patches.cache_default_factory_checks()
    return vf.load_environment(config)


def load_tasks(vf_env: "vf.Env", env: EnvConfig) -> TaskStream:
    """The tasks of the env by index, at most env.num_examples of them, drawn lazily (never listed whole)."""
    taskset = vf_env.taskset if env.num_examples < 0 else vf_env.taskset.take(env.num_examples)
    return TaskStream(taskset, env.id)


# ---------------------------------------------------------------- running


def renderer_name(model: str) -> str:
    """Renderer of the train client: the model-specific one for known hub ids (e.g. qwen3) and qwen3 for a local
    Qwen3 directory with Qwen3's tokenizer (scripts/qwen.py's, a download, a fine-tune), else the chat template."""
    from renderers.base import MODEL_RENDERER_MAP

    from lib.models.qwen import is_qwen3_directory

    return "qwen3" if is_qwen3_directory(model) else MODEL_RENDERER_MAP.get(model, "default")


def renderer_config(name: str) -> dict:
    """The train client's renderer by name; the chat-template one reads tool calls in Qwen's <tool_call> format.

    (The tiny model's template writes them so; for a tokenizer without a <tool_call> token the parser
    finds none and the reply stays text.)
    """
    return {"name": name, "tool_parser": "qwen3"} if name == "default" else {"name": name}


def model_context(
    base_url: str,
    model: str,
    sampling: "SamplingConfig",
    train: bool = False,
    tokenizer: str | Path | None = None,
    renderer: str = "auto",
) -> "vf.ModelContext":
    """Which server and model episodes talk to, and how they sample.

    The eval client (train=False) relays chat requests to any OpenAI-compatible server: messages and
    rewards only. The train client renders the chat here with `tokenizer` (default: the model; give a
    local directory so nothing asks the hub) and calls /inference/v1/generate, so episodes carry token
    ids and logprobs. `renderer` "auto" picks the model-specific renderer of a known hub id, else the
    tokenizer's chat template; pass e.g. "qwen3" for a local fine-tune of Qwen3. The bearer token is
    $PLAINRL_API_KEY when a client is built: run episodes inside `key_in_environment(key)`.
    """
    import verifiers.v1 as vf

    from lib.endpoint import check_base_url

    base_url = check_base_url(base_url)
    values = {"temperature": sampling.temperature, "top_p": sampling.top_p, "max_tokens": sampling.max_tokens}
    if sampling.top_k > 0:
        values["top_k"] = sampling.top_k
    if sampling.seed is not None:
        values["seed"] = sampling.seed
    if train:
        client = vf.TrainClientConfig(
            base_url=base_url,
            api_key_var=KEY_VARIABLE,
            renderer=renderer_config(renderer_name(model) if renderer == "auto" else renderer),
            renderer_model_name=str(tokenizer or model),
        )
    else:
        client = vf.EvalClientConfig(base_url=base_url, api_key_var=KEY_VARIABLE)
    return vf.ModelContext(model=model, client=client, sampling=vf.SamplingConfig(**values))


@contextlib.asynccontextmanager
async def serving(vf_env: "vf.Env"):
    """verifiers' serving session of the env (its interception server, shared tools); run episodes inside.

    On leaving it, the plainrl_chat harness's HTTP connections of this event loop are closed too.
    """
    import plainrl_chat

    try:
        async with vf_env.serving():
            yield
    finally:
        await plainrl_chat.close_session()


async def run_episode(vf_env: "vf.Env", task, ctx: "vf.ModelContext") -> "vf.Episode":
    """One episode of `task`; call inside `async with serving(vf_env):`. Failures come back as data, never raised."""
    from verifiers.v1.utils.retries import run_episode_with_retry

    patches.rebind_renderers_lock()
    return await run_episode_with_retry(lambda: vf_env.run_episode(task, ctx), vf_env.config.retries)


async def run_group(
    vf_env: "vf.Env",
    task,
    ctx: "vf.ModelContext",
    num: int,
    semaphore: asyncio.Semaphore | None = None,
    on_complete: Callable[["vf.Episode"], None] | None = None,
) -> list["vf.Episode"]:
    """`num` episodes of one task, run together; `semaphore` bounds episodes in flight across groups.

    `on_complete` is called as each episode ends (a progress bar, say).
    """

    async def one() -> "vf.Episode":
        async with semaphore or contextlib.nullcontext():
            episode = await run_episode(vf_env, task, ctx)
        if on_complete is not None:
            on_complete(episode)
        return episode

    return await gather_or_cancel(one() for _ in range(num))


async def gather_or_cancel(coroutines) -> list:
    """The coroutines' results, run together; when one raises, the others are cancelled and awaited
    before the error propagates (left running, they would keep asking the server for nothing)."""
    tasks = [asyncio.ensure_future(coroutine) for coroutine in coroutines]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def episode_error(episode: "vf.Episode") -> str | None:
    """Why an episode failed (the last error of the episode or of its traces), or None if it did not.

    An episode that succeeded on a retry keeps the failed attempts' errors; `ok` is its verdict."""
    if episode.ok:
        return None
    errors = list(episode.errors) + [error for trace in episode.traces for error in trace.errors]
    if not errors:
        return "the episode did not complete (no error recorded)"
    return f"{errors[-1].type}: {errors[-1].message}"


def raise_user_error(episode: "vf.Episode") -> None:
    """Raises again the UserError that the environment's own code raised in the episode (plainrl_file: a reward
    that raised or is no finite number). verifiers records it as a TaskError whose message ends with it; taken
    for a failed rollout, the run would go on and train on the others."""
    errors = list(episode.errors) + [error for trace in episode.traces for error in trace.errors]
    for error in errors:
        _, found, sentence = error.message.partition(f"{UserError.__name__}: ")
        if found:
            raise UserError(sentence)


def episode_reward(episode: "vf.Episode") -> float:
    """The reward of the episode's (single-agent) trace; 0 when scoring did not happen."""
    return float(sum(trace.reward or 0.0 for trace in episode.traces))


def training_samples(
    episode: "vf.Episode",
    policy_version: int = 0,
    env: str = "",
    task_id: str = "",
    episode_index: int | None = None,
) -> tuple[list[Rollout], str | None]:
    """Rollouts of a train-client episode, one per trainable branch, and why it failed (None if it did not).

    A failed episode gives no rollouts: its reward would be missing, not 0; one that failed on the user's
    mistake (a UserError of the environment's code) ends the run (raise_user_error). A chat template that
    rewrites earlier turns forks an episode into several branches, each its own rollout. The other
    arguments tag every rollout (see Rollout). Every branch of an episode is truncated when any model turn
    of the episode ended by length (a max_tokens that patches.fit_max_tokens shortened to fit seq_len ends
    so too), or the episode stopped at a token limit: a turn cut anywhere, not only the last, is a cut
    answer that the rest of the episode, and its reward, build on.
    """
    raise_user_error(episode)
    error = episode_error(episode)
    if error is not None:
        return [], error
    rollouts = []
    for trace in episode.traces:
        if not trace.agent.trainable:
            continue
        whole = conversation(trace.messages)  # its final branch: every turn, whichever branch trains
        finish_reasons = [call.finish_reason or "" for call in trace.calls if call.error is None]
        truncated = "length" in finish_reasons or trace.stop_condition in TOKEN_LIMIT_STOPS
        for branch in trace.branches:
            if not branch.trainable or not any(branch.sampled_mask):
                continue  # eval-client traces carry no tokens
            assert len(branch.token_ids) == len(branch.sampled_mask) == len(branch.logprobs), "ragged branch"
            messages = branch.messages
            first = next((i for i, m in enumerate(messages) if m.role == "assistant"), len(messages))
            completion = "\n".join(
                (m.content or "")
                + "".join(f" [calls {c.name}({c.arguments})]" for c in getattr(m, "tool_calls", None) or [])
                if m.role == "assistant"
                else f"[{m.role}] {m.content}"
                for m in messages[first:]
            )
            rollouts.append(
                Rollout(
                    token_ids=list(branch.token_ids),
                    loss_mask=list(branch.sampled_mask),
                    inference_logp=list(branch.logprobs),
                    reward=float(trace.reward),
                    policy_version=policy_version,
                    env=env,
                    completion=completion,
                    task_id=task_id,
                    prompt="\n".join(f"[{m.role}] {m.content}" for m in messages[:first]),
                    episode=episode_index,
                    messages=whole,
                    finish_reasons=finish_reasons,
                    truncated=truncated,
                    **kept_sets(branch),
                )
            )
    return rollouts, None


def conversation(messages) -> list[dict]:
    """verifiers' messages as rollout records hold them: role and content, and the tool calls a reply made."""
    plain = []
    for m in messages:
        message = {"role": m.role, "content": m.content}
        if calls := getattr(m, "tool_calls", None):
            message["tool_calls"] = [{"name": c.name, "arguments": c.arguments} for c in calls]
        plain.append(message)
    return plain


def kept_sets(branch) -> dict:
    """The branch's served kept sets (verifiers' SamplingMask: int32 ids and per-token counts, aligned with its
    tokens) as Rollout fields, or none when the server sent none (or not for every sampled token)."""
    import numpy as np

    mask = branch.sampling_mask
    if mask is None:
        return {}
    counts = np.asarray(mask.counts, dtype=np.int32)
    sampled = np.asarray(branch.sampled_mask, dtype=bool)
    # verifiers drops a turn's masks that do not match its tokens: a branch with one turn missing has none.
    if len(counts) != len(sampled) or not (counts[sampled] > 0).all():
        return {}
    return {"kept_ids": np.asarray(mask.ids, dtype=np.int32), "kept_counts": counts}
