#!/usr/bin/env python3
"""How often an ideal bf16 engine's top-1 token differs from the float32 reference's (CPU only).

    python scripts/bf16_agreement.py [--model qwen3-0.6b] [--seeds 11,12,13,14] [--tokens 64]

For random prompts (the GPU logits test's: tests/gpu/test_model.py), the float32 numpy reference
(tileinfer.model.reference) against the same forward with every activation a bf16 engine keeps in
bf16 rounded to bf16 (ReferenceModel.forward_bf16_activations): the top-1 agreement, the
positions that differ with their top-two gaps, and how the gaps are spread (in units of each
row's logit standard deviation). On a synthetic checkpoint (random weights) the logits are close
to independent Gaussians over 151,936 tokens, whose top two are often nearly tied; this bounds the
top-1 agreement any bf16 engine can show against a float32 reference there.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from tileinfer.model.checkpoint import Checkpoint
from tileinfer.model.reference import ReferenceModel
from tileinfer.model.synthetic import cached_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-0.6b", help="a preset (its synthetic checkpoint) or a checkpoint directory")
    ap.add_argument("--seeds", default="11,12,13,14")
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    path = Path(args.model) if Path(args.model).is_dir() else cached_checkpoint(args.model, progress=True)
    ref = ReferenceModel.from_checkpoint(Checkpoint.open(path))
    vocab = ref.config.vocab_size
    agree, total, gaps = 0, 0, []
    for seed in (int(s) for s in args.seeds.split(",")):
        ids = np.random.default_rng(seed).integers(0, min(vocab, 151643), args.tokens).tolist()
        exact, bf16 = ref.forward(ids), ref.forward_bf16_activations(ids)
        top = np.sort(exact, axis=1)[:, -2:]
        gap = (top[:, 1] - top[:, 0]) / exact.std(axis=1)
        miss = np.flatnonzero(exact.argmax(1) != bf16.argmax(1))
        agree += len(ids) - miss.size
        total += len(ids)
        gaps.append(gap)
        print(f"prompt seed {seed}: {miss.size} of {len(ids)} differ, at {miss.tolist()}, top-two gaps there "
              f"{np.round(gap[miss], 4).tolist()}")
    g = np.concatenate(gaps)
    print(f"ideal bf16 top-1 agreement: {agree}/{total} = {agree / total:.4f}")
    print(f"top-two gap (x row std): median {np.median(g):.3f}; under 0.05: {np.mean(g < 0.05):.1%}; "
          f"under 0.01: {np.mean(g < 0.01):.1%}")


if __name__ == "__main__":
    main()
