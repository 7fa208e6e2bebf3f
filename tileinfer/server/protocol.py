"""The request bodies of the OpenAI endpoints, validated by pydantic, and their mapping to SamplingParams.

Fields the server does not know are ignored with one log line naming them, as vLLM does (`ignored`); the
ones it knows but cannot honour yet (n > 1, echo) are refused with a 400 naming them. Ranges are checked
once, by SamplingParams, whose ValueError names the field.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Sampling(BaseModel):
    """What completions and chat share. Unknown top-level fields are kept aside (`ignored`)."""
    model_config = ConfigDict(extra="allow")

    model: str
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    user: str | None = None
    # Extensions vLLM also takes:
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None

    @property
    def ignored(self) -> list[str]:
        """The body's fields this server does not know (it ignores them)."""
        return sorted(self.model_extra or {})

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> dict:
        """SamplingParams' keyword arguments (the ones given); checked where the request is made."""
        if self.n != 1:
            raise APIError(400, f"n={self.n}: only n=1 is supported (one choice per request)", param="n")
        if logprobs is not None and self.stream:
            raise APIError(400, "logprobs with stream=true is not supported yet; ask without stream",
                           param="logprobs")
        given = dict(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, stop=self.stop,
                     seed=self.seed, presence_penalty=self.presence_penalty,
                     frequency_penalty=self.frequency_penalty, top_k=self.top_k, min_p=self.min_p,
                     repetition_penalty=self.repetition_penalty, ignore_eos=self.ignore_eos, logprobs=logprobs,
                     stop_token_ids=self.stop_token_ids)
        out = {k: v for k, v in given.items() if v is not None}
        out["max_tokens"] = max_tokens  # None: what the context leaves (resolved with the prompt's length)
        out.setdefault("temperature", 1.0)  # OpenAI's default
        return out

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: Literal[False] = False

    def one_prompt(self) -> str | list[int]:
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise APIError(400, f"prompt is a list of {len(p)} prompts: send one prompt per request",
                               param="prompt")
            p = p[0]
        return p


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict | None = None  # passed to the chat template, e.g. {"enable_thinking": false}

    def reply_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def top_n(self) -> int | None:
        """SamplingParams' logprobs: None (off) or how many alternatives per token."""
        if not self.logprobs:
            if self.top_logprobs is not None:
                raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
            return None
        return self.top_logprobs or 0


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """pydantic's errors as one line (each field and what is wrong with it) and the first field's name."""
    parts, param = [], None
    for e in errors:
        if e.get("type") == "json_invalid":
            return f"the body is not valid JSON: {e.get('ctx', {}).get('error', e.get('msg'))}", None
        loc = [str(x) for x in e.get("loc", ()) if x != "body"]
        # pydantic reports a union's every branch (prompt.str, prompt.list[int], ...): the field is enough
        field = ".".join(x for x in loc if not x.startswith(("list[", "str", "int", "function-")))
        param = param or (field or None)
        what = "not a supported field" if e.get("type") == "extra_forbidden" else e.get("msg", "invalid")
        parts.append(f"{field or 'body'}: {what}")
    return "; ".join(dict.fromkeys(parts)), param


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the checkpoint's template."""
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int]
