"""Tensor parallelism over NCCL: one process per GPU, rank 0 the engine's.

`LLM(model, tensor_parallel_size=N)` (and `tileinfer serve --tensor-parallel-size N`) starts N - 1 worker
processes (multiprocessing spawn); rank r runs on GPU ordinal + r. Rank 0 listens on a TCP address
(127.0.0.1, an ephemeral port, a random key); each worker connects, says its rank and receives the
EngineConfig and NCCL's unique id. That connection then carries everything rank 0 tells a worker.

Across hosts it is the same code with an address every host reaches: `tensor_parallel_address="HOST:PORT"`
makes rank 0 listen there and start no workers; each other rank is started by hand on its host,

    TILEINFER_TP_KEY=<the same secret everywhere> tileinfer tp-worker --address HOST:PORT --rank R --device cuda:K

and connects (the key authenticates it; rank 0 needs it in its environment too). NCCL then finds its own
way between the hosts from the unique id.

Start-up: every rank runs start_gpu (runner/startup.py) for its own shards: its communicator, its weights
(model/sharding.py's split), the warm-up on its own GPU (the collectives inside run in the same order on
every rank: it is the same code) and its pool sized from its own NVML free memory. The ranks then agree on
the smallest page count (`agree_pages`: rank 0 gathers, decides, tells), so one block table serves every
rank's pool, and every rank captures its decode graphs over that pool.

Steps: the engine drives a `TensorParallelRunner`, rank 0's GPURunner with a mirror. Each call that enqueues
device work (a launch, a verify step, copy-on-write page copies) is sent to every worker before it runs on
rank 0, its sequences as (positions, block table); a worker runs the same call on its own runner. The
scheduler and the block manager live on rank 0 only. Every rank samples the same tokens (the logits are
gathered whole on every rank, the seeds are the same) and replays its own decode graphs; only rank 0 reads
the tokens back. A worker that fails sends its error and exits; a thread of rank 0 (`watch`) sees that (or
the connection closing) at once, aborts rank 0's communicator so that no collective waits forever for the
lost rank, and rank 0's next call (reading a step's tokens included) raises WorkerError with the worker's
traceback: the engine stops rather than hang or return what an aborted step computed. The thread watches from
the moment the workers connect, so a worker that fails during start-up (its weights do not fit, say) stops
rank 0's start-up too, even while rank 0 waits inside NCCL's initialisation for a worker that will never join
(`join_communicator`: that call cannot be aborted, so it runs on a thread of its own, which is left behind);
a worker likewise stops waiting there when its connection to rank 0 closes.

Not under tensor parallelism (refused up front): speculative decoding, structured output, and `extend` /
`logits` (teacher-forced logits of a prompt).
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import queue
import socket
import threading
import time
import traceback
from multiprocessing.connection import Connection, Listener, wait

from ..config import parse_address
from ..kv import Sequence

log = logging.getLogger(__name__)

CONNECT_TIMEOUT = 300.0  # seconds a worker has to start its interpreter and connect
KEY_ENV = "TILEINFER_TP_KEY"  # the shared secret of a group whose ranks are started by hand


class WorkerError(RuntimeError):
    """A worker process failed (its traceback is in the message) or went away."""


def _rows(batch) -> list[tuple[int, list[int], list[int], int]]:
    """A step's (sequence, ids[, start]) rows as a worker rebuilds them: (positions, block table, ids, start)."""
    out = []
    for item in batch:
        seq, ids = item[0], list(item[1])
        start = item[2] if len(item) > 2 else seq.num_positions - len(ids)
        out.append((seq.num_positions, list(seq.block_table), ids, start))
    return out


def _batch(rows) -> list[tuple[Sequence, list[int], int]]:
    """The rows back as the runner takes them: each sequence a copy of rank 0's (its pages are the same ids in
    this rank's pool; no block manager of this rank owns it)."""
    out = []
    for positions, table, ids, start in rows:
        seq = Sequence()
        seq.num_positions, seq.block_table = positions, table
        out.append((seq, ids, start))
    return out


def tensor_parallel_group(config) -> "TensorParallelGroup":
    """The group of config.tensor_parallel_size ranks on GPUs device .. device + N - 1 (checked to be there),
    its workers started and connected."""
    from ..cuda.driver import NoDeviceError, device_handle
    first, world = config.gpu_ordinal, config.tensor_parallel_size
    last = first if config.tensor_parallel_address else first + world - 1  # (by hand: the others are elsewhere)
    try:
        device_handle(last)
    except NoDeviceError as e:
        raise ValueError(f"tensor_parallel_size {world} needs GPUs {first}..{first + world - 1} ({e}); give at most "
                         f"as many as the machine has") from None
    return TensorParallelGroup(config)


class TensorParallelGroup:
    """Rank 0's side of a group: the workers, a connection to each, the id of the group's communicator."""

    def __init__(self, config):
        from ..cuda.nccl import unique_id
        self.world = config.tensor_parallel_size
        self.uid = unique_id()
        self.comm = None
        self.failed: str | None = None
        self._closing = False
        self._watcher: threading.Thread | None = None
        self._pages: queue.Queue = queue.Queue()  # (rank, pages) from the workers' start-ups (the watch puts them)
        self.procs = []
        self.conns: list[Connection | None] = [None] * (self.world - 1)
        if config.tensor_parallel_address:  # the other ranks are started by hand and connect here
            host, port = parse_address(config.tensor_parallel_address)
            self._authkey = shared_key()
            self._listener = Listener((host, port), authkey=self._authkey)
        else:
            self._authkey = os.urandom(16)
            self._listener = Listener(("127.0.0.1", 0), authkey=self._authkey)
            ctx = multiprocessing.get_context("spawn")  # a fresh interpreter each: no CUDA state inherited
            self.procs = [ctx.Process(target=worker_main, args=(self._listener.address, self._authkey, rank),
                                      name=f"tileinfer-tp-rank{rank}", daemon=True) for rank in range(1, self.world)]
        try:
            for p in self.procs:
                p.start()
            self._accept()
            for conn in self.conns:
                conn.send((config, self.uid))
            self._watch_workers()
        except BaseException:
            self.close()
            raise

    def _accept(self) -> None:
        """Every worker's connection, in rank order (each says its rank first)."""
        self._listener._listener._socket.settimeout(CONNECT_TIMEOUT)  # (multiprocessing's listening socket)
        for _ in range(self.world - 1):
            try:
                conn = self._listener.accept()
            except TimeoutError:
                dead = [p.name for p in self.procs if not p.is_alive()]
                raise WorkerError(f"tensor parallelism: not every worker connected within {CONNECT_TIMEOUT:.0f} s"
                                  + (f" ({', '.join(dead)} exited)" if dead else "")) from None
            rank = conn.recv()
            if not (isinstance(rank, int) and 1 <= rank < self.world) or self.conns[rank - 1] is not None:
                conn.close()
                raise WorkerError(f"tensor parallelism: a worker connected as rank {rank!r}; a group of "
                                  f"{self.world} takes ranks 1..{self.world - 1}, each once")
            self.conns[rank - 1] = conn

    def connect(self, vocab_size: int):
        """Rank 0's place in the group (its GPU's context current): the communicator, once every rank joins
        (WorkerError at once if a worker has failed already: it would never join)."""
        from ..model.sharding import TensorParallel
        self.check()
        self.comm = join_communicator(self.uid, self.world, 0, lambda: self.failed)
        return TensorParallel(self.comm, 0, self.world, vocab_size)

    def agree_pages(self, pages: int) -> int:
        """The pool's pages on every rank: the fewest any rank has room for (WorkerError if a worker fails first)."""
        theirs = []
        while len(theirs) < self.world - 1:
            self.check()
            try:
                theirs.append(self._pages.get(timeout=0.2)[1])
            except queue.Empty:
                pass
        agreed = min([pages] + theirs)
        self.send(("pages", agreed))
        if agreed < pages:
            log.info("tensor parallelism: %d KV pages on every rank (rank 0 had room for %d)", agreed, pages)
        return agreed

    def send(self, message) -> None:
        """`message` to every worker, after checking that none has reported a failure."""
        self.check()
        for rank, conn in enumerate(self.conns, 1):
            try:
                conn.send(message)
            except OSError:
                self._fail(f"tensor-parallel rank {rank} went away")
                raise WorkerError(self.failed) from None

    def check(self) -> None:
        """WorkerError if a worker has failed (the watch notes it)."""
        if self.failed is not None:
            raise WorkerError(self.failed)

    def _watch_workers(self) -> None:
        """A thread that reads what the workers say: their pool sizes during start-up, then nothing until they are
        told to close; a failure report or a closed connection marks the group failed and aborts the
        communicator."""
        ranks = {conn: rank for rank, conn in enumerate(self.conns, 1)}
        if ranks:
            self._watcher = threading.Thread(target=self._watch, args=(ranks,), name="tileinfer-tp-watch", daemon=True)
            self._watcher.start()

    def _watch(self, ranks: dict[Connection, int]) -> None:
        while ranks and not self._closing:
            for conn in wait(list(ranks)):
                rank = ranks[conn]
                try:
                    message = conn.recv()
                except (EOFError, OSError):
                    del ranks[conn]
                    if not self._closing:
                        self._fail(f"tensor-parallel rank {rank} went away")
                    continue
                if message[0] == "pages":
                    self._pages.put((rank, message[1]))
                else:  # ("error", traceback)
                    self._fail(f"tensor-parallel rank {rank} failed:\n{message[1]}")

    def _fail(self, why: str) -> None:
        if self.failed is None:
            self.failed = why
            log.error("%s; aborting the tensor-parallel group", why)
            if self.comm is not None:
                self.comm.abort()  # rank 0's collectives stop waiting for the lost rank

    def close(self) -> None:
        """Tell the workers to stop, wait for them (then end any that hang), close the communicator."""
        self._closing = True
        for conn in self.conns:
            if conn is not None:
                try:
                    conn.send(("close",))
                except OSError:
                    pass
        for p in self.procs:
            if p.pid is not None:
                p.join(timeout=30)
                if p.is_alive():
                    p.terminate()
                    p.join(timeout=5)
        for conn in self.conns:
            if conn is not None:
                conn.close()
        self.conns = [None] * len(self.conns)
        self._listener.close()
        if self._watcher is not None:
            self._watcher.join(timeout=5)
        if self.comm is not None:
            self.comm.close()
            self.comm = None


def join_communicator(uid: bytes, world: int, rank: int, failed, poll: float = 0.05):
    """This rank's Communicator (this thread's CUDA context current), or WorkerError as soon as failed() names a
    failure: NCCL's initialisation waits for every rank and cannot be aborted before it returns, so it runs on a
    thread of its own while this one watches; a thread whose rank will never come stays behind, waiting (a
    daemon: it does not keep the process alive)."""
    from cuda.bindings import driver

    from ..cuda.driver import call
    from ..cuda.nccl import Communicator
    context = call(driver.cuCtxGetCurrent)
    result: dict = {}

    def init() -> None:
        try:
            call(driver.cuCtxSetCurrent, context)  # NCCL takes the calling thread's device
            result["comm"] = Communicator(uid, world, rank)
        except BaseException as e:  # handed to the waiting thread
            result["error"] = e

    thread = threading.Thread(target=init, name=f"tileinfer-nccl-init-rank{rank}", daemon=True)
    thread.start()
    while thread.is_alive():
        why = failed()
        if why is not None:
            raise WorkerError(f"{why}\n(rank {rank} stopped waiting for it in NCCL's initialisation)")
        thread.join(poll)
    if "error" in result:
        raise result["error"]
    return result["comm"]


class _WorkerGroup:
    """A worker's side of the group during start-up (start_gpu's `group`)."""

    def __init__(self, conn: Connection, uid: bytes, rank: int, world: int):
        self.conn, self.uid, self.rank, self.world = conn, uid, rank, world
        self.comm = None

    def connect(self, vocab_size: int):
        """This rank's place in the group: the communicator, or WorkerError if rank 0 goes away first."""
        from ..model.sharding import TensorParallel
        self.comm = join_communicator(self.uid, self.world, self.rank, self._rank0_gone)
        return TensorParallel(self.comm, self.rank, self.world, vocab_size)

    def _rank0_gone(self) -> str | None:
        """Why this worker should stop waiting for rank 0 to join, else None: its connection has closed, or
        carries a message (rank 0 sends none before every rank has joined, but for "close" when its own start-up
        failed). Peeks at the socket without taking anything from it."""
        with socket.socket(fileno=os.dup(self.conn.fileno())) as sock:
            try:
                pending = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                return None
            except OSError as e:
                return f"rank 0's connection failed ({e})"
        return "rank 0 closed the group" if pending else "rank 0 went away"

    def agree_pages(self, pages: int) -> int:
        self.conn.send(("pages", pages))
        return self.conn.recv()[1]


def shared_key() -> bytes:
    """The group's key when its ranks are started by hand: $TILEINFER_TP_KEY, the same on every host."""
    key = os.environ.get(KEY_ENV, "")
    if not key:
        raise ValueError(f"a tensor-parallel group started by hand needs a shared secret: set {KEY_ENV} to the "
                         f"same value for rank 0 and every worker")
    return key.encode()


def _connect(address, authkey: bytes) -> Connection:
    """A connection to rank 0, retried while nothing listens there yet (a worker started by hand may come first)."""
    from multiprocessing.connection import Client
    deadline = time.monotonic() + CONNECT_TIMEOUT
    while True:
        try:
            return Client(address, authkey=authkey)
        except ConnectionRefusedError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def worker_main(address, authkey: bytes, rank: int, device: str | None = None) -> str | None:
    """A worker process: connect to rank 0, start this rank's runner (on `device`, or GPU ordinal + rank of rank
    0's), then run what rank 0 sends until told to close (or rank 0 goes away). A failure is sent to rank 0
    before the process exits, and returned (its traceback); None after a normal close."""
    error = None
    conn = _connect(address, authkey)
    conn.send(rank)
    started = group = None
    try:
        config, uid = conn.recv()
        config = dataclasses.replace(config, device=device or f"cuda:{config.gpu_ordinal + rank}", progress=False)
        from .startup import start_gpu
        group = _WorkerGroup(conn, uid, rank, config.tensor_parallel_size)
        started = start_gpu(config, group=group)
        _serve(conn, started.runner)
    except (EOFError, KeyboardInterrupt):
        pass  # rank 0 is gone (or the user interrupted it): nothing to report to
    except BaseException:
        error = traceback.format_exc()
        try:
            conn.send(("error", error))
        except OSError:
            pass
    finally:
        if started is not None:
            started.runner.close()
        if group is not None and group.comm is not None:
            group.comm.close()
        conn.close()
    return error


def _serve(conn: Connection, runner) -> None:
    """Run rank 0's calls on this rank's runner, in order."""
    while True:
        message = conn.recv()
        op = message[0]
        if op == "close":
            return
        if op == "launch":
            runner.launch(_batch(message[1]), **message[2])
        elif op == "verify":
            runner.verify(_batch(message[1]), **message[2])
        elif op == "copy_pages":
            runner.cache.copy_pages(message[1], runner.stream)
        else:
            raise ValueError(f"tensor-parallel worker: unknown call {op!r}")


class TensorParallelRunner:
    """Rank 0's runner for the engine: its GPURunner, with every call that enqueues device work sent to the
    workers first (the module docstring). Everything else (collect, logits_rows, the cache and its block
    manager, the configs) is rank 0's runner's own."""

    def __init__(self, runner, group: TensorParallelGroup):
        self.local = runner
        self.group = group

    def __getattr__(self, name):
        return getattr(self.local, name)

    def _copy_pending_pages(self) -> None:
        """Copy-on-write page copies the block manager asked for, on every rank, before the step that needs them."""
        copies = self.local.cache.manager.take_pending_copies()
        if copies:
            self.group.send(("copy_pages", copies))
            self.local.cache.copy_pages(copies, self.local.stream)

    def launch(self, batch, sampling=None, *, sample: bool = True, penalties: list | None = None,
               masked: list[bool] | None = None, token_src: list[int] | None = None) -> int | None:
        if masked is not None and any(masked):
            raise ValueError("structured output is not supported with tensor parallelism")
        self.group.check()  # (before the block manager hands over its page copies)
        self._copy_pending_pages()
        options = dict(sampling=sampling, sample=sample, penalties=penalties, token_src=token_src)
        self.group.send(("launch", _rows(batch), options))
        return self.local.launch(batch, **options)

    def collect(self, slot: int | None, n: int):
        """Rank 0's tokens of a launched step, unless a worker failed meanwhile (the step was then aborted)."""
        out = self.local.collect(slot, n)
        self.group.check()
        return out

    def step(self, batch, sampling=None, *, sample: bool = True, penalties: list | None = None,
             masked: list[bool] | None = None):
        slot = self.launch(batch, sampling, sample=sample, penalties=penalties, masked=masked)
        return self.collect(slot, len(batch))

    def verify(self, batch, *, logits: str = "argmax", graph_width: int | None = None, drafted=None, meanwhile=None):
        if drafted is not None or meanwhile is not None:
            raise ValueError("verify: a DFlash drafter's drafts and context are not supported under tensor parallelism")
        self.group.check()
        self._copy_pending_pages()
        options = dict(logits=logits, graph_width=graph_width)
        self.group.send(("verify", _rows(batch), options))
        out = self.local.verify(batch, **options)
        self.group.check()
        return out

    def extend(self, *args, **kwargs):
        raise ValueError("extend (teacher-forced logits of a prompt) is not available with tensor parallelism; "
                         "generate with the LLM")

    def logits(self, *args, **kwargs):
        raise ValueError("logits (teacher-forced logits of a prompt) is not available with tensor parallelism")

    def close(self) -> None:
        """Close rank 0's runner and the group (the workers close theirs)."""
        try:
            self.local.close()
        finally:
            self.group.close()

    def __enter__(self) -> "TensorParallelRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

