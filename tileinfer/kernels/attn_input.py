"""Launcher for cuda_src/attn_input.cu (q/k RMSNorm + RoPE + store K/V at their slots)."""
from ..cuda import F32, I32, DeviceArray, kernel
from ._check import BF16, FLOAT32, INT8, INT32, cdiv, expect

HEAD_DIM = 128


def check_inputs(qkv, positions, slots, q_norm, k_norm, inv_freq, q_out, num_heads, num_kv_heads) -> int:
    """The checks both variants (and attention's fused input) share; returns the number of tokens."""
    n = qkv.shape[0]
    hd = HEAD_DIM
    expect("qkv", qkv, (n, (num_heads + 2 * num_kv_heads) * hd), BF16)
    expect("positions", positions, (n,), INT32)
    expect("slots", slots, (n,), INT32)
    expect("q_norm", q_norm, (hd,), BF16)
    expect("k_norm", k_norm, (hd,), BF16)
    expect("inv_freq", inv_freq, (hd // 2,), FLOAT32)
    expect("q_out", q_out, (n, num_heads, hd), BF16)
    return n


def attn_input(qkv: DeviceArray, positions: DeviceArray, slots: DeviceArray, q_norm: DeviceArray,
               k_norm: DeviceArray, inv_freq: DeviceArray, q_out: DeviceArray, k_pool: DeviceArray,
               v_pool: DeviceArray, num_heads: int, num_kv_heads: int, eps: float, stream) -> None:
    """qkv [n, (H + 2 KV) * 128] -> q_out [n, H, 128]; keys/values into pools [pages, KV, page_size, 128]."""
    n = check_inputs(qkv, positions, slots, q_norm, k_norm, inv_freq, q_out, num_heads, num_kv_heads)
    hd = HEAD_DIM
    pages, kv, page_size, _ = k_pool.shape
    expect("k_pool", k_pool, (pages, num_kv_heads, page_size, hd), BF16)
    expect("v_pool", v_pool, (pages, num_kv_heads, page_size, hd), BF16)
    grid = (n, cdiv(num_heads + num_kv_heads, 4))
    kernel("attn_input.cu", "attn_input").launch(
        grid, (128,), [qkv, positions, slots, q_norm, k_norm, inv_freq, q_out, k_pool, v_pool,
                       I32(num_heads), I32(num_kv_heads), I32(page_size), F32(eps)], stream)


def attn_input_int8(qkv: DeviceArray, positions: DeviceArray, slots: DeviceArray, q_norm: DeviceArray,
                    k_norm: DeviceArray, inv_freq: DeviceArray, smoothing: DeviceArray | None, q_out: DeviceArray,
                    k_pool: DeviceArray, v_pool: DeviceArray, k_scale: DeviceArray, v_scale: DeviceArray,
                    num_heads: int, num_kv_heads: int, eps: float, stream) -> None:
    """As attn_input, into an INT8 cache: pools int8 [pages, KV, page_size, 128] and scales float32
    [pages, KV, page_size] (tileinfer/kv/int8.py). smoothing: float32 [128] factors c (keys stored
    as k / c, queries written as q * c), or None for no smoothing."""
    n = check_inputs(qkv, positions, slots, q_norm, k_norm, inv_freq, q_out, num_heads, num_kv_heads)
    hd = HEAD_DIM
    if smoothing is not None:
        expect("smoothing", smoothing, (hd,), FLOAT32)
    pages, kv, page_size, _ = k_pool.shape
    expect("k_pool", k_pool, (pages, num_kv_heads, page_size, hd), INT8)
    expect("v_pool", v_pool, (pages, num_kv_heads, page_size, hd), INT8)
    expect("k_scale", k_scale, (pages, num_kv_heads, page_size), FLOAT32)
    expect("v_scale", v_scale, (pages, num_kv_heads, page_size), FLOAT32)
    grid = (n, cdiv(num_heads + num_kv_heads, 4))
    kernel("attn_input.cu", "attn_input_int8").launch(
        grid, (128,), [qkv, positions, slots, q_norm, k_norm, inv_freq, smoothing, q_out, k_pool, v_pool, k_scale,
                       v_scale, I32(num_heads), I32(num_kv_heads), I32(page_size), F32(eps)], stream)
