"""The README, docs/ and the scripts' docstrings say what works: every command they show for a script or for the
`tileinfer` command line is accepted by its argument parser, and every path of this repository the README and docs/
name exists.

A command is a line of a fenced block (continued lines joined), an inline code span or a docstring's line that runs
`python scripts/NAME.py ...` or, in a fenced block, `tileinfer ...`; lines with [optional] parts are syntax, not
commands, and are left out. A script's command is parsed by the script's own main(), stopped right after its
parse_args: nothing runs.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import inspect
import re
import shlex
import sys
from pathlib import Path

import pytest

import tileinfer
from tileinfer.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"```[a-z]*\n(.*?)```", re.S)
SEPARATORS = ("&", "&&", "|", "||", ";")
REPO_PATH = re.compile(r"(?<![\w/.$~-])((?:tileinfer|scripts|cuda_src|tests|graphs|bench|docs)/[\w./-]*\w)")


def fenced_lines(text: str) -> list[str]:
    """The lines of the fenced blocks, continued lines joined."""
    return [line for block in FENCE.findall(text) for line in block.replace("\\\n", " ").splitlines()]


def code_spans(text: str) -> list[str]:
    """Inline code spans outside the fenced blocks, a span wrapped over lines joined into one."""
    return [span.replace("\n", " ") for span in re.findall(r"`([^`]+)`", FENCE.sub("", text))]


def doc_lines(doc: Path) -> list[str]:
    """A document's fenced lines and inline code spans, the file read once."""
    text = doc.read_text()
    return fenced_lines(text) + code_spans(text)


def commands(line: str) -> list[list[str]]:
    """The commands of a shell line (`a && b`, `a | b`: two), redirections and comments left out; a command with
    [optional] parts is syntax, not a command, and is left out too."""
    lexer = shlex.shlex(re.sub(r"(?<!\S)\d*>>?&?\s*\S+", " ", line), posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    found, words = [], []
    for word in [*lexer, "&&"]:
        if word in SEPARATORS:
            if words and not any("[" in w or "..." in w for w in words):
                found.append(words)
            words = []
        else:
            words.append(word)
    return found


def docstring_lines(path: Path) -> list[str]:
    """The lines of a script's docstring that run a script, from `python` on (its usage, its examples)."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return [m.group(0) for line in doc.replace("\\\n", " ").splitlines()
            for m in [re.search(r"python3? scripts/\w+\.py.*", line)] if m]


def script_commands() -> list[tuple[str, str, tuple[str, ...]]]:
    """(where, script name, arguments) of every `python scripts/NAME.py` command the README, docs/ and the
    scripts' docstrings show, once each."""
    sources = [(doc.name, doc_lines(doc)) for doc in DOCS]
    sources += [(f"scripts/{path.name}", docstring_lines(path)) for path in sorted((ROOT / "scripts").glob("*.py"))]
    found = {}
    for where, lines in sources:
        for line in lines:
            if not re.search(r"scripts/\w+\.py", line):
                continue
            for words in commands(line):
                if len(words) > 1 and words[0] in ("python", "python3") and re.fullmatch(r"scripts/\w+\.py", words[1]):
                    found.setdefault((Path(words[1]).stem, tuple(words[2:])), where)
    return [(where, script, argv) for (script, argv), where in sorted(found.items())]


def cli_commands() -> list[tuple[str, tuple[str, ...]]]:
    """(document, arguments) of every `tileinfer ...` command of the fenced blocks, once each."""
    found = {}
    for doc in DOCS:
        for line in fenced_lines(doc.read_text()):
            if "tileinfer " in line:
                for words in commands(line):
                    if words[0] == "tileinfer":
                        found.setdefault(tuple(words[1:]), doc.name)
    return [(doc, argv) for argv, doc in sorted(found.items())]


class Parsed(Exception):
    """Raised by parse_args once the arguments parsed: the script stops there."""


@pytest.mark.parametrize("doc, script, argv", script_commands(),
                         ids=lambda v: v if isinstance(v, str) else " ".join(v)[:60])
def test_documented_script_command_parses(monkeypatch, doc, script, argv):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    try:
        module = importlib.import_module(script)
    except ImportError as e:  # the demo's training scripts need PyTorch
        pytest.skip(f"scripts/{script}.py needs {e.name}")
    parse = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        raise Parsed(parse(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [f"scripts/{script}.py", *argv])
    with pytest.raises(Parsed):  # SystemExit(2) here: argparse refused the documented command
        module.main()


@pytest.mark.parametrize("doc, argv", cli_commands(), ids=lambda v: v if isinstance(v, str) else " ".join(v)[:60])
def test_documented_cli_command_parses(doc, argv):
    try:
        build_parser().parse_args(list(argv))
    except SystemExit as e:  # --version and --help exit 0
        assert e.code == 0, f"{doc}: `tileinfer {' '.join(argv)}` is refused by the command line"


def test_documented_paths_exist():
    missing = sorted({(doc.name, path) for doc in DOCS for span in doc_lines(doc) for path in REPO_PATH.findall(span)
                      if not (ROOT / path).exists()})
    assert missing == []


def test_the_commands_are_found():
    """The extraction itself: the README's own set-up and server commands are among those checked."""
    scripts = {(script, argv) for _, script, argv in script_commands()}
    assert ("make_checkpoint", ("--preset", "tiny", "--out", "/tmp/tiny")) in scripts
    assert len(scripts) > 50
    assert ("generate", "--device", "cpu", "--prompt", "The capital of France is", "--max-new-tokens", "16") in {
        argv for _, argv in cli_commands()}


def python_calls() -> list[tuple[str, str, tuple[str, ...]]]:
    """(where, callable, keyword names) of each call the README's Python blocks make of a tileinfer public name
    (imported from tileinfer, or tileinfer.NAME), or of a method of an object a block made from a public class
    (`llm = LLM(...)` or `with LLM(...) as llm`, then `llm.generate(...)`: "LLM.generate")."""
    def public(f) -> str | None:
        if isinstance(f, ast.Name):
            return f.id if f.id in tileinfer.__all__ else None
        if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "tileinfer":
            return f.attr if f.attr in tileinfer.__all__ else None
        return None

    found = []
    for doc in DOCS:
        for n, block in enumerate(re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)):
            tree, made = ast.parse(block), {}
            for node in ast.walk(tree):  # the objects made from public classes, by variable
                pairs = ([(node.targets[0], node.value)] if isinstance(node, ast.Assign) else
                         [(item.optional_vars, item.context_expr) for item in node.items] if isinstance(node, ast.With)
                         else [])
                for target, value in pairs:
                    if isinstance(target, ast.Name) and isinstance(value, ast.Call) and inspect.isclass(
                            getattr(tileinfer, public(value.func) or "", None)):
                        made[target.id] = public(value.func)
            for node in ast.walk(tree):
                if not isinstance(node, ast.Call):
                    continue
                f = node.func
                name = public(f) or (f"{made[f.value.id]}.{f.attr}" if isinstance(f, ast.Attribute)
                                     and isinstance(f.value, ast.Name) and f.value.id in made else None)
                if name:
                    found.append((f"{doc.name}, python block {n + 1}", name,
                                  tuple(k.arg for k in node.keywords if k.arg is not None)))
    return found


# What a public callable taking **kwargs hands them to: the names it accepts that way.
FORWARDS = {
    "LLM": lambda: {f.name for f in dataclasses.fields(tileinfer.EngineConfig)},       # LLM(model, **options)
    "ChatSession.send": lambda: set(inspect.signature(tileinfer.ChatSession.stream).parameters) - {"self"},
}


@pytest.mark.parametrize("where, name, keywords", python_calls(), ids=lambda v: v if isinstance(v, str) else None)
def test_documented_python_call_takes_its_keywords(where, name, keywords):
    """What a call in the README passes by name is a parameter of that callable (or of what it hands its
    **kwargs to: FORWARDS)."""
    cls, _, method = name.partition(".")
    target = getattr(getattr(tileinfer, cls), method) if method else getattr(tileinfer, cls)
    params = inspect.signature(target).parameters
    accepted = {p for p, v in params.items() if v.kind is not inspect.Parameter.VAR_KEYWORD}
    if any(v.kind is inspect.Parameter.VAR_KEYWORD for v in params.values()):
        if name not in FORWARDS:
            pytest.fail(f"{where}: {name} takes **kwargs; say in FORWARDS what it hands them to")
        accepted |= FORWARDS[name]()
    assert set(keywords) <= accepted, f"{where}: {name}() takes no {sorted(set(keywords) - accepted)}"


def test_every_environment_variable_the_package_reads_is_documented():
    """The README's table of environment variables names exactly the TILEINFER_* variables the package's code
    (tileinfer/, graphs/, cuda_src/) mentions: none read in secret, none documented that nothing reads."""
    used = {name for part in ("tileinfer", "graphs", "cuda_src") for path in (ROOT / part).rglob("*")
            if path.suffix in (".py", ".cu", ".cuh") for name in re.findall(r"TILEINFER_[A-Z_]+", path.read_text())}
    table = set(re.findall(r"^\| `(TILEINFER_[A-Z_]+)`", (ROOT / "README.md").read_text(), re.M))
    assert used == table
