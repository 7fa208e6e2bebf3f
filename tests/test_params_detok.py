"""SamplingParams validation, incremental detokenization and stop strings (CPU)."""
from __future__ import annotations

import numpy as np
import pytest
import tokenizers

from tileinfer.engine.detokenize import IncrementalDetokenizer, TokenBytes
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
    ("logit_bias", {5: 101}, "logit_bias must map token ids (integers >= 0) to numbers in [-100, 100]"),
    ("logit_bias", {-1: 1.0}, "logit_bias must map token ids"),
    ("logit_bias", {"5": 1.0}, "logit_bias must map token ids"),
    ("logit_bias", {5: float("nan")}, "logit_bias must map token ids"),
    ("logit_bias", [5], "logit_bias must map token ids"),
    ("logit_bias", dict.fromkeys(range(513), 1.0), "logit_bias names 513 tokens; at most 512"),
])
def test_invalid_values_name_the_field_and_range(field, value, words):
    with pytest.raises(ValueError) as e:
        SamplingParams(**{field: value})
    assert words in str(e.value)


def test_logit_bias_drops_zeros():
    assert SamplingParams(logit_bias={5: 0, 7: -2}).logit_bias == {7: -2.0}
    assert SamplingParams(logit_bias={5: 0}).logit_bias is None


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


def byte_token(hf, byte: int) -> int:
    """The id of the token that is this one byte."""
    return next(i for i, piece in enumerate(TokenBytes.of(hf).pieces) if piece == bytes([byte]))


def test_tokens_ending_inside_a_character_are_flushed_at_the_end(hf):
    # The first two bytes of a three-byte character (a model can end on them): held back while streaming,
    # then given as U+FFFD once the request ends, as a decode of the whole output gives them.
    ids = hf.encode("Tiger", add_special_tokens=False).ids + [byte_token(hf, 0xE4), byte_token(hf, 0xB8)]
    d = IncrementalDetokenizer(hf)
    streamed = "".join(d.add(t) for t in ids)
    assert streamed == "Tiger" and d.stream_delta(False) == "Tiger"
    assert d.stream_delta(True) == "\ufffd" == hf.decode(ids)[len("Tiger"):] and d.text == hf.decode(ids)
    d.flush()  # twice is once
    assert d.text == hf.decode(ids)


def test_bytes_that_can_start_no_character_come_out_as_replacement_characters_at_once(hf):
    ids = hf.encode("Tiger", add_special_tokens=False).ids + [byte_token(hf, b) for b in (0xA1, 0xA2, 0xFF)]
    d = IncrementalDetokenizer(hf)
    assert "".join(d.add(t) for t in ids) == "Tiger\ufffd\ufffd\ufffd" == hf.decode(ids)


def windowed(hf) -> tokenizers.Tokenizer:
    """The same tokenizer with its byte-level decoder inside a Sequence: decoded by windows, not by bytes."""
    other = tokenizers.Tokenizer.from_str(hf.to_str())
    other.decoder = tokenizers.decoders.Sequence([tokenizers.decoders.ByteLevel()])
    return other


@pytest.mark.parametrize("path", ["bytes", "windows"])
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_streamed_text_equals_the_tokenizers_decode_of_random_tokens(hf, path, skip_special_tokens):
    """Random ids (single bytes: partial and invalid UTF-8; anything in the vocabulary; special and added
    tokens among them): the streamed deltas join to what the tokenizer's decode of all of them gives."""
    tokenizer = hf if path == "bytes" else windowed(hf)
    assert (TokenBytes.of(tokenizer) is None) == (path == "windows")
    rng = np.random.default_rng(5)
    vocab = hf.get_vocab_size()
    for trial in range(150 if path == "bytes" else 40):
        n = int(rng.integers(1, 30))
        # up to vocab + 300: a model's vocabulary is often padded past its tokenizer's (decoded as nothing)
        ids = [rng.integers(0, 256, n), rng.integers(0, vocab + 300, n), rng.integers(vocab - 30, vocab, 3)][trial % 3]
        if trial % 3 == 2:
            ids = rng.permutation(np.concatenate([ids, rng.integers(0, 300, n)]))
        ids = [int(i) for i in ids]
        d = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        streamed = "".join([(d.add(t), d.stream_delta(False))[1] for t in ids]) + d.stream_delta(True)
        want = hf.decode(ids, skip_special_tokens=skip_special_tokens)
        assert streamed == d.text == want, ids