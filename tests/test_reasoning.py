"""Qwen3's reasoning parsed out of a reply (tileinfer/server/reasoning.py), whole and streamed."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tileinfer.server.reasoning import ReasoningStream, split


def test_split_whole_replies():
    assert split("<think>\nThe user greets me.\n</think>\n\nHello!") == ("\nThe user greets me.\n", "Hello!")
    assert split("Hello!") == (None, "Hello!")
    assert split("<think>cut off before the end") == ("cut off before the end", "")
    assert split("<think></think>\n\n") == ("", "")
    assert split("Hi <think>x</think>") == (None, "Hi <think>x</think>")  # only a reply that opens with it


def streamed(pieces: list[str]) -> tuple[str, str]:
    s = ReasoningStream()
    reasoning, content = "", ""
    for p in pieces:
        r, c = s.feed(p)
        reasoning, content = reasoning + r, content + c
    r, c = s.finish()
    return reasoning + r, content + c


TEXTS = ["<think>\nThe user greets me.\n</think>\n\nHello!", "Hello, no reasoning here.", "<think>cut off",
         "<think></think>\n\nOk", "<thin", "<think>a</thi", "<think>x</think>\n\n\n", "<", "", "<think>\n\n</think>"]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(TEXTS), st.lists(st.integers(0, 40), max_size=8))
def test_streamed_pieces_add_up_to_the_whole_split(text, cuts):
    cuts = sorted(set(min(c, len(text)) for c in cuts))
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    reasoning, content = split(text)
    assert streamed(pieces) == (reasoning or "", content)


def test_the_chat_message_carries_the_reasoning_apart():
    from tileinfer.server.app import chat_message
    assert chat_message("<think>\nhm\n</think>\n\nHi") == {"role": "assistant", "content": "Hi",
                                                             "reasoning_content": "\nhm\n"}
    assert chat_message("Hi") == {"role": "assistant", "content": "Hi", "reasoning_content": None}
