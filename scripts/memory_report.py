#!/usr/bin/env python3
"""The start-up memory report of tileinfer.LLM for a checkpoint at several memory budgets.

    python scripts/memory_report.py [--model qwen3-8b] [--utilization 0.9,0.95] [--max-num-seqs 256]

--model: a preset (its synthetic checkpoint, written on first use) or a checkpoint directory.
Starts an engine at each `gpu_memory_utilization` in turn (the pool sized from NVML's free memory),
prints its report (what NVML sees, split into context, weights, workspace, kernels, graphs, KV pool
and the unaccounted rest) and closes it.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from tileinfer import LLM
from tileinfer.model.synthetic import cached_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-8b")
    ap.add_argument("--utilization", default="0.9,0.95")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--kv-int8", action="store_true")
    args = ap.parse_args()
    path = Path(args.model) if Path(args.model).is_dir() else cached_checkpoint(args.model, progress=True)
    for u in (float(x) for x in args.utilization.split(",")):
        with LLM(path, max_num_seqs=args.max_num_seqs, max_context=args.max_context, gpu_memory_utilization=u,
                 kv_quantize="int8" if args.kv_int8 else None, progress=False) as llm:
            print(f"$ {args.model}, gpu_memory_utilization={u}")
            print(llm.memory_report.format(), flush=True)


if __name__ == "__main__":
    main()
