#!/usr/bin/env python3
"""Drive `tileinfer chat` in a pseudo-terminal as a person would, and print the transcript.

    python scripts/chat_transcript.py [--model DIR] [--max-new-tokens 24] [-- extra chat args]

Sends three messages (waiting for each reply's statistics line), `/reset`, one more message,
then Ctrl-C; prints everything the terminal showed and the exit status, and fails if the
program printed a traceback, did not answer, or exited with a status other than 0 or 130.
Then runs `tileinfer generate` with a long budget and presses Ctrl-C while the text streams,
with the same checks.
"""
from __future__ import annotations

import argparse
import fcntl
import os
import pty
import re
import select
import signal
import struct
import sys
import termios
import time

STATS = re.compile(rb"\[\d+ tokens, [\d.]+ tok/s")


class Terminal:
    def __init__(self, argv: list[str]):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the chat program on a 100 x 30 terminal (a size of 0 x 0 hides progress bars)
            fcntl.ioctl(0, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
            os.execvp(argv[0], argv)
        self.seen = b""

    def read_until(self, pattern: re.Pattern, timeout: float, start: int = 0) -> bool:
        """Read output until `pattern` appears after offset `start` (True) or `timeout` passes (False)."""
        deadline = time.monotonic() + timeout
        while not pattern.search(self.seen, start):
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:  # the program exited
                    return bool(pattern.search(self.seen, start))
                if not chunk:
                    return bool(pattern.search(self.seen, start))
                self.seen += chunk
        return True

    def type(self, text: str) -> int:
        """Type a line; returns the output offset before it."""
        mark = len(self.seen)
        os.write(self.fd, text.encode() + b"\r")
        return mark

    def finish(self, timeout: float) -> int:
        """Wait for the program to exit; its exit status (128 + signal if killed)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.read_until(re.compile(rb"$^"), 0.2)  # drain
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
        os.kill(self.pid, signal.SIGKILL)
        os.waitpid(self.pid, 0)
        raise TimeoutError("the chat did not exit after Ctrl-C")


def render(raw: str) -> str:
    """The output as lines: a progress bar redrawn in place (carriage returns) shows as its last
    frame, on a line of its own, so the transcript records which bars appeared."""
    lines = []
    for line in raw.replace("\r\n", "\n").split("\n"):
        frames = [f for f in line.split("\r") if f.strip()]
        last = {}  # bar description -> its last frame, in order of first appearance
        for f in frames:
            last[f.split(":", 1)[0] if "|" in f else f] = f
        lines.extend(last.values() if frames else [""])
    return "\n".join(lines)


def ended_cleanly(term: Terminal, what: str) -> list[str]:
    """Wait for the program to exit after Ctrl-C, print its transcript; the problems seen."""
    status = term.finish(30)
    transcript = render(term.seen.decode("utf-8", "replace"))
    print(transcript)
    print(f"[exit status {status}]")
    problems = []
    if "Traceback" in transcript:
        problems.append(f"{what}: a traceback was printed")
    if status not in (0, 130):
        problems.append(f"{what}: exit status {status}")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--start-timeout", type=float, default=300, help="seconds for loading, compiling, the first reply")
    ap.add_argument("extra", nargs="*", help="more arguments for `tileinfer chat`")
    args = ap.parse_args()
    argv = ["tileinfer", "chat", "--max-new-tokens", str(args.max_new_tokens), "--no-think", *args.extra]
    if args.model:
        argv += ["--model", args.model]
    print("$ " + " ".join(argv), flush=True)
    term = Terminal(argv)
    problems = []
    if not term.read_until(re.compile(rb"> "), args.start_timeout):
        problems.append("no prompt appeared")
    for i, message in enumerate(["Hello! Who are you?", "Name three colours.", "/reset", "What is 2 + 2?",
                                 "And what about 3 + 3?"]):
        mark = term.type(message)
        if message == "/reset":
            if not term.read_until(re.compile(rb"conversation cleared"), 30, mark):
                problems.append("/reset was not acknowledged")
            continue
        if not term.read_until(STATS, args.start_timeout if i == 0 else 60, mark):
            problems.append(f"no reply statistics after {message!r}")
        term.read_until(re.compile(rb"> "), 10, mark + 1)
    os.write(term.fd, b"\x03")  # Ctrl-C
    problems += ended_cleanly(term, "chat")

    # Ctrl-C while `generate` streams its text.
    argv = ["tileinfer", "generate", "--prompt", "Once upon a time", "--max-new-tokens", "4000"]
    if args.model:
        argv += ["--model", args.model]
    print("\n$ " + " ".join(argv) + "   (Ctrl-C once 200 characters of text have arrived)", flush=True)
    term = Terminal(argv)
    # A progress bar frame is at most a line (100 columns) between carriage returns; text is longer.
    if not term.read_until(re.compile(rb"[^\r\n]{200}"), args.start_timeout):
        problems.append("generate streamed no text")
    os.write(term.fd, b"\x03")
    problems += ended_cleanly(term, "generate")
    for p in problems:
        print("PROBLEM:", p, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
