#!/usr/bin/env python3
"""How much the INT8 KV cache changes a model's predictions, with and without key smoothing.

    python scripts/kv_fidelity.py --model qwen3-0.6b [--prompt-tokens 1000] [--generate 256]

For a random prompt of --prompt-tokens tokens: the mean KL divergence KL(exact || INT8) of the
next-token distributions at every position, INT8 with and without key smoothing; then greedy
agreement: of --generate tokens generated with the exact cache, how many the INT8 cache also
picks (teacher-forced, position by position).

Backend: the float32 numpy reference (tileinfer.model.reference), on the CPU: the exact cache is
float32, the INT8 cache quantizes every written vector as tileinfer/kv/int8.py specifies. (The
GPU engine's INT8 cache, compared with its BF16 cache, comes with the INT8 attention kernels.)
--model: a preset (its synthetic checkpoint) or a checkpoint directory. Prints a table and one
JSON line.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from tileinfer.model.checkpoint import Checkpoint
from tileinfer.model.reference import ReferenceModel
from tileinfer.model.synthetic import cached_checkpoint


def log_softmax(logits: np.ndarray) -> np.ndarray:
    x = logits.astype(np.float64)
    x -= x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--generate", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    path = Path(args.model) if Path(args.model).is_dir() else cached_checkpoint(args.model)
    t0 = time.perf_counter()
    ref = ReferenceModel.from_checkpoint(Checkpoint.open(path))
    prompt = np.random.default_rng(args.seed).integers(0, 151643, args.prompt_tokens)
    # Exact cache: the prompt, then greedy continuation; its tokens are teacher-forced below.
    generated = ref.greedy(prompt, args.generate)
    tokens = np.concatenate([prompt, np.asarray(generated, np.int64)])
    exact = log_softmax(ref.forward(tokens, ref.new_cache()))
    n = args.prompt_tokens
    report = dict(model=args.model, prompt_tokens=n, generated=args.generate, backend="float32 reference (CPU)")
    for smoothing in (False, True):
        lp = log_softmax(ref.forward(tokens, ref.new_cache(int8=True, smoothing=smoothing)))
        kl = (np.exp(exact[:n]) * (exact[:n] - lp[:n])).sum(axis=-1)
        # Greedy agreement: does the INT8 cache pick the exact cache's next token at each generated step?
        picks = lp[n - 1:n - 1 + args.generate].argmax(axis=-1)
        agree = float(np.mean(picks == np.asarray(generated)))
        key = "smoothing" if smoothing else "plain"
        report[key] = dict(mean_kl=float(kl.mean()), max_kl=float(kl.max()), greedy_agreement=agree)
    report["kl_reduction"] = report["plain"]["mean_kl"] / max(report["smoothing"]["mean_kl"], 1e-30)
    report["seconds"] = time.perf_counter() - t0
    print(f"{args.model}: {n}-token prompt, {args.generate} greedy tokens ({report['backend']})")
    print("| INT8 cache | mean KL | max KL | greedy agreement |\n|---|---|---|---|")
    for key in ("plain", "smoothing"):
        r = report[key]
        print(f"| {key} | {r['mean_kl']:.2e} | {r['max_kl']:.2e} | {100 * r['greedy_agreement']:.1f}% |")
    print(f"smoothing lowers the mean KL {report['kl_reduction']:.0f}x")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
