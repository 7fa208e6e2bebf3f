"""Structured output: a request's text held to a JSON schema, a regex, a list of choices or a grammar.

    SamplingParams(max_tokens=200, structured_outputs=StructuredOutputs(json={"type": "object", ...}))

The grammar engine is llguidance (the one vLLM and llama.cpp use). Per constrained request a matcher
follows the tokens generated so far; before each of its samples the engine asks it for the allowed
tokens, a bitmask of one bit per vocabulary entry, and the sampling step sets every other logit to
-inf (after penalties, before temperature, so greedy, top-k/top-p and logprobs all see the constrained
distribution). EOS is allowed only where the grammar may end, and a request whose grammar is complete
finishes ("stop"). Requests without a constraint pay nothing.

What it costs. A step's matchers advance and compute their masks together (`Grammars.consume`,
`Grammars.fill_masks`: llguidance's executor, Rust threads without the GIL), the masks written
straight into the runner's pinned staging rows. The engine does it after launching the step, while
the GPU runs its forward (the step's sampling waits for them: runner/gpu.py), and in the background
(`Grammars.start`): the engine's own host work for the step (detokenizing, stop checks, scheduling and
launching the next one) runs meanwhile. A batch of constrained requests pays the GPU for copying the masks in, and
the host for whatever of the mask work neither hides.

JSON is generated compact (", " and ": " separators, no other whitespace): a model cannot then spend
its budget on whitespace the grammar would allow.
"""
from __future__ import annotations

import re
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from ..model.tokenizer import check_text


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one constraint (the fields follow vLLM's StructuredOutputsParams)."""
    json: dict | str | None = None       # a JSON schema (a dict, or its JSON text)
    json_object: bool = False            # any JSON object
    regex: str | None = None             # the whole text matches this regular expression
    choice: list[str] | None = None      # the whole text is one of these strings
    grammar: str | None = None           # a Lark grammar (llguidance's dialect)

    def __post_init__(self) -> None:
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object is True else []
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of json, json_object, regex, choice, grammar; "
                             f"got {', '.join(given) or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise ValueError(f"structured_outputs.json is a JSON schema (dict or JSON text), "
                             f"got {type(self.json).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured_outputs.choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar", "choice"):  # (the grammar engine takes UTF-8)
            value = getattr(self, name)
            for text in [value] if isinstance(value, str) else value or ():
                check_text(text, f"structured_outputs.{name}")

    def grammar_text(self) -> str:
        """The constraint as an llguidance grammar."""
        from llguidance import LLMatcher
        if self.json is not None or self.json_object:
            schema = self.json if self.json is not None else {"type": "object"}
            try:
                return LLMatcher.grammar_from_json_schema(schema, overrides=COMPACT_JSON)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not a JSON schema: {e}") from None
        if self.regex is not None:
            return LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in self.choice))
        return LLMatcher.grammar_from_lark(self.grammar)


COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# llguidance's mask computation groups the vocabulary into "slices" (a regex each; a token belongs to the first
# it matches) and allows a whole slice at once where the grammar's lexer accepts all of it, walking the token
# trie only for the rest. Its default slices end JSON string contents at 10 and 30 characters, so inside a
# string with a maxLength and fewer characters left the short string tokens are all walked; slices of 2, 4
# and 6 characters first let most of them go at once. The masks are the same (tests/test_structured.py).
_STRING = r'[^"\\\x00-\x1F\x7F]'  # a character of a JSON string's contents (llguidance's own slices' class)
SHORT_STRING_SLICES = [f"{_STRING}{{1,{n}}}" for n in (2, 4, 6)]


class Grammars:
    """The engine's grammar side: the tokenizer as llguidance sees it (built on first use, about a
    second for Qwen3's vocabulary), a matcher per constrained request, and the thread pool that advances
    a step's matchers and computes their masks in parallel."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids):
        self._tokenizer_json = tokenizer.to_str()
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.eos_token_ids = sorted(eos_token_ids)
        self._ll = None
        self._executor = None
        self._background: ThreadPoolExecutor | None = None
        self.background_seconds = 0.0  # the background thread's time in start's work (the engine takes it)

    def _ll_tokenizer(self):
        if self._ll is None:
            from llguidance import LLTokenizer
            self._ll = LLTokenizer(self._tokenizer_json, n_vocab=self.vocab_size, eos_token=self.eos_token_ids,
                                   slices=SHORT_STRING_SLICES + LLTokenizer.general_slices())
        return self._ll

    def _pool(self):
        if self._executor is None:
            from llguidance import LLExecutor
            self._executor = LLExecutor()  # llguidance's default: 80% of the CPUs, at most 32 threads
        return self._executor

    def matcher(self, spec: StructuredOutputs) -> "Matcher":
        """A matcher for one request; ValueError naming the problem if the grammar engine rejects it."""
        from llguidance import LLMatcher
        grammar = spec.grammar_text()
        error = LLMatcher.validate_grammar(grammar, self._ll_tokenizer())
        if error:
            raise ValueError(f"structured_outputs: the grammar engine rejects it: {error}")
        return Matcher(LLMatcher(self._ll_tokenizer(), grammar, log_level=0), self.vocab_size)

    def fill_masks(self, matchers: list["Matcher | None"], out: np.ndarray) -> None:
        """out[i] = matchers[i]'s allowed next tokens (as Matcher.mask), all computed in one call on the
        pool's threads; a row whose matcher is None allows every token. out: C-contiguous int32 [n, words],
        e.g. pinned staging memory the GPU copies from."""
        if out.dtype != np.int32 or out.shape != (len(matchers), self.words) or not out.flags.c_contiguous:
            raise ValueError(f"fill_masks: out must be C-contiguous int32 {(len(matchers), self.words)}, "
                             f"got {out.dtype} {out.shape}")
        work = []
        for i, m in enumerate(matchers):
            if m is None:
                out[i] = -1
            else:
                work.append((m._m, i))
        if work:
            self._pool().unsafe_compute_mask_ptr(work, out.ctypes.data, self.words * 4, len(matchers))

    def start(self, pairs: list[tuple["Matcher", int]], masks_for: list["Matcher | None"] | None,
              publish) -> "GrammarStep":
        """On the background thread: advance each matcher by its token (consume), then, if masks_for is given,
        publish(fill) the next step's masks (fill(out) as fill_masks(masks_for, out); publish is the runner's
        publish_masks). Until the step's `wait`, only that thread may touch these matchers."""
        if self._background is None:
            self._background = ThreadPoolExecutor(1, thread_name_prefix="tileinfer-grammar")
        consumed = self._background.submit(self._timed, self._consume_and_check, pairs)
        published = None
        if masks_for is not None:
            published = self._background.submit(self._timed, publish, lambda out: self.fill_masks(masks_for, out))
        return GrammarStep(consumed, published)

    def _timed(self, fn, *args):
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.background_seconds += time.perf_counter() - start

    def _consume_and_check(self, pairs: list[tuple["Matcher", int]]) -> tuple[list[str | None], list[bool]]:
        return self.consume(pairs), [m.done for m, _ in pairs]

    def consume(self, pairs: list[tuple["Matcher", int]]) -> list[str | None]:
        """Advance each matcher by its sampled token, in parallel; per pair None, or the grammar engine's
        error if it refuses the token (a bug: the token was sampled under that matcher's mask)."""
        if not pairs:
            return []
        ok = self._pool().consume_token_par([(m._m, int(t)) for m, t in pairs])
        return [None if good else m._m.get_error() for (m, _), good in zip(pairs, ok)]


@dataclass
class GrammarStep:
    """A step's grammar work running in the background (Grammars.start)."""
    consumed: Future            # -> (per pair: None or the error of a refused token, per pair: grammar complete)
    published: Future | None    # the next step's masks handed to the runner

    def wait(self) -> None:
        """Until all of it is done; raises what it raised."""
        self.consumed.result()
        if self.published is not None:
            self.published.result()


class Matcher:
    """One request's grammar state (Grammars.consume advances it token by token)."""

    def __init__(self, ll_matcher, vocab_size: int):
        self._m = ll_matcher
        self.words = (vocab_size + 31) // 32

    def mask(self) -> np.ndarray:
        """The allowed next tokens: int32 words, bit t % 32 of word t // 32 set for token t (one request's;
        the engine computes a step's masks together with Grammars.fill_masks)."""
        out = np.empty(self.words, np.int32)
        self._m.unsafe_compute_mask_ptr(out.ctypes.data, out.nbytes)
        return out

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing more may follow."""
        return self._m.is_stopped()
