"""Our safetensors reader/writer against the `safetensors` package, plus malformed and fuzzed files."""
from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors
import safetensors.numpy
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tileinfer.model.safetensors_io import (
    MAX_HEADER_BYTES, SafetensorsError, SafetensorsFile, write_safetensors, write_safetensors_streamed,
)


def raw_file(header, data: bytes = b"") -> bytes:
    """Header (a dict, or text/bytes taken as is) and data section, framed as safetensors."""
    if isinstance(header, dict):
        header = json.dumps(header)
    if isinstance(header, str):
        header = header.encode("utf-8")
    return struct.pack("<Q", len(header)) + header + data


def write_raw(tmp_path, content: bytes):
    path = tmp_path / "t.safetensors"
    path.write_bytes(content)
    return path


# ---------------------------------------------------------------------------------------------- round trips

def test_f32_f16_round_trip_with_the_safetensors_package(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"a.weight": rng.standard_normal((3, 5)).astype(np.float32),
               "b": rng.standard_normal(7).astype(np.float16),
               "scalar": np.array(2.5, np.float32),
               "empty": np.zeros((0, 4), np.float16)}
    ours = tmp_path / "ours.safetensors"
    write_safetensors(ours, tensors)
    theirs = safetensors.numpy.load_file(ours)
    for name, value in tensors.items():
        np.testing.assert_array_equal(theirs[name], value)
        assert theirs[name].dtype == value.dtype

    written_by_package = tmp_path / "theirs.safetensors"
    safetensors.numpy.save_file(tensors, written_by_package, metadata={"format": "pt"})
    reader = SafetensorsFile(written_by_package)
    assert reader.metadata == {"format": "pt"}
    for name, value in tensors.items():
        np.testing.assert_array_equal(reader.read(name), value)
        assert reader.read(name).dtype == value.dtype


def test_bf16_bit_patterns_survive_both_ways(tmp_path):
    bits = np.array([0x3F80, 0xC000, 0x7F80, 0xFF80, 0x7FC1, 0x0001, 0x8000, 0x1234], np.uint16)  # 1, -2, inf, -inf, nan, ...
    weights = bits.view(ml_dtypes.bfloat16).reshape(2, 4)
    path = tmp_path / "bf16.safetensors"
    write_safetensors(path, {"w": weights})
    [(name, entry)] = safetensors.deserialize(path.read_bytes())
    assert (name, entry["dtype"], entry["shape"]) == ("w", "BF16", [2, 4])
    assert bytes(entry["data"]) == bits.astype("<u2").tobytes()

    back = SafetensorsFile(path).read("w")
    assert back.dtype == ml_dtypes.bfloat16 and back.shape == (2, 4)
    np.testing.assert_array_equal(back.view(np.uint16).ravel(), bits)

    spec = safetensors.TensorSpec(dtype="bfloat16", shape=[2, 4], data_ptr=bits.ctypes.data, data_len=bits.nbytes)
    (tmp_path / "pkg.safetensors").write_bytes(safetensors.serialize({"w": spec}, metadata={"format": "pt"}))
    np.testing.assert_array_equal(SafetensorsFile(tmp_path / "pkg.safetensors").read("w").view(np.uint16).ravel(), bits)


def test_reads_are_zero_copy_and_read_only(tmp_path):
    path = tmp_path / "x.safetensors"
    write_safetensors(path, {"x": np.arange(6, dtype=np.float32)})
    array = SafetensorsFile(path).read("x")
    assert not array.flags.writeable and not array.flags.owndata


def test_header_is_padded_and_tensors_keep_their_order(tmp_path):
    path = tmp_path / "x.safetensors"
    write_safetensors(path, {"z": np.zeros(3, np.float32), "a": np.ones(1, np.float16)}, metadata={"k": "v"})
    content = path.read_bytes()
    header_len = struct.unpack("<Q", content[:8])[0]
    assert header_len % 8 == 0
    header = json.loads(content[8:8 + header_len])
    assert header["__metadata__"] == {"k": "v"}
    assert list(header) == ["__metadata__", "z", "a"]
    assert header["z"]["data_offsets"] == [0, 12] and header["a"]["data_offsets"] == [12, 14]
    info = SafetensorsFile(path).tensors["a"]
    assert (info.dtype, info.shape, info.offset, info.nbytes, info.path) == ("F16", (1,), 8 + header_len + 12, 2, path)


def test_streamed_writer_checks_chunks_against_the_layout(tmp_path):
    path = tmp_path / "s.safetensors"
    layout = {"a": (np.float32, (2, 3)), "b": (np.float16, (4,))}
    pieces = [np.arange(4, dtype=np.float32), np.arange(4, 6, dtype=np.float32), np.ones(4, np.float16)]
    write_safetensors_streamed(path, layout, iter(pieces))
    np.testing.assert_array_equal(SafetensorsFile(path).read("a"), np.arange(6, dtype=np.float32).reshape(2, 3))

    with pytest.raises(ValueError, match="does not fit tensor 'a'"):
        write_safetensors_streamed(path, layout, iter([np.zeros(6, np.float16)]))
    with pytest.raises(ValueError, match="tensor 'b' incomplete"):
        write_safetensors_streamed(path, layout, iter(pieces[:2]))
    with pytest.raises(ValueError, match="more data"):
        write_safetensors_streamed(path, layout, iter(pieces + pieces[:1]))
    assert not list(tmp_path.glob(".*tmp*")), "a failed write must not leave its temp file"
    np.testing.assert_array_equal(SafetensorsFile(path).read("b"), np.ones(4, np.float16))  # old file intact


def test_big_endian_input_is_written_little_endian(tmp_path):
    path = tmp_path / "be.safetensors"
    write_safetensors(path, {"x": np.arange(3, dtype=">f4")})
    np.testing.assert_array_equal(safetensors.numpy.load_file(path)["x"], np.arange(3, dtype=np.float32))


# ---------------------------------------------------------------------------------------------- malformed files

GOOD_ENTRY = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}

MALFORMED = [
    # (description, file bytes, message fragment)
    ("too short", b"\x01\x02\x03", "shorter than the 8-byte header length"),
    ("header past end", struct.pack("<Q", 100) + b"{}", "runs past the end"),
    ("absurd header", struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}", "larger than"),
    ("huge u64 header", b"\xff" * 8 + b"{}", "larger than"),
    ("bad utf-8", raw_file(b'{"a\xff": 1}'), "not valid UTF-8"),
    ("bad json", raw_file('{"x": '), "not valid JSON"),
    ("deep json", raw_file("[" * 100_000), "not valid JSON"),
    ("duplicate key", raw_file('{"x": {}, "x": {}}'), "duplicate key"),
    ("not an object", raw_file("[1, 2]"), "must be a JSON object"),
    ("entry not object", raw_file({"w": [1]}), "'w': entry must be an object"),
    ("unknown dtype", raw_file({"w": {**GOOD_ENTRY, "dtype": "F17"}}, bytes(8)), "'w': unknown dtype 'F17'"),
    ("missing dtype", raw_file({"w": {"shape": [2], "data_offsets": [0, 8]}}, bytes(8)), "'w': unknown dtype None"),
    ("negative dim", raw_file({"w": {**GOOD_ENTRY, "shape": [-2]}}, bytes(8)), "'w': shape must be a list"),
    ("float dim", raw_file({"w": {**GOOD_ENTRY, "shape": [2.0]}}, bytes(8)), "'w': shape must be a list"),
    ("bool dim", raw_file({"w": {**GOOD_ENTRY, "shape": [True, 2]}}, bytes(8)), "'w': shape must be a list"),
    ("too many axes", raw_file({"w": {**GOOD_ENTRY, "shape": [1] * 65 + [2]}}, bytes(8)), "beyond what an array can have"),
    ("empty but huge", raw_file({"w": {**GOOD_ENTRY, "shape": [0, 2**62], "data_offsets": [0, 0]}}), "beyond what an array"),
    ("shape not list", raw_file({"w": {**GOOD_ENTRY, "shape": 2}}, bytes(8)), "'w': shape must be a list"),
    ("one offset", raw_file({"w": {**GOOD_ENTRY, "data_offsets": [0]}}, bytes(8)), "'w': data_offsets must be two"),
    ("string offsets", raw_file({"w": {**GOOD_ENTRY, "data_offsets": ["0", "8"]}}, bytes(8)), "data_offsets must be two"),
    ("negative offset", raw_file({"w": {**GOOD_ENTRY, "data_offsets": [-8, 0]}}, bytes(8)), "data_offsets must be two"),
    ("end before begin", raw_file({"w": {**GOOD_ENTRY, "data_offsets": [8, 0]}}, bytes(8)), "'w': data_offsets end 0 is before begin 8"),
    ("end past data", raw_file({"w": GOOD_ENTRY}, bytes(4)), "'w': data_offsets end 8 is beyond the 4-byte data section"),
    ("size mismatch", raw_file({"w": {**GOOD_ENTRY, "shape": [3]}}, bytes(8)), "'w': holds 8 bytes but shape [3] of F32 needs 12"),
    ("overlap", raw_file({"a": GOOD_ENTRY, "b": {**GOOD_ENTRY, "data_offsets": [4, 12]}}, bytes(12)), "'b' overlaps tensor 'a'"),
    ("metadata not strings", raw_file({"__metadata__": {"format": 1}}), "__metadata__ must be an object of string values"),
    ("metadata not object", raw_file({"__metadata__": "pt"}), "__metadata__ must be an object"),
]


@pytest.mark.parametrize("content, fragment", [case[1:] for case in MALFORMED], ids=[case[0] for case in MALFORMED])
def test_malformed_files_raise_errors_naming_the_problem(tmp_path, content, fragment):
    path = write_raw(tmp_path, content)
    with pytest.raises(SafetensorsError) as caught:
        SafetensorsFile(path)
    message = str(caught.value)
    assert message.startswith(str(path)), message
    assert fragment in message, message


def test_valid_edge_cases_open(tmp_path):
    header = {"__metadata__": {}, "empty": {"dtype": "BF16", "shape": [0, 3], "data_offsets": [8, 8]},
              "w": GOOD_ENTRY, "u8": {"dtype": "U8", "shape": [], "data_offsets": [8, 9]}}
    file = SafetensorsFile(write_raw(tmp_path, raw_file(header, struct.pack("<2f", 1.5, -2.0) + b"\x07")))
    assert file.read("empty").shape == (0, 3)
    np.testing.assert_array_equal(file.read("w"), [1.5, -2.0])
    assert file.read("u8").shape == () and file.read("u8") == 7
    with pytest.raises(KeyError, match="no tensor named 'nope'"):
        file.read("nope")


# ---------------------------------------------------------------------------------------------- fuzzing

def _valid_file() -> bytes:
    header = {"__metadata__": {"format": "pt"},
              "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
              "b": {"dtype": "BF16", "shape": [3], "data_offsets": [16, 22]},
              "c": {"dtype": "I64", "shape": [1], "data_offsets": [24, 32]}}
    return raw_file(header, bytes(range(32)))


VALID = _valid_file()

# A valid file with one splice (replace bytes at a position) and a possible truncation: cheap to
# draw, and it reaches every check, from the length prefix to the tensor offsets.
mutated_files = st.builds(
    lambda at, cut, insert, keep: (VALID[:at] + insert + VALID[at + cut:])[:keep],
    st.integers(0, len(VALID)), st.integers(0, 8), st.binary(max_size=8), st.integers(0, len(VALID) + 8),
)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=4,
)
plausible_entries = st.fixed_dictionaries({}, optional={
    "dtype": st.sampled_from(["F32", "BF16", "F16", "U8", "BOOL", "F8_E4M3", "X", ""]) | json_values,
    "shape": st.lists(st.integers(-1, 5) | st.sampled_from([0, 2**31, 2**62, 2**64]), max_size=3) | json_values,
    "data_offsets": st.lists(st.integers(-1, 40), min_size=0, max_size=3) | json_values,
})
json_headers = st.builds(
    lambda header, data, length_delta: _frame(header, data, length_delta),
    st.dictionaries(st.sampled_from(["a", "b", "c", "__metadata__"]) | st.text(max_size=3),
                    plausible_entries | json_values, max_size=4) | json_values,
    st.binary(max_size=48),
    st.sampled_from([0, 0, 0, -1, 1, 2**63]),
)


def _frame(header, data: bytes, length_delta: int) -> bytes:
    encoded = json.dumps(header, allow_nan=True).encode()
    length = max(0, min(len(encoded) + length_delta, 2**64 - 1))
    return struct.pack("<Q", length) + encoded + data


@pytest.fixture(scope="module")
def fuzz_path(tmp_path_factory):
    return tmp_path_factory.mktemp("fuzz") / "f.safetensors"


FUZZED_FILES = mutated_files | json_headers | st.binary(max_size=64)
FUZZ_SETTINGS = dict(deadline=None, database=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


# 1,000 files here; scripts/fuzz_safetensors.py runs the same check on as many as asked (100,000 by default).
@settings(max_examples=1_000, **FUZZ_SETTINGS)
@given(content=FUZZED_FILES)
def test_fuzzed_files_either_open_or_raise_safetensors_error(fuzz_path, content):
    check_opens_or_raises(fuzz_path, content)


def check_opens_or_raises(fuzz_path, content: bytes) -> None:
    """`content` written to fuzz_path either opens, every tensor readable in bounds, or raises a
    SafetensorsError naming the file."""
    fuzz_path.write_bytes(content)
    try:
        file = SafetensorsFile(fuzz_path)
    except SafetensorsError as e:
        assert str(e).startswith(str(fuzz_path))
        return
    for name, info in file.tensors.items():       # a file that opened must be readable in bounds
        array = file.read(name)
        assert array.nbytes == info.nbytes and array.shape == info.shape
        assert info.offset + info.nbytes <= len(content)
