#!/usr/bin/env python3
"""The KV cache and weights of a Qwen3 model, and how much of it fits on a GPU (same as `tileinfer size`).

    python scripts/kv_sizing.py qwen3-4b --gpu-memory 141
    python scripts/kv_sizing.py /data/qwen3-8b --context 4096,32768,131072 --json

See tileinfer/sizing_cli.py for the output, tileinfer/kv/sizing.py for the arithmetic.
"""
import sys

from tileinfer.sizing_cli import main

if __name__ == "__main__":
    sys.exit(main(prog="kv_sizing.py"))
