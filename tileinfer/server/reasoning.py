"""Qwen3's reasoning apart from its answer: a reply that opens with `<think>` has everything up to `</think>`
as `reasoning_content`, and what follows (its leading newlines dropped) as `content`, as vLLM's Qwen3
reasoning parser returns them. A reply without `<think>` at its start is all content; one cut off before
`</think>` is all reasoning.

`split` does it for a whole reply; `ReasoningStream` does the same piece by piece for a streamed one (the
pieces may cut the tags anywhere), so that the streamed parts add up to `split`'s.
"""
from __future__ import annotations

START, END = "<think>", "</think>"


def split(text: str) -> tuple[str | None, str]:
    """(reasoning or None, content) of a whole reply."""
    if not text.startswith(START):
        return None, text
    body = text[len(START):]
    at = body.find(END)
    if at < 0:
        return body, ""
    return body[:at], body[at + len(END):].lstrip("\n")


class ReasoningStream:
    """Feed a reply's text pieces in order; each feed returns the (reasoning, content) text it completes.
    `finish()` returns what was held back (a possible tag's start) once the reply has ended."""

    def __init__(self):
        self.state = "start"    # start -> (reasoning -> answer) or content
        self.held = ""          # text not yet given out: a possible tag, or newlines before the answer

    def feed(self, piece: str) -> tuple[str, str]:
        self.held += piece
        if self.state == "start":
            if START.startswith(self.held):
                return "", ""   # could still be the opening tag
            if not self.held.startswith(START):
                self.state = "content"
            else:
                self.state, self.held = "reasoning", self.held[len(START):]
        if self.state == "content":
            out, self.held = self.held, ""
            return "", out
        if self.state == "reasoning":
            at = self.held.find(END)
            if at < 0:
                keep = _tag_prefix_len(self.held, END)  # the end of held might start </think>
                out, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
                return out, ""
            reasoning, self.held = self.held[:at], self.held[at + len(END):]
            self.state = "answer"
            return reasoning, self._answer()
        return "", self._answer()

    def _answer(self) -> str:
        """The answer's text: its leading newlines dropped, so held until something else comes."""
        if self.state == "answer" and self.held.strip("\n") == "":
            return ""  # only newlines so far: keep holding
        if self.state == "answer":
            self.state, out, self.held = "content", self.held.lstrip("\n"), ""
            return out
        return ""

    def finish(self) -> tuple[str, str]:
        held, self.held = self.held, ""
        if self.state == "start":
            return "", held       # a reply shorter than the tag that was not the tag
        if self.state == "reasoning":
            return held, ""
        return "", held.lstrip("\n") if self.state == "answer" else held


def _tag_prefix_len(text: str, tag: str) -> int:
    """The longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
