"""Where a speculative round's wall time goes on the host: `LLM.generate` over the demo's held-out chats, batch 1,
greedy, with a perf_counter mark at each phase of every round (the engine step, the acceptance, propose, the
verify step, the drafter's context pass, every graph launch and every wait for the device), printed as the
median round of the most common shape, each mark in microseconds after the previous round's verify step
returned.

    python scripts/speculation_timeline.py [--draft tileinfer/demo/dflash] [--device cuda] [--tokens 128]

A round's marks: the wait that ends the verify step ("wait<" before "accept>"), the acceptance, the next
engine step, propose (a DFlash pass launched ahead is taken there without a launch), the verify step's
staging up to its graph launch, the work launched behind it (the context pass, a pass drafted ahead), and
the wait for the step. The host's part of a round is what lies between the waits.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

from tileinfer import LLM, SamplingParams
from tileinfer.cuda import Event, Graph
from tileinfer.demo import DFLASH, TARGET
from tileinfer.model.checkpoint import Checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the scripts beside this one
from demo_checks import PINNED, PROMPTS, chat_ids  # noqa: E402


def rounds_of(marks: list[tuple[str, float]]) -> list[list[tuple[str, float]]]:
    """The marks between consecutive returns of the verify step, each (label, seconds after the first)."""
    rounds, current, end = [], [], None
    for label, t in marks:
        if end is not None:
            current.append((label, t - end))
        if label == "verify<":
            if end is not None:
                rounds.append(current)
            current, end = [], t
    return rounds


def median_round(rounds: list[list[tuple[str, float]]]) -> tuple[list[str], list[float], int]:
    """The most common sequence of labels (numbered where one repeats), the median time of each, its count."""
    shapes = defaultdict(list)
    for r in rounds:
        seen = defaultdict(int)
        labels = []
        for label, _ in r:
            seen[label] += 1
            labels.append(f"{label}#{seen[label]}")
        shapes[tuple(labels)].append([t for _, t in r])
    labels, times = max(shapes.items(), key=lambda kv: len(kv[1]))
    return list(labels), [statistics.median(v[i] for v in times) for i in range(len(labels))], len(times)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--draft", default=str(DFLASH), help="the drafter (default: the demo's DFlash drafter)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=128, help="tokens a chat")
    ap.add_argument("--passes", type=int, default=3, help="passes over the chats; the fastest is shown")
    ap.add_argument("--chats", type=int, default=len(PINNED + PROMPTS), help="how many of the held-out chats")
    args = ap.parse_args(argv)

    checkpoint = Checkpoint.open(TARGET)
    tokenizer = checkpoint.tokenizer()
    prompts = [chat_ids(checkpoint, tokenizer, q) for q in (PINNED + PROMPTS)[:args.chats]]
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    marks: list[tuple[str, float]] = []

    def mark(label: str) -> None:
        marks.append((label, time.perf_counter()))

    def around(obj, name: str, label: str) -> None:
        f = getattr(obj, name)

        def timed(*a, **k):
            mark(label + ">")
            try:
                return f(*a, **k)
            finally:
                mark(label + "<")
        setattr(obj, name, timed)

    launch, synchronize = Graph.launch, Event.synchronize

    def graph_launch(self, stream) -> None:
        mark("launch " + self.label.split(" (")[0])
        launch(self, stream)

    with LLM(TARGET, device=args.device, max_num_seqs=4, max_context=1024, progress=False,
             draft_model=args.draft) as llm:
        llm.generate([prompts[0]], params)  # captures the graphs
        engine = llm.engine
        around(engine, "step", "step")
        around(engine, "_accept_round", "accept")
        around(engine.runner, "verify", "verify")
        around(engine.drafter, "propose", "propose")
        if hasattr(engine.drafter, "add_context"):
            around(engine.drafter, "add_context", "context")
        Graph.launch = graph_launch
        Event.synchronize = lambda self: (mark("wait>"), synchronize(self), mark("wait<"))[1]
        try:
            best = None
            for _ in range(args.passes):
                marks.clear()
                start = time.perf_counter()
                outs = [llm.generate([q], params)[0] for q in prompts]
                seconds = time.perf_counter() - start
                if best is None or seconds < best[0]:
                    best = seconds, list(marks), sum(o.speculation.target_steps for o in outs)
        finally:
            Graph.launch, Event.synchronize = launch, synchronize
    seconds, kept, steps = best
    labels, times, count = median_round(rounds_of(kept))
    tokens = len(prompts) * args.tokens
    print(f"{args.draft}: {tokens} tokens in {seconds * 1e3:.1f} ms ({tokens / seconds:,.0f} tok/s), {steps} target "
          f"steps; the median round of the most common shape ({count} rounds), us after the last verify returned:")
    previous = 0.0
    for label, t in zip(labels, times):
        print(f"  {label:40s} {t * 1e6:8.1f}  (+{(t - previous) * 1e6:6.1f})")
        previous = t
    return dict(tok_s=tokens / seconds, target_steps=steps, rounds=count, labels=labels,
                us=[t * 1e6 for t in times])


if __name__ == "__main__":
    main()
