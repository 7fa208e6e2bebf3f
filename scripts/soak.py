#!/usr/bin/env python3
"""Soak: many requests of random lengths through tileinfer.LLM with a small page pool.

    python scripts/soak.py --model qwen3-0.6b --requests 10000 --num-pages 200

Requests (prompt 1-512 tokens, 1-128 new tokens, half greedy, half sampled with their own seed,
some with stop tokens) arrive in batches of --batch. Checks, after each of two identical passes
on fresh engines: every request finished with a finish reason, the free page count equals the
pool size, and the host's resident memory did not grow beyond --rss-limit-mb from the first batch
to the last; then that the two passes gave the same tokens. Prints one JSON line (also written to
$OUT/soak.json) with the duration, tokens, preemptions and memory figures; exits 1 on a failed check.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

from tileinfer import LLM, SamplingParams
from tileinfer.model.synthetic import cached_checkpoint

VOCAB = 151643


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def workload(n: int, seed: int):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, VOCAB, int(k)).tolist() for k in rng.integers(1, 513, n)]
    params = []
    for i, m in enumerate(rng.integers(1, 129, n)):
        stop = [int(rng.integers(0, VOCAB))] if i % 5 == 0 else []
        if i % 2:
            params.append(SamplingParams(max_tokens=int(m), temperature=0.8, top_p=0.95, seed=i, stop_token_ids=stop))
        else:
            params.append(SamplingParams(max_tokens=int(m), temperature=0, ignore_eos=True, stop_token_ids=stop))
    return prompts, params


def one_pass(path, args, prompts, params) -> dict:
    t0 = time.perf_counter()
    digest = hashlib.sha256()
    rss = []
    with LLM(path, max_num_seqs=args.max_num_seqs, max_context=1024, num_pages=args.num_pages,
             progress=False) as llm:
        for start in range(0, len(prompts), args.batch):
            outs = llm.generate(prompts[start:start + args.batch], params[start:start + args.batch])
            for o in outs:
                if o.finish_reason not in ("stop", "length"):
                    raise SystemExit(f"request {o.request_id} ended with {o.finish_reason!r}")
                digest.update(np.asarray(o.token_ids, np.int32).tobytes())
            rss.append(rss_mb())
        free_ok = llm.runner.cache.manager.num_free_pages == args.num_pages
        stats = llm.stats.as_dict()
    return dict(seconds=time.perf_counter() - t0, digest=digest.hexdigest(), free_pages_ok=free_ok,
                rss_first_mb=rss[0], rss_last_mb=rss[-1], rss_growth_mb=rss[-1] - rss[0], **stats)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b", help="a preset (synthetic checkpoint) or a checkpoint directory")
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--batch", type=int, default=500)
    ap.add_argument("--num-pages", type=int, default=200)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--rss-limit-mb", type=float, default=200.0)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = ap.parse_args()
    path = Path(args.model) if Path(args.model).is_dir() else cached_checkpoint(args.model)
    prompts, params = workload(args.requests, seed=0)
    passes = [one_pass(path, args, prompts, params) for _ in range(2)]
    report = dict(model=args.model, requests=args.requests, num_pages=args.num_pages, passes=passes,
                  same_outputs=passes[0]["digest"] == passes[1]["digest"])
    line = json.dumps(report)
    print(line)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "soak.json").write_text(line + "\n")
    ok = report["same_outputs"] and all(p["free_pages_ok"] and p["rss_growth_mb"] <= args.rss_limit_mb
                                        for p in passes)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
