"""Tensor parallelism's GPU forward at world size 1 (runner/gpu.py tensor_parallel=, model/forward.py tp=).

A GPURunner in a one-rank NCCL group loads its shards through ShardedCheckpoint and runs every collective of the
sharded forward: the embedding's all-reduce (after prefill's embedding launch, and after the decode graphs'
fetch_step), two all-reduces a layer, the LM head's all-gather and column copies into the whole vocabulary's
logits. Over the same checkpoint (the tiny preset: tied embeddings) it must give what the plain runner gives:
prefill by `extend` (every row's logits), then greedy decode steps through the decode graphs, at batch 1 and 5
(padded to its bucket of 8), both runners fed the plain runner's tokens.
  - batch_invariant=True: bitwise the same logits and tokens (a one-rank all-reduce adds nothing; both runners
    run the same products).
  - default kernels: bitwise too, but for the steps of 3-32 rows. There the plain runner takes the next norm's
    statistics from the residual products' epilogue and the sharded one (which must all-reduce the residual
    first) runs the rmsnorm kernel, so bf16 roundings fall elsewhere: logits within TOLERANCE of each row's
    spread (on an H200: at most 0.021, on average 0.0024), the same greedy tokens but at a near tie (the plain
    logits' top two closer than twice the largest difference found).
The communicator is the caller's: it still works after the runner closed.

What a rank past 0 runs that rank 0 does not, without NCCL: its embedding of a vocabulary slice (table row 0 is
token `first`; tokens outside give zero rows), in the embedding kernel and in fetch_step; and its o_proj and
down_proj (the "f32" epilogue over the residual; the all-reduce adds rank 0's old residual back), on every
route bitwise what the "residual" epilogue gives; and the copy of each gathered part's real columns into the
whole vocabulary's logits at its range's offset (copy_columns), nothing else written."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_helpers import linear_weight, rand_bf16, seed_of, to_f32
from tileinfer.cuda import DeviceArray, PinnedBuffer
from tileinfer.cuda.memory import copy_columns
from tileinfer.graphs import bucket_for
from tileinfer.kernels import embedding, fetch_step, linear
from tileinfer.kernels.routing import SWAP_DEFAULT_ROWS
from tileinfer.kv import Sequence
from tileinfer.model.forward import EPI_NORM_MAX_ROWS
from tileinfer.model.sharding import TensorParallel, vocab_part, vocab_range
from tileinfer.runner.gpu import GPURunner, decode_buckets
from tileinfer.runner.step import SamplingRow

pytestmark = pytest.mark.gpu

STEPS = 6                                      # decode steps after the prefill
MAX_SEQS = 8                                   # decode buckets 1, 2, 4 and 8
PROMPTS = {1: [45], 5: [2, 9, 33, 70, 130]}    # prompt lengths by batch: GEMV, swap-AB and TMA GEMM row counts
# Default kernels, steps whose norm statistics the plain runner takes from the epilogue: |sharded - plain| over
# each row's std of the plain logits, at most and on average.
TOLERANCE, MEAN_TOLERANCE = 0.05, 0.005


@pytest.fixture(scope="module")
def comm(device):
    pytest.importorskip("nccl.bindings.nccl", reason="nccl4py is not installed (pip install tileinfer[tp])")
    from tileinfer.cuda.nccl import Communicator, unique_id
    with Communicator(unique_id(), 1, 0) as c:
        yield c


def prompts_of(lengths: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(seed_of("tp prompts", *lengths))
    return [rng.integers(0, 151643, n).tolist() for n in lengths]


def greedy(model: GPURunner, prompts: list[list[int]], fed: np.ndarray | None = None) -> tuple[list, np.ndarray]:
    """Prefill each prompt, then STEPS greedy decode steps of the whole batch fed the tokens sampled (or fed[k]
    at step k). Returns (logits: each prompt's [len, vocab], then each step's [batch, vocab]; tokens
    [STEPS + 1, batch]: the prefill logits' argmax, then each step's samples)."""
    cache = model.ensure_cache(1024, page_size=16)
    seqs = [Sequence() for _ in prompts]
    rows = [SamplingRow() for _ in prompts]
    try:
        logits = [model.extend(seq, prompt) for seq, prompt in zip(seqs, prompts)]
        tokens = [np.array([int(block[-1].argmax()) for block in logits], np.int32)]
        for k in range(STEPS):
            step_in = tokens[-1] if fed is None else fed[k]
            for seq in seqs:
                cache.manager.reserve(seq, 1)
            tokens.append(model.step([(s, [int(t)]) for s, t in zip(seqs, step_in)], rows))
            logits.append(model.logits_rows(len(seqs)))
    finally:
        for seq in seqs:
            cache.manager.release(seq)
    return logits, np.stack(tokens)


@pytest.mark.parametrize("batch_invariant", [True, False], ids=["invariant", "default"])
def test_one_rank_gives_the_plain_runners_logits_and_tokens(tiny_checkpoint, comm, stream, batch_invariant):
    options = dict(max_num_seqs=MAX_SEQS, batch_invariant=batch_invariant, progress=False)
    with GPURunner(tiny_checkpoint, **options) as plain:
        want = {b: greedy(plain, prompts_of(lengths)) for b, lengths in PROMPTS.items()}
        config, logits_shape = plain.config, plain.workspace.logits.shape
    tp = TensorParallel(comm, 0, 1, config.vocab_size)
    with GPURunner(tiny_checkpoint, tensor_parallel=tp, **options) as sharded:
        assert sharded.config == config and sharded.local_config.vocab_size == config.vocab_size
        assert sharded.workspace.head_keys is None and sharded.workspace.logits.shape == logits_shape
        for b, lengths in PROMPTS.items():
            want_logits, want_tokens = want[b]
            logits, tokens = greedy(sharded, prompts_of(lengths), fed=want_tokens)
            if batch_invariant:
                for i, (got, ref) in enumerate(zip(logits, want_logits)):
                    assert np.array_equal(got, ref), f"batch {b}, logits block {i}: not bitwise the plain runner's"
                np.testing.assert_array_equal(tokens, want_tokens)
            else:
                check_close(logits, want_logits, tokens, want_tokens, b)
        assert sharded.graphs.count() == 2, "the decode graphs of buckets 1 and 8 were not captured"
    check_comm_works(comm, stream)


def check_close(logits: list, want_logits: list, tokens: np.ndarray, want_tokens: np.ndarray, b: int) -> None:
    """Bitwise the plain logits where the plain step took no norm statistics from the epilogue, within TOLERANCE
    of their spread where it did; tokens equal but at a near tie of the plain logits."""
    steps = PROMPTS[b] + [bucket_for(b, decode_buckets(MAX_SEQS))] * STEPS  # each logits block's step rows
    errors = []
    for i, (n, got, ref) in enumerate(zip(steps, logits, want_logits)):
        assert got.shape == ref.shape and np.isfinite(got).all()
        if not epilogue_norms(n):
            assert np.array_equal(got, ref), f"batch {b}, logits block {i} ({n} rows): not bitwise the plain runner's"
            continue
        errors.append(np.abs(got - ref) / ref.std(axis=1, keepdims=True))
    err = np.concatenate(errors) if errors else np.zeros(1)
    print(f"batch {b}: |sharded - plain| / std: max {err.max():.2e}, mean {err.mean():.2e}")
    assert err.max() <= TOLERANCE and err.mean() <= MEAN_TOLERANCE, f"batch {b}: logits differ by {err.max():.3f} std"
    for k in range(STEPS + 1):  # the logits each token was chosen from: the prompts' last rows, then step k's
        chosen = np.stack([block[-1] for block in want_logits[:b]]) if k == 0 else want_logits[b + k - 1]
        for j in np.flatnonzero(tokens[k] != want_tokens[k]):
            top = np.sort(chosen[j])[-2:]
            gap = float(top[1] - top[0]) / float(chosen[j].std())
            assert gap < 2 * err.max(), (f"batch {b}, step {k}, row {j}: token {tokens[k][j]}, plain "
                                         f"{want_tokens[k][j]}, whose top two logits are {gap:.3f} of their spread "
                                         f"apart")


def epilogue_norms(n: int) -> bool:
    """Whether the plain runner's step of n rows takes the norm statistics from the residual products' epilogue
    (model/forward.py _views)."""
    return n in SWAP_DEFAULT_ROWS and n <= EPI_NORM_MAX_ROWS


def check_comm_works(comm, stream) -> None:
    """The runner left the communicator open: an all-reduce over it still runs (one rank: x itself)."""
    host = np.arange(40, dtype=np.float32)
    x = DeviceArray.from_host(host)
    try:
        comm.all_reduce(x, stream)
        np.testing.assert_array_equal(x.to_host(stream), host)
    finally:
        x.free()


@pytest.mark.parametrize("force", [None, "gemm"], ids=["default", "invariant"])
@pytest.mark.parametrize("n", [1, 2, 5, 40, 100])
def test_a_later_ranks_partial_plus_the_old_residual_is_the_residual_epilogue(n, force, buf, stream):
    """o_proj / down_proj of n rows ([n, 2048] x [1024, 2048]^T, out [n, 1024] float32): GEMV (1-2 rows),
    swap-AB (5, 40) or TMA GEMM (100, and every n batch-invariant)."""
    N, K = 1024, 2048
    rng = np.random.default_rng(seed_of("tp partial", n, force))
    x, w = buf.upload(rand_bf16(rng, (n, K))), buf.upload(linear_weight(N, K))
    old = rng.standard_normal((n, N)).astype(np.float32)
    resid, partial = buf.upload(old), buf.poisoned((n, N), np.float32)
    linear(x, w, resid, "residual", stream, force=force)
    linear(x, w, partial, "f32", stream, force=force)
    assert np.array_equal(old + partial.to_host(stream), resid.to_host(stream))


@pytest.mark.parametrize("first", [0, 300, 760])
def test_a_ranks_embedding_of_its_vocabulary_slice(first, buf, stream):
    """Rows [first, first + 256) of a 1003-token vocabulary (the last rank's slice: its range ends at 1003, the
    rest of its rows padding), 65 tokens from -1 to 1003."""
    rows, dim, n = 256, 1024, 65
    rng = np.random.default_rng(seed_of("tp embedding", first))
    table = rand_bf16(rng, (rows, dim))
    tokens = rng.integers(-1, 1004, n).astype(np.int32)
    tokens[:4] = [first - 1, first, first + rows - 1, first + rows]  # each edge of the slice
    valid = (tokens >= first) & (tokens < first + rows)
    want = np.zeros((n, dim), np.float32)
    want[valid] = to_f32(table)[tokens[valid] - first]
    out = buf.poisoned((n, dim), np.float32)
    embedding(buf.upload(tokens), buf.upload(table), out, stream, first=first)
    np.testing.assert_array_equal(out.to_host(stream), want)

    # fetch_step: the step buffers' mirror holds the token ids, then token_src (all -1: nothing to resolve)
    field = 16 * -(-n // 4)
    host = PinnedBuffer(2 * field, mapped=True)
    try:
        host.array((n,), np.int32, 0)[:] = tokens
        host.array((n,), np.int32, field)[:] = -1
        dst = buf.poisoned((2 * field,), np.uint8)
        ids, src = (DeviceArray((n,), np.int32, ptr=dst.ptr + at) for at in (0, field))
        fetched = buf.poisoned((n, dim), np.float32)
        fetch_step(host.device_array((2 * field,), np.uint8), dst, ids, src, buf.upload(np.zeros(1, np.int32)),
                   stream, embed=(buf.upload(table), fetched), first=first)
        np.testing.assert_array_equal(fetched.to_host(stream), want)
        np.testing.assert_array_equal(ids.to_host(stream), tokens)
    finally:
        host.free()


@pytest.mark.parametrize("world", [2, 4])
def test_each_ranks_real_columns_land_at_its_range(world, buf, stream):
    """Gathered parts [world x 7 rows, vocab_part] of a 1003-token vocabulary into logits [7, 1003] (poisoned):
    every column from its rank's part, the padding columns dropped, nothing past the rows written."""
    vocab, rows = 1003, 7
    per = vocab_part(vocab, world)
    parts = np.random.default_rng(seed_of("tp gather", world)).standard_normal((world * rows, per)).astype(np.float32)
    gathered, logits = buf.upload(parts), buf.poisoned((rows + 1, vocab), np.float32)
    want = np.empty((rows, vocab), np.float32)
    for r in range(world):
        start, stop = vocab_range(vocab, r, world)
        copy_columns(logits.rows(0, rows), start, gathered.rows(r * rows, (r + 1) * rows), 0, stop - start, stream)
        want[:, start:stop] = parts[r * rows:(r + 1) * rows, :stop - start]
    got = logits.to_host(stream)
    np.testing.assert_array_equal(got[:rows], want)
    assert np.isnan(got[rows]).all(), "copy_columns wrote past the rows"


def test_an_engine_over_a_one_rank_group_gives_the_plain_engines_tokens(tiny_checkpoint, comm):
    """The launcher's path at world size 1 (runner/tensor_parallel.py: the group, start-up's communicator and page
    agreement, rank 0's mirror; no worker processes at one rank): an Engine over it gives the plain LLM's tokens,
    greedy and seeded sampling, in batch-invariant mode, prompts in chunks beside decodes."""
    from tileinfer import LLM, SamplingParams
    from tileinfer.config import EngineConfig
    from tileinfer.engine.engine import Engine
    from tileinfer.runner.startup import start_gpu
    from tileinfer.runner.tensor_parallel import TensorParallelGroup, TensorParallelRunner
    options = dict(batch_invariant=True, max_num_seqs=8, max_context=256, num_pages=40, page_size=16,
                   max_num_batched_tokens=64, progress=False)
    prompts = prompts_of([45, 2, 9, 33, 70, 130])
    params = [SamplingParams(max_tokens=14, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=14, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)]
    params = [params[i % 2] for i in range(len(prompts))]
    with LLM(tiny_checkpoint, **options) as llm:
        want = [o.token_ids for o in llm.generate(prompts, params)]
    config = EngineConfig(model=tiny_checkpoint, **options)
    group = TensorParallelGroup(config)
    started = start_gpu(config, group)
    runner = TensorParallelRunner(started.runner, group)
    try:
        assert started.runner.tensor_parallel.world == 1 and runner.cache.manager.num_pages == 40
        engine = Engine(config, runner, runner.tokenizer, runner.eos_token_ids)
        reqs = [engine.make_request(p, sp) for p, sp in zip(prompts, params)]
        for req in reqs:
            engine.add(req)
        for _ in range(200):
            if not engine.has_unfinished:
                break
            engine.step()
        got = [engine.output(req).token_ids for req in reqs]
    finally:
        runner.close()
    assert got == want


def _gpus() -> int:
    from cuda.bindings import driver
    from tileinfer.cuda.driver import call, init_driver
    init_driver()
    return call(driver.cuDeviceGetCount)


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_on_several_gpus_give_one_gpus_tokens(tiny_checkpoint, device, world):
    """LLM(tensor_parallel_size=world) (worker processes, NCCL between the GPUs) against the same model on one GPU,
    batch-invariant: the same greedy and seeded tokens, and each token's top log-probabilities within bf16
    rounding (the ranks' partial sums are added in another order than one GPU's products sum)."""
    pytest.importorskip("nccl.bindings.nccl", reason="nccl4py is not installed (pip install tileinfer[tp])")
    if _gpus() < world:
        pytest.skip(f"tensor parallelism over {world} GPUs needs {world} GPUs; this machine has {_gpus()}")
    from tileinfer import LLM, SamplingParams
    options = dict(batch_invariant=True, max_num_seqs=8, max_context=256, num_pages=40, page_size=16,
                   max_num_batched_tokens=64, progress=False)
    prompts = prompts_of([45, 2, 9, 33, 70, 130])
    params = [SamplingParams(max_tokens=14, temperature=0, ignore_eos=True, logprobs=3),
              SamplingParams(max_tokens=14, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)]
    params = [params[i % 2] for i in range(len(prompts))]
    with LLM(tiny_checkpoint, **options) as one:
        want = one.generate(prompts, params)
    with LLM(tiny_checkpoint, tensor_parallel_size=world, **options) as split:
        got = split.generate(prompts, params)
        assert split.runner.tensor_parallel.world == world and len(split.runner.group.procs) == world - 1
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for g, w in zip(got, want):
        for token, lg, lw in zip(g.token_ids, g.logprobs or [], w.logprobs or []):
            common = sorted(lg.keys() & lw.keys())  # (the third most likely may differ at a near tie)
            assert token in common
            np.testing.assert_allclose([lg[t] for t in common], [lw[t] for t in common], atol=0.05)


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_the_cli_runs_generate_and_chat_over_the_gpus(tiny_checkpoint, device, command):
    """`tileinfer generate|chat --tensor-parallel-size 2`: on one GPU the group's check names what is missing
    (exit 1, one line); with two it answers (the ranks' tokens against one GPU's: test_ranks_on_several_gpus_...)."""
    import subprocess
    import sys
    pytest.importorskip("nccl.bindings.nccl", reason="nccl4py is not installed (pip install tileinfer[tp])")
    args = ["generate", "--prompt", "Hello there"] if command == "generate" else ["chat"]
    run = [sys.executable, "-m", "tileinfer", *args, "--model", str(tiny_checkpoint), "--max-new-tokens", "8",
           "--max-context", "256"]
    stdin = "Hello there\n/exit\n" if command == "chat" else None
    split = subprocess.run([*run, "--tensor-parallel-size", "2"], input=stdin, capture_output=True, text=True,
                           timeout=300)
    if _gpus() < 2:
        assert split.returncode == 1 and "tensor_parallel_size 2 needs GPUs 0..1" in split.stderr, split.stderr
        return
    assert split.returncode == 0 and split.stdout.strip(), split.stderr
    assert "tok/s" in split.stderr


def test_rank_0_stops_waiting_in_nccls_initialisation_for_a_failed_worker(device):
    """Real NCCL, a group of 2 whose rank 1 never joins: join_communicator raises WorkerError once the group is
    failed instead of waiting in ncclCommInitRank forever. In a process of its own: the initialisation's thread
    stays behind, waiting, until that process exits."""
    import subprocess
    import sys
    pytest.importorskip("nccl.bindings.nccl", reason="nccl4py is not installed (pip install tileinfer[tp])")
    script = """if True:
        import time
        from tileinfer.cuda import get_device
        from tileinfer.cuda.nccl import unique_id
        from tileinfer.runner.tensor_parallel import WorkerError, join_communicator
        get_device()
        start = time.monotonic()
        try:
            join_communicator(unique_id(), 2, 0, lambda: "rank 1 failed" if time.monotonic() > start + 2 else None)
        except WorkerError as e:
            print("raised after %.1f s: %s" % (time.monotonic() - start, str(e).splitlines()[-1]), flush=True)
        comm = join_communicator(unique_id(), 1, 0, lambda: None)  # a group that is all here joins
        print("joined a group of", comm.world_size, flush=True)
        comm.close()
    """
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("raised after ") and "(rank 0 stopped waiting for it in NCCL's" in lines[0], done.stdout
    assert float(lines[0].split()[2]) < 10 and lines[1] == "joined a group of 1"


def test_a_rank_started_by_hand_on_one_gpu_gets_rank_0_an_error_not_a_wait(tiny_checkpoint, device, tmp_path):
    """The hand-started path on real NCCL: rank 0 (an LLM listening at tensor_parallel_address) and a `tileinfer
    tp-worker` connect, authenticate and start up. Both on the one GPU here, which NCCL refuses for two ranks of
    a communicator: the LLM raises (NCCL's error or the worker's report) instead of waiting. In a process of its
    own, bounded."""
    import socket
    import subprocess
    import sys
    pytest.importorskip("nccl.bindings.nccl", reason="nccl4py is not installed (pip install tileinfer[tp])")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = f"""if True:
        import os, subprocess, sys, time
        os.environ["TILEINFER_TP_KEY"] = "test-key"
        from tileinfer import LLM
        worker = subprocess.Popen([sys.executable, "-m", "tileinfer", "tp-worker", "--address", "127.0.0.1:{port}",
                                   "--rank", "1", "--device", "cuda:0"], stderr=subprocess.PIPE, text=True)
        start = time.monotonic()
        try:
            LLM({str(tiny_checkpoint)!r}, tensor_parallel_size=2, tensor_parallel_address="127.0.0.1:{port}",
                max_num_seqs=2, max_context=256, num_pages=16, progress=False)
            print("started", flush=True)
        except Exception as e:
            print("raised after %.0f s: %s" % (time.monotonic() - start, type(e).__name__), flush=True)
        worker.wait(timeout=60)
        print("worker exit", worker.returncode, flush=True)
        print(worker.stderr.read()[-2000:], file=sys.stderr)
    """
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=150,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("raised after "), done.stdout + done.stderr[-3000:]
    assert lines[1] == "worker exit 1" and "tensor-parallel rank 1 failed" in done.stderr, done.stderr[-3000:]
