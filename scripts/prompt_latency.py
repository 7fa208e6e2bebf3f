#!/usr/bin/env python3
"""How long one prompt alone takes to its first token through the offline engine: `LLM.generate` with
`max_tokens=1`, host work and GPU work together (a short prompt's step can wait for the host's launches).

    python3 scripts/prompt_latency.py --models qwen3-0.6b,qwen3-4b --lengths 17,100,300,512,600 [--repeats 30]
        [--device cpu] [--json OUT]

Per model (a preset name, made as a synthetic checkpoint once, or a checkpoint directory) and prompt length: a
fresh prompt of random token ids each time, three warm-ups (a one-prompt prefill graph is captured at its bucket's
first step), then --repeats timed prompts; it prints the medians of the wall time of `generate` and of the engine's
own first-token time (RequestOutput.time_to_first_token), in ms. Prompts differ from each other, so no measured
prompt finds its pages in the prefix cache.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the checkout's package, when not installed
from tileinfer import LLM, SamplingParams  # noqa: E402
from tileinfer.model.synthetic import cached_checkpoint  # noqa: E402

WARMUPS = 3


def model_path(name: str) -> Path:
    return Path(name) if Path(name).is_dir() else cached_checkpoint(name, progress=False)


def measure(llm: LLM, length: int, repeats: int, rng: np.random.Generator) -> dict:
    """Medians over `repeats` prompts of `length` tokens, each alone: generate's wall time and the engine's TTFT."""
    vocab = min(llm.runner.config.vocab_size, 151643)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    walls, ttfts = [], []
    for i in range(WARMUPS + repeats):
        prompt = rng.integers(0, vocab, length).tolist()
        start = time.perf_counter()
        out = llm.generate([prompt], params)[0]
        if i >= WARMUPS:
            walls.append(time.perf_counter() - start)
            ttfts.append(out.time_to_first_token)
    return dict(prompt_tokens=length, generate_ms=1e3 * statistics.median(walls),
                first_token_ms=1e3 * statistics.median(ttfts))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="qwen3-0.6b", help="presets or checkpoint directories, comma-separated")
    ap.add_argument("--lengths", default="17,100,300,512", help="prompt lengths in tokens, comma-separated")
    ap.add_argument("--repeats", type=int, default=30, help="timed prompts a length (30)")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = ap.parse_args(argv)
    lengths = [int(n) for n in args.lengths.split(",") if n]
    if args.repeats < 1 or not lengths or min(lengths) < 1:
        ap.error("--repeats and every --lengths entry must be >= 1")
    rng = np.random.default_rng(args.seed)
    rows = []
    for name in args.models.split(","):
        longest = max(lengths) + 1
        with LLM(model_path(name), device=args.device, max_context=max(longest, 64), progress=False) as llm:
            for n in lengths:
                row = dict(model=name, **measure(llm, n, args.repeats, rng))
                rows.append(row)
                print(f"{name} prompt {n} alone: generate {row['generate_ms']:.3f} ms, "
                      f"first token {row['first_token_ms']:.3f} ms", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
