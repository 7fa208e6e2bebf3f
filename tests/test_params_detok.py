"""SamplingParams validation, incremental detokenization and stop strings (CPU)."""
from __future__ import annotations

import pytest
import tokenizers

from tileinfer.engine.detokenize import IncrementalDetokenizer
from tileinfer.engine.params import SamplingParams
from tileinfer.model import tokenizer as tok


@pytest.fixture(scope="module")
def hf():
    return tokenizers.Tokenizer.from_str(tok.qwen3_tokenizer_json())


@pytest.mark.parametrize("field, value, words", [
    ("max_tokens", 0, "max_tokens must be an integer >= 1"),
    ("min_tokens", 17, "min_tokens must be an integer in [0, max_tokens=16]"),
    ("min_tokens", -1, "min_tokens must be an integer in [0, max_tokens=16]"),
    ("max_tokens", 2.5, "max_tokens"),
    ("temperature", -0.1, "temperature must be a finite number >= 0"),
    ("temperature", float("nan"), "temperature"),
    ("top_k", -2, "top_k"),
    ("top_p", 0.0, "top_p must be in (0, 1]"),
    ("top_p", 1.5, "top_p"),
    ("min_p", -0.1, "min_p must be in [0, 1]"),
    ("repetition_penalty", 0.0, "repetition_penalty must be a finite number > 0"),
    ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2]"),
    ("frequency_penalty", -3, "frequency_penalty must be in [-2, 2]"),
    ("seed", -1, "seed must be None or an integer"),
    ("stop", [""], "stop must be a non-empty string"),
    ("stop_token_ids", [-5], "stop_token_ids"),
    ("logprobs", 21, "logprobs must be None or an integer in [0, 20]"),
    ("ignore_eos", "yes", "ignore_eos must be True or False"),
])
def test_invalid_values_name_the_field_and_range(field, value, words):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    assert words in str(e.value)


def test_defaults_and_normalisation():
    p = SamplingParams(top_k=-1, stop="END")
    assert p.top_k == 0 and p.stop == ["END"] and not p.has_penalties and not p.greedy
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(repetition_penalty=1.2).has_penalties
    assert SamplingParams(seed=7).resolved_seed() == 7


def test_incremental_text_equals_full_decode(hf):
    text = "Grüße, 世界! 🙂 naïve café — ok\n\tdone"
    ids = hf.encode(text, add_special_tokens=False).ids
    d = IncrementalDetokenizer(hf)
    pieces = [d.add(t) for t in ids]
    assert "".join(pieces) == text == d.text
    assert all("\ufffd" not in p for p in pieces)


def test_stop_string_spanning_tokens_is_found_and_cut(hf):
    text = "alpha beta STOPWORD gamma"
    ids = hf.encode(text, add_special_tokens=False).ids
    d = IncrementalDetokenizer(hf, stop=["PWO"])  # inside one word: spans a token boundary or sits in one token
    for t in ids:
        d.add(t)
        if d.stopped_by:
            break
    assert d.stopped_by == "PWO"
    assert d.text == "alpha beta STO"
    d2 = IncrementalDetokenizer(hf, stop=["beta S"], include_stop_str_in_output=True)
    for t in ids:
        d2.add(t)
        if d2.stopped_by:
            break
    assert d2.text == "alpha beta S"


def test_streaming_holds_back_a_possible_stop_prefix(hf):
    d = IncrementalDetokenizer(hf, stop=["<END>"])
    streamed = ""
    for t in hf.encode("one two <EN", add_special_tokens=False).ids:
        d.add(t)
        streamed += d.stream_delta(finished=False)
    assert "<EN" not in streamed  # could still become "<END>"
    for t in hf.encode("D> three", add_special_tokens=False).ids:
        d.add(t)
        streamed += d.stream_delta(finished=d.stopped_by is not None)
        if d.stopped_by:
            break
    assert d.stopped_by == "<END>"
    assert streamed == d.text == "one two "


def test_tokens_ending_inside_a_character_are_flushed_at_the_end(hf):
    # Byte tokens that never complete a character (a model can end on them): held back while streaming,
    # then given as U+FFFD once the request ends, as a decode of the whole output gives them.
    ids = hf.encode("Tiger", add_special_tokens=False).ids + [94, 95, 96]
    d = IncrementalDetokenizer(hf)
    streamed = "".join(d.add(t) for t in ids)
    assert streamed == "Tiger" and d.stream_delta(False) == "Tiger"
    assert d.stream_delta(True) == hf.decode(ids)[len("Tiger"):] and d.text == hf.decode(ids)
    d.flush()  # twice is once
    assert d.text == hf.decode(ids)
