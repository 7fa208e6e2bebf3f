"""Device buffers, typed device arrays and pinned host buffers.

Everything is a plain `cuMemAlloc` allocation (no managed memory). Copies between host
and device go through pinned buffers when they must be asynchronous (the per-step upload);
one-off copies (weights, test data) may come from ordinary numpy arrays.
"""
from __future__ import annotations

import ctypes
import math

import numpy as np
from cuda.bindings import driver

from .driver import call


def _nbytes(shape, dtype) -> int:
    return int(math.prod(shape)) * np.dtype(dtype).itemsize


_live_bytes = 0  # bytes of every DeviceArray allocated and not yet freed (the memory report reads it)


def allocated_bytes() -> int:
    """Bytes this process holds in DeviceArray allocations now."""
    return _live_bytes


class DeviceArray:
    """A typed, C-contiguous device allocation: `shape`, `dtype`, `ptr` (int), `nbytes`.

    `base` is set for views (`rows`), which never free memory themselves.
    """

    def __init__(self, shape, dtype, *, ptr: int | None = None, base: "DeviceArray | None" = None):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.nbytes = _nbytes(self.shape, self.dtype)
        self.base = base
        if ptr is None:
            # A zero-byte allocation is an error in the driver: keep one byte so every array has an address.
            ptr = int(call(driver.cuMemAlloc, max(self.nbytes, 1), detail=f"{self.nbytes} bytes"))
            self._owned = True
            global _live_bytes
            _live_bytes += max(self.nbytes, 1)
        else:
            self._owned = False
        self.ptr = int(ptr)

    # -- construction ------------------------------------------------------------------
    @classmethod
    def empty(cls, shape, dtype) -> "DeviceArray":
        return cls(shape, dtype)

    @classmethod
    def from_host(cls, array: np.ndarray, stream=None) -> "DeviceArray":
        array = np.ascontiguousarray(array)
        out = cls(array.shape, array.dtype)
        out.copy_from_host(array, stream)
        return out

    @classmethod
    def zeros(cls, shape, dtype, stream=None) -> "DeviceArray":
        out = cls(shape, dtype)
        out.fill_bytes(0, stream)
        return out

    # -- copies ------------------------------------------------------------------------
    def copy_from_host(self, array: np.ndarray, stream=None) -> None:
        array = np.ascontiguousarray(array)
        if array.nbytes != self.nbytes:
            raise ValueError(f"copy_from_host: {array.nbytes} bytes into a {self.nbytes}-byte array {self.shape}")
        if stream is None:
            # Synchronous for the whole device: the engine's streams do not wait for the legacy stream.
            call(driver.cuMemcpyHtoD, self.ptr, array.ctypes.data, self.nbytes)
            call(driver.cuCtxSynchronize)
        else:
            call(driver.cuMemcpyHtoDAsync, self.ptr, array.ctypes.data, self.nbytes, stream.handle)

    def to_host(self, stream=None) -> np.ndarray:
        """Copy to a new numpy array. Synchronous: with a stream, after that stream's work; without, after
        all work on the device."""
        out = np.empty(self.shape, self.dtype)
        if stream is None:
            call(driver.cuCtxSynchronize)  # wait for kernels on every stream that may write this array
            call(driver.cuMemcpyDtoH, out.ctypes.data, self.ptr, self.nbytes)
        else:
            call(driver.cuMemcpyDtoHAsync, out.ctypes.data, self.ptr, self.nbytes, stream.handle)
            stream.synchronize()
        return out

    def fill_bytes(self, value: int, stream=None) -> None:
        """Set every byte to `value` (0 to clear; 0xFF to poison test outputs)."""
        if stream is None:
            call(driver.cuMemsetD8, self.ptr, value, self.nbytes)
            call(driver.cuCtxSynchronize)
        else:
            call(driver.cuMemsetD8Async, self.ptr, value, self.nbytes, stream.handle)

    # -- views -------------------------------------------------------------------------
    def rows(self, start: int, stop: int) -> "DeviceArray":
        """A view of rows [start, stop) along the first axis (no copy)."""
        if not 0 <= start <= stop <= self.shape[0]:
            raise IndexError(f"rows({start}, {stop}) out of range for shape {self.shape}")
        row_bytes = self.nbytes // self.shape[0] if self.shape[0] else 0
        return self._view((stop - start,) + self.shape[1:], self.dtype, self.ptr + start * row_bytes,
                          (stop - start) * row_bytes)

    def _view(self, shape: tuple, dtype: np.dtype, ptr: int, nbytes: int) -> "DeviceArray":
        """A view made without __init__'s conversions (rows: shape, dtype and size already known); the
        forward pass takes a few hundred of them a step."""
        out = DeviceArray.__new__(DeviceArray)
        out.shape, out.dtype, out.nbytes, out.base, out._owned, out.ptr = shape, dtype, nbytes, self, False, ptr
        return out

    def view(self, shape, dtype=None) -> "DeviceArray":
        """The same bytes with another shape (and dtype); sizes must agree."""
        dtype = self.dtype if dtype is None else np.dtype(dtype)
        if _nbytes(shape, dtype) != self.nbytes:
            raise ValueError(f"view {shape} {dtype} does not match {self.shape} {self.dtype}")
        return DeviceArray(shape, dtype, ptr=self.ptr, base=self)

    # -- lifetime ----------------------------------------------------------------------
    def free(self) -> None:
        if self._owned and self.ptr:
            call(driver.cuMemFree, self.ptr)
            global _live_bytes
            _live_bytes -= max(self.nbytes, 1)
        self.ptr = 0
        self._owned = False

    def __repr__(self) -> str:
        return f"DeviceArray(shape={self.shape}, dtype={self.dtype}, ptr=0x{self.ptr:x})"


def copy_columns(dst: DeviceArray, dst_col: int, src: DeviceArray, src_col: int, cols: int, stream) -> None:
    """dst[:, dst_col: dst_col + cols] = src[:, src_col: src_col + cols] for 2-D arrays of one dtype and one
    row count: one device-to-device cuMemcpy2DAsync (each row a piece of its pitch), which a stream being
    captured takes as a graph node. No-op for cols 0."""
    if len(dst.shape) != 2 or len(src.shape) != 2 or dst.dtype != src.dtype or dst.shape[0] != src.shape[0]:
        raise ValueError(f"copy_columns: needs 2-D arrays of one dtype and row count, got {dst.dtype} {dst.shape} "
                         f"<- {src.dtype} {src.shape}")
    if cols < 0 or not (0 <= dst_col <= dst.shape[1] - cols and 0 <= src_col <= src.shape[1] - cols):
        raise ValueError(f"copy_columns: {cols} columns from {src_col} of {src.shape} to {dst_col} of {dst.shape}")
    if cols == 0 or dst.shape[0] == 0:
        return
    item = dst.dtype.itemsize
    p = driver.CUDA_MEMCPY2D()
    p.srcMemoryType = p.dstMemoryType = driver.CUmemorytype.CU_MEMORYTYPE_DEVICE
    p.srcDevice, p.srcXInBytes, p.srcPitch = src.ptr, src_col * item, src.shape[1] * item
    p.dstDevice, p.dstXInBytes, p.dstPitch = dst.ptr, dst_col * item, dst.shape[1] * item
    p.WidthInBytes, p.Height = cols * item, dst.shape[0]
    call(driver.cuMemcpy2DAsync, p, stream.handle, detail=f"{dst.shape[0]} rows of {cols * item} bytes")


class PinnedBuffer:
    """Page-locked host memory viewed as a numpy array (for asynchronous copies). mapped=True also maps
    it into the device's address space: kernels write it directly at `device_ptr` (device_array())."""

    def __init__(self, nbytes: int, *, mapped: bool = False):
        self.nbytes = int(nbytes)
        flags = int(driver.CU_MEMHOSTALLOC_DEVICEMAP) if mapped else 0
        self.ptr = int(call(driver.cuMemHostAlloc, max(self.nbytes, 1), flags, detail=f"{self.nbytes} bytes"))
        self.device_ptr = int(call(driver.cuMemHostGetDevicePointer, self.ptr, 0)) if mapped else 0
        raw = (ctypes.c_uint8 * max(self.nbytes, 1)).from_address(self.ptr)
        self.bytes = np.ctypeslib.as_array(raw)[: self.nbytes]

    def array(self, shape, dtype, offset: int = 0) -> np.ndarray:
        """A numpy view of part of the buffer."""
        n = _nbytes(shape, dtype)
        if offset + n > self.nbytes:
            raise ValueError(f"pinned view of {n} bytes at {offset} exceeds {self.nbytes}")
        return self.bytes[offset: offset + n].view(dtype).reshape(shape)

    def device_array(self, shape, dtype) -> DeviceArray:
        """The mapped buffer as kernels address it (mapped=True only; the array does not own it)."""
        if not self.device_ptr:
            raise ValueError("device_array needs a PinnedBuffer(mapped=True)")
        if _nbytes(shape, dtype) > self.nbytes:
            raise ValueError(f"device view of {_nbytes(shape, dtype)} bytes exceeds {self.nbytes}")
        return DeviceArray(shape, dtype, ptr=self.device_ptr)

    def free(self) -> None:
        if self.ptr:
            self.bytes = None
            call(driver.cuMemFreeHost, self.ptr)
            self.ptr = 0
