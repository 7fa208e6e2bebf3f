#!/usr/bin/env python3
"""How much the INT8 KV cache changes a model's predictions, with and without key smoothing.

    python scripts/kv_fidelity.py --model qwen3-0.6b [--prompt-tokens 1000] [--generate 256]

For a random prompt of --prompt-tokens tokens: the mean KL divergence KL(exact || INT8) of the
next-token distributions at every position, INT8 with and without key smoothing; then greedy
agreement: of --generate tokens generated with the exact cache, how many the INT8 cache also
picks (teacher-forced, position by position).

Backends: --backend engine (the default; needs a GPU) runs the model's own kernels, comparing its
INT8 cache with its BF16 cache (prompt and continuation prefilled in chunks through the paged
cache, as a prefill does). --backend reference runs the float32 numpy reference
(tileinfer.model.reference) on the CPU, comparing an INT8 cache quantized as tileinfer/kv/int8.py
specifies with an exact float32 cache. --model: a preset (its synthetic checkpoint, whose
key-norm weights have a few channels ~100x the rest) or a checkpoint directory. Prints a table and
one JSON line. --parts (reference backend only) adds two rows with smoothing: only the keys
quantized, only the values, to show which half the remaining error comes from. --baseline bf16
(reference backend only) measures against a cache rounded to bfloat16 instead of the exact one, as
the engine backend's figure does (its baseline is the BF16 cache). --activations bf16 (reference
backend only) rounds to bf16 every activation the engine's kernels write in bf16
(ReferenceModel.forward's bf16_activations): with --baseline bf16, what an ideal bf16 engine with the
specified INT8 cache would measure, so that the engine's figure minus this one is its kernels' share.
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


class ReferenceBackend:
    name = "float32 reference (CPU) vs its float32 cache"

    def __init__(self, path: Path, bf16_activations: bool = False):
        self.ref = ReferenceModel.from_checkpoint(Checkpoint.open(path))
        self.bf16_activations = bf16_activations

    def greedy(self, prompt, n: int) -> list[int]:
        return [int(t) for t in self.ref.greedy(prompt, n)]

    def log_probs(self, tokens, int8: bool = False, smoothing: bool = False, parts: str = "kv",
                  bf16: bool = False) -> np.ndarray:
        cache = self.ref.new_cache(int8=int8, smoothing=smoothing, parts=parts, bf16=bf16)
        return log_softmax(self.ref.forward(tokens, cache, bf16_activations=self.bf16_activations))

    def close(self) -> None:
        pass


class EngineBackend:
    name = "GPU engine: INT8 cache vs BF16 cache"

    def __init__(self, path: Path):
        import tileinfer
        self.tileinfer = tileinfer
        self.model = tileinfer.load_model(path)

    def greedy(self, prompt, n: int) -> list[int]:
        return self.tileinfer.generate(self.model, [int(t) for t in prompt], max_new_tokens=n,
                                       stop_at_eos=False).token_ids

    def log_probs(self, tokens, int8: bool = False, smoothing: bool = False) -> np.ndarray:
        logits = self.model.logits([int(t) for t in tokens], kv_quantize="int8" if int8 else None, smoothing=smoothing)
        return log_softmax(logits)

    def close(self) -> None:
        self.model.close()


def compare(exact: np.ndarray, lp: np.ndarray, n: int, generated) -> dict:
    """Mean and max KL(exact || lp) over the n prompt positions, and greedy agreement: does lp pick the
    exact cache's next token at each generated step (None when nothing was generated)?"""
    kl = (np.exp(exact[:n]) * (exact[:n] - lp[:n])).sum(axis=-1)
    picks = lp[n - 1:n - 1 + len(generated)].argmax(axis=-1)
    agree = float(np.mean(picks == np.asarray(generated))) if len(generated) else None
    return dict(mean_kl=float(kl.mean()), max_kl=float(kl.max()), greedy_agreement=agree)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--backend", choices=("engine", "reference"), default="engine")
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--generate", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parts", action="store_true",
                    help="also quantize only the keys, then only the values (reference backend)")
    ap.add_argument("--baseline", choices=("exact", "bf16"), default="exact",
                    help="reference backend: the cache INT8 is compared with, exact float32 or rounded to bfloat16")
    ap.add_argument("--activations", choices=("float32", "bf16"), default="float32",
                    help="reference backend: activations in float32, or rounded to bf16 where the engine's are")
    args = ap.parse_args()
    if args.parts and args.backend != "reference":
        ap.error("--parts needs --backend reference (the GPU's INT8 cache quantizes keys and values together)")
    if args.baseline != "exact" and args.backend != "reference":
        ap.error("--baseline needs --backend reference (the engine's baseline is its BF16 cache)")
    if args.activations != "float32" and args.backend != "reference":
        ap.error("--activations needs --backend reference (the engine's activations are bf16)")
    path = Path(args.model) if Path(args.model).is_dir() else cached_checkpoint(args.model)
    t0 = time.perf_counter()
    backend = (EngineBackend(path) if args.backend == "engine"
               else ReferenceBackend(path, bf16_activations=args.activations == "bf16"))
    try:
        prompt = np.random.default_rng(args.seed).integers(0, 151643, args.prompt_tokens)
        # Exact cache: the prompt, then greedy continuation; its tokens are teacher-forced below.
        generated = backend.greedy(prompt, args.generate)
        tokens = np.concatenate([prompt, np.asarray(generated, np.int64)])
        exact = backend.log_probs(tokens, bf16=True) if args.baseline == "bf16" else backend.log_probs(tokens)
        n = args.prompt_tokens
        report = dict(model=args.model, prompt_tokens=n, generated=args.generate, backend=backend.name,
                      baseline=args.baseline, activations=args.activations)
        if args.baseline == "bf16":  # the baseline's own distance from the exact cache
            report["bf16 cache"] = compare(backend.log_probs(tokens), exact, n, generated)
        for smoothing in (False, True):
            lp = backend.log_probs(tokens, int8=True, smoothing=smoothing)
            key = "smoothing" if smoothing else "plain"
            report[key] = compare(exact, lp, n, generated)
        for parts, key in ((("k", "keys only, smoothed"), ("v", "values only")) if args.parts else ()):
            report[key] = compare(exact, backend.log_probs(tokens, int8=True, smoothing=True, parts=parts), n, generated)
    finally:
        backend.close()
    report["kl_reduction"] = report["plain"]["mean_kl"] / max(report["smoothing"]["mean_kl"], 1e-30)
    report["seconds"] = time.perf_counter() - t0
    baseline = "; against the cache rounded to bfloat16 (its row: KL(exact || bf16))" if args.baseline == "bf16" else ""
    baseline += "; bf16 activations" if args.activations == "bf16" else ""
    print(f"{args.model}: {n}-token prompt, {args.generate} greedy tokens ({report['backend']}{baseline})")
    print("| INT8 cache | mean KL | max KL | greedy agreement |\n|---|---|---|---|")
    for key in ("bf16 cache", "plain", "smoothing", "keys only, smoothed", "values only"):
        if key not in report:
            continue
        r = report[key]
        agree = "-" if r["greedy_agreement"] is None else f"{100 * r['greedy_agreement']:.1f}%"
        print(f"| {key} | {r['mean_kl']:.2e} | {r['max_kl']:.2e} | {agree} |")
    print(f"smoothing lowers the mean KL {report['kl_reduction']:.0f}x")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
