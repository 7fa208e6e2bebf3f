"""Where a decode step's wall time goes: the GPU time of each decode step of a real run (events recorded around
every `GPURunner.launch`), the idle gap between consecutive steps, and the host's time in `launch`, against the
GPU time of the step's graph replayed back to back (bench.py's figure).

    python scripts/decode_timeline.py --model qwen3-4b --context 32768 --kv int8 [--max-splits 32]
    python scripts/decode_timeline.py --model qwen3-4b --batch 256 --context 512
    python scripts/decode_timeline.py --model qwen3-0.6b --offline

At batch 1 the run is a `tileinfer.generate`; at --batch B it is B requests of --context random tokens each
through `tileinfer.LLM` (bench.py's batched decode), and the steps counted are those in which all B decode.
A gap near zero means the host keeps the GPU fed (decode is pipelined: step t + 1 is launched before step
t's tokens are read back), so a wall time per step above the replay's GPU time is the steps themselves; a gap
that is a sizeable part of the step is time the GPU waits for the host.
--max-splits overrides the engine's cap on decode attention's key splits (runner/gpu.py MAX_SPLITS).
"""
from __future__ import annotations

import argparse
import contextlib
import time
from dataclasses import dataclass

import numpy as np

import tileinfer
import tileinfer.runner.gpu as engine_model
from tileinfer.cuda import Event
from tileinfer.engine.params import SamplingParams
from tileinfer.graphs import DECODE, bucket_for
from tileinfer.model.synthetic import cached_checkpoint

from bench import graph_step_ms, replay_ms
from bench_engine import live_step


@dataclass
class Mark:
    """One launch: events before and after its work on the runner's stream, when the host began it
    (perf_counter seconds), the host's ms in launch(), its rows and whether every row is one token."""
    start: object
    end: object
    began: float
    host_ms: float
    rows: int
    decode: bool


@contextlib.contextmanager
def recording():
    """GPURunner.launch with a Mark recorded around each call, for the duration; yields the list of Marks."""
    marks: list[Mark] = []
    original = engine_model.GPURunner.launch

    def launch(self, batch, *args, **kwargs):
        start, end = Event(), Event()
        start.record(self.stream)
        t0 = time.perf_counter()
        slot = original(self, batch, *args, **kwargs)
        host_ms = (time.perf_counter() - t0) * 1e3
        end.record(self.stream)
        marks.append(Mark(start, end, t0, host_ms, len(batch), all(len(item[1]) == 1 for item in batch)))
        return slot

    engine_model.GPURunner.launch = launch
    try:
        yield marks
    finally:
        engine_model.GPURunner.launch = original


def summarize(marks: list[Mark], rows: int, elapsed_ms) -> dict:
    """The decode steps of `rows` rows among `marks`: per step its GPU ms, the host's ms in launch() and, for
    each two such steps launched one after the other, the GPU's idle ms between them (the first one's end to
    the second one's start) and the wall ms between their launches. elapsed_ms(a, b): ms from event a to b."""
    picked = [i for i, m in enumerate(marks) if m.decode and m.rows == rows]
    chosen = set(picked)
    pairs = [(marks[i], marks[i + 1]) for i in picked if i + 1 in chosen]
    if not pairs:
        raise ValueError(f"no two consecutive decode steps of {rows} rows among {len(marks)} launches")
    steps = [marks[i] for i in picked]
    return dict(steps=len(steps),
                step_ms=np.array([elapsed_ms(m.start, m.end) for m in steps]),
                host_ms=np.array([m.host_ms for m in steps]),
                gap_ms=np.array([elapsed_ms(a.end, b.start) for a, b in pairs]),
                wall_ms=np.array([(b.began - a.began) * 1e3 for a, b in pairs]))


def render(title: str, rows: int, s: dict, replay_ms_: float, replay_at: str, step_at: float) -> str:
    """Two lines: tokens/s from the median wall time a step and the graph's replay (`replay_at`: the positions
    it replays at) beside the recorded step at those positions (`step_at`, its GPU ms), then the GPU, gap and
    host medians."""
    wall = float(np.median(s["wall_ms"]))
    gap = float(np.median(s["gap_ms"]))
    return (f"{title}: {rows * 1e3 / wall:,.1f} tok/s ({wall:.3f} ms a step, median over {s['steps']} steps); "
            f"graph replay {replay_ms_:.3f} ms {replay_at} (that step in the run: {step_at:.3f} ms)\n"
            f"  GPU a step: median {np.median(s['step_ms']):.3f} ms, max {s['step_ms'].max():.3f}; GPU idle between "
            f"steps: median {gap * 1e3:.1f} us ({gap / wall:.1%} of a step), max {s['gap_ms'].max() * 1e3:.1f} us; "
            f"host in launch(): median {np.median(s['host_ms']):.3f} ms")


def _elapsed(a, b) -> float:
    return a.elapsed_ms(b)


def _destroy(marks: list[Mark]) -> None:
    for m in marks:
        m.start.destroy()
        m.end.destroy()


def batch_one(args, kv_quantize: str | None) -> str:
    with tileinfer.load_model(cached_checkpoint(args.model), progress=False,
                              max_batch_tokens=max(4096, args.context)) as model:
        prompt = np.random.default_rng(0).integers(0, 151643, args.context).tolist()
        tileinfer.generate(model, prompt, max_new_tokens=16, stop_at_eos=False, kv_quantize=kv_quantize)  # warm-up
        with recording() as marks:
            tileinfer.generate(model, prompt, max_new_tokens=args.new, stop_at_eos=False, kv_quantize=kv_quantize)
        s = summarize(marks, 1, _elapsed)
        _destroy(marks)
        title = f"{args.model} at {args.context} positions, {args.kv} cache, {model.decode_splits(1)} splits"
        # the graph's buffers hold the run's last step: the replay recomputes it
        return render(title, 1, s, graph_step_ms(model), "of the last step", float(s["step_ms"][-1]))


def batched(args, kv_quantize: str | None) -> str:
    B = args.batch
    with tileinfer.LLM(cached_checkpoint(args.model), max_num_seqs=B, max_context=args.context + args.new + 64,
                       progress=False, kv_quantize=kv_quantize) as llm:
        rng = np.random.default_rng(B)
        vocab = llm.model_config.vocab_size

        def run(n: int, context: int, new: int) -> None:
            params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
            for _ in range(n):
                llm.add_request(rng.integers(0, vocab, context).tolist(), params)
            while llm.has_unfinished_requests():
                llm.step()
            llm.finished_outputs()

        run(min(8, B), 64, 8)  # warm-up
        with recording() as marks:
            run(B, args.context, args.new)
        s = summarize(marks, B, _elapsed)
        _destroy(marks)

        def replay(runner, batch: int) -> float:
            bucket = bucket_for(batch, runner.buckets)
            return replay_ms(runner.stream, lambda stream: runner.graphs.run(DECODE, bucket, stream), 50)

        # The run's requests are gone by now (their graph buffers stale): the graph is replayed over a live step
        # of new requests, which live_step takes at the first step all of them decode (about context + 2
        # positions), against the run's first such step; the run's later steps read more cache.
        return render(f"{args.model} batch {B} at {args.context} positions, {args.kv} cache", B, s,
                      live_step(llm, B, args.context, replay), "of a step at the prompts' end",
                      float(s["step_ms"][0]))


def by_kind(marks: list[Mark], elapsed_ms) -> dict[str, dict]:
    """The decode steps and the prompt steps among `marks`: for each, the steps, their GPU seconds, the host's seconds
    in launch() and the GPU's idle seconds before them (from the end of the launch before each), with the largest
    such gap in ms. elapsed_ms(a, b): ms from event a to b."""
    out = {}
    for kind, decode in (("decode steps", True), ("prompt steps", False)):
        picked = [i for i, m in enumerate(marks) if m.decode == decode]
        idle = [elapsed_ms(marks[i - 1].end, marks[i].start) for i in picked if i > 0]
        out[kind] = dict(steps=len(picked), gpu_s=sum(elapsed_ms(marks[i].start, marks[i].end) for i in picked) / 1e3,
                         host_s=sum(marks[i].host_ms for i in picked) / 1e3, idle_s=sum(idle) / 1e3,
                         largest_idle_ms=max(idle, default=0.0))
    return out


def offline_timeline(args) -> str:
    """bench.py's offline run (bench_engine.offline, the qwen3-0.6b goal's workload) with every launch recorded:
    per kind of step (decode: one token a row; prompt: with prompt chunks) the steps, their GPU seconds, the host's
    seconds in launch() and the GPU's idle seconds before each (from the end of the launch before it)."""
    from bench_engine import offline
    with tileinfer.LLM(cached_checkpoint(args.model), max_num_seqs=256, max_context=2048 + 64,
                       max_num_batched_tokens=8192, progress=False) as llm:
        t0 = time.perf_counter()  # no warm-up, as in bench.py: the start-up captured the graphs
        with recording() as marks:
            r = offline(llm)
        wall = time.perf_counter() - t0
        lines = [f"{args.model} offline: {r['output_tok_s']:,.0f} output tok/s, {wall:.2f} s in all, "
                 f"{len(marks)} launches; the GPU from the first launch's start to the last one's end "
                 f"{_elapsed(marks[0].start, marks[-1].end) / 1e3:.2f} s"]
        for kind, k in by_kind(marks, _elapsed).items():
            lines.append(f"  {kind}: {k['steps']}, GPU {k['gpu_s']:.3f} s, host in launch() {k['host_s']:.3f} s, GPU "
                         f"idle before them {k['idle_s']:.3f} s (largest {k['largest_idle_ms']:.2f} ms)")
        _destroy(marks)
        return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-4b", help="a preset (its synthetic checkpoint)")
    ap.add_argument("--batch", type=int, default=1, help="sequences decoding together (1)")
    ap.add_argument("--context", type=int, default=32768, help="prompt positions before the decode")
    ap.add_argument("--kv", default="bf16", choices=("bf16", "int8"))
    ap.add_argument("--new", type=int, default=128, help="tokens generated")
    ap.add_argument("--max-splits", type=int, default=None, help="override the engine's MAX_SPLITS")
    ap.add_argument("--offline", action="store_true", help="bench.py's offline run instead (256 requests, in/out "
                    "100-1,024 tokens): each kind of step's GPU, host and idle seconds")
    args = ap.parse_args()
    if args.batch < 1 or args.new < 3:
        ap.error("--batch must be >= 1 and --new >= 3 (two consecutive decode steps at least)")
    if args.max_splits is not None:
        engine_model.MAX_SPLITS = args.max_splits
    kv_quantize = "int8" if args.kv == "int8" else None
    if args.offline:
        print(offline_timeline(args))
        return
    print(batch_one(args, kv_quantize) if args.batch == 1 else batched(args, kv_quantize))


if __name__ == "__main__":
    main()
