"""The CUDA-graph manager: every graph a runner replays, keyed by (kind, bucket), over persistent buffers.

A decode step is ~10 kernels per layer (hundreds per step); launched one by one from Python each costs
~9 us, inside a graph ~1 us. Graphs freeze their kernel arguments, so a step's inputs must already sit in
the persistent step buffers (tileinfer/runner/step.py) and every shape is the bucket's: a batch of b
sequences replays the smallest bucket >= b, and the padding rows are no-ops for every kernel (no query
tokens, slot -1).

Kinds: "decode" (one token a sequence, a bucket per batch size), ("decode", "masked") (the same step whose
sampling first waits for the host's allowed-token bitmasks: structured output, runner/gpu.py), "prefill" and
("prefill", "masked") (one sequence's prompt step, its token rows padded to the bucket: a bucket per prompt
size, runner/gpu.py prefill_bucket) and ("verify", tokens a row, logits) (a speculative verify step: each row a
sequence's last committed token and its proposals, padded to the bucket x tokens a row). A kind is registered
with the function that enqueues one step of a bucket; the first run of (kind, bucket) runs that step eagerly
(loading every kernel it uses) and captures it.

All host planning (reserving pages, filling the step buffers) happens outside the graph.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Sequence

from tileinfer.cuda import Graph, Stream

log = logging.getLogger(__name__)

DECODE = "decode"
DECODE_MASKED = ("decode", "masked")
PREFILL = "prefill"
PREFILL_MASKED = ("prefill", "masked")


def bucket_for(batch: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds `batch` sequences."""
    for b in sorted(buckets):
        if b >= batch:
            return b
    raise ValueError(f"a batch of {batch} exceeds the largest decode bucket ({max(buckets)})")


def _label(kind: Hashable, bucket: int) -> str:
    if kind == DECODE:
        return f"the decode graph for batch {bucket}"
    if kind == PREFILL:
        return f"the prefill graph for {bucket} tokens"
    if kind == PREFILL_MASKED:
        return f"the masked prefill graph for {bucket} tokens"
    return f"the {' '.join(map(str, kind))} graph for batch {bucket}"


class GraphManager:
    """Captures `enqueue(bucket, stream)` of each registered kind once per bucket and replays it.

    An enqueue function must only launch kernels over persistent buffers (no allocation, no sync)."""

    def __init__(self):
        self._enqueue: dict[Hashable, Callable[[int, Stream], None]] = {}
        self._graphs: dict[tuple[Hashable, int], Graph] = {}
        self.capture_seconds = 0.0

    def add_kind(self, kind: Hashable, enqueue: Callable[[int, Stream], None]) -> None:
        self._enqueue[kind] = enqueue

    def has_kind(self, kind: Hashable) -> bool:
        return kind in self._enqueue

    def buckets(self, kind: Hashable) -> list[int]:
        """The buckets of `kind` captured so far."""
        return sorted(b for k, b in self._graphs if k == kind)

    def graph(self, kind: Hashable, bucket: int) -> Graph:
        return self._graphs[(kind, bucket)]

    def count(self, kind: Hashable | None = None) -> int:
        """Graphs captured (of one kind, or of every kind)."""
        return sum(1 for k, _ in self._graphs if kind is None or k == kind)

    def capture(self, stream: Stream, kind: Hashable, buckets: Sequence[int], *, progress: bool = False) -> None:
        """Capture these buckets of `kind`, largest first (with a progress bar if asked)."""
        todo = [b for b in sorted(set(buckets), reverse=True) if (kind, b) not in self._graphs]
        bar = None
        if progress and todo:
            from tqdm import tqdm
            bar = tqdm(total=len(todo), unit="graph", desc="capturing graphs", leave=False)
        try:
            for b in todo:
                start = time.perf_counter()
                enqueue = self._enqueue[kind]
                self._graphs[(kind, b)] = Graph(stream, lambda s, b=b: enqueue(b, s), label=_label(kind, b))
                seconds = time.perf_counter() - start
                self.capture_seconds += seconds
                log.info("captured %s: %d nodes in %.3f s", _label(kind, b), self._graphs[(kind, b)].num_nodes,
                         seconds)
                if bar is not None:
                    bar.update()
        finally:
            if bar is not None:
                bar.close()

    def run(self, kind: Hashable, bucket: int, stream: Stream) -> None:
        """Replay the graph of (kind, bucket). The first time, run its step eagerly instead (loading every
        kernel it uses) and capture the same launches for the steps that follow."""
        graph = self._graphs.get((kind, bucket))
        if graph is not None:
            graph.launch(stream)
        else:
            self._enqueue[kind](bucket, stream)
            self.capture(stream, kind, [bucket])

    def destroy(self) -> None:
        for g in self._graphs.values():
            g.destroy()
        self._graphs.clear()
