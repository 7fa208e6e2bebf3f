#!/usr/bin/env python3
"""The safetensors reader fuzzed at length: tests/test_safetensors.py's fuzz check on many files.

    python scripts/fuzz_safetensors.py [--examples 100000] [--seed N]

The test suite runs the same check (every drawn file either opens, each tensor readable in bounds,
or raises a SafetensorsError naming the file) on 1,000 files; this draws as many as asked from the
same strategies. Needs the test extra (pip install -e ".[test]"). Exits 1 with hypothesis's
minimal failing file on a failure.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from hypothesis import given, seed, settings  # noqa: E402

import test_safetensors as t  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=100_000, help="files to draw (100,000)")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis's seed (default: random)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "f.safetensors"

        @settings(max_examples=args.examples, **t.FUZZ_SETTINGS)
        @given(content=t.FUZZED_FILES)
        def fuzz(content):
            t.check_opens_or_raises(path, content)

        if args.seed is not None:
            fuzz = seed(args.seed)(fuzz)
        start = time.perf_counter()
        fuzz()
    print(f"{args.examples:,} fuzzed files opened or raised SafetensorsError in {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
