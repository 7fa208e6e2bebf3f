"""Tensor parallelism's processes and plumbing (runner/tensor_parallel.py) without a GPU: the options checked
before anything starts, a step's sequences as a worker rebuilds them, the worker's dispatch over a real pipe,
and rank 0's mirror sending every device call before it runs. The GPU side at world size 1 is
tests/gpu/test_tensor_parallel.py (and, on two GPUs, the same file's group tests)."""
from __future__ import annotations

import threading
from multiprocessing import Pipe

import numpy as np
import pytest

from tileinfer import LLM, SamplingParams, StructuredOutputs
from tileinfer.config import EngineConfig
from tileinfer.engine.engine import Engine
from tileinfer.kv import BlockManager, Sequence
from tileinfer.runner.cpu import CPURunner
from tileinfer.runner.step import SamplingRow
from tileinfer.runner.tensor_parallel import TensorParallelRunner, WorkerError, _batch, _rows, _serve


def test_the_options_are_checked_before_anything_starts(tiny_checkpoint):
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        EngineConfig(model=tiny_checkpoint, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="the CPU runner runs it whole"):
        EngineConfig(model=tiny_checkpoint, device="cpu", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="speculative decoding"):
        EngineConfig(model=tiny_checkpoint, draft_model=tiny_checkpoint, tensor_parallel_size=2)
    # the tiny model has 2 KV heads: 3 ranks cannot split its cache (checked from config.json, no GPU touched)
    with pytest.raises(ValueError, match="does not divide the model's 2 KV heads .* choose one of 1, 2"):
        LLM(tiny_checkpoint, tensor_parallel_size=3, progress=False)


def test_a_steps_sequences_reach_a_worker_as_they_are():
    manager = BlockManager(num_pages=32, page_size=4)
    a, b = Sequence(), Sequence()
    manager.reserve(a, 9)
    manager.reserve(b, 2)
    manager.reserve(a, 3)  # a's pages interleave with b's
    batch = [(a, [5, 6, 7], 9), (b, [1, 2])]  # the second as a pair: its last reserved positions
    rows = _rows(batch)
    assert rows == [(12, a.block_table, [5, 6, 7], 9), (2, b.block_table, [1, 2], 0)]
    rebuilt = _batch(rows)
    for (seq, ids, start), (orig, want_ids, want_start) in zip(rebuilt, [(a, [5, 6, 7], 9), (b, [1, 2], 0)]):
        assert (seq.num_positions, seq.block_table, ids, start) == (orig.num_positions, orig.block_table,
                                                                    want_ids, want_start)
        # a worker's own manager (no pages of its own taken) computes the same slots from the copy
        theirs = BlockManager(num_pages=32, page_size=4)
        np.testing.assert_array_equal(theirs.slots(seq, start, len(ids)), manager.slots(orig, start, len(ids)))


class _Recorder:
    """A runner (and its cache) that records the calls a worker makes."""

    def __init__(self):
        self.calls = []
        self.stream = "stream"
        self.cache = self

    def launch(self, batch, **options):
        self.calls.append(("launch", _rows(batch), options))
        return 0

    def verify(self, batch, **options):
        self.calls.append(("verify", _rows(batch), options))

    def copy_pages(self, copies, stream):
        self.calls.append(("copy_pages", copies, stream))

    def collect(self, slot, n):
        self.calls.append(("collect", slot, n))
        return np.arange(n)


def test_a_worker_runs_rank_0s_calls_in_order_until_told_to_close():
    ours, theirs = Pipe()
    runner = _Recorder()
    worker = threading.Thread(target=_serve, args=(theirs, runner))
    worker.start()
    rows = [(3, [7], [11], 2)]
    options = dict(sampling=[SamplingRow(temperature=0.5, seed=3)], sample=True, penalties=None, token_src=[1])
    ours.send(("copy_pages", [(1, 4)]))
    ours.send(("launch", rows, options))
    ours.send(("verify", rows, dict(logits="argmax", graph_width=5)))
    ours.send(("close",))
    worker.join(timeout=10)
    assert not worker.is_alive()
    (sampling,) = runner.calls[1][2].pop("sampling")  # (a SamplingRow compares by identity: its fields here)
    assert vars(sampling) == vars(options.pop("sampling")[0])
    assert runner.calls == [("copy_pages", [(1, 4)], "stream"), ("launch", rows, options),
                            ("verify", rows, dict(logits="argmax", graph_width=5))]


class _Group:
    def __init__(self, log):
        self.log, self.failed = log, None

    def check(self):
        if self.failed:
            raise WorkerError(self.failed)

    def send(self, message):
        self.check()
        self.log.append(("sent",) + message)


def test_rank_0_sends_every_device_call_before_it_runs_it():
    log = []
    local = _Recorder()
    local.calls = log
    manager = BlockManager(num_pages=16, page_size=4, enable_prefix_caching=True)
    local.manager = manager
    runner = TensorParallelRunner(local, _Group(log))
    seq = Sequence()
    manager.reserve(seq, 5)
    manager._pending_copies = [(2, 9)]  # what a copy-on-write leaves for the next step
    assert runner.step([(seq, [4], 4)]) == [0]
    rows = [(5, seq.block_table, [4], 4)]
    options = dict(sampling=None, sample=True, penalties=None, token_src=None)
    assert log == [("sent", "copy_pages", [(2, 9)]), ("copy_pages", [(2, 9)], "stream"),
                   ("sent", "launch", rows, options), ("launch", rows, options), ("collect", 0, 1)]
    with pytest.raises(ValueError, match="structured output is not supported with tensor parallelism"):
        runner.launch([(seq, [4], 4)], masked=[True])
    with pytest.raises(ValueError, match="not available with tensor parallelism"):
        runner.extend(seq, [1, 2])
    runner.group.failed = "tensor-parallel rank 1 failed:\nTraceback ..."
    with pytest.raises(WorkerError, match="rank 1 failed"):
        runner.verify([(seq, [4], 4)])


def test_structured_output_is_refused_under_tensor_parallelism(tiny_checkpoint):
    runner = CPURunner(tiny_checkpoint)
    runner.ensure_cache(64, page_size=16)
    config = EngineConfig(model=tiny_checkpoint, tensor_parallel_size=2)  # a GPU config: nothing starts here
    engine = Engine(config, runner, runner.tokenizer, runner.eos_token_ids)
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(json_object=True))
    with pytest.raises(ValueError, match="structured output is not supported with tensor_parallel_size > 1"):
        engine.make_request([1, 2, 3], params)


def test_a_worker_that_cannot_start_reports_why(tiny_checkpoint, monkeypatch):
    # A real worker process (spawned, connected over 127.0.0.1 with the group's key, handed the config), on a
    # machine where its GPU cannot be opened: rank 0 gets the worker's traceback instead of waiting for it.
    # (NCCL's id is only passed along here: the worker fails before it would join a communicator.)
    import tileinfer.cuda.nccl as nccl
    from tileinfer.runner.tensor_parallel import TensorParallelGroup
    monkeypatch.setattr(nccl, "unique_id", lambda: bytes(range(128)))
    config = EngineConfig(model=tiny_checkpoint, device="cuda:7", tensor_parallel_size=2, progress=False)
    group = TensorParallelGroup(config)
    try:
        assert [p.name for p in group.procs] == ["tileinfer-tp-rank1"] and group.conns[0] is not None
        with pytest.raises(WorkerError, match="(?s)tensor-parallel rank 1 failed:.*Traceback.*start_gpu"):
            group.agree_pages(10)
    finally:
        group.close()
    assert not group.procs[0].is_alive() and group.procs[0].exitcode == 0


def test_a_rank_started_by_hand_connects_with_the_shared_key(tiny_checkpoint, monkeypatch):
    # The multi-host path on one host: rank 0 listens at tensor_parallel_address and starts no worker; rank 1 is
    # `tileinfer tp-worker` started by hand (before rank 0 listens: it retries), authenticated by the shared key.
    # Its GPU (cuda:7 here) cannot be opened, so it reports why, as a worker on another host would.
    import socket
    import subprocess
    import sys
    import tileinfer.cuda.nccl as nccl
    from tileinfer.runner.tensor_parallel import TensorParallelGroup
    monkeypatch.setattr(nccl, "unique_id", lambda: bytes(range(128)))
    monkeypatch.setenv("TILEINFER_TP_KEY", "a shared secret")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    worker = subprocess.Popen([sys.executable, "-m", "tileinfer", "tp-worker", "--address", f"127.0.0.1:{port}",
                               "--rank", "1", "--device", "cuda:7"], stderr=subprocess.PIPE, text=True)
    try:
        config = EngineConfig(model=tiny_checkpoint, tensor_parallel_size=2, progress=False,
                              tensor_parallel_address=f"127.0.0.1:{port}")
        group = TensorParallelGroup(config)
        try:
            assert group.procs == [] and group.conns[0] is not None
            with pytest.raises(WorkerError, match="(?s)tensor-parallel rank 1 failed:.*Traceback"):
                group.agree_pages(10)
        finally:
            group.close()
        assert worker.wait(timeout=60) == 1
        assert "tensor-parallel rank 1 failed (rank 0 was told)" in worker.stderr.read()
    finally:
        if worker.poll() is None:
            worker.kill()
    with pytest.raises(ValueError, match="tensor_parallel_address must be HOST:PORT"):
        EngineConfig(model=tiny_checkpoint, tensor_parallel_size=2, tensor_parallel_address="nowhere")
    with pytest.raises(ValueError, match="needs tensor_parallel_size >= 2"):
        EngineConfig(model=tiny_checkpoint, tensor_parallel_address="127.0.0.1:9")


def test_a_failed_worker_stops_rank_0_instead_of_letting_it_wait(tiny_checkpoint, monkeypatch):
    # Rank 0's watch thread reads a worker's failure the moment it arrives: the group is failed from then on, so
    # rank 0 does not join a communicator the worker will never join, and reading a step's tokens or launching
    # one raises instead of waiting. (The worker fails when it opens its GPU; a later failure reports the same
    # way.)
    import tileinfer.cuda.nccl as nccl
    from tileinfer.runner.tensor_parallel import TensorParallelGroup
    monkeypatch.setattr(nccl, "unique_id", lambda: bytes(range(128)))
    group = TensorParallelGroup(EngineConfig(model=tiny_checkpoint, device="cuda:7", tensor_parallel_size=2,
                                             progress=False))
    try:
        group._watcher.join(timeout=120)  # the worker reported, then closed its connection
        assert group.failed.startswith("tensor-parallel rank 1 failed:") and "NoDeviceError" in group.failed
        with pytest.raises(WorkerError, match="rank 1 failed"):
            group.connect(151936)
        runner = TensorParallelRunner(_Recorder(), group)
        with pytest.raises(WorkerError, match="rank 1 failed"):
            runner.collect(0, 1)
        with pytest.raises(WorkerError, match="rank 1 failed"):
            runner.launch([], sample=False)
    finally:
        group.close()


def test_a_failure_aborts_the_communicator_once():
    # What lets rank 0's collectives return when a rank is lost mid-step: the first failure aborts the
    # communicator (from the watch thread), later ones only stand.
    from tileinfer.runner.tensor_parallel import TensorParallelGroup

    class Comm:
        aborted = 0

        def abort(self):
            Comm.aborted += 1
    group = TensorParallelGroup.__new__(TensorParallelGroup)
    group.failed, group.comm = None, Comm()
    group._fail("tensor-parallel rank 2 went away")
    group._fail("tensor-parallel rank 3 went away")
    assert Comm.aborted == 1 and group.failed == "tensor-parallel rank 2 went away"
    with pytest.raises(WorkerError, match="rank 2 went away"):
        group.check()


def test_rank_0_stops_waiting_in_nccls_initialisation_when_a_worker_fails(monkeypatch):
    # NCCL's initialisation waits for every rank and cannot be aborted before it returns: join_communicator runs it
    # on a thread of its own and raises as soon as the group is failed, leaving that thread behind. A stand-in
    # communicator whose initialisation waits (for a rank that never comes, here: an event) shows it, on the CPU.
    import tileinfer.cuda.driver as cuda_driver
    import tileinfer.cuda.nccl as nccl
    from tileinfer.runner.tensor_parallel import join_communicator
    release, entered = threading.Event(), threading.Event()
    made = []

    class Waiting:
        def __init__(self, uid, world, rank):
            entered.set()
            release.wait(60)
            made.append((uid, world, rank))

    monkeypatch.setattr(cuda_driver, "call", lambda fn, *args: None)  # (the context calls)
    monkeypatch.setattr(nccl, "Communicator", Waiting)
    failure = []
    threading.Timer(0.3, lambda: failure.append("tensor-parallel rank 1 failed:\nboom")).start()
    with pytest.raises(WorkerError, match=r"rank 1 failed:\nboom\n\(rank 0 stopped waiting for it in NCCL's"):
        join_communicator(b"u", 2, 0, lambda: failure[0] if failure else None, poll=0.01)
    assert entered.is_set() and not made  # it gave up while the initialisation still waited
    release.set()
    # every rank joined: the communicator; a failed initialisation: its own error
    assert isinstance(join_communicator(b"u", 2, 0, lambda: None), Waiting) and made[-1] == (b"u", 2, 0)

    class Refused:
        def __init__(self, uid, world, rank):
            raise RuntimeError("NCCL error: invalid usage")
    monkeypatch.setattr(nccl, "Communicator", Refused)
    with pytest.raises(RuntimeError, match="invalid usage"):
        join_communicator(b"u", 2, 0, lambda: None)


def test_a_worker_stops_waiting_in_nccls_initialisation_when_rank_0_goes_away(monkeypatch):
    # The worker's side: its connection to rank 0 closing (rank 0 died before joining) ends the wait, and so does
    # a message waiting on it (rank 0 sends nothing before every rank has joined but "close", when its own
    # start-up failed); the peek takes nothing from the connection.
    import tileinfer.cuda.driver as cuda_driver
    import tileinfer.cuda.nccl as nccl
    from tileinfer.runner.tensor_parallel import _WorkerGroup
    release = threading.Event()

    class Waiting:
        def __init__(self, uid, world, rank):
            release.wait(60)

    monkeypatch.setattr(cuda_driver, "call", lambda fn, *args: None)
    monkeypatch.setattr(nccl, "Communicator", Waiting)
    rank0, worker = Pipe()
    group = _WorkerGroup(worker, b"u", 1, 2)
    assert group._rank0_gone() is None
    rank0.send(("close",))
    assert group._rank0_gone() == "rank 0 closed the group" and worker.recv() == ("close",)  # message untouched
    assert group._rank0_gone() is None
    threading.Timer(0.3, rank0.close).start()
    try:
        with pytest.raises(WorkerError, match=r"rank 0 went away\n\(rank 1 stopped waiting for it in NCCL's"):
            group.connect(151936)
    finally:
        release.set()
        worker.close()
