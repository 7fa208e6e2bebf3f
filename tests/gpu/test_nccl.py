"""NCCL collectives on our streams (tileinfer/cuda/nccl.py), on one GPU: a communicator of one rank (NCCL puts
no two ranks of a communicator on one GPU), its all-reduce and all-gather eager and captured into a CUDA graph
after a memset, the id handed over as bytes, NVLink SHARP off."""
from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

from tileinfer.cuda import DeviceArray, Graph

pytestmark = pytest.mark.gpu
pytest.importorskip("nccl.bindings.nccl", reason="nccl4py is not installed (pip install tileinfer[tp])")

from tileinfer.cuda.nccl import Communicator, unique_id  # noqa: E402


@pytest.fixture
def comm(device):
    with Communicator(unique_id(), 1, 0) as c:
        yield c


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_one_rank_all_reduce_and_all_gather_give_back_its_data(comm, stream, dtype):
    rng = np.random.default_rng(3)
    host = rng.standard_normal((7, 129)).astype(dtype)  # an awkward size
    x, out, whole = DeviceArray.from_host(host), DeviceArray.empty((7, 129), dtype), DeviceArray.empty((7, 129), dtype)
    comm.all_reduce(x, stream, out=out)
    comm.all_gather(x, whole, stream)
    assert np.array_equal(out.to_host(stream), host) and np.array_equal(whole.to_host(stream), host)
    comm.all_reduce(x, stream)  # in place
    assert np.array_equal(x.to_host(stream), host)
    assert os.environ["NCCL_NVLS_ENABLE"] == "0"


def test_an_all_reduce_captured_in_a_graph_reads_its_buffer_at_each_replay(comm, stream):
    """out poisoned, then the all-reduce of x into out, captured once; each replay gives what x holds then."""
    n = 4096
    x, out = DeviceArray.empty((n,), np.float32), DeviceArray.empty((n,), np.float32)

    def enqueue(s):
        out.fill_bytes(0xFF, s)
        comm.all_reduce(x, s, out=out)
    graph = Graph(stream, enqueue, "memset + all-reduce")
    try:
        for seed in (1, 2):
            values = np.random.default_rng(seed).standard_normal(n).astype(np.float32)
            x.copy_from_host(values, stream)
            graph.launch(stream)
            assert np.array_equal(out.to_host(stream), values)
    finally:
        graph.destroy()


def test_bad_arguments_are_refused_before_nccl(device):
    with pytest.raises(ValueError, match="128 bytes"):
        Communicator(b"short", 1, 0)
    with pytest.raises(ValueError, match="0 <= rank < world_size"):
        Communicator(unique_id(), 2, 2)
    with Communicator(unique_id(), 1, 0) as c:
        with pytest.raises(TypeError, match="NCCL collectives here take"):
            c.all_reduce(DeviceArray.empty((4,), np.float64), None)
    with pytest.raises(RuntimeError, match="closed"):
        c.all_reduce(DeviceArray.empty((4,), np.float32), None)
