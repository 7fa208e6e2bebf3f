"""Tool calls (tileinfer/server/tools.py): Qwen3's <tool_call> replies parsed whole and streamed, and
tool_choice "required" / a named function enforced by the grammar, through the server with the OpenAI
client on a random-weight checkpoint (only the grammar can make its calls valid)."""
from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tileinfer.server.tools import ToolCallStream, parse

from test_server import NAME, error_of, serving

CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Bern"}}\n</tool_call>'


def test_parse_whole_replies():
    content, calls = parse(CALL)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [("weather", {"city": "Bern"})]
    content, calls = parse("Let me look.\n" + CALL + "\n" + CALL.replace("Bern", "Chur"))
    assert content == "Let me look." and [json.loads(c.arguments)["city"] for c in calls] == ["Bern", "Chur"]
    assert len({c.id for c in calls}) == 2
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert parse(broken) == (broken, [])  # stays content, as the model wrote it
    assert parse("no calls here") == ("no calls here", [])
    assert parse('<tool_call>{"arguments": {}}</tool_call>')[1] == []  # no name: not a call


def streamed(pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    s = ToolCallStream()
    content, calls = "", []
    for p in pieces:
        c, made = s.feed(p)
        content += c
        calls += [(m.name, m.arguments) for m in made]
    return content + s.finish(), calls


TEXTS = [CALL, "Sure.\n" + CALL, CALL + CALL, "plain text", "<tool_ca", "<tool_call>\n{unclosed", "a < b",
         "<tool_call>{bad}</tool_call> then " + CALL, ""]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(TEXTS), st.lists(st.integers(0, 120), max_size=8))
def test_streamed_pieces_give_the_whole_parse(text, cuts):
    cuts = sorted(set(min(c, len(text)) for c in cuts))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    content, calls = parse(text)
    got_content, got_calls = streamed(pieces)
    assert got_calls == [(c.name, c.arguments) for c in calls]
    assert got_content.strip() == content.strip()


# ---------------------------------------------------------------------------- through the server
TOOLS = [
    {"type": "function", "function": {"name": "weather", "description": "The weather in a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                         "b": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["a", "b"], "additionalProperties": False}}},
]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Bern?"}]


@pytest.fixture(scope="module")
def served(serve_target):
    yield from serving(serve_target.checkpoint, serve_target.engine_options(max_num_seqs=8, max_context=1024))


@pytest.mark.parametrize("seed", range(6))
def test_a_named_tool_call_has_valid_arguments(served, seed):
    r = served.client().chat.completions.create(
        model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=120, temperature=1.0, seed=seed,
        tool_choice={"type": "function", "function": {"name": "weather"}}, parallel_tool_calls=False)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call, = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS["weather"])


def test_required_calls_stream_as_deltas_and_the_result_continues_the_chat(served):
    client = served.client()
    chunks = list(client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=200,
                                                 temperature=1.0, seed=7, tool_choice="required", stream=True))
    deltas = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    assert deltas and [d.index for d in deltas] == list(range(len(deltas)))
    for d in deltas:
        jsonschema.validate(json.loads(d.function.arguments), PARAMETERS[d.function.name])
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
    history = MESSAGES + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": d.id, "type": "function", "function": {"name": d.function.name, "arguments": d.function.arguments}}
        for d in deltas]}] + [{"role": "tool", "tool_call_id": d.id, "content": '{"ok": true}'} for d in deltas]
    r = client.chat.completions.create(model=NAME, messages=history, tools=TOOLS, max_tokens=5, temperature=0)
    assert r.usage.prompt_tokens > 0 and r.choices[0].finish_reason in ("length", "stop", "tool_calls")


def test_tool_choice_none_and_auto_leave_plain_text_alone(served):
    client = served.client()
    r = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=8, temperature=0,
                                       tool_choice="none")
    with_tools = client.chat.completions.create(model=NAME, messages=MESSAGES, tools=TOOLS, max_tokens=8,
                                                temperature=0)
    plain = client.chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=8, temperature=0)
    assert r.usage.prompt_tokens == plain.usage.prompt_tokens < with_tools.usage.prompt_tokens  # none: not rendered
    assert with_tools.choices[0].message.tool_calls is None  # a random model does not write <tool_call>


@pytest.mark.parametrize("extra, words", [
    (dict(tool_choice="required"), "tool_choice needs tools"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "not among the tools"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}),
     "ask for one structured output"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]),
     "parameters must be a JSON schema"),
])
def test_bad_tool_choices_are_400(served, extra, words):
    with pytest.raises(openai.BadRequestError) as e:
        served.client().chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=4, **extra)
    assert words in error_of(e.value)["message"]
