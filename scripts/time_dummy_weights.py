#!/usr/bin/env python3
"""How long load_format="dummy" takes to make one tensor-parallel rank's weights on this machine's cores.

    python scripts/time_dummy_weights.py [--preset qwen3-32b] [--world 2] [--rank 0]

Writes the preset's config.json and tokenizer (make_checkpoint.py --config-only) to a temporary directory, then
reads every tensor the rank reads through ShardedCheckpoint(DummyCheckpoint(...)), as start-up does before the
upload: made (only the rank's rows, on threads) and dropped. No GPU is used. Prints the bytes, seconds and GB/s.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tileinfer.model.checkpoint import DummyCheckpoint
from tileinfer.model.sharding import ShardedCheckpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-32b")
    ap.add_argument("--world", type=int, default=2, help="tensor-parallel size (1: the whole model)")
    ap.add_argument("--rank", type=int, default=0)
    args = ap.parse_args()
    make = Path(__file__).resolve().with_name("make_checkpoint.py")
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, str(make), "--preset", args.preset, "--config-only", "--out", d],
                       check=True, capture_output=True)
        rank = ShardedCheckpoint(DummyCheckpoint.open(d), args.rank, args.world)
        start, nbytes = time.perf_counter(), 0
        for name in rank.checkpoint.tensors:
            nbytes += rank.read(name).nbytes
        seconds = time.perf_counter() - start
    print(f"{args.preset}, rank {args.rank} of {args.world}: {nbytes / 1e9:.1f} GB of dummy bf16 weights made in "
          f"{seconds:.1f} s ({nbytes / 1e9 / seconds:.2f} GB/s) on {os.cpu_count()} cores", flush=True)


if __name__ == "__main__":
    main()
