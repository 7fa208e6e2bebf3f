"""Timing kernels without Python's launch cost: capture many launches into one CUDA graph and time
its replays with CUDA events (the microbenchmarks' shared helper)."""
from __future__ import annotations

import statistics
from collections.abc import Callable

from tileinfer.cuda import Event, Graph, Stream


def microseconds_per_call(stream: Stream, enqueue: Callable[[Stream], None], calls: int, replays: int) -> float:
    """`enqueue(s)` launches `calls` calls on s. Run it once eagerly (loading the kernels and setting
    their attributes outside the capture), capture it, replay once to warm up, then return the
    median over `replays` timed replays of the time per call, in microseconds."""
    enqueue(stream)
    stream.synchronize()
    graph = Graph(stream, enqueue)
    start, end = Event(), Event()
    try:
        graph.launch(stream)
        times = []
        for _ in range(replays):
            start.record(stream)
            graph.launch(stream)
            end.record(stream)
            end.synchronize()
            times.append(start.elapsed_ms(end) * 1e3 / calls)
    finally:
        graph.destroy()
        start.destroy()
        end.destroy()
    return statistics.median(times)
