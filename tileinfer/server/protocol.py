"""The request bodies of the OpenAI endpoints, validated by pydantic, and their mapping to SamplingParams.

Fields the server does not know are ignored with one log line naming them, as vLLM does (`ignored`); the
ones it knows but cannot honour (a completion's suffix, best_of beyond n, echo with logprobs) are
refused with a 400 naming them, so that a client never gets text made without what it asked for. Ranges are
checked once, by SamplingParams, whose ValueError names the field.
"""
from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from ..engine.structured import StructuredOutputs
from ..model.tokenizer import check_text


MAX_N = 16          # choices per prompt
MAX_PROMPTS = 64    # prompts per completions request


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


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: str | None = None
    schema_: dict = Field(alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text (no constraint), any JSON object, or JSON valid for a schema."""
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class GuidedFields(BaseModel):
    """vLLM's structured_outputs object: one of json, regex, choice, grammar (and json_object)."""
    model_config = ConfigDict(extra="forbid")
    json_: dict | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


# vLLM's fields that would change the output, which this server does not implement: asking for one (a value other
# than null, false or empty) is a 400 (refuse_unhonoured), not a request run as if it had not been asked; other
# unknown fields are ignored, with a log line.
UNHONOURED = {
    "allowed_token_ids": "sampling only from a set of tokens",
    "bad_words": "banning words from the output",
    "prompt_logprobs": "the prompt's log-probabilities",
    "truncate_prompt_tokens": "truncating the prompt",
    "use_beam_search": "beam search",
}


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
    logit_bias: dict[str, float] | None = None   # token id (as a string, as JSON keys are) -> bias
    user: str | None = None
    # Extensions vLLM also takes:
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
    response_format: ResponseFormat | None = None
    structured_outputs: GuidedFields | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def structured(self) -> StructuredOutputs | None:
        """The request's constraint, if any (at most one way of asking for it); APIError naming the field."""
        asked = self._structured_fields()
        if not asked:
            return None
        if len(asked) > 1:
            raise APIError(400, f"ask for one structured output, got {', '.join(n for n, _ in asked)}",
                           param=asked[1][0])
        name, fields = asked[0]
        if isinstance(fields.get("json"), str):
            try:
                fields["json"] = json.loads(fields["json"])
            except json.JSONDecodeError as e:
                raise APIError(400, f"{name}: the schema is not valid JSON: {e}", param=name) from None
        try:
            return StructuredOutputs(**fields)
        except ValueError as e:
            raise APIError(400, f"{name}: {e}", param=name) from None

    @property
    def structured_param(self) -> str:
        """The field the request asked for its structured output with (to name in errors)."""
        asked = self._structured_fields()
        return asked[0][0] if asked else "structured_outputs"

    def _structured_fields(self) -> list[tuple[str, dict]]:
        asked = []
        if self.response_format is not None and self.response_format.type != "text":
            f = self.response_format
            if f.type == "json_schema":
                if f.json_schema is None:
                    raise APIError(400, "response_format of type json_schema needs json_schema: {name, schema}",
                                   param="response_format")
                asked.append(("response_format", dict(json=f.json_schema.schema_)))
            else:
                asked.append(("response_format", dict(json_object=True)))
        if self.structured_outputs is not None:
            g = self.structured_outputs
            asked.append(("structured_outputs", dict(json=g.json_, regex=g.regex, choice=g.choice, grammar=g.grammar,
                                                     json_object=bool(g.json_object))))
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                          ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                asked.append((name, {key: getattr(self, name)}))
        return asked

    @property
    def ignored(self) -> list[str]:
        """The body's fields this server does not know (it ignores them)."""
        return sorted(self.model_extra or {})

    def refuse_unhonoured(self) -> None:
        """APIError for a field of UNHONOURED that asks for something."""
        for name, what in UNHONOURED.items():
            value = (self.model_extra or {}).get(name)
            if value is None or value is False or (isinstance(value, (str, list, dict)) and not value):
                continue
            raise APIError(400, f"{name} ({what}) is not supported by this server", param=name)

    def token_bias(self) -> dict[int, float] | None:
        """logit_bias with its keys as token ids; APIError naming a key that is not one."""
        if not self.logit_bias:
            return None
        bad = [k for k in self.logit_bias if not k.strip().isdigit()]
        if bad:
            raise APIError(400, f"logit_bias keys must be token ids (e.g. \"1234\"), got {bad[:5]}", param="logit_bias")
        return {int(k): v for k, v in self.logit_bias.items()}

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> dict:
        """SamplingParams' keyword arguments (the ones given); checked where the request is made."""
        if not 1 <= self.n <= MAX_N:
            raise APIError(400, f"n must be in [1, {MAX_N}], got {self.n}", param="n")
        given = dict(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p, stop=self.stop,
                     seed=self.seed, presence_penalty=self.presence_penalty,
                     frequency_penalty=self.frequency_penalty, top_k=self.top_k, min_p=self.min_p,
                     repetition_penalty=self.repetition_penalty, ignore_eos=self.ignore_eos, logprobs=logprobs,
                     stop_token_ids=self.stop_token_ids, min_tokens=self.min_tokens,
                     include_stop_str_in_output=self.include_stop_str_in_output,
                     skip_special_tokens=self.skip_special_tokens, logit_bias=self.token_bias(),
                     structured_outputs=self.structured())
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
    echo: bool = False
    suffix: str | None = None     # refused unless empty
    best_of: int | None = None    # refused unless it is n

    def refuse_unsupported(self) -> None:
        """APIError for a field this server knows but does not honour, when it asks for something."""
        self.refuse_unhonoured()
        if self.suffix:
            raise APIError(400, "suffix (text to follow the completion, for insertion) is not supported by this "
                                "server", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, f"best_of={self.best_of} (keeping the best of several completions) is not supported "
                                f"by this server; n={self.n} returns that many choices", param="best_of")

    def prompts(self) -> list[str | list[int]]:
        """The prompts: one (text or token ids) or a list of them, each continued n times."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) > MAX_PROMPTS:
                raise APIError(400, f"prompt is a list of {len(p)} prompts; at most {MAX_PROMPTS} a request",
                               param="prompt")
            return list(p)
        if self.echo and self.logprobs is not None:
            raise APIError(400, "echo with logprobs would need the prompt's log-probabilities, which this server "
                                "does not compute; ask for one of them", param="echo")
        return [p]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str   # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """A message as chat templates read it: role and text content; an assistant's earlier tool calls; a
    tool's result (role "tool", with the id of the call it answers)."""
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _tool_fields(self):
        if self.tool_calls and self.role != "assistant":
            raise ValueError("tool_calls belong to assistant messages")
        if self.role == "tool" and self.content is None:
            raise ValueError("a tool message needs content (the tool's result)")
        for text in [self.content] if isinstance(self.content, str) else [p.text for p in self.content or ()]:
            check_text(text, "its content")
        if self.reasoning_content:
            check_text(self.reasoning_content, "its reasoning_content")
        return self

    def as_template_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out = {"role": self.role, "content": content or ""}
        if self.tool_calls:  # templates read arguments as a mapping (Qwen3's renders it back as JSON)
            out["tool_calls"] = [{"id": c.id, "type": c.type, "function": {"name": c.function.name,
                                  "arguments": _json_arguments(c.function.arguments)}} for c in self.tool_calls]
        for key in ("tool_call_id", "name", "reasoning_content"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


def _json_arguments(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # not JSON: the template gets the text as it came


class Tool(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["function"] = "function"
    function: dict

    @model_validator(mode="after")
    def _named(self):
        if not isinstance(self.function.get("name"), str) or not self.function["name"]:
            raise ValueError("a tool's function needs a name")
        if not isinstance(self.function.get("parameters", {}), dict):
            raise ValueError("a tool's function parameters must be a JSON schema (an object)")
        return self


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    chat_template_kwargs: dict | None = None  # passed to the chat template, e.g. {"enable_thinking": false}
    tools: list[Tool] | None = None           # rendered by the chat template; calls in the reply parsed
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None   # False: at most one call when calls are forced

    @property
    def uses_tools(self) -> bool:
        """Tools offered (and not switched off with tool_choice "none"): the reply's calls are parsed."""
        return bool(self.tools) and self.tool_choice != "none"

    def template_variables(self) -> dict:
        extra = dict(self.chat_template_kwargs or {})
        if self.uses_tools:
            extra.setdefault("tools", [t.model_dump() for t in self.tools])
        return extra

    def _structured_fields(self) -> list[tuple[str, dict]]:
        """Besides response_format and the rest: tool_choice "required" or a named function, as a grammar."""
        from .tools import forced_grammar
        asked = super()._structured_fields()
        choice = self.tool_choice
        if choice is None or choice in ("none", "auto"):
            return asked
        if not self.tools:
            raise APIError(400, "tool_choice needs tools to choose from", param="tool_choice")
        name = None
        if isinstance(choice, NamedToolChoice):
            name = choice.function.name
            if name not in [t.function["name"] for t in self.tools]:
                raise APIError(400, f"tool_choice names the function '{name}', which is not among the tools",
                               param="tool_choice")
        grammar = forced_grammar([t.model_dump() for t in self.tools], name,
                                 parallel=self.parallel_tool_calls is not False)
        return asked + [("tool_choice", {"grammar": grammar})]

    @property
    def template_param(self) -> str:
        """The field to name when the chat template fails to render: what the request passed it besides messages,
        if anything."""
        return "chat_template_kwargs" if self.chat_template_kwargs else "messages"

    def reply_budget(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def reply_budget_param(self) -> str:
        """The field reply_budget came from (to name in errors)."""
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

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
