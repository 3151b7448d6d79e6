"""Tool calls in the Qwen (Hermes) text format: a completion's text split into content and OpenAI tool_calls."""

import json
import re
import uuid

TOOL_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """The text before the first <tool_call> block and the well-formed calls, as OpenAI tool_calls.

    A block is a JSON object with a "name" and optional "arguments" (sent on as a JSON string, as
    OpenAI's API does). Blocks that do not parse are dropped, as vLLM's hermes parser drops them; text
    without any well-formed block comes back whole, with no calls.
    """
    calls = []
    for block in TOOL_CALL.findall(text):
        try:
            parsed = json.loads(block.strip())
        except json.JSONDecodeError:
            continue
        if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
            continue
        arguments = parsed.get("arguments", {})
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": parsed["name"],
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                },
            }
        )
    if not calls:
        return text, []
    return text[: text.index("<tool_call>")], calls
