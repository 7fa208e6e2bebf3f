"""What the engine hands back: each request's output, streamed pieces, and the engine's counters."""
from __future__ import annotations

from dataclasses import dataclass

from .speculative import SpecStats


@dataclass
class RequestOutput:
    """What one request produced. `text` excludes a matched stop string (unless asked)."""
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None          # "stop" (EOS, stop token or stop string), "length", "abort", or None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0         # prompt tokens served by the prefix cache (or a chat's held prefix)
    num_preemptions: int = 0
    time_to_first_token: float = 0.0   # seconds from the request's start to its first new token
    seconds: float = 0.0               # seconds from the request's start to its end
    speculation: SpecStats | None = None  # drafted, accepted, target steps: when a draft model speculated

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def decode_tokens_per_second(self) -> float:
        """New tokens after the first, per second after the first (the first comes from the prefill)."""
        decode = self.seconds - self.time_to_first_token
        return (len(self.token_ids) - 1) / decode if len(self.token_ids) > 1 and decode > 0 else 0.0


@dataclass
class StreamOutput:
    """New tokens of one request from one engine step."""
    index: int                 # position of the request in the prompts given
    request_id: int
    token_ids: list[int]       # the new token(s)
    text: str                  # the new text they complete (may be "" mid-character or near a stop string)
    finished: bool
    finish_reason: str | None = None


@dataclass
class EngineStats:
    steps: int = 0
    graph_steps: int = 0          # decode steps run as a CUDA graph's replay (one-prompt prefill graphs not counted)
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    computed_tokens: int = 0      # prefill and decode tokens run through the model
    prefill_tokens: int = 0       # prompt (and recomputed) positions run through the model
    generated_tokens: int = 0
    preemptions: int = 0
    step_seconds: float = 0.0
    # Steps of one new token per row (a decode graph's shape), their rows, and the wall time of the
    # engine iterations that finished one. With async scheduling an iteration launches step n + 1 and
    # then waits for step n, so its time is step n's (the GPU's, when the GPU is the bottleneck).
    decode_steps: int = 0
    decode_rows: int = 0
    decode_positions: int = 0     # cached positions those rows' attention read (each row's start + 1)
    decode_seconds: float = 0.0
    # Host time advancing structured-output matchers and computing their masks (while steps run).
    grammar_seconds: float = 0.0

    def as_dict(self) -> dict:
        return dict(self.__dict__)
