"""SamplingParams: how one request is continued, validated once when it is made.

The fields and their meaning follow vLLM's SamplingParams, so code written for it reads the
same here. Every invalid value raises ValueError naming the field and its allowed range.

Order of the logits processing, per generated token (cuda_src/sampling.cu):
  1. the request's logit_bias added to the raw logits (as vLLM adds it before the penalties); then
     penalties: repetition (prompt and output tokens; a positive logit is divided by it, a negative one
     multiplied), then frequency x count and presence (output tokens only) subtracted; then tokens banned
     (min_tokens) or outside a structured output's grammar (structured_outputs) set to -inf;
  2. temperature (0 = greedy: the argmax, lowest index on ties; nothing below applies);
  3. min_p, top_k, top_p restrict the candidates; a Gumbel-max draw picks one, seeded by
     (seed, position), so a request's samples depend only on its own seed and tokens.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from ..runner.sampler import MAX_BANNED_TOKENS, MAX_LOGIT_BIAS
from .structured import StructuredOutputs

MAX_LOGPROBS = 20


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@dataclass
class SamplingParams:
    max_tokens: int = 16                 # new tokens at most (finish reason "length")
    min_tokens: int = 0                  # new tokens at least: EOS and stop_token_ids are banned, stop strings
                                         # not looked for, before that many
    temperature: float = 1.0             # 0 = greedy
    top_k: int = 0                       # 0 or -1 = off
    top_p: float = 1.0                   # 1 = off
    min_p: float = 0.0                   # 0 = off; keep tokens with p >= min_p x the largest p
    repetition_penalty: float = 1.0      # 1 = off
    presence_penalty: float = 0.0        # 0 = off
    frequency_penalty: float = 0.0       # 0 = off
    seed: int | None = None              # None: a fresh random seed per request
    stop: list[str] | str | None = None  # finish (reason "stop") when the text contains one
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False             # keep going past the checkpoint's EOS tokens
    logprobs: int | None = None          # top-n log-probabilities per generated token (0..20)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputs | None = None  # a JSON schema, regex, choice or grammar to hold to
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, in [-100, 100] (OpenAI's)

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                             f"got {self.min_tokens!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise ValueError(f"top_k must be an integer >= 1, or 0 / -1 for off, got {self.top_k!r}")
        if self.top_k == -1:
            self.top_k = 0
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be a finite number > 0 (1 = off), "
                             f"got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2 <= value <= 2:
                raise ValueError(f"{name} must be in [-2, 2] (0 = off), got {value!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**64):
            raise ValueError(f"seed must be None or an integer in [0, 2**64), got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        self.stop_token_ids = list(self.stop_token_ids or [])
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids (integers >= 0), got {self.stop_token_ids!r}")
        if self.min_tokens and len(self.stop_token_ids) > MAX_BANNED_TOKENS - 8:
            raise ValueError(f"stop_token_ids has {len(self.stop_token_ids)} ids; with min_tokens at most "
                             f"{MAX_BANNED_TOKENS - 8} (they are banned until min_tokens)")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise ValueError(f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputs):
            raise ValueError(f"structured_outputs must be a StructuredOutputs, "
                             f"got {type(self.structured_outputs).__name__}")
        if self.logit_bias is not None:
            bias = self.logit_bias
            if not isinstance(bias, dict) or not all(_is_int(t) and t >= 0 for t in bias) or \
                    not all(_is_number(v) and -100 <= v <= 100 for v in bias.values()):
                raise ValueError(f"logit_bias must map token ids (integers >= 0) to numbers in [-100, 100], "
                                 f"got {bias!r}"[:300])
            if len(bias) > MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias names {len(bias)} tokens; at most {MAX_LOGIT_BIAS}")
            self.logit_bias = {t: float(v) for t, v in bias.items() if v != 0} or None
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    def resolved_seed(self) -> int:
        """The request's seed: the given one, or a fresh random one."""
        return self.seed if self.seed is not None else int.from_bytes(os.urandom(8), "little")
