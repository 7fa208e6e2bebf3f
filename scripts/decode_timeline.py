"""Where a batch-1 decode step's wall time goes: the GPU time of each step of a real `tileinfer.generate`
(events recorded around every `GPURunner.launch`), the idle gap between consecutive steps, and the host's time
in `launch`, against the GPU time of the batch-1 graph replayed back to back (bench.py's figure).

    python scripts/decode_timeline.py --model qwen3-4b --context 32768 --kv int8 [--max-splits 32]

A gap near zero means the host keeps the GPU fed (decode is pipelined: step t + 1 is launched before step
t's token is read back), so a wall time per token above the replay's GPU time is the steps themselves.
--max-splits overrides the engine's cap on decode attention's key splits (runner/gpu.py MAX_SPLITS).
"""
from __future__ import annotations

import argparse
import time

import numpy as np

import tileinfer
import tileinfer.runner.gpu as engine_model
from tileinfer.cuda import Event
from tileinfer.model.synthetic import cached_checkpoint

from bench import graph_step_ms


def timeline(model, prompt: list[int], kv_quantize: str | None, new: int) -> dict:
    """One generate of `new` tokens with an event pair around each launch: per decode step its GPU ms,
    the gap after it (ms) and the host's ms in launch()."""
    marks = []
    original = engine_model.GPURunner.launch

    def launch(self, *args, **kwargs):
        start, end = Event(), Event()
        start.record(self.stream)
        t0 = time.perf_counter()
        slot = original(self, *args, **kwargs)
        host_ms = (time.perf_counter() - t0) * 1e3
        end.record(self.stream)
        marks.append((start, end, host_ms))
        return slot

    engine_model.GPURunner.launch = launch
    try:
        result = tileinfer.generate(model, prompt, max_new_tokens=new, stop_at_eos=False, kv_quantize=kv_quantize)
    finally:
        engine_model.GPURunner.launch = original
    steps = marks[-(new - 1):]  # the decode steps (the prefill's launches come first)
    out = dict(tok_s=result.decode_tokens_per_second,
               step_ms=np.array([s.elapsed_ms(e) for s, e, _ in steps]),
               gap_ms=np.array([a[1].elapsed_ms(b[0]) for a, b in zip(steps, steps[1:])]),
               host_ms=np.array([h for _, _, h in steps]))
    for s, e, _ in marks:
        s.destroy()
        e.destroy()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-4b", help="a preset (its synthetic checkpoint)")
    ap.add_argument("--context", type=int, default=32768, help="prompt positions before the decode")
    ap.add_argument("--kv", default="bf16", choices=("bf16", "int8"))
    ap.add_argument("--new", type=int, default=128, help="tokens generated")
    ap.add_argument("--max-splits", type=int, default=None, help="override the engine's MAX_SPLITS")
    args = ap.parse_args()
    if args.max_splits is not None:
        engine_model.MAX_SPLITS = args.max_splits
    kv_quantize = "int8" if args.kv == "int8" else None
    with tileinfer.load_model(cached_checkpoint(args.model), progress=False,
                              max_batch_tokens=max(4096, args.context)) as model:
        prompt = np.random.default_rng(0).integers(0, 151643, args.context).tolist()
        tileinfer.generate(model, prompt, max_new_tokens=16, stop_at_eos=False, kv_quantize=kv_quantize)  # warm-up
        t = timeline(model, prompt, kv_quantize, args.new)
        replay = graph_step_ms(model)
        print(f"{args.model} at {args.context} positions, {args.kv} cache, {model.decode_splits(1)} splits: "
              f"{t['tok_s']:.1f} tok/s ({1e3 / t['tok_s']:.3f} ms a token); graph replay {replay:.3f} ms")
        print(f"  GPU a step: median {np.median(t['step_ms']):.3f} ms, max {t['step_ms'].max():.3f}; gap between "
              f"steps: median {np.median(t['gap_ms']) * 1e3:.1f} us, max {t['gap_ms'].max() * 1e3:.1f} us; host in "
              f"launch(): median {np.median(t['host_ms']):.3f} ms")


if __name__ == "__main__":
    main()
