"""Kernel.launch's argument packing, the launchers' shape checks and DeviceArray views, without a GPU: the
driver call is replaced by one that reads the arguments back through the pointers the launch passes, as the
driver does."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
from cuda.bindings import driver

from tileinfer.cuda import module
from tileinfer.cuda.driver import last_work
from tileinfer.cuda.memory import DeviceArray
from tileinfer.kernels._check import BF16, FLOAT32, INT32, expect


class Stream:
    handle = 7


def unlaunched_kernel(name: str) -> module.Kernel:
    """A Kernel with no module behind it: its launches go to whatever replaces module.call."""
    k = module.Kernel.__new__(module.Kernel)
    k.name, k.function, k.max_dynamic_smem = name, None, 1 << 20
    k._config = driver.CUlaunchConfig()
    k._config.numAttrs = 0
    return k


@pytest.fixture
def driver_reads(monkeypatch):
    """Each launch's (config fields, the arguments' bytes as the driver would copy them, sizes given)."""
    seen = []

    def call(fn, config, function, params, extra, detail=""):
        assert fn is driver.cuLaunchKernelEx and extra == 0
        sizes = seen_sizes[0]
        pointers = (ctypes.c_void_p * len(sizes)).from_address(params)
        args = [ctypes.string_at(pointers[i], size) for i, size in enumerate(sizes)]
        seen.append(((config.gridDimX, config.gridDimY, config.gridDimZ),
                     (config.blockDimX, config.blockDimY, config.blockDimZ), config.sharedMemBytes,
                     int(config.hStream), args, str(detail)))

    seen_sizes = [()]
    monkeypatch.setattr(module, "call", call)
    saved = last_work[0]
    yield seen, seen_sizes
    last_work[0] = saved


def test_the_driver_reads_each_argument_through_the_launch_pointers(driver_reads):
    seen, sizes = driver_reads
    x = DeviceArray((4, 8), BF16, ptr=0x7F00_0000_1000)
    tmap = (ctypes.c_uint64 * 16)(*range(100, 116))
    args = [x, None, ctypes.c_int32(-3), ctypes.c_float(0.5), ctypes.c_uint64(1 << 40), tmap, x.rows(1, 3)]
    sizes[0] = (8, 8, 4, 4, 8, 128, 8)
    unlaunched_kernel("k").launch((5, 2), (128,), args, Stream(), smem=1024)
    (grid, block, smem, stream, got, detail), = seen
    assert grid == (5, 2, 1) and block == (128, 1, 1) and smem == 1024 and stream == Stream.handle
    want = [(0x7F00_0000_1000).to_bytes(8, "little"), bytes(8), (-3).to_bytes(4, "little", signed=True),
            np.float32(0.5).tobytes(), (1 << 40).to_bytes(8, "little"), bytes(tmap),
            (0x7F00_0000_1000 + 8 * 2).to_bytes(8, "little")]
    assert got == want
    assert detail == "kernel k grid=(5, 2, 1) block=(128, 1, 1) smem=1024" == str(last_work[0])


def test_an_empty_grid_launches_nothing_and_a_bad_argument_is_named(driver_reads):
    seen, _ = driver_reads
    k = unlaunched_kernel("k")
    k.launch((0,), (128,), [ctypes.c_int32(1)], Stream())
    assert seen == []
    with pytest.raises(TypeError, match="kernel argument 3"):
        k.launch((1,), (32,), [3], Stream())


def test_packed_arguments_point_at_their_values_and_bad_ones_are_named():
    class Named(DeviceArray):  # a subclass goes as a DeviceArray does
        pass
    x, y = DeviceArray((2, 8), BF16, ptr=0x1000), Named((4,), FLOAT32, ptr=0x2000)
    scale = ctypes.c_float(2.0)
    slots = module.pack_arguments([x, None, scale, y])
    assert len(slots) == 8 and list(slots[4:]) == [0x1000, 0, 0, 0x2000]
    base = slots.buffer_info()[0]
    assert list(slots[:4]) == [base + 32, base + 40, ctypes.addressof(scale), base + 56]
    for bad in (3, 2.5, "x", np.int32(1)):
        with pytest.raises(TypeError, match="kernel argument .*: pass a DeviceArray, None, a ctypes scalar"):
            module.pack_arguments([x, bad])


def test_row_views_share_the_memory_of_their_array():
    a = DeviceArray((6, 4), FLOAT32, ptr=0x1000)
    v = a.rows(2, 5)
    assert (v.shape, v.dtype, v.nbytes, v.ptr, v.base) == ((3, 4), FLOAT32, 48, 0x1000 + 2 * 16, a)
    assert a.rows(6, 6).shape == (0, 4) and a.rows(6, 6).nbytes == 0
    v.free()  # a view never frees its array's memory
    assert a.ptr == 0x1000
    with pytest.raises(IndexError, match=r"rows\(4, 7\) out of range for shape \(6, 4\)"):
        a.rows(4, 7)


def test_expect_names_the_argument_and_what_it_should_be():
    a = DeviceArray((3, 5), BF16, ptr=0x1000)
    expect("x", a, (3, None), BF16)
    with pytest.raises(ValueError, match=r"x: expected shape \(3, 4\) bfloat16, got \(3, 5\) bfloat16"):
        expect("x", a, (3, 4), BF16)
    with pytest.raises(ValueError, match=r"x: expected shape \(3, 5\) int32, got \(3, 5\) bfloat16"):
        expect("x", a, (3, 5), INT32)
    with pytest.raises(ValueError, match="expected shape"):
        expect("x", a, (3, 5, 1), BF16)
    with pytest.raises(ValueError, match=r"slots: expected a device array of shape \(3,\), got None"):
        expect("slots", None, (3,), INT32)
