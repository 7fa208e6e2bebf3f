"""NCCL collectives on TileInfer's own streams, for tensor parallelism: nccl4py's low-level bindings over the
libnccl of the nvidia-nccl-cu13 wheel (`pip install tileinfer[tp]`).

    uid = unique_id()                          # on rank 0: 128 bytes, handed to every rank (a pipe on one
                                               # host; across hosts, a TCP rendezvous)
    comm = Communicator(uid, world_size, rank) # on each rank, its GPU's context current
    comm.all_reduce(x, stream)                 # in place: x summed over the ranks
    comm.all_gather(part, whole, stream)       # whole = every rank's part, in rank order
    comm.close()

The calls only enqueue work on the stream, as a kernel launch does, so a CUDA graph captured on that stream
holds them with the kernels around them (a sharded model's decode graph holds its all-reduces).

NVLink SHARP stays off (NCCL_NVLS_ENABLE=0, set before NCCL reads its environment at the first communicator):
its multicast objects can put a shared machine's GPUs out of service.
"""
from __future__ import annotations

import ctypes
import os

import ml_dtypes
import numpy as np

from .memory import DeviceArray

UNIQUE_ID_BYTES = 128  # NCCL_UNIQUE_ID_BYTES


def _bindings():
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    try:
        import nccl.bindings.nccl as nb
    except ImportError as e:
        raise ImportError(f"tensor parallelism needs NCCL's Python bindings ({e}): pip install tileinfer[tp] "
                          f"(nccl4py and nvidia-nccl-cu13)") from None
    return nb


def _data_type(dtype: np.dtype) -> int:
    nb = _bindings()
    types = {np.dtype(np.float32): nb.DataType.Float32, np.dtype(np.float16): nb.DataType.Float16,
             np.dtype(ml_dtypes.bfloat16): nb.DataType.Bfloat16, np.dtype(np.int32): nb.DataType.Int32,
             np.dtype(np.int64): nb.DataType.Int64, np.dtype(np.uint8): nb.DataType.Uint8}
    if dtype not in types:
        raise TypeError(f"NCCL collectives here take {', '.join(str(t) for t in types)} arrays, not {dtype}")
    return int(types[dtype])


def unique_id() -> bytes:
    """A new communicator's id (rank 0 makes it; every rank passes the same bytes to Communicator)."""
    uid = _bindings().get_unique_id()
    return ctypes.string_at(uid.ptr, UNIQUE_ID_BYTES)


class Communicator:
    """One rank's NCCL communicator over `world_size` ranks, each on its own GPU (NCCL refuses two ranks
    of one communicator on one GPU)."""

    def __init__(self, uid: bytes, world_size: int, rank: int):
        if not isinstance(uid, bytes) or len(uid) != UNIQUE_ID_BYTES:
            raise ValueError(f"a communicator's id is the {UNIQUE_ID_BYTES} bytes unique_id() returns, got "
                             f"{type(uid).__name__} of length {len(uid) if isinstance(uid, bytes) else '?'}")
        if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
            raise ValueError(f"rank {rank!r} of world_size {world_size!r}: "
                             "need 0 <= rank < world_size, world_size >= 1")
        nb = _bindings()
        self.world_size, self.rank = world_size, rank
        self._comm = nb.comm_init_rank(world_size, nb.UniqueId.from_buffer(bytearray(uid)), rank)

    def _check(self, what: str, *arrays: DeviceArray) -> None:
        if self._comm is None:
            raise RuntimeError(f"{what}: the communicator is closed")
        for a in arrays:
            if not isinstance(a, DeviceArray):
                raise TypeError(f"{what} takes DeviceArrays, got {type(a).__name__}")

    def all_reduce(self, x: DeviceArray, stream, out: DeviceArray | None = None) -> None:
        """out (default x, in place) = x summed element by element over the ranks; enqueued on `stream`."""
        out = x if out is None else out
        self._check("all_reduce", x, out)
        if out.shape != x.shape or out.dtype != x.dtype:
            raise ValueError(f"all_reduce: out is {out.dtype} {out.shape}, x is {x.dtype} {x.shape}")
        nb = _bindings()
        nb.all_reduce(x.ptr, out.ptr, int(np.prod(x.shape)), _data_type(x.dtype), int(nb.RedOp.Sum), self._comm,
                      int(stream.handle))

    def all_gather(self, part: DeviceArray, whole: DeviceArray, stream) -> None:
        """whole = every rank's `part`, one after another in rank order (whole holds world_size parts)."""
        self._check("all_gather", part, whole)
        n = int(np.prod(part.shape))
        if whole.dtype != part.dtype or int(np.prod(whole.shape)) != n * self.world_size:
            raise ValueError(f"all_gather: whole is {whole.dtype} {whole.shape}, needs {self.world_size} parts of "
                             f"{part.dtype} {part.shape}")
        _bindings().all_gather(part.ptr, whole.ptr, n, _data_type(part.dtype), self._comm, int(stream.handle))

    def abort(self) -> None:
        """Abort the communicator from any thread: collectives waiting for a rank that is gone return instead of
        waiting forever (what they computed is garbage; the group cannot be used again). Idempotent."""
        if self._comm is not None:
            comm, self._comm = self._comm, None
            _bindings().comm_abort(comm)

    def close(self) -> None:
        """Free the communicator (after the work enqueued with it has finished). Idempotent."""
        if self._comm is not None:
            _bindings().comm_destroy(self._comm)
            self._comm = None

    def __enter__(self) -> "Communicator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
