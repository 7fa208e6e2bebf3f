"""A checkpoint's chat template rendered as Hugging Face renders it (jinja2 in a sandbox): the prompt of a
conversation, for ChatSession, LLM.chat and the server's chat completions."""
from __future__ import annotations

import json


def render_chat(template: str, messages: list[dict], /, *, add_generation_prompt: bool = True,
                enable_thinking: bool | None = None, **extra) -> str:
    """Render a Hugging Face chat template the way transformers does: jinja2 in an immutable
    sandbox, trim_blocks and lstrip_blocks, `raise_exception` available to the template. extra: more of the
    template's variables (tools, ...); ValueError if the template fails to render."""
    from jinja2 import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = _tojson
    if "messages" in extra:
        raise ValueError("the template's extra variables cannot set messages (the conversation is messages)")
    variables = dict(messages=messages, add_generation_prompt=add_generation_prompt, **extra)
    if enable_thinking is not None:
        variables["enable_thinking"] = enable_thinking
    try:
        return env.from_string(template).render(**variables)
    except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
        # what a template raises over values it cannot use (a tools variable that is not a list, ...)
        raise ValueError(f"the chat template failed to render: {type(e).__name__}: {e}") from None


def _tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False) -> str:
    """JSON as chat templates expect it: plain json.dumps (jinja's own tojson escapes <, > and & for HTML)."""
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)
