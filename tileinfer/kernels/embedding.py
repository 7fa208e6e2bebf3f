"""Launcher for cuda_src/embedding.cu."""
from ..cuda import I32, DeviceArray, kernel
from ._check import BF16, FLOAT32, INT32, expect


def embedding(tokens: DeviceArray, table: DeviceArray, out: DeviceArray, stream) -> None:
    """out[i] = table[tokens[i]] as float32; tokens outside the vocabulary give zero rows."""
    n = tokens.shape[0]
    vocab, dim = table.shape
    expect("tokens", tokens, (n,), INT32)
    expect("table", table, (vocab, dim), BF16)
    expect("out", out, (n, dim), FLOAT32)
    if dim % 8:
        raise ValueError(f"embedding: dim must be a multiple of 8, got {dim}")
    kernel("embedding.cu", "embedding").launch((n,), (128,), [tokens, table, out, I32(dim), I32(vocab)], stream)
