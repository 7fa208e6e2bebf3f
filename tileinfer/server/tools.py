"""Tool calls in Qwen3's form: the model answers a call as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Bern"}}
    </tool_call>

(the chat template lists the tools in the system turn). `parse` turns a finished reply into OpenAI's
`tool_calls` and the remaining content; `ToolCallStream` does the same while streaming: content passes
through until a call opens, then the call is held until it closes and goes out as one tool-call delta.
A call whose JSON does not parse, or lacks a name, stays in the content as the model wrote it.

tool_choice "required" or a named function is enforced with the grammar (`forced_grammar`): the reply is
then one or more calls whose arguments follow each function's parameters schema.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from ..engine.structured import COMPACT_JSON

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str

    def as_dict(self, index: int | None = None) -> dict:
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return out if index is None else {"index": index, **out}


def _call_of(body: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return ToolCall(value["name"], text, f"call_{uuid.uuid4().hex[:24]}")


def parse(text: str) -> tuple[str, list[ToolCall]]:
    """A finished reply's content (without the calls that parse) and its calls, in order."""
    calls, kept, at = [], [], 0
    for m in _CALL.finditer(text):
        call = _call_of(m.group(1))
        if call is None:
            continue
        kept.append(text[at:m.start()])
        calls.append(call)
        at = m.end()
    kept.append(text[at:])
    content = "".join(kept) if calls else text
    return (content.strip() if calls else content), calls


class ToolCallStream:
    """Streaming `parse`: feed text deltas, get (content delta, calls completed by this delta)."""

    def __init__(self):
        self._held = ""  # text that may be (the start of) a call

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._held += text
        content, calls = [], []
        while True:
            start = self._held.find(OPEN)
            if start < 0:
                keep = _partial_suffix(self._held, OPEN)
                content.append(self._held[:len(self._held) - keep])
                self._held = self._held[len(self._held) - keep:]
                break
            content.append(self._held[:start])
            end = self._held.find(CLOSE, start)
            if end < 0:
                self._held = self._held[start:]
                break
            whole = self._held[start:end + len(CLOSE)]
            call = _call_of(whole[len(OPEN):-len(CLOSE)].strip())
            if call is None:
                content.append(whole)
            else:
                calls.append(call)
            self._held = self._held[end + len(CLOSE):]
        return "".join(content), calls

    def finish(self) -> str:
        """What is still held (an unclosed call, a partial tag): it was content after all."""
        rest, self._held = self._held, ""
        return rest


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest suffix of text that is a proper prefix of tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def forced_grammar(tools: list[dict], name: str | None, parallel: bool = True) -> str:
    """A Lark grammar (llguidance's dialect) of one or more calls (one, unless parallel) to these tools
    (only `name`, if given), each call's arguments valid for its parameters schema."""
    chosen = [t["function"] for t in tools if name is None or t["function"].get("name") == name]
    schemas = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                 "arguments": f.get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False} for f in chosen]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema["x-guidance"] = COMPACT_JSON  # no free whitespace for the model to spend its budget on
    start = 'start: call ("\\n" call)*' if parallel else "start: call"
    # <tool_call> unquoted: Qwen3's added token itself (llguidance's special-token syntax), not its letters
    return f'{start}\ncall: {OPEN} "\\n" %json {json.dumps(schema)} "\\n" {CLOSE}\n'
