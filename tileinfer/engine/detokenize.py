"""Incremental detokenization and stop strings.

Byte-level BPE tokens do not map to whole characters: a character of several UTF-8 bytes may
span tokens, and decoding a prefix that ends inside one gives U+FFFD. The detokenizer decodes a
short window [prefix_offset, end) of the output and emits only what extends the already
emitted text once the window no longer ends in a partial character (the method HF's
text-generation-inference and vLLM use).

Stop strings are searched in the decoded text, not in single tokens, so a stop string that
spans a token boundary is found. While streaming, the last (longest stop string - 1)
characters are held back until they can no longer be the start of a stop string.
"""
from __future__ import annotations

_REPLACEMENT = "\ufffd"


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

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int, find_stop: bool = True) -> str:
        """Append one generated token; returns the text it completes ("" if it ends mid-character).

        After a stop string is found, `stopped_by` names it and `text` ends before it (or after
        it, with include_stop_str_in_output). find_stop=False: not looked for in this token's text
        (a request's first min_tokens tokens)."""
        self.ids.append(int(token_id))
        prefix = self._decode(self.ids[self._prefix_offset:self._read_offset])
        window = self._decode(self.ids[self._prefix_offset:])
        if len(window) <= len(prefix) or window.endswith(_REPLACEMENT):
            return ""
        delta = window[len(prefix):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        start = len(self.text)
        self.text += delta
        if self.stop and self.stopped_by is None and find_stop:
            self._find_stop(max(0, start - self._hold))
        return delta

    def flush(self) -> None:
        """At the end: the text of tokens still held back because they end inside a character. They decode
        as U+FFFD, as a decode of the whole output gives them; the stop strings are looked for in it too."""
        if self.stopped_by is not None or self._read_offset == len(self.ids):
            return
        prefix = self._decode(self.ids[self._prefix_offset:self._read_offset])
        window = self._decode(self.ids[self._prefix_offset:])
        self._prefix_offset, self._read_offset = self._read_offset, len(self.ids)
        if len(window) > len(prefix):
            start = len(self.text)
            self.text += window[len(prefix):]
            if self.stop:
                self._find_stop(max(0, start - self._hold))

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
        end = len(self.text) if finished or self.stopped_by is not None else max(self._streamed, len(self.text) - self._hold)
        delta = self.text[self._streamed:end]
        self._streamed = end
        return delta
