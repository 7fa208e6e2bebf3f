"""Our own safetensors reader and writer.

The format: an 8-byte little-endian header length N, N bytes of UTF-8 JSON, then the data section.
The JSON maps each tensor name to {"dtype", "shape", "data_offsets": [begin, end]} with offsets
relative to the start of the data section, plus an optional "__metadata__" object of strings.

Why not the `safetensors` package: numpy has no bfloat16, so its numpy reader cannot return the
weights we actually load, and we want every header field checked with a message that names the
file, the tensor and the problem. The reader never trusts a number from the file before checking
it against the file's size, so no input bytes can make it read out of bounds.
"""
from __future__ import annotations

import json
import math
import mmap
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

# A header larger than this is not a weights file anyone wrote on purpose.
MAX_HEADER_BYTES = 100 * 1024 * 1024

DTYPES: dict[str, np.dtype] = {
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F16": np.dtype(np.float16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I8": np.dtype(np.int8),
    "I16": np.dtype(np.int16),
    "I32": np.dtype(np.int32),
    "I64": np.dtype(np.int64),
    "U8": np.dtype(np.uint8),
    "U16": np.dtype(np.uint16),
    "U32": np.dtype(np.uint32),
    "U64": np.dtype(np.uint64),
    "BOOL": np.dtype(np.bool_),
}
DTYPE_NAMES: dict[np.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}


class SafetensorsError(ValueError):
    """A file that is not a valid safetensors file; the message starts with its path."""


@dataclass(slots=True, frozen=True)
class TensorInfo:
    """Where one tensor lives: `offset` is absolute in `path`, so a loader can read it directly."""
    name: str
    dtype: str             # safetensors name: "BF16", "F32", ...
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    path: Path


# ----------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------

class SafetensorsFile:
    """A validated safetensors file, memory-mapped; `read` returns zero-copy, read-only arrays."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        with open(self.path, "rb") as f:
            file_size = os.fstat(f.fileno()).st_size
            header, data_start = _read_header(f, file_size, self.path)
            # mmap cannot map an empty range; a file whose data section is empty needs no map.
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) if file_size > data_start else None
        self.metadata, self.tensors = _parse_header(header, data_start, file_size - data_start, self.path)

    def read(self, name: str) -> np.ndarray:
        info = self.tensors.get(name)
        if info is None:
            raise KeyError(f"{self.path}: no tensor named {name!r}")
        dtype = DTYPES[info.dtype]
        count = info.nbytes // dtype.itemsize
        if count == 0:
            return np.zeros(info.shape, dtype)
        return np.frombuffer(self._map, dtype=dtype, count=count, offset=info.offset).reshape(info.shape)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __repr__(self) -> str:
        return f"SafetensorsFile({str(self.path)!r}, {len(self.tensors)} tensors)"


def _read_header(f, file_size: int, path: Path) -> tuple[bytes, int]:
    if file_size < 8:
        raise SafetensorsError(f"{path}: file is {file_size} bytes, shorter than the 8-byte header length")
    header_len = int.from_bytes(f.read(8), "little")
    if header_len > MAX_HEADER_BYTES:
        raise SafetensorsError(f"{path}: header length {header_len} is larger than the "
                               f"{MAX_HEADER_BYTES}-byte limit; the file is corrupt or not safetensors")
    if 8 + header_len > file_size:
        raise SafetensorsError(f"{path}: header length {header_len} runs past the end of the "
                               f"{file_size}-byte file (truncated download?)")
    return f.read(header_len), 8 + header_len


def _parse_header(raw: bytes, data_start: int, data_size: int, path: Path):
    try:
        header = json.loads(raw.decode("utf-8"), object_pairs_hook=_reject_duplicate_keys)
    except UnicodeDecodeError as e:
        raise SafetensorsError(f"{path}: header is not valid UTF-8 ({e})") from None
    except (ValueError, RecursionError) as e:     # JSONDecodeError is a ValueError
        raise SafetensorsError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(f"{path}: header must be a JSON object, got {type(header).__name__}")
    metadata = _parse_metadata(header.pop("__metadata__", {}), path)
    tensors = {name: _parse_entry(name, entry, data_start, data_size, path) for name, entry in header.items()}
    _check_no_overlap(tensors.values(), path)
    return metadata, tensors


def _reject_duplicate_keys(pairs: list) -> dict:
    seen = {}
    for key, value in pairs:
        if key in seen:
            raise ValueError(f"duplicate key {key!r}")
        seen[key] = value
    return seen


def _parse_metadata(metadata, path: Path) -> dict[str, str]:
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SafetensorsError(f"{path}: __metadata__ must be an object of string values, got {_brief(metadata)}")
    return metadata


def _parse_entry(name: str, entry, data_start: int, data_size: int, path: Path) -> TensorInfo:
    def fail(problem: str):
        raise SafetensorsError(f"{path}: tensor {name!r}: {problem}")

    if not isinstance(entry, dict):
        fail(f"entry must be an object, got {type(entry).__name__}")
    dtype = entry.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        fail(f"unknown dtype {_brief(dtype)} (known: {', '.join(DTYPES)})")
    shape = entry.get("shape")
    if not isinstance(shape, list) or not all(_is_count(d) for d in shape):
        fail(f"shape must be a list of non-negative integers, got {_brief(shape)}")
    # numpy limits: at most 64 axes, and even an empty array's nonzero axes must fit its size type.
    if len(shape) > 64 or math.prod(d for d in shape if d) * DTYPES[dtype].itemsize >= 2**63:
        fail(f"shape {_brief(shape)} is beyond what an array can have")
    offsets = entry.get("data_offsets")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_count(o) for o in offsets):
        fail(f"data_offsets must be two non-negative integers, got {_brief(offsets)}")
    begin, end = offsets
    if end < begin:
        fail(f"data_offsets end {end} is before begin {begin}")
    if end > data_size:
        fail(f"data_offsets end {end} is beyond the {data_size}-byte data section (truncated file?)")
    expected = math.prod(shape) * DTYPES[dtype].itemsize
    if end - begin != expected:
        fail(f"holds {end - begin} bytes but shape {shape} of {dtype} needs {expected}")
    return TensorInfo(name, dtype, tuple(shape), data_start + begin, end - begin, path)


def _brief(value) -> str:
    """A JSON value for an error message: short, and never a deep recursion (repr of a value nested
    almost as deep as the JSON parser allows could overflow the stack)."""
    items = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    if any(isinstance(item, (list, dict)) for item in items):
        return f"a nested {type(value).__name__}"
    text = repr(value)
    return text if len(text) <= 100 else text[:97] + "..."


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_no_overlap(infos: Iterable[TensorInfo], path: Path) -> None:
    previous = None
    for info in sorted((i for i in infos if i.nbytes), key=lambda i: i.offset):
        if previous is not None and info.offset < previous.offset + previous.nbytes:
            raise SafetensorsError(f"{path}: tensor {info.name!r} overlaps tensor {previous.name!r} "
                                   f"in the data section")
        previous = info


# ----------------------------------------------------------------------------------------------
# Writing
# ----------------------------------------------------------------------------------------------

def write_safetensors(path: str | Path, tensors: Mapping[str, np.ndarray],
                      metadata: Mapping[str, str] | None = None) -> None:
    """Write `tensors` in their mapping order, array by array (no giant bytes object)."""
    arrays = {name: np.asarray(arr) for name, arr in tensors.items()}
    layout = {name: (arr.dtype, arr.shape) for name, arr in arrays.items()}
    write_safetensors_streamed(path, layout, arrays.values(), metadata)


def write_safetensors_streamed(path: str | Path, layout: Mapping[str, tuple[np.dtype, tuple[int, ...]]],
                               chunks: Iterable[np.ndarray], metadata: Mapping[str, str] | None = None) -> None:
    """Write a file whose tensors (`layout`: name -> (dtype, shape), in file order) arrive as `chunks`.

    Each chunk is a piece of one tensor in row-major order; a tensor may come in several chunks,
    but a chunk never spans two tensors. This lets a producer generate a 16 GB file piece by piece.
    The file appears under its name only when complete (temp file, then rename).
    """
    path = Path(path)
    header, sizes = _encode_header(layout, metadata, path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(len(header).to_bytes(8, "little"))
            f.write(header)
            _write_chunks(f, layout, sizes, chunks, path)
        os.replace(tmp, path)   # no fsync: the point is never to leave a half-written file under `path`
    finally:
        tmp.unlink(missing_ok=True)


def _encode_header(layout, metadata, path: Path) -> tuple[bytes, list[int]]:
    metadata = {"format": "pt"} if metadata is None else dict(metadata)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError(f"{path}: metadata keys and values must be strings, got {metadata!r}")
    header: dict = {"__metadata__": metadata}
    sizes, offset = [], 0
    for name, (dtype, shape) in layout.items():
        dtype = _native(dtype)
        if name == "__metadata__" or dtype not in DTYPE_NAMES:
            raise ValueError(f"{path}: cannot write tensor {name!r} of dtype {dtype} "
                             f"(supported: {', '.join(str(d) for d in DTYPE_NAMES)})")
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": [int(d) for d in shape],
                        "data_offsets": [offset, offset + nbytes]}
        sizes.append(nbytes)
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    # Pad with spaces to a multiple of 8 so the data section starts aligned.
    return encoded + b" " * (-len(encoded) % 8), sizes


def _write_chunks(f, layout: Mapping, sizes: list[int], chunks: Iterable[np.ndarray], path: Path) -> None:
    # Empty tensors take no bytes and so need no chunk; empty chunks are skipped for the same reason.
    pending = [(name, _native(dtype), size) for (name, (dtype, _)), size in zip(layout.items(), sizes) if size]
    index, written = 0, 0
    for chunk in chunks:
        if chunk.nbytes == 0:
            continue
        if index == len(pending):
            raise ValueError(f"{path}: more data than the layout's {len(sizes)} tensors hold")
        name, dtype, size = pending[index]
        if _native(chunk.dtype) != dtype or written + chunk.nbytes > size:
            raise ValueError(f"{path}: a chunk of {chunk.nbytes} bytes of {chunk.dtype} does not fit tensor "
                             f"{name!r} ({size - written} bytes of {dtype} still to write)")
        f.write(_little_endian_bytes(chunk))
        written += chunk.nbytes
        if written == size:
            index, written = index + 1, 0
    if index < len(pending):
        name, _, size = pending[index]
        raise ValueError(f"{path}: data ended with tensor {name!r} incomplete ({written} of {size} bytes)")


def _native(dtype) -> np.dtype:
    return np.dtype(dtype).newbyteorder("=")


def _little_endian_bytes(arr: np.ndarray) -> memoryview:
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    # A uint8 view works for every dtype, ml_dtypes' bfloat16 included, and copies nothing when
    # the array is already contiguous.
    return memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))
