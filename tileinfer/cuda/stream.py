"""Streams, events and CUDA graphs captured from a stream."""
from __future__ import annotations

from cuda.bindings import driver

from .driver import call, last_work


class Stream:
    """A non-blocking stream (graph capture needs a stream other than the legacy default one)."""

    def __init__(self):
        self.handle = call(driver.cuStreamCreate, int(driver.CUstream_flags.CU_STREAM_NON_BLOCKING))

    def synchronize(self) -> None:
        call(driver.cuStreamSynchronize, self.handle)

    def wait(self, event: "Event") -> None:
        """Work enqueued here from now on waits for `event`'s last record (in a graph capture: a dependency on
        what came before that record, which also brings this stream into the capture)."""
        call(driver.cuStreamWaitEvent, self.handle, event.handle, 0)

    def is_capturing(self) -> bool:
        """Whether a graph capture is recording this stream."""
        status = call(driver.cuStreamIsCapturing, self.handle)
        return status == driver.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE

    def destroy(self) -> None:
        if self.handle is not None:
            call(driver.cuStreamDestroy, self.handle)
            self.handle = None


class Event:
    def __init__(self, timing: bool = True):
        flags = 0 if timing else int(driver.CUevent_flags.CU_EVENT_DISABLE_TIMING)
        self.handle = call(driver.cuEventCreate, flags)

    def record(self, stream: Stream, *, external: bool = False) -> None:
        """Record on `stream`. During graph capture, external=True makes it an event-record node of
        the graph (a timestamp at each replay) instead of a capture dependency marker; outside a
        capture (where the driver rejects the flag) it is a plain record."""
        if external and stream.is_capturing():
            flags = int(driver.CUevent_record_flags.CU_EVENT_RECORD_EXTERNAL)
            call(driver.cuEventRecordWithFlags, self.handle, stream.handle, flags)
        else:
            call(driver.cuEventRecord, self.handle, stream.handle)

    def synchronize(self) -> None:
        call(driver.cuEventSynchronize, self.handle)

    def elapsed_ms(self, end: "Event") -> float:
        """Milliseconds from this event to `end` (both recorded and complete)."""
        return float(call(driver.cuEventElapsedTime, self.handle, end.handle))

    def destroy(self) -> None:
        if self.handle is not None:
            call(driver.cuEventDestroy, self.handle)
            self.handle = None


class Graph:
    """An executable graph captured from everything `fn(stream)` enqueues on `stream`.

    Kernel parameters (pointers, sizes) are frozen at capture; whatever changes between
    replays must be read by the kernels from device buffers.
    """

    def __init__(self, stream: Stream, fn, label: str = "a CUDA graph"):
        mode = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL
        call(driver.cuStreamBeginCapture, stream.handle, mode)
        try:
            fn(stream)
        except BaseException:
            # End the capture so the stream is usable again, then re-raise the real error.
            err, graph = driver.cuStreamEndCapture(stream.handle)
            if err == driver.CUresult.CUDA_SUCCESS and graph is not None:
                driver.cuGraphDestroy(graph)
            raise
        self.graph = call(driver.cuStreamEndCapture, stream.handle)
        self.exec = call(driver.cuGraphInstantiate, self.graph, 0)
        self.num_nodes = call(driver.cuGraphGetNodes, self.graph, 0)[1]
        self.label = f"{label} ({self.num_nodes} nodes)"

    def launch(self, stream: Stream) -> None:
        last_work[0] = self.label
        call(driver.cuGraphLaunch, self.exec, stream.handle, detail=self.label)

    def destroy(self) -> None:
        if self.exec is not None:
            call(driver.cuGraphExecDestroy, self.exec)
            call(driver.cuGraphDestroy, self.graph)
            self.exec = self.graph = None
