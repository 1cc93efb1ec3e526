"""Prompt ids reuse the exact ids of earlier turns; tool calls parse; stop strings cut."""

from __future__ import annotations

import json
from typing import Any

import pytest

from jetctl.client.timeline import (
    ChatRenderer,
    Timeline,
    ToolCallFormat,
    Turn,
    normalize_message,
    parse_tool_calls,
    tool_call_formats,
    tools_key,
    truncate_at_stop,
)
from jetctl.types import LLMCall

pytestmark = pytest.mark.unit

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]


def _renderer(tokenizer: Any) -> ChatRenderer:
    return ChatRenderer(tokenizer, [tokenizer.convert_tokens_to_ids("<|im_end|>")])


def _record(
    r: ChatRenderer,
    tl: Timeline,
    messages: list[dict[str, Any]],
    completion: str,
    tools: Any = None,
) -> Turn:
    msgs = [normalize_message(m) for m in messages]
    plan = r.prompt_ids(tl, msgs, tools)
    ids = r.encode(completion)
    reply = parse_tool_calls(r.decode(ids, skip_special_tokens=True))
    call = LLMCall("policy", plan.ids, ids, [-1.0] * len(ids), 0)
    turn = Turn(msgs, tools_key(tools), plan.prompt_text, reply.as_message(), call, plan.reused)
    tl.turns.append(turn)
    return turn


def test_second_turn_starts_with_first_prompt_and_completion(tokenizer: Any) -> None:
    r, tl = _renderer(tokenizer), Timeline("r")
    first = _record(r, tl, [{"role": "user", "content": "Reply with 7."}], "7777<|im_end|>")
    messages = [
        {"role": "user", "content": "Reply with 7."},
        {"role": "assistant", "content": "7777", "refusal": None},
        {"role": "user", "content": "Again."},
    ]
    plan = r.prompt_ids(tl, [normalize_message(m) for m in messages], None)
    head = first.call.prompt_ids + first.call.completion_ids
    assert plan.reused and plan.ids[: len(head)] == head
    # with a well-behaved template the result also equals a fresh render, token for token
    assert plan.ids == r.encode(plan.prompt_text)


def test_completion_without_end_of_turn_gets_the_closing_added(tokenizer: Any) -> None:
    r, tl = _renderer(tokenizer), Timeline("r")
    first = _record(r, tl, [{"role": "user", "content": "Count."}], "12")  # stopped by max_tokens
    messages = [
        {"role": "user", "content": "Count."},
        {"role": "assistant", "content": "12"},
        {"role": "user", "content": "more"},
    ]
    plan = r.prompt_ids(tl, [normalize_message(m) for m in messages], None)
    head = first.call.prompt_ids + first.call.completion_ids
    assert plan.ids[: len(head)] == head
    assert r.decode(plan.ids[len(head) :], skip_special_tokens=False).startswith(
        "<|im_end|>\n<|im_start|>user\nmore"
    )


def test_edited_history_renders_fresh(tokenizer: Any) -> None:
    r, tl = _renderer(tokenizer), Timeline("r")
    _record(r, tl, [{"role": "user", "content": "Reply with 7."}], "7777<|im_end|>")
    edited = [
        {"role": "user", "content": "Reply with 7."},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "x"},
    ]
    plan = r.prompt_ids(tl, [normalize_message(m) for m in edited], None)
    assert not plan.reused and plan.ids == r.encode(plan.prompt_text)


def test_tool_call_turn_keeps_generated_ids_even_when_json_spacing_differs(tokenizer: Any) -> None:
    r, tl = _renderer(tokenizer), Timeline("r")
    completion = '<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call><|im_end|>'
    first = _record(r, tl, [{"role": "user", "content": "1+2?"}], completion, TOOLS)
    assert first.reply["tool_calls"][0]["function"] == {
        "name": "add",
        "arguments": {"a": 1, "b": 2},
    }
    call_id = "call_x"
    messages = [
        {"role": "user", "content": "1+2?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": call_id,
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": call_id, "content": "3"},
    ]
    plan = r.prompt_ids(tl, [normalize_message(m) for m in messages], TOOLS)
    head = first.call.prompt_ids + first.call.completion_ids
    assert plan.reused and plan.ids[: len(head)] == head
    tail = r.decode(plan.ids[len(head) :], skip_special_tokens=False)
    assert (
        tail
        == "\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def test_parse_tool_calls() -> None:
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>{"name": "mul", "arguments": "{\\"x\\": 2}"}</tool_call>'
    reply = parse_tool_calls(text)
    assert reply.content == "Let me add."
    assert [c["function"]["name"] for c in reply.tool_calls] == ["add", "mul"]
    assert json.loads(reply.tool_calls[0]["function"]["arguments"]) == {"a": 1}
    assert reply.tool_calls[1]["function"]["arguments"] == '{"x": 2}'
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in reply.tool_calls)
    broken = parse_tool_calls("<tool_call>not json</tool_call>")
    assert broken.tool_calls == [] and broken.content == "<tool_call>not json</tool_call>"


# What real chat templates say about tool calls, trimmed to the sentence that declares the
# format (Llama 3.1's system prompt; Mistral v3's assistant turn).
LLAMA_TEMPLATE = (
    "{{- 'Respond in the format {\"name\": function name, \"parameters\": dictionary of "
    "argument name and its value}. Do not use variables.' }}{{- '<|python_tag|>' }}"
)
MISTRAL_TEMPLATE = "{{- '[TOOL_CALLS] [' }}{%- for tool in message.tool_calls %}{%- endfor %}"


def test_tool_call_formats_are_the_ones_the_template_declares() -> None:
    from jetctl.models import chatml_template

    assert tool_call_formats(chatml_template()) == ("hermes",)  # builtin SmolLM2 and tiny
    assert tool_call_formats(LLAMA_TEMPLATE) == ("llama_json",)
    assert tool_call_formats(MISTRAL_TEMPLATE) == ("mistral",)
    assert tool_call_formats({"default": "x", "tool_use": MISTRAL_TEMPLATE}) == ("mistral",)
    # a template that cannot render tools declares nothing: the common format
    assert tool_call_formats("{{ messages[0].content }}") == ("hermes",)
    assert tool_call_formats(None) == ("hermes",)


@pytest.mark.parametrize(
    ("formats", "text"),
    [
        (("hermes",), '<tool_call>\n{"name": "click", "arguments": {"target": "Add"}}\n</tool_call>'),
        (("hermes",), '<tool_call>[{"name": "click", "arguments": {"target": "Add"}}]</tool_call>'),
        (("hermes",), '<tool_call>\n{"name": "click", "arguments": {"target": "Add"}}\n'),
        (("hermes",), '<tool_call>{"name": "click", "parameters": {"target": "Add"}}</tool_call>'),
        (("llama_json",), '{"name": "click", "parameters": {"target": "Add"}}'),
        (("llama_json",), '<|python_tag|>{"name": "click", "parameters": {"target": "Add"}}'),
        (("mistral",), '[TOOL_CALLS] [{"name": "click", "arguments": {"target": "Add"}}]'),
        (("mistral",), '[{"name": "click", "arguments": {"target": "Add"}}]'),
    ],
)
def test_every_declared_format_gives_the_same_openai_tool_call(
    formats: tuple[ToolCallFormat, ...], text: str
) -> None:
    reply = parse_tool_calls(text, formats)
    assert reply.content is None
    assert [c["function"] for c in reply.tool_calls] == [
        {"name": "click", "arguments": '{"target": "Add"}'}
    ]


def test_text_in_a_format_the_template_does_not_declare_stays_content() -> None:
    llama = '{"name": "click", "parameters": {"target": "Add"}}'
    hermes = f"<tool_call>{llama}</tool_call>"
    assert parse_tool_calls(llama, ("hermes",)).tool_calls == []
    assert parse_tool_calls(hermes, ("llama_json",)).content == hermes
    assert parse_tool_calls(llama, ("mistral",)).content == llama
    # half a call, a nameless one, arguments that are neither object nor text
    for text in (
        '<tool_call>{"name": "click", "arguments": {"target": ',
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>{"name": "click", "arguments": 3}</tool_call>',
        '<tool_call>[{"name": "click"}, 7]</tool_call>',
    ):
        assert parse_tool_calls(text).tool_calls == [], text
    # a ';' inside a string is not a separator; two calls joined by ';' are two calls
    named = parse_tool_calls('{"name": "a; b", "parameters": {}}', ("llama_json",))
    assert [c["function"]["name"] for c in named.tool_calls] == ["a; b"]
    two = parse_tool_calls('{"name": "a", "parameters": {}}; {"name": "b"}', ("llama_json",))
    assert [c["function"]["name"] for c in two.tool_calls] == ["a", "b"]


def test_truncate_at_stop(tokenizer: Any) -> None:
    ids = tokenizer.encode("12 STOP 34", add_special_tokens=False)
    kept, stopped = truncate_at_stop(tokenizer, ids, ["STOP"])
    assert stopped and "STOP" in tokenizer.decode(kept) and "34" not in tokenizer.decode(kept)
    assert truncate_at_stop(tokenizer, ids, ["zzz"]) == (ids, False)
