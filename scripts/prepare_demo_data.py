"""Fetch, clean and tokenize the demo model's training text; train its byte-level BPE tokenizer.

    python scripts/prepare_demo_data.py [--out build/demo-data]

Runs where the package registries are reachable (the GPU machine reaches none). Two sources, both
pinned by version and sha256:
  chat  the chitchat-dataset wheel from PyPI (MIT): 7,168 conversations, rendered as ChatML turns
        with this project's chat template (the first speaker is the user, the second the assistant)
  docs  the reStructuredText sources of the Python 3.11 documentation in Debian's python3.11-doc
        package (PSF License Version 2), markup lightly stripped, one document per file
Each source is split into training and held-out documents by a seeded shuffle. The tokenizer is a
byte-level BPE trained with `tokenizers` on the training text: Qwen3's pre-tokenizer split regex,
then Qwen3's 26 added tokens (<|endoftext|>, <|im_start|>, <|im_end|>, ..., <think>, </think>)
after the learned vocabulary, as Qwen3 orders them. Every document ends with <|endoftext|>.

Writes into --out: tokens.npz (uint16 arrays train_chat, held_out_chat, train_docs, held_out_docs),
tokenizer.json, tokenizer_config.json (chat template), manifest.json (sources, hashes, sizes, token
counts, special ids) and NOTICE (the sources and their licences) which scripts/train_demo.py reads.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import lzma
import math
import re
import subprocess
import sys
import tarfile
import time
import urllib.request
import zipfile
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

from tileinfer.chat import render_chat
from tileinfer.model.tokenizer import ADDED_TOKENS, CHAT_TEMPLATE, NUM_SPECIAL, SPLIT_REGEX

CHITCHAT = {
    "name": "chitchat-dataset 0.9.0 (BYU PCC lab's Chit-Chat Challenge)",
    "licence": "MIT (Copyright (c) 2019 Perception, Control and Cognition Lab)",
    "requirement": "chitchat-dataset==0.9.0",
    "file": "chitchat_dataset-0.9.0-py3-none-any.whl",
    "sha256": "7bf89f36645e2d5ec87d53370c8e851b5a688479c7beb7079cb4c87fc5acea3e",
}
PYTHON_DOCS = {
    "name": "Python 3.11 documentation sources (Debian bookworm's python3.11-doc 3.11.2-6+deb12u8)",
    "licence": "PSF License Version 2 (Copyright (c) 2001-2023 Python Software Foundation)",
    "url": "https://deb.debian.org/debian/pool/main/p/python3.11/python3.11-doc_3.11.2-6+deb12u8_all.deb",
    "file": "python3.11-doc_3.11.2-6+deb12u8_all.deb",
    "sha256": "50eb63e7f636c4281e9ce1b8f10386f1def42159eddce34fc1f41c46261df71b",
}
DOC_SOURCES = "./usr/share/doc/python3.11/html/_sources/"

VOCAB_SIZE = 8192                       # learned BPE tokens + Qwen3's added tokens
EOT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
EMPTY_THINK = "<think>\n\n</think>\n\n"  # what Qwen3's template puts before a reply when thinking is off
SYSTEM_FRACTION = 0.3                   # conversations opened by a system message naming their topic
EMPTY_THINK_FRACTION = 0.5              # conversations whose last reply opens with an empty think block


# ---------------------------------------------------------------------------------------------- fetch


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def check_pinned(path: Path, expected: str) -> None:
    actual = sha256_of(path)
    if actual != expected:
        raise SystemExit(f"{path}: sha256 {actual} differs from the pinned {expected}; delete it and run again, "
                         f"or pass the file you trust explicitly")


def fetch_chitchat(cache: Path) -> Path:
    wheel = cache / CHITCHAT["file"]
    if not wheel.is_file():
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
                        "-d", str(cache), CHITCHAT["requirement"]], check=True)
    check_pinned(wheel, CHITCHAT["sha256"])
    return wheel


def fetch_python_docs(cache: Path) -> Path:
    deb = cache / PYTHON_DOCS["file"]
    if not deb.is_file():
        tmp = deb.with_suffix(".part")
        try:
            with urllib.request.urlopen(PYTHON_DOCS["url"], timeout=120) as response, open(tmp, "wb") as f:
                f.write(response.read())
        except OSError as e:
            raise SystemExit(f"{PYTHON_DOCS['url']}: {e}; if the mirror dropped this version, run "
                             f"`apt-get download python3.11-doc` and pass the .deb with --python-doc-deb") from None
        tmp.rename(deb)
    check_pinned(deb, PYTHON_DOCS["sha256"])
    return deb


def ar_members(data: bytes) -> dict[str, bytes]:
    """The files of a Unix ar archive (a .deb is one): 8-byte magic, then 60-byte headers."""
    if not data.startswith(b"!<arch>\n"):
        raise ValueError("not an ar archive (a .deb starts with !<arch>)")
    members, at = {}, 8
    while at + 60 <= len(data):
        header = data[at:at + 60]
        name = header[:16].decode().strip().rstrip("/")
        size = int(header[48:58].decode().strip())
        members[name] = data[at + 60:at + 60 + size]
        at += 60 + size + (size & 1)    # members are padded to an even offset
    return members


def read_chitchat(wheel: Path) -> tuple[dict, str]:
    with zipfile.ZipFile(wheel) as z:
        dataset = json.loads(z.read("chitchat_dataset/dataset.json"))
        licence = z.read("chitchat_dataset-0.9.0.dist-info/LICENSE").decode()
    return dataset, licence


def read_python_docs(deb: Path) -> dict[str, str]:
    """Every .rst.txt under the documentation's _sources/, by its path there."""
    members = ar_members(deb.read_bytes())
    name = next((n for n in members if n.startswith("data.tar")), None)
    if name is None:
        raise ValueError(f"{deb}: no data.tar.* member")
    payload = members[name]
    if name.endswith(".xz"):
        payload = lzma.decompress(payload)
    elif not name.endswith(".tar"):
        raise ValueError(f"{deb}: {name} is compressed in a way this script does not read (only .xz)")
    docs = {}
    with tarfile.open(fileobj=io.BytesIO(payload)) as tar:
        for member in tar:
            if member.isfile() and member.name.startswith(DOC_SOURCES) and member.name.endswith(".rst.txt"):
                docs[member.name[len(DOC_SOURCES):]] = tar.extractfile(member).read().decode("utf-8")
    return docs


# ---------------------------------------------------------------------------------------------- clean

# Directives whose whole block is markup, not prose.
DROPPED_DIRECTIVES = {
    "index", "module", "moduleauthor", "sectionauthor", "testsetup", "testcleanup", "highlight", "toctree",
    "currentmodule", "tabularcolumns", "include", "literalinclude", "image", "raw", "contents", "miscnews",
    "only", "audit-event", "availability", "productionlist",
}
# Directives that become a plain label; the rest keep their argument (a signature, a title) as a line.
LABELS = {"note": "Note:", "warning": "Warning:", "seealso": "See also:", "important": "Important:",
          "caution": "Caution:", "tip": "Tip:", "impl-detail": "CPython implementation detail:"}
VERSION_LABELS = {"versionadded": "New in version {}.", "versionchanged": "Changed in version {}.",
                  "deprecated": "Deprecated since version {}.",
                  "deprecated-removed": "Deprecated since version {}, removed in version {}."}
PROSE_ROLES = {"ref", "term", "doc", "dfn", "abbr", "kbd", "menuselection", "guilabel", "mailheader",
               "mimetype", "manpage", "newsgroup", "sup", "sub", "token", "command", "program", "emphasis"}

DIRECTIVE = re.compile(r"^(\s*)\.\.\s+([\w:-]+)::\s*(.*)$")
COMMENT_OR_TARGET = re.compile(r"^(\s*)\.\.(\s|$)")
FIELD = re.compile(r"^\s+:[\w-]+:")
UNDERLINE = re.compile(r"^([=\-~^*#\"+`':.])\1{2,}\s*$")
ROLE = re.compile(r":(?:[\w-]+:)?([\w-]+):`([^`]+)`")
LINK = re.compile(r"`([^`<]+?)\s*<[^`>]+>`__?")
NAMED_REF = re.compile(r"(?<![`:])`([^`]+)`__?")
LITERAL = re.compile(r"``(.+?)``")
FOOTNOTE = re.compile(r"(\[(?:\d+|#\w*|\*)\])_")


def render_role(match: re.Match) -> str:
    role, text = match.group(1), match.group(2)
    if role == "pep":
        return f"PEP {text}"
    if role == "rfc":
        return f"RFC {text}"
    if role in ("issue", "gh"):
        return f"{'bpo' if role == 'issue' else 'gh'}-{text}"
    explicit = re.match(r"^(.*?)\s*<([^>]+)>$", text)     # :ref:`the text <target>`
    if explicit:
        text = explicit.group(1)
    text = text.lstrip("!")
    if text.startswith("~"):                              # :meth:`~a.b.c` shows c
        text = text[1:].rsplit(".", 1)[-1]
    return text if role in PROSE_ROLES else f"`{text}`"


def clean_inline(line: str) -> str:
    # Hyperlinks first: they alone end in `_, and the code spans below leave single backticks.
    line = LINK.sub(r"\1", line)
    line = NAMED_REF.sub(r"\1", line)
    line = LITERAL.sub(r"`\1`", line)
    line = ROLE.sub(render_role, line)
    return FOOTNOTE.sub(r"\1", line).replace("\\ ", "")


def clean_rest(text: str) -> str:
    """reST to readable plain text with Markdown-like inline code: directives, roles, targets,
    section underlines and option fields go, prose and code blocks stay."""
    out: list[str] = []
    lines = text.splitlines()
    skip_indent = None           # inside a dropped block: lines indented deeper than this are skipped
    in_options = False           # right after a directive line: its ":option:" fields
    for i, line in enumerate(lines):
        indent = len(line) - len(line.lstrip())
        if skip_indent is not None:
            if not line.strip() or indent > skip_indent:
                continue
            skip_indent = None
        if in_options and FIELD.match(line):
            continue
        in_options = False
        directive = DIRECTIVE.match(line)
        if directive:
            pad, name, argument = directive.groups()
            name = name.split(":")[-1] if name.startswith(("c:", "py:")) else name
            in_options = True
            if name in DROPPED_DIRECTIVES:
                skip_indent = len(pad)
            elif name in LABELS:
                out.append(pad + LABELS[name] + (" " + clean_inline(argument) if argument else ""))
            elif name in VERSION_LABELS:
                versions = argument.split()
                versions += [""] * (2 - len(versions))
                out.append(pad + VERSION_LABELS[name].format(*versions[:2]))
            elif argument and name not in ("code-block", "sourcecode", "doctest", "testcode", "testoutput"):
                out.append(pad + clean_inline(argument))
            continue
        if COMMENT_OR_TARGET.match(line):      # comments, `.. _label:` targets, substitution definitions
            skip_indent = indent
            continue
        if UNDERLINE.match(line):
            continue
        if line.strip() == "::":
            continue
        if line.endswith("::"):
            line = line[:-1]                    # "Example::" introduces a literal block: "Example:"
        out.append(clean_inline(line.rstrip()))
    return re.sub(r"\n{3,}", "\n\n", "\n".join(out)).strip() + "\n"


# ---------------------------------------------------------------------------------------------- chat


def conversation_messages(conversation: dict, rng: np.random.Generator) -> list[dict]:
    """One chit-chat conversation as chat messages: speaker one is the user, speaker two the
    assistant; a turn's separate utterances become lines of one message."""
    messages = []
    if conversation.get("prompt") and rng.random() < SYSTEM_FRACTION:
        messages.append({"role": "system", "content": f"Chat with the user. Topic: {conversation['prompt'].strip()}"})
    first_sender = None
    for turn in conversation["messages"]:
        text = "\n".join(u["text"].strip() for u in turn if u["text"].strip())
        if not text:
            continue
        sender = turn[0]["sender"]
        first_sender = first_sender or sender
        role = "user" if sender == first_sender else "assistant"
        if messages and messages[-1]["role"] == role:
            messages[-1]["content"] += "\n" + text
        else:
            messages.append({"role": role, "content": text})
    replies = [m for m in messages if m["role"] == "assistant"]
    if replies and rng.random() < EMPTY_THINK_FRACTION:
        replies[-1]["content"] = EMPTY_THINK + replies[-1]["content"]
    return messages


def chat_documents(dataset: dict, rng: np.random.Generator) -> list[str]:
    """The conversations with at least one reply (many in the dataset have none), rendered."""
    documents = []
    for key in sorted(dataset):               # sorted: the output depends on the seed alone
        messages = conversation_messages(dataset[key], rng)
        if sum(m["role"] == "assistant" for m in messages):
            documents.append(render_chat(CHAT_TEMPLATE, messages, add_generation_prompt=False))
    return documents


# ---------------------------------------------------------------------------------------------- split, tokenizer


def split(documents: list[str], fraction: float, rng: np.random.Generator) -> tuple[list[str], list[str]]:
    """(train, held_out): a seeded shuffle, the first ceil(fraction * n) documents held out."""
    order = rng.permutation(len(documents))
    cut = math.ceil(fraction * len(documents))
    return [documents[i] for i in order[cut:]], [documents[i] for i in order[:cut]]


def train_tokenizer(texts: list[str]) -> Tokenizer:
    """Byte-level BPE over Qwen3's pre-tokenizer, then Qwen3's added tokens after the learned ones."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE - len(ADDED_TOKENS), min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    special = re.compile("|".join(re.escape(t) for t in ADDED_TOKENS))
    tokenizer.train_from_iterator((special.sub("\n", t) for t in texts), trainer=trainer)
    learned = tokenizer.get_vocab_size()
    for i, content in enumerate(ADDED_TOKENS):       # one at a time, so each takes the next id
        token = AddedToken(content, special=i < NUM_SPECIAL, normalized=False)
        (tokenizer.add_special_tokens if i < NUM_SPECIAL else tokenizer.add_tokens)([token])
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"the BPE learned {learned} tokens; expected {VOCAB_SIZE - len(ADDED_TOKENS)} "
                           f"(too little text for the vocabulary?)")
    return tokenizer


def tokenizer_config(tokenizer: Tokenizer, model_max_length: int) -> dict:
    """tokenizer_config.json in the shape Qwen3's checkpoints carry, with this tokenizer's ids."""
    added = {str(tokenizer.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                             "single_word": False, "special": i < NUM_SPECIAL}
             for i, t in enumerate(ADDED_TOKENS)}
    return {
        "add_bos_token": False, "add_prefix_space": False, "added_tokens_decoder": added,
        "additional_special_tokens": list(ADDED_TOKENS[1:NUM_SPECIAL]), "bos_token": None,
        "chat_template": CHAT_TEMPLATE, "clean_up_tokenization_spaces": False, "eos_token": IM_END,
        "errors": "replace", "model_max_length": model_max_length, "pad_token": EOT,
        "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer", "unk_token": None,
    }


def encode(tokenizer: Tokenizer, documents: list[str]) -> np.ndarray:
    """Every document's tokens followed by <|endoftext|>, concatenated. # [tokens] uint16"""
    eot = tokenizer.token_to_id(EOT)
    ids = [np.append(np.asarray(e.ids, np.uint16), np.uint16(eot)) for e in tokenizer.encode_batch(documents)]
    return np.concatenate(ids) if ids else np.zeros(0, np.uint16)


# ---------------------------------------------------------------------------------------------- main


def notice(manifest: dict, chitchat_licence: str) -> str:
    lines = ["The demo models were trained on:", ""]
    for source in manifest["sources"].values():
        lines.append(f"- {source['name']}: {source['licence']}; {source['origin']} (sha256 {source['sha256']})")
    lines += ["", "The chitchat-dataset licence:", "", chitchat_licence.strip(), "",
              "The Python documentation is used under the PSF License Version 2:",
              "https://docs.python.org/3.11/license.html", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="build/demo-data", help="output directory (build/demo-data)")
    parser.add_argument("--cache", default="build/demo-downloads",
                        help="where the downloads are kept (build/demo-downloads; not needed for training)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--held-out", type=float, default=0.03, help="fraction of each source's documents (0.03)")
    parser.add_argument("--python-doc-deb", default=None,
                        help="a python3.11-doc .deb to use instead of downloading the pinned one")
    parser.add_argument("--model-max-length", type=int, default=4096, help="tokenizer_config's model_max_length")
    args = parser.parse_args(argv)
    if not 0 < args.held_out < 0.5:
        parser.error("--held-out must be in (0, 0.5)")
    out = Path(args.out)
    cache = Path(args.cache)
    cache.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()

    wheel = fetch_chitchat(cache)
    deb = Path(args.python_doc_deb) if args.python_doc_deb else fetch_python_docs(cache)
    dataset, chitchat_licence = read_chitchat(wheel)
    rst = read_python_docs(deb)
    rng = np.random.default_rng(args.seed)
    cleaned = (clean_rest(rst[name]) for name in sorted(rst))
    documents = {"chat": chat_documents(dataset, rng), "docs": [doc for doc in cleaned if doc.strip()]}
    splits = {name: split(docs, args.held_out, rng) for name, docs in documents.items()}
    print(f"read {len(dataset)} conversations ({wheel.stat().st_size / 1e6:.1f} MB wheel; "
          f"{len(documents['chat'])} have a reply) and {len(rst)} documentation files "
          f"({deb.stat().st_size / 1e6:.1f} MB .deb)")

    tokenizer = train_tokenizer([doc for train, _ in splits.values() for doc in train])
    arrays = {}
    for name, (train, held_out) in splits.items():
        arrays[f"train_{name}"], arrays[f"held_out_{name}"] = encode(tokenizer, train), encode(tokenizer, held_out)

    out.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(out / "tokens.npz", **arrays)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(tokenizer, args.model_max_length), indent=2, ensure_ascii=False) + "\n")
    origins = {"chat": (CHITCHAT, f"PyPI {CHITCHAT['requirement']}", wheel),
               "docs": (PYTHON_DOCS, PYTHON_DOCS["url"] if not args.python_doc_deb else str(deb), deb)}
    manifest = {
        "seed": args.seed, "held_out_fraction": args.held_out, "vocab_size": tokenizer.get_vocab_size(),
        "special_ids": {t: tokenizer.token_to_id(t) for t in ADDED_TOKENS},
        "sources": {name: {"name": meta["name"], "licence": meta["licence"], "origin": origin,
                           "sha256": sha256_of(path), "download_bytes": path.stat().st_size,
                           "text_bytes": sum(len(d.encode()) for d in documents[name]),
                           "documents": {"train": len(splits[name][0]), "held_out": len(splits[name][1])},
                           "tokens": {"train": int(arrays[f"train_{name}"].size),
                                      "held_out": int(arrays[f"held_out_{name}"].size)}}
                    for name, (meta, origin, path) in origins.items()},
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
    (out / "NOTICE").write_text(notice(manifest, chitchat_licence))
    report(out, manifest, time.perf_counter() - start)
    return 0


def report(out: Path, manifest: dict, seconds: float) -> None:
    for name, s in manifest["sources"].items():
        t = s["tokens"]
        print(f"{name}: {s['text_bytes'] / 1e6:.2f} MB of text in {sum(s['documents'].values())} documents -> "
              f"{t['train']:,} train + {t['held_out']:,} held-out tokens "
              f"({s['text_bytes'] / (t['train'] + t['held_out']):.2f} bytes/token)")
    written = [p for p in out.iterdir() if p.is_file()]
    total = sum(p.stat().st_size for p in written)
    print(f"wrote {', '.join(sorted(p.name for p in written))} to {out}: {total / 2**20:.1f} MiB "
          f"(tokens.npz {(out / 'tokens.npz').stat().st_size / 2**20:.1f} MiB) in {seconds:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
