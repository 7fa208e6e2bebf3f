"""Launchers for cuda_src/embedding.cu.

`first` is the vocabulary id of the table's row 0: 0 for the whole vocabulary; a rank's vocab_start under
tensor parallelism (model/sharding.py), whose table holds its part of the vocabulary only."""
from ..cuda import I32, DeviceArray, kernel
from ._check import BF16, FLOAT32, INT32, UINT8, expect


def embedding(tokens: DeviceArray, table: DeviceArray, out: DeviceArray, stream, *, first: int = 0) -> None:
    """out[i] = table[tokens[i] - first] as float32; tokens outside [first, first + table rows) give zero rows."""
    n = tokens.shape[0]
    expect("tokens", tokens, (n,), INT32)
    vocab, dim = _check_table(table, out, n, "embedding")
    _check_first(first, "embedding")
    kernel("embedding.cu", "embedding").launch((n,), (128,), [tokens, table, out, I32(dim), I32(vocab), I32(first)],
                                               stream)


def resolve_tokens(tokens: DeviceArray, src: DeviceArray, sampled: DeviceArray, stream) -> None:
    """tokens[i] = sampled[src[i]] where src[i] >= 0 (a token the previous step sampled on the device)."""
    n = tokens.shape[0]
    expect("tokens", tokens, (n,), INT32)
    expect("src", src, (n,), INT32)
    expect("sampled", sampled, (sampled.shape[0],), INT32)
    kernel("embedding.cu", "resolve_tokens").launch(((n + 255) // 256,), (256,), [tokens, src, sampled, I32(n)],
                                                    stream)


def fetch_step(src: DeviceArray, dst: DeviceArray, tokens: DeviceArray, token_src: DeviceArray,
               sampled: DeviceArray, stream, *, embed: tuple[DeviceArray, DeviceArray] | None = None,
               first: int = 0) -> None:
    """dst <- src, both uint8 [n] with n a multiple of 16: src the mapped page-locked mirror of the step
    buffers (PinnedBuffer(mapped=True).device_array), read by the kernel itself; with resolve_tokens'
    work done on the way: tokens and token_src are int32 fields of dst (16-byte aligned), and
    tokens[i] becomes sampled[token_src[i]] where token_src[i] >= 0.

    embed: (table, out), out [rows, dim] float32 with rows <= len(tokens): the same launch also does
    embedding's work for the first rows tokens (out[i] = table[tokens[i] - first] after resolving, zero rows
    outside [first, first + table rows))."""
    n = dst.shape[0]
    expect("dst", dst, (n,), UINT8)
    expect("src", src, (n,), UINT8)
    if n == 0 or n % 16 or src.ptr % 16 or dst.ptr % 16:
        raise ValueError(f"fetch_step: {n} bytes at {src.ptr:#x} -> {dst.ptr:#x}: need positive multiples of 16")
    ntok = tokens.shape[0]
    expect("tokens", tokens, (ntok,), INT32)
    expect("token_src", token_src, (ntok,), INT32)
    expect("sampled", sampled, (sampled.shape[0],), INT32)
    for name, a in (("tokens", tokens), ("token_src", token_src)):
        at = a.ptr - dst.ptr
        if at % 16 or not 0 <= at <= n - a.nbytes:
            raise ValueError(f"fetch_step: {name} must be a 16-byte aligned field of dst, got offset {at} of {n}")
    n16 = n // 16
    tok0, delta = (tokens.ptr - dst.ptr) // 16, (token_src.ptr - tokens.ptr) // 16
    table, out, rows, vocab, dim = None, None, 0, 0, 0
    if embed is not None:
        table, out = embed
        rows = out.shape[0]
        if rows > ntok:
            raise ValueError(f"fetch_step: {rows} embedding rows for {ntok} token ids")
        vocab, dim = _check_table(table, out, rows, "fetch_step")
    _check_first(first, "fetch_step")
    kernel("embedding.cu", "fetch_step").launch(
        (-(-n16 // 256) + rows,), (256,),
        [src, dst, I32(n16), I32(tok0), I32(ntok), I32(delta), sampled, table, out, I32(dim), I32(vocab), I32(first)],
        stream)


def gather_states(src: DeviceArray, states: DeviceArray, last: DeviceArray | None, last_col: int,
                  out: DeviceArray, stream) -> None:
    """out[i] = states[src[i]] as bf16 (zeros where src[i] < 0); with `last` [rows, hidden] bf16, columns
    last_col..last_col + hidden - 1 of out[i] come from last[src[i]] instead. src int32 [n], states float32
    [rows, width], out bf16 [n, width]. The caller keeps src within states' rows."""
    n = src.shape[0]
    expect("src", src, (n,), INT32)
    rows, width = states.shape
    expect("states", states, (rows, width), FLOAT32)
    expect("out", out, (n, width), BF16)
    hidden = 0
    if last is not None:
        hidden = last.shape[1]
        expect("last", last, (rows, hidden), BF16)
        if last_col % 8 or not 0 <= last_col <= width - hidden:
            raise ValueError(f"gather_states: last_col {last_col} must be a multiple of 8 in [0, {width - hidden}]")
    if width % 8 or hidden % 8:
        raise ValueError(f"gather_states: widths must be multiples of 8, got {width} and {hidden}")
    if n:
        kernel("embedding.cu", "gather_states").launch(
            (n,), (128,), [src, states, last, I32(last_col), I32(hidden), out, I32(width)], stream)


def _check_table(table: DeviceArray, out: DeviceArray, rows: int, name: str) -> tuple[int, int]:
    vocab, dim = table.shape
    expect("table", table, (vocab, dim), BF16)
    expect("out", out, (rows, dim), FLOAT32)
    if dim % 8:
        raise ValueError(f"{name}: dim must be a multiple of 8, got {dim}")
    return vocab, dim


def _check_first(first: int, name: str) -> None:
    if isinstance(first, bool) or not isinstance(first, int) or not 0 <= first < 2**31:
        raise ValueError(f"{name}: first (the vocabulary id of the table's row 0) must be an int in [0, 2^31), "
                         f"got {first!r}")


def next_block_inputs(rows: DeviceArray, argmax: DeviceArray, drafted: DeviceArray, mask_token: int, page_size: int,
                      inputs, stream) -> None:
    """A DFlash block pass's step inputs, decided on the device from the verify step before it
    (cuda_src/embedding.cu next_block_inputs): rows int32 [R, 7 + W] (src, m, first, start, entry, count, out,
    then the request's block table) a request, in pass order; argmax int32 the verify step's; drafted int32
    the drafts it read; `inputs` the pass's StepInputs (block tables W pages wide), whose tokens, positions,
    slots, kv_lens, cu_q, last_rows and block tables it writes for rows 0..sum(count) (its token sources must
    be -1: the tokens are these). The caller keeps every index in range."""
    R, width = rows.shape
    expect("rows", rows, (R, width), INT32)
    W = inputs.block_tables.shape[1]
    if width != 7 + W:
        raise ValueError(f"next_block_inputs: rows of {width} ints; 7 and a block table of {W} make {7 + W}")
    expect("argmax", argmax, (argmax.shape[0],), INT32)
    expect("drafted", drafted, (drafted.shape[0],), INT32)
    if page_size < 1:
        raise ValueError(f"next_block_inputs: page_size must be positive, got {page_size}")
    if R:
        kernel("embedding.cu", "next_block_inputs").launch(
            (R,), (128,), [rows, I32(W), argmax, drafted, I32(mask_token), I32(page_size), inputs.tokens,
                           inputs.positions, inputs.slots, inputs.kv_lens, inputs.cu_q,
                           inputs.last_rows, inputs.block_tables], stream)
