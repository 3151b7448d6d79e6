"""lib/inference/server/tools.py: tool calls in the Qwen (Hermes) text format split into content and OpenAI tool_calls."""

from lib.inference.server.tools import parse_tool_calls


def test_tool_call_text_parses_into_content_and_openai_calls():
    text = 'Let me see.<tool_call>{"name": "calculate", "arguments": {"expression": "2*3"}}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me see."
    assert [c["function"] for c in calls] == [{"name": "calculate", "arguments": '{"expression": "2*3"}'}]
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert parse_tool_calls("<tool_call>{not json}</tool_call> plain") == (
        "<tool_call>{not json}</tool_call> plain",
        [],
    )
    assert parse_tool_calls("no calls here") == ("no calls here", [])
