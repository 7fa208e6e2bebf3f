"""A small byte-level tokenizer with Apertus' special tokens, and a chat template in Apertus' format.

Apertus' own vocabulary (131,072 tokens) is not available offline, so synthetic Apertus checkpoints carry
this tokenizer instead (every preset: apertus-tiny's vocabulary is exactly its 384 tokens; the real-shaped
presets' larger embedding has rows no text maps to):
    ids 0-72      control tokens, Apertus' own ids where they are known: <unk> 0, <s> 1, </s> 2, <pad> 3 and
                  the chat tokens 61-72 (<|system_start|> ... <|tools_suffix|>); 4-60 are reserved
    ids 73-328    the 256 bytes, spelled as byte-level BPE spells them (no merges: one token a byte)
    ids 329-383   reserved
The reasoning and tool markers (<|inner_prefix|>, <|inner_suffix|>, <|tools_prefix|>, <|tools_suffix|>)
are added tokens but not special: decode(skip_special_tokens=True) keeps them, so a reply's reasoning
stays visible to the chat template that drops it from earlier turns.
"""
from __future__ import annotations

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from tileinfer.model.tokenizer import byte_to_unicode

CHAT_TOKENS = {   # Apertus' chat tokens and their ids in its tokenizer
    "<|system_start|>": 61, "<|system_end|>": 62, "<|developer_start|>": 63, "<|developer_end|>": 64,
    "<|user_start|>": 65, "<|user_end|>": 66, "<|assistant_start|>": 67, "<|assistant_end|>": 68,
    "<|inner_prefix|>": 69, "<|inner_suffix|>": 70, "<|tools_prefix|>": 71, "<|tools_suffix|>": 72,
}
TEXT_MARKERS = ("<|inner_prefix|>", "<|inner_suffix|>", "<|tools_prefix|>", "<|tools_suffix|>")
UNK, BOS, EOS, PAD = 0, 1, 2, 3
ASSISTANT_END = CHAT_TOKENS["<|assistant_end|>"]
FIRST_BYTE = 73
VOCAB_SIZE = 384

# Apertus' model card recommends temperature 0.8 and top_p 0.9; a reply ends with <|assistant_end|>.
GENERATION_CONFIG = {"bos_token_id": BOS, "eos_token_id": ASSISTANT_END, "pad_token_id": PAD,
                     "do_sample": True, "temperature": 0.8, "top_p": 0.9}


def control_tokens() -> dict[int, str]:
    """Every id that is not a byte -> its token."""
    named = {UNK: "<unk>", BOS: "<s>", EOS: "</s>", PAD: "<pad>", **{i: t for t, i in CHAT_TOKENS.items()}}
    reserved = [*range(4, 61), *range(FIRST_BYTE + 256, VOCAB_SIZE)]
    return dict(sorted({**{i: f"<|reserved_{i}|>" for i in reserved}, **named}.items()))


def build_tokenizer() -> tokenizers.Tokenizer:
    to_unicode = byte_to_unicode()
    controls = control_tokens()
    vocab = {token: i for i, token in controls.items()}
    vocab.update({to_unicode[b]: FIRST_BYTE + b for b in range(256)})
    tokenizer = tokenizers.Tokenizer(models.BPE(vocab, [], ignore_merges=False))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    # The control tokens are in the vocabulary already, so adding them keeps their ids.
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in controls.values() if t not in TEXT_MARKERS])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in TEXT_MARKERS])
    return tokenizer


def tokenizer_json() -> str:
    return build_tokenizer().to_str()


def tokenizer_config(model_max_length: int) -> dict:
    """tokenizer_config.json for a synthetic Apertus checkpoint: special tokens and the chat template."""
    added = {str(i): {"content": token, "lstrip": False, "normalized": False, "rstrip": False,
                      "single_word": False, "special": token not in TEXT_MARKERS}
             for i, token in control_tokens().items()}
    return {
        "add_bos_token": False,
        "add_eos_token": False,
        "added_tokens_decoder": added,
        "bos_token": "<s>",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|assistant_end|>",
        "model_max_length": model_max_length,
        "pad_token": "<pad>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
    }


# TileInfer's own template in Apertus' format: <s>, a system block (the first message's, or a default),
# a developer block (a developer message, or one saying whether deliberation is enabled), then each
# user and assistant turn between its role's start and end tokens; the generation prompt opens an
# assistant turn. Reasoning sits between <|inner_prefix|> and <|inner_suffix|> inside an assistant turn
# (in its content, or given apart as reasoning_content); assistant turns before the last user message
# lose theirs, as Apertus' template drops earlier turns' reasoning. No literal newlines outside strings,
# so trim_blocks/lstrip_blocks do not change the output.
CHAT_TEMPLATE = r"""{#- TileInfer's chat template for Apertus models. -#}
{%- set ns = namespace(last_user=-1, start=0, system='You are a helpful assistant.', developer=none) -%}
{%- if tools is defined and tools -%}
    {{- raise_exception('this chat template does not render tools') -}}
{%- endif -%}
{%- for message in messages -%}
    {%- if message.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- if messages and messages[0].role == 'system' -%}
    {%- set ns.system = messages[0].content -%}
    {%- set ns.start = 1 -%}
{%- endif -%}
{%- if messages | length > ns.start and messages[ns.start].role == 'developer' -%}
    {%- set ns.developer = messages[ns.start].content -%}
    {%- set ns.start = ns.start + 1 -%}
{%- endif -%}
{%- if ns.developer is none -%}
    {%- set thinking = 'enabled' if enable_thinking is defined and enable_thinking else 'disabled' -%}
    {%- set ns.developer = 'Deliberation: ' ~ thinking ~ '\nTool Capabilities: disabled' -%}
{%- endif -%}
{{- '<s><|system_start|>' ~ ns.system ~ '<|system_end|><|developer_start|>' ~ ns.developer ~ '<|developer_end|>' -}}
{%- for message in messages[ns.start:] -%}
    {%- set content = message.content if message.content is string else '' -%}
    {%- if message.role == 'user' -%}
        {{- '<|user_start|>' ~ content ~ '<|user_end|>' -}}
    {%- elif message.role == 'assistant' -%}
        {%- if loop.index0 + ns.start < ns.last_user -%}
            {%- set parts = content.split('<|inner_prefix|>') -%}
            {%- set kept = namespace(text=parts[0]) -%}
            {%- for part in parts[1:] -%}
                {%- if '<|inner_suffix|>' in part -%}
                    {%- set kept.text = kept.text ~ part.split('<|inner_suffix|>', 1)[1] -%}
                {%- endif -%}
            {%- endfor -%}
            {%- set content = kept.text -%}
        {%- elif message.reasoning_content is string and message.reasoning_content -%}
            {%- set content = '<|inner_prefix|>' ~ message.reasoning_content ~ '<|inner_suffix|>' ~ content -%}
        {%- endif -%}
        {{- '<|assistant_start|>' ~ content ~ '<|assistant_end|>' -}}
    {%- else -%}
        {{- raise_exception('this chat template renders system, developer, user and assistant messages, not '
                            ~ message.role) -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|assistant_start|>' -}}
{%- endif -%}
"""
