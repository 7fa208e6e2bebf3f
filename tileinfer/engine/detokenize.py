"""Incremental detokenization and stop strings.

Byte-level BPE tokens do not map to whole characters: a character of several UTF-8 bytes may
span tokens, and decoding a prefix that ends inside one gives U+FFFD. The detokenizer decodes a
short window [prefix_offset, end) of the output and emits only what extends the already
emitted text once the window no longer ends in a partial character (the method HF's
text-generation-inference and vLLM use).

Stop strings are searched in the decoded text, not in single tokens, so a stop string that
spans a token boundary is found. While streaming, the last (longest stop string - 1)
characters are held back until they can no longer be the start of a stop string.

Byte-level BPE (the decoder of Qwen3's and Apertus' tokenizers) has a faster exact form. Its decode
maps each token to bytes (GPT-2's byte-to-character table, or the token's UTF-8 when a character is
not in that table), drops skipped special tokens, joins the bytes and decodes them as UTF-8 with
invalid sequences replaced. So the text of a token stream is what an incremental UTF-8 decoder
gives, fed each token's bytes (`TokenBytes`): one table lookup a token instead of two decodes of a
window, which matters when a server streams hundreds of sequences a step. A tokenizer with any other
decoder is decoded by windows.
"""
from __future__ import annotations

import codecs
import re
import weakref

from tokenizers.decoders import ByteLevel

_REPLACEMENT = "\ufffd"


def _byte_to_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable bytes stand for themselves, the others (controls, space,
    0x7f-0xa0, 0xad) for the characters from U+0100 on, in byte order. Character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenBytes:
    """Each token id's bytes under a byte-level tokenizer, and the ids of its special tokens (which a
    decode with skip_special_tokens leaves out). `of(tokenizer)` builds it once per tokenizer."""

    _made: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its table (None: not byte-level)

    def __init__(self, pieces: list[bytes], special: frozenset[int]):
        self.pieces = pieces      # [tokenizer's ids] bytes; b"" for an id with no token
        self.special = special

    @classmethod
    def of(cls, tokenizer) -> "TokenBytes | None":
        """The table of a Hugging Face tokenizer whose decoder is byte-level, else None."""
        if tokenizer not in cls._made:
            cls._made[tokenizer] = cls._build(tokenizer)
        return cls._made[tokenizer]

    @classmethod
    def _build(cls, tokenizer) -> "TokenBytes | None":
        if not isinstance(getattr(tokenizer, "decoder", None), ByteLevel):
            return None
        chars = _byte_to_char()
        to_latin1 = str.maketrans({c: chr(b) for c, b in chars.items()})  # then .encode("latin-1"): the bytes
        outside = re.compile("[^" + re.escape("".join(chars)) + "]")
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        pieces = [b""] * (max(vocab.values()) + 1)
        for token, i in vocab.items():
            if outside.search(token):  # a character outside the alphabet (an added token's text): its UTF-8
                pieces[i] = token.encode()
            else:
                pieces[i] = token.translate(to_latin1).encode("latin-1")
        special = frozenset(i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        return cls(pieces, special)


class IncrementalDetokenizer:
    def __init__(self, tokenizer, *, skip_special_tokens: bool = True, stop: list[str] | None = None,
                 include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or [])
        self.include_stop = include_stop_str_in_output
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.text = ""            # everything decoded so far (cut at a stop string once one is found)
        self._prefix_offset = 0
        self._read_offset = 0
        self._streamed = 0        # characters of `text` already handed out by `stream_delta`
        self.stopped_by: str | None = None
        self._bytes = TokenBytes.of(tokenizer)
        self._partial = b""       # the byte-level path: the bytes of a character not complete yet

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int, find_stop: bool = True) -> str:
        """Append one generated token; returns the text it completes ("" if it ends mid-character).

        After a stop string is found, `stopped_by` names it and `text` ends before it (or after
        it, with include_stop_str_in_output). find_stop=False: not looked for in this token's text
        (a request's first min_tokens tokens)."""
        token_id = int(token_id)
        self.ids.append(token_id)
        delta = self._next_bytes(token_id) if self._bytes is not None else self._next_window()
        self._append(delta, find_stop)
        return delta

    def flush(self) -> None:
        """At the end: the text of tokens still held back because they end inside a character. They decode
        as U+FFFD, as a decode of the whole output gives them; the stop strings are looked for in it too."""
        if self.stopped_by is not None:
            return
        if self._bytes is not None:
            rest, self._partial = self._partial.decode("utf-8", "replace"), b""  # an unfinished character: U+FFFD
        else:
            rest = self._next_window(final=True)
        self._append(rest, find_stop=True)

    def _append(self, delta: str, find_stop: bool) -> None:
        """Add decoded text; look for the stop strings in it (and the characters held back before it)."""
        if not delta:
            return
        start = len(self.text)
        self.text += delta
        if self.stop and self.stopped_by is None and find_stop:
            self._find_stop(max(0, start - self._hold))

    def _next_bytes(self, token_id: int) -> str:
        """The byte-level path: the characters this token's bytes complete (invalid bytes as U+FFFD)."""
        b = self._bytes
        if self.skip_special_tokens and token_id in b.special:
            return ""
        pieces = b.pieces  # a model's vocabulary may be padded past the tokenizer's: such an id decodes to nothing
        data = self._partial + (pieces[token_id] if token_id < len(pieces) else b"")
        text, used = codecs.utf_8_decode(data, "replace", False)  # stops before an unfinished character
        self._partial = data[used:]
        return text

    def _next_window(self, final: bool = False) -> str:
        """Any other decoder: the window's new text once it no longer ends inside a character (final: as it
        is, an unfinished character as U+FFFD)."""
        if self._read_offset == len(self.ids):
            return ""
        prefix = self._decode(self.ids[self._prefix_offset:self._read_offset])
        window = self._decode(self.ids[self._prefix_offset:])
        if not final and (len(window) <= len(prefix) or window.endswith(_REPLACEMENT)):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        return window[len(prefix):]

    def _find_stop(self, search_from: int) -> None:
        best = None
        for s in self.stop:
            at = self.text.find(s, search_from)
            if at >= 0 and (best is None or at < best[0]):
                best = (at, s)
        if best is not None:
            at, s = best
            self.stopped_by = s
            self.text = self.text[:at + len(s)] if self.include_stop else self.text[:at]

    def stream_delta(self, finished: bool) -> str:
        """New text safe to show: all of it once finished (held-back tokens flushed), else all but what could
        start a stop string."""
        if finished:
            self.flush()
        held = finished or self.stopped_by is not None
        end = len(self.text) if held else max(self._streamed, len(self.text) - self._hold)
        delta = self.text[self._streamed:end]
        self._streamed = end
        return delta
