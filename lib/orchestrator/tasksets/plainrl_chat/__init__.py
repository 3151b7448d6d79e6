"""plainrl_chat: an in-process chat harness, one model call per turn, with no subprocess, sandbox or download.

verifiers runs every model call of a rollout through its interception server (which records the
tokens and applies the sampling settings), so the harness only has to send the conversation there.
When the environment offers tools (verifiers toolsets, served over MCP), they go with every call; the
model's tool calls are executed through those servers and their results sent back as `tool`
messages, until the model answers without a tool call or max_tool_rounds is reached.
"""

import asyncio
import contextlib
import json
import weakref

import aiohttp
import verifiers.v1 as vf
from verifiers.v1.dialects.chat import message_to_wire
from verifiers.v1.harnesses.utils.mcp import call_mcp, connect_mcp


class PlainChatHarnessConfig(vf.HarnessConfig):
    id: str = "plainrl_chat"
    max_tool_rounds: int = 8
    """Most model calls answered with tool results in one turn; the next call goes without tools."""


class PlainChatHarness(vf.Harness[PlainChatHarnessConfig]):
    APPENDS_SYSTEM_PROMPT = True  # the system prompt stays its own message, as the chat template expects
    SUPPORTS_MCP = True  # an environment's toolsets reach the harness as MCP server URLs
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
        async with contextlib.AsyncExitStack() as stack:
            tools, dispatch, servers = [], {}, {}
            if mcp_urls:
                spec = {
                    name: {"url": url, "timeout": self.config.tool_timeout} for name, url in mcp_urls.items()
                }
                tools, dispatch, servers = await connect_mcp({"mcpServers": spec}, stack)
            for round_ in range(self.config.max_tool_rounds + 1):
                # Sampling settings are not sent: the interception server applies the run's own.
                body = {"model": ctx.model, "messages": messages}
                if tools and round_ < self.config.max_tool_rounds:
                    body["tools"] = tools
                async with loop_session().post(
                    f"{endpoint}/chat/completions", headers={"Authorization": f"Bearer {secret}"}, json=body
                ) as response:
                    text = await response.text()
                if response.status != 200:
                    # A failed call exits non-zero; the rollout records the model error or stop condition.
                    return vf.ProgramResult(exit_code=1, stdout="", stderr=text[-2000:])
                message = json.loads(text)["choices"][0]["message"]
                calls = (message.get("tool_calls") or []) if "tools" in body else []
                if not calls:
                    break
                messages.append(
                    {"role": "assistant", "content": message.get("content") or "", "tool_calls": calls}
                )
                for call in calls:
                    result = await run_tool(servers, dispatch, call["function"])
                    messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": result})
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


async def run_tool(servers: dict, dispatch: dict, function: dict) -> str:
    """One tool call's result as text; a bad call (unknown tool, arguments that are no JSON object, a
    failing tool) answers with an error the model can read, as a tool server would."""
    name = function.get("name", "")
    if name not in dispatch:
        return f"error: no tool named {name!r}; the tools are {', '.join(dispatch) or 'none'}."
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except json.JSONDecodeError as error:
        return f"error: the arguments are not valid JSON ({error.msg})."
    if not isinstance(arguments, dict):
        return "error: the arguments must be a JSON object."
    try:
        result = await call_mcp(servers, dispatch, name, arguments)
    except Exception as error:  # the model's call failed, not the rollout: it reads the error and goes on
        return f"error: {error}"
    return result if isinstance(result, str) else json.dumps(result)


_sessions: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, aiohttp.ClientSession]" = (
    weakref.WeakKeyDictionary()
)


def loop_session() -> aiohttp.ClientSession:
    """One aiohttp session per event loop, connections kept alive and unlimited in number.

    aiohttp's client, not httpx: on this loopback hop httpx and httpcore cost several times more CPU
    per call (benchmarks/rl/bench_env_overhead.py).
    """
    loop = asyncio.get_running_loop()
    if loop not in _sessions:
        timeout = aiohttp.ClientTimeout(total=None, connect=10)
        _sessions[loop] = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout)
    return _sessions[loop]


async def close_session() -> None:
    """Closes this event loop's session, if it has one (lib.orchestrator.envs.serving does, on leaving)."""
    session = _sessions.pop(asyncio.get_running_loop(), None)
    if session is not None:
        await session.close()


__all__ = ["PlainChatHarness", "PlainChatHarnessConfig"]
