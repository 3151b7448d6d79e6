"""plainrl_chat: an in-process chat harness, one model call per turn, with no subprocess, sandbox or download.

verifiers runs every model call of a rollout through its interception server (which records the
tokens and applies the sampling settings), so the harness only has to send the conversation there.
"""

import asyncio
import weakref

import aiohttp
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire


class PlainChatHarnessConfig(vf.HarnessConfig):
    id: str = "plainrl_chat"


class PlainChatHarness(vf.Harness[PlainChatHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True  # the system prompt stays its own message, as the chat template expects
    SUPPORTS_RESUME = True  # a later user turn relaunches on the whole conversation so far
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False  # nothing runs but this coroutine, so the subprocess runtime is safe

    async def launch(
        self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None
    ) -> vf.ProgramResult:
        system, prompt = self.resolve_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        if isinstance(prompt, str):
            messages.append({"role": "user", "content": prompt})
        elif prompt:
            messages += [message_to_wire(message) for message in prompt]
        # Sampling settings are not sent: the interception server applies the run's own.
        async with loop_session().post(
            f"{endpoint}/chat/completions",
            headers={"Authorization": f"Bearer {secret}"},
            json={"model": ctx.model, "messages": messages},
        ) as response:
            text = await response.text()
        # A failed call exits non-zero; the rollout records the model error or stop condition behind it.
        return vf.ProgramResult(exit_code=0 if response.status == 200 else 1, stdout="", stderr=text[-2000:])


_sessions: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aiohttp.ClientSession]" = (
    weakref.WeakKeyDictionary()
)


def loop_session() -> aiohttp.ClientSession:
    """One aiohttp session per event loop, connections kept alive and unlimited in number.

    aiohttp's client, not httpx: on this loopback hop httpx and httpcore cost several times more CPU
    per call (benchmarks/bench_env_overhead.py).
    """
    loop = asyncio.get_running_loop()
    if loop not in _sessions:
        timeout = aiohttp.ClientTimeout(total=None, connect=10)
        _sessions[loop] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout)
    return _sessions[loop]


async def close_session() -> None:
    """Closes this event loop's session, if it has one (lib.envs.serving does, on leaving)."""
    session = _sessions.pop(asyncio.get_running_loop(), None)
    if session is not None:
        await session.close()


__all__ = ["PlainChatHarness", "PlainChatHarnessConfig"]
