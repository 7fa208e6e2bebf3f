"""The decode-graph manager: one CUDA graph per batch bucket, over persistent buffers.

A decode step is ~10 kernels per layer (hundreds per step); launched one by one from Python
each costs ~9 us, inside a graph ~1 us. Graphs freeze their kernel arguments, so a step's
inputs must already sit in the persistent step buffers (tileinfer.engine.step) and every
shape is the bucket's: a batch of b sequences replays the smallest bucket >= b, and the
padding rows are no-ops for every kernel (no query tokens, slot -1).

All host planning (reserving pages, filling the step buffers) happens outside the graph.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from tileinfer.cuda import Graph, Stream

log = logging.getLogger(__name__)


def bucket_for(batch: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds `batch` sequences."""
    for b in sorted(buckets):
        if b >= batch:
            return b
    raise ValueError(f"a batch of {batch} exceeds the largest decode bucket ({max(buckets)})")


class DecodeGraphs:
    """Captures `enqueue_step(bucket, stream)` once per bucket and replays it.

    `enqueue_step` must only launch kernels over persistent buffers (no allocation, no sync).
    """

    def __init__(self, enqueue_step: Callable[[int, Stream], None], buckets: Sequence[int], *,
                 kind: str = "decode", bucket_unit: str = "batch"):
        self.enqueue_step = enqueue_step
        self.kind = kind  # a graph is named "the {kind} graph for {bucket_unit} {bucket}" in logs and errors
        self.bucket_unit = bucket_unit
        self.buckets = tuple(sorted(set(buckets)))
        self.graphs: dict[int, Graph] = {}
        self.capture_seconds = 0.0

    def capture(self, stream: Stream, buckets: Sequence[int] | None = None, *, progress: bool = False) -> None:
        """Capture the given buckets (default: all), largest first (with a progress bar if asked)."""
        todo = [b for b in sorted(buckets or self.buckets, reverse=True) if b not in self.graphs]
        bar = None
        if progress and todo:
            from tqdm import tqdm
            bar = tqdm(total=len(todo), unit="graph", desc=f"capturing {self.kind} graphs", leave=False)
        try:
            for b in todo:
                start = time.perf_counter()
                self.graphs[b] = Graph(stream, lambda s, b=b: self.enqueue_step(b, s),
                                       label=f"the {self.kind} graph for {self.bucket_unit} {b}")
                seconds = time.perf_counter() - start
                self.capture_seconds += seconds
                log.info("captured the %s graph for %s %d: %d nodes in %.3f s", self.kind, self.bucket_unit, b,
                         self.graphs[b].num_nodes, seconds)
                if bar is not None:
                    bar.update()
        finally:
            if bar is not None:
                bar.close()

    def run(self, bucket: int, stream: Stream) -> None:
        """Replay the graph for `bucket`. The first time, run its step eagerly instead (loading every
        kernel it uses) and capture the same launches for the steps that follow."""
        if bucket in self.graphs:
            self.graphs[bucket].launch(stream)
        else:
            self.enqueue_step(bucket, stream)
            self.capture(stream, [bucket])

    def destroy(self) -> None:
        for g in self.graphs.values():
            g.destroy()
        self.graphs.clear()
