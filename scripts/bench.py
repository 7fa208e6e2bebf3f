#!/usr/bin/env python3
"""Decode and prefill benchmarks on synthetic checkpoints, side by side with the peer.

    python scripts/bench.py --models qwen3-0.6b,qwen3-4b,qwen3-8b --peer bench/peer_gptfast.py

For each model: batch-1 decode tokens/s after a prompt of --context tokens (--new tokens
timed, after a warm-up generation that captures the decode graph), with the bytes a step
must read (every weight once + the KV cache) as achieved GB/s and the fraction of the
bandwidth roofline; prefill tokens/s and TFLOP/s for each --prefill length. With --peer,
the gpt-fast-style peer runs the same decode case in the same process tree, one subprocess
per model. Prints a markdown table; writes bench.json (and the table) to $OUT or --out.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import tileinfer
from tileinfer.cuda import Event, Graph, Kernel, get_device
from tileinfer.runner.step import prepare_step
from tileinfer.graphs import bucket_for
from tileinfer.kv import Sequence
from tileinfer.model.config import preset
from tileinfer.model.synthetic import cached_checkpoint

ROOFLINE_BYTES_PER_S = 4.3e12   # the H200's measured read bandwidth (docs/benchmarks.md, Rooflines)
MATMUL_FLOPS = 790e12            # the H200's measured bf16 matrix-product rate


def source_hash() -> str:
    """12 hex digits of sha256 over the code a run executes: the imported tileinfer package's Python files, its
    graphs package's and the kernel sources it compiles (compiler.cuda_src_dir, TILEINFER_CUDA_SRC where set), each
    named by its path within its folder. The same files give the same hash in a git checkout, an ab.py tree or a
    copy without the repository's history, so a figure from a GPU machine names its code."""
    import hashlib
    import importlib
    from tileinfer.cuda.compiler import cuda_src_dir
    graphs = Path(importlib.import_module("tileinfer.graphs").__file__).parent
    roots = [("graphs", graphs, "*.py"), ("cuda_src", cuda_src_dir(), "*.cu*")]
    package = Path(tileinfer.__file__).parent
    files = [(f"{name}/{f.relative_to(root).as_posix()}", f) for name, root, pattern in roots
             for f in root.rglob(pattern)]
    files += [(f"tileinfer/{f.relative_to(package).as_posix()}", f) for f in package.rglob("*.py")
              if not f.is_relative_to(graphs)]  # a wheel install keeps graphs inside the package
    digest = hashlib.sha256()
    for name, f in sorted(files):
        digest.update(name.encode() + b"\0" + f.read_bytes() + b"\0")
    return digest.hexdigest()[:12]


def revision() -> str:
    """The code of this run: its source hash, with the ab.py tree's revision (its REVISION file) or, in a git
    checkout, the commit (+changes where the package, graphs or kernels differ from it)."""
    root = Path(tileinfer.__file__).parent.parent
    where = ""
    if (root / "REVISION").is_file():  # scripts/ab.py prepare
        where = f"tree {(root / 'REVISION').read_text().strip()}, "
    elif (root / ".git").exists():
        git = ["git", "-C", str(root)]
        head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        if head.returncode == 0:
            changed = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no", "--", "tileinfer",
                                      "graphs", "cuda_src"], capture_output=True, text=True).stdout.strip()
            where = f"git {head.stdout.strip()}{'+changes' if changed else ''}, "
    return f"{where}source {source_hash()}"


def run_header(gpu: str) -> str:
    """When, where and on what code a run measured: the UTC time, the GPU and its driver, tileinfer's version and
    revision()."""
    driver = "unknown"
    try:
        import pynvml
        pynvml.nvmlInit()
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else driver
    except Exception:  # noqa: BLE001 - the header still names the rest
        pass
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return f"{when}; {gpu}, driver {driver}; tileinfer {tileinfer.__version__}, {revision()}"


def weight_bytes(cfg) -> int:
    """Bytes of weights a decode step reads: everything once (the embedding only as the LM head)."""
    return 2 * cfg.num_parameters()


def kv_bytes(cfg, positions: int, kv: str = "bf16") -> int:
    """Cache bytes a decode step reads: keys and values (INT8: codes + one float32 scale per vector)."""
    per_vector = cfg.head_dim + 4 if kv == "int8" else 2 * cfg.head_dim
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * per_vector * positions


def bench_decode(model, context: int, new: int, repeats: int, kv: str = "bf16") -> dict:
    prompt = np.random.default_rng(0).integers(0, min(151643, model.config.vocab_size), context).tolist()
    kv_quantize = "int8" if kv == "int8" else None
    # Warm-up: kernels, the cache, the graph.
    tileinfer.generate(model, prompt, max_new_tokens=16, stop_at_eos=False, kv_quantize=kv_quantize)
    rates = []
    for _ in range(repeats):
        r = tileinfer.generate(model, prompt, max_new_tokens=new, stop_at_eos=False, kv_quantize=kv_quantize)
        rates.append(r.decode_tokens_per_second)
    tok_s = float(np.median(rates))
    graph_ms = graph_step_ms(model)
    cfg = model.config
    step_bytes = weight_bytes(cfg) + kv_bytes(cfg, context + new // 2, kv)
    return dict(decode_tok_s=tok_s, decode_runs=rates, graph_step_ms=graph_ms, wall_step_ms=1e3 / tok_s,
                step_bytes=step_bytes, GB_s=tok_s * step_bytes / 1e9, graph_GB_s=step_bytes / graph_ms / 1e6,
                roofline_tok_s=ROOFLINE_BYTES_PER_S / step_bytes,
                roofline_fraction=tok_s * step_bytes / ROOFLINE_BYTES_PER_S)


def graph_step_ms(model, replays: int = 50) -> float:
    """GPU time of one decode step: back-to-back replays of the batch-1 graph, timed with events.

    Each replay recomputes the last step (same inputs, same cache slot), so nothing changes; the
    difference to the wall-clock time per token is the host's share (planning, upload, sync).
    """
    return replay_ms(model.stream, model.graphs.graph("decode", 1).launch, replays)


def replay_ms(stream, enqueue, replays: int) -> float:
    """Milliseconds of GPU time per `enqueue(stream)` (one untimed first, then `replays` timed with events)."""
    start, end = Event(), Event()
    enqueue(stream)
    start.record(stream)
    for _ in range(replays):
        enqueue(stream)
    end.record(stream)
    end.synchronize()
    return start.elapsed_ms(end) / replays


def weights_read(weights: dict, args) -> list:
    """The weight arrays among a launch's arguments (`weights`: the model's, by device pointer)."""
    return [weights[a.ptr] for a in args if getattr(a, "ptr", None) in weights]


def profile_step(model, bucket: int = 1) -> list[dict]:
    """Per-kernel GPU time of one decode step of `bucket` sequences (over the step buffers' last contents)."""
    return profile_graph(model, lambda s: model._enqueue_decode(bucket, s))


def profile_graph(model, enqueue) -> list[dict]:
    """Per-kernel GPU time of what `enqueue(stream)` launches, captured as a graph.

    The launches are captured again with an event recorded before every launch (and one after the
    last); replaying that graph timestamps each kernel without launch gaps from Python. The events
    also keep a kernel from starting early (programmatic dependent launch), so each row holds its
    kernel's whole ramp-up and tail. Rows are grouped by kernel name; their bytes are the weights
    the launches read (every weight array among a launch's arguments).
    """
    marks: list[tuple[str, Event, int, int]] = []
    original = Kernel.launch
    weights = {a.ptr: a for a in model.weights.arrays}

    def launch(self, grid, block, args, stream, smem=0):
        event = Event()
        event.record(stream, external=True)
        read = weights_read(weights, args)
        nbytes = sum(w.nbytes for w in read)
        flops = 0
        x = args[0] if args else None
        matrices = [w for w in read if len(w.shape) == 2]  # (an xIELU product also reads its 4 parameters)
        if len(matrices) == 1 and len(getattr(x, "shape", ())) == 2:
            flops = 2 * x.shape[0] * matrices[0].shape[0] * matrices[0].shape[1]  # a matrix product x W^T
        marks.append((self.name, event, nbytes, flops))
        original(self, grid, block, args, stream, smem)

    end = Event()
    Kernel.launch = launch
    try:
        graph = Graph(model.stream, lambda s: (enqueue(s), end.record(s, external=True)))
    finally:
        Kernel.launch = original
    for _ in range(3):
        graph.launch(model.stream)
    end.synchronize()
    rows: dict[str, dict] = {}
    for i, (name, event, nbytes, flops) in enumerate(marks):
        nxt = marks[i + 1][1] if i + 1 < len(marks) else end
        r = rows.setdefault(name, dict(kernel=name, launches=0, us=0.0, bytes=0, flops=0))
        r["launches"] += 1
        r["us"] += event.elapsed_ms(nxt) * 1e3
        r["bytes"] += nbytes
        r["flops"] += flops
    graph.destroy()
    for r in rows.values():
        r["GB_s"] = r["bytes"] / (r["us"] * 1e3) if r["bytes"] else None
        r["TFLOP_s"] = r["flops"] / (r["us"] * 1e6) if r["flops"] else None
    return sorted(rows.values(), key=lambda r: -r["us"])


def render_profile(name: str, rows: list[dict], what: str = "one decode step", top: int | None = None) -> str:
    """A profile's rows (profile_graph's, slowest first) as a table; with `top`, only the slowest `top`."""
    total = sum(r["us"] for r in rows)
    lines = [f"{name}: {what}, {total:.0f} us of GPU time", "",
             "| kernel | launches | total us | share | GB/s | TFLOP/s |", "|---|---|---|---|---|---|"]
    for r in rows[:top]:
        gbs = f"{r['GB_s']:.0f}" if r["GB_s"] else "-"
        tfs = f"{r['TFLOP_s']:.0f}" if r.get("TFLOP_s") else "-"
        lines.append(f"| {r['kernel']} | {r['launches']} | {r['us']:.1f} | {100 * r['us'] / total:.1f}% | {gbs} | {tfs} |")
    return "\n".join(lines) + "\n"


# Kernel groups of a decode step (kernel-name prefixes) whose in-graph cost --ablate measures: batch 1
# (every product a GEMV), and larger batches (tensor-core products, separate RMSNorm launches).
ABLATE_GROUPS = (
    ("attention: attn_input, attention, combine", ("attn_input", "attention")),
    ("  of it: attn_input alone", ("attn_input",)),
    ("  of it: attention_combine alone", ("attention_combine",)),
    ("QKV GEMV, RMSNorm fused", ("gemv_norm_m1_e0",)),
    ("gate/up GEMV, RMSNorm fused", ("gemv_norm_m1_e2",)),
    ("o_proj + down_proj GEMV", ("gemv_m1_e1", "gemv_pipe_m1_e1")),
    ("LM head GEMV", ("gemv_m1_e3", "gemv_pipe_m1_e3", "gemv_argmax_m1_e3", "gemv_pipe_argmax_m1_e3")),
)
BATCH_ABLATE_GROUPS = (
    ("attention: attn_input, attention, combine", ("attn_input", "attention")),
    ("matrix products (LM head included)", ("gemm", "gemv")),
    ("RMSNorm", ("rmsnorm",)),
)
SAMPLING_KERNELS = ("sample_rows", "argmax_rows")


def ablate_step(model, bucket: int = 1, replays: int = 50, *, enqueue=None, groups=None) -> dict:
    """What each kernel group costs inside the decode graph of `bucket` sequences (over the step
    buffers' contents), kernel boundaries included. `enqueue(stream)` and `groups` ((label, name
    prefixes) pairs) replace the decode step and its groups (bench_speculative.py: the verify step).

    The step is captured again without the group's launches and replayed; its GPU time subtracted
    from the whole step's is the group's marginal time, which, unlike profile_graph's rows, keeps the
    overlap programmatic dependent launch gives. Such a graph computes nothing meaningful, only its time
    is used: every graph here, the reference included, also leaves out the sampling kernels, so the
    token each replay embeds stays the last one sampled. Bytes: the weights the group's launches read.
    """
    weights = {a.ptr: a for a in model.weights.arrays}

    def timed_without(prefixes: tuple[str, ...]) -> tuple[float, int, int]:
        dropped = dict(launches=0, bytes=0)
        original = Kernel.launch

        def launch(self, grid, block, args, stream, smem=0):
            if self.name.startswith(SAMPLING_KERNELS):
                return
            if prefixes and self.name.startswith(prefixes):
                dropped["launches"] += 1
                dropped["bytes"] += sum(w.nbytes for w in weights_read(weights, args))
                return
            original(self, grid, block, args, stream, smem)

        Kernel.launch = launch
        try:
            graph = Graph(model.stream, enqueue or (lambda s: model._enqueue_decode(bucket, s)))
        finally:
            Kernel.launch = original
        try:
            return replay_ms(model.stream, graph.launch, replays), dropped["launches"], dropped["bytes"]
        finally:
            graph.destroy()

    step_ms = timed_without(())[0]
    rows = []
    for label, prefixes in groups or (ABLATE_GROUPS if bucket == 1 else BATCH_ABLATE_GROUPS):
        ms, launches, nbytes = timed_without(prefixes)
        saved_us = (step_ms - ms) * 1e3
        rows.append(dict(group=label, launches=launches, step_ms=ms, us=saved_us, bytes=nbytes,
                         bound_us=nbytes / ROOFLINE_BYTES_PER_S * 1e6,
                         GB_s=nbytes / (saved_us * 1e3) if nbytes and saved_us > 0 else None))
    return dict(step_ms=step_ms, groups=rows)


def render_ablation(name: str, ab: dict, step: str = "decode step") -> str:
    """ablate_step's result as a table."""
    lines = [f"{name}: {step} without sampling {ab['step_ms'] * 1e3:.0f} us of GPU time; what each group "
             "costs inside it (the step without the group, subtracted)", "",
             "| group | launches | us | us a launch | weight bytes at 4.3 TB/s, us | GB/s |", "|---|---|---|---|---|---|"]
    for r in ab["groups"]:
        gbs = f"{r['GB_s']:.0f}" if r["GB_s"] else "-"
        per = r["us"] / r["launches"] if r["launches"] else 0.0
        lines.append(f"| {r['group']} | {r['launches']} | {r['us']:.1f} | {per:.2f} | {r['bound_us']:.1f} | {gbs} |")
    return "\n".join(lines) + "\n"


def profile_prefill(model, n: int) -> list[dict]:
    """Per-kernel GPU time of one prefill step of n tokens (one chunk: n <= max_batch_tokens)."""
    prompt = np.random.default_rng(1).integers(0, min(151643, model.config.vocab_size), n).tolist()
    cache = model.ensure_cache(n + 1)
    seq = Sequence()
    try:
        cache.manager.reserve(seq, n)
        shape = prepare_step(model.steps, cache.manager, [(seq, prompt)])
        model.steps.upload(model.stream)
        return profile_graph(model, lambda s: model._enqueue_step(shape, sample=False, num_splits=1, stream=s))
    finally:
        model.stream.synchronize()
        cache.manager.release(seq)


def bench_prefill(model, n: int, repeats: int, pause: float = 0.0) -> dict:
    """One n-token prompt through the paged cache, a warm-up then `repeats` timed runs (CUDA events), the median.
    pause: seconds the GPU idles before each timed run (0: back to back), to tell a prompt after a quiet spell
    from one of a stream of them."""
    prompt = np.random.default_rng(1).integers(0, min(151643, model.config.vocab_size), n).tolist()
    cache = model.ensure_cache(n + 1)
    times = []
    start, end = Event(), Event()
    for i in range(repeats + 1):
        if i and pause:
            time.sleep(pause)
        seq = Sequence()
        try:
            start.record(model.stream)
            for begin in range(0, n, model.max_batch_tokens):
                part = prompt[begin: begin + model.max_batch_tokens]
                cache.manager.reserve(seq, len(part))
                model.step([(seq, part)], sample=begin + len(part) >= n)
            end.record(model.stream)
            end.synchronize()
            if i:  # the first run is a warm-up
                times.append(start.elapsed_ms(end) / 1e3)
        finally:
            cache.manager.release(seq)
    seconds = float(np.median(times))
    cfg = model.config
    attn_flops = 4 * cfg.num_hidden_layers * cfg.num_attention_heads * cfg.head_dim * n * n / 2
    flops = 2 * (cfg.num_parameters() - cfg.vocab_size * cfg.hidden_size) * n + attn_flops \
        + 2 * cfg.vocab_size * cfg.hidden_size  # the LM head runs for the last token only
    return dict(prefill_tokens=n, prefill_s=seconds, prefill_tok_s=n / seconds, TFLOP_s=flops / seconds / 1e12,
                matmul_fraction=flops / seconds / MATMUL_FLOPS, pause_s=pause,
                TFLOP_s_runs=[flops / t / 1e12 for t in times])


def prefill_runs(p: dict) -> str:
    """A bench_prefill result's timed runs, TFLOP/s each, in the order they ran."""
    return ", ".join(f"{t:.0f}" for t in p.get("TFLOP_s_runs", []))


def peer_command(peer: Path, name: str, context: int, new: int, batch: int = 1) -> list[str]:
    """The command that runs the peer on one case (bench/peer_gptfast.py MODEL BATCH CONTEXT NEW)."""
    return [sys.executable, str(peer), name, str(batch), str(context), str(new)]


def run_peer(peer: Path, name: str, context: int, new: int, timeout: int, batch: int = 1) -> dict | None:
    try:
        proc = subprocess.run(peer_command(peer, name, context, new, batch), capture_output=True,
                              text=True, timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    except subprocess.TimeoutExpired:
        print(f"peer {name}: timed out after {timeout} s", flush=True)
        return None
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode or not lines:
        print(f"peer {name} failed (exit {proc.returncode}): {proc.stderr[-2000:]}", flush=True)
        return None
    return json.loads(lines[-1])


def engine_max_context(context: int, new: int, requested: int = 0) -> int:
    """The engine's max_context for --batches: `requested`, or the run's own (a prompt of `context`, `new` tokens
    and 64 to spare); SystemExit naming the least it may be when a run would not fit."""
    need = context + new + 64
    if requested and requested < need:
        raise SystemExit(f"bench: --engine-max-context {requested} is less than the run needs ({need}: --context "
                         f"+ --new + 64)")
    return requested or need


def parser() -> argparse.ArgumentParser:
    """The command's options; scripts/bench_goals.py takes its defaults from here too."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--revision", action="store_true",
                    help="print the code's revision (the git commit or ab.py tree, and the source hash that runs "
                         "report) and exit: no GPU needed")
    ap.add_argument("--models", default="qwen3-0.6b,qwen3-4b,qwen3-8b")
    ap.add_argument("--context", type=int, default=512, help="prompt positions before the timed decode")
    ap.add_argument("--new", type=int, default=128, help="decode tokens timed per run")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prefill", default="512,4096", help="prompt lengths for the prefill benchmark ('' = none)")
    ap.add_argument("--prefill-pause", type=float, default=0.0,
                    help="seconds the GPU idles before each timed prompt (default 0: back to back)")
    ap.add_argument("--peer", type=Path, help="path to the peer, bench/peer_gptfast.py (runs the same decode case)")
    ap.add_argument("--peer-timeout", type=int, default=300)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--profile", action="store_true", help="also print the per-kernel time of one decode step")
    ap.add_argument("--ablate", action="store_true",
                    help="also time the decode graph without each kernel group (its in-graph cost): batch 1 and "
                         "each of --batches")
    ap.add_argument("--single", default=True, action=argparse.BooleanOptionalAction,
                    help="the batch-1 decode and prefill benchmarks on the single-sequence path")
    ap.add_argument("--batches", default="", help="engine (LLM) decode at these batch sizes, e.g. 1,8,64,256")
    ap.add_argument("--peer-batches", default=None, help="batch sizes the peer runs at (default: every --batches)")
    ap.add_argument("--offline", action="store_true", help="engine offline throughput (256 requests)")
    ap.add_argument("--shared-prefix", action="store_true", help="engine shared-prefix prefill, cache on and off")
    ap.add_argument("--kv", default="bf16", help="KV cache kinds for the batch-1 decode: bf16, int8 or both (bf16,int8)")
    ap.add_argument("--engine-kv", default="bf16", choices=("bf16", "int8"), help="KV cache of the engine's --batches runs")
    ap.add_argument("--engine-max-context", type=int, default=0,
                    help="max_context of the engine's --batches runs (default: the run's own, --context + --new + "
                         "64); a server's is longer, which gives a small batch more key splits")
    return ap


def main() -> None:
    args = parser().parse_args()

    if args.revision:
        print(revision())
        return
    dev = get_device()
    header = run_header(f"{dev.info.name}, {dev.info.num_sms} SMs")
    print(f"Run: {header}", flush=True)
    results = []
    for name in args.models.split(","):
        cfg = preset(name)
        t = time.perf_counter()
        path = cached_checkpoint(name)
        print(f"{name}: checkpoint ready in {time.perf_counter() - t:.1f} s", flush=True)
        row = dict(model=name, context=args.context, new=args.new)
        extra = []  # one more row per further cache kind, with the same peer run beside it
        if args.single:
            kinds = args.kv.split(",")
            row.update(single(args, name, cfg, path, kinds[0]))
            extra = [dict(single(args, name, cfg, path, kv, peer=False), peer=row.get("peer")) for kv in kinds[1:]]
        if args.batches or args.offline or args.shared_prefix:
            row["engine"] = engine(args, name, path)
        results += [row, *extra]
        save(args.out, results, header)  # after every model, so a cut-short run keeps what it measured
    print(render(results, header))


def engine(args, name: str, path: Path) -> dict:
    from bench_engine import batch_decode, live_step, offline, shared_prefix
    out: dict = {}
    batches = [int(b) for b in args.batches.split(",") if b]
    if batches:
        ctx = engine_max_context(args.context, args.new, args.engine_max_context)
        kv = args.engine_kv
        with tileinfer.LLM(path, max_num_seqs=max(batches), max_context=ctx, progress=False,
                           kv_quantize="int8" if kv == "int8" else None) as llm:
            out["capture_s"] = llm.startup.capture
            out["num_graphs"] = llm.runner.graphs.count("decode")
            out["startup"] = dataclasses.asdict(llm.startup)
            print(f"{name}: {llm.startup.format()}", flush=True)
            out["memory"] = llm.memory_report.as_dict() if llm.memory_report else None
            print(f"{name}: {out['num_graphs']} decode graphs captured in {llm.startup.capture:.2f} s", flush=True)
            batch_decode(llm, min(8, max(batches)), 64, 8)  # warm-up
            out["batch_decode"] = []
            for b in batches:
                r = batch_decode(llm, b, args.context, args.new)
                r["kv"] = kv
                print(f"{name}: batch {b} decode{' (INT8 cache)' if kv == 'int8' else ''} {r['decode_tok_s']:.0f} tok/s "
                      f"in total ({r['ms_per_step']:.2f} ms/step, "
                      f"{r['gpu_wait_ms_per_step']:.2f} ms of it waiting for the GPU)", flush=True)
                if args.profile and b in llm.runner.buckets:
                    r["profile"] = live_step(llm, b, args.context, profile_step)
                    print(render_profile(f"{name} batch {b}", r["profile"]), flush=True)
                if args.ablate and b in llm.runner.buckets:
                    r["ablation"] = live_step(llm, b, args.context, ablate_step)
                    print(render_ablation(f"{name} batch {b}", r["ablation"]), flush=True)
                out["batch_decode"].append(r)
        if args.peer:
            peer_batches = {int(b) for b in (args.peer_batches or args.batches).split(",") if b}
            for r in out["batch_decode"]:
                if r["batch"] not in peer_batches:
                    continue
                peer = run_peer(args.peer, name, args.context, args.new, args.peer_timeout, batch=r["batch"])
                r["peer"] = peer
                if peer:
                    print(f"{name}: peer batch {r['batch']} {peer['decode_tok_s_total']:.0f} tok/s in total", flush=True)
    if args.offline:
        with tileinfer.LLM(path, max_num_seqs=256, max_context=2048 + 64, max_num_batched_tokens=8192,
                           progress=False) as llm:
            r = offline(llm)
            if args.ablate and r["decode_steps"]:
                # A decode step like the run's average: its mean rows (rounded up to a graph's batch) at
                # its mean positions, each kernel group's cost inside the graph.
                rows = bucket_for(round(r["decode_rows"] / r["decode_steps"]), llm.runner.buckets)
                context = round(r["decode_positions"] / r["decode_rows"])
                try:
                    r["typical_step"] = dict(batch=rows, context=context,
                                             ablation=live_step(llm, rows, context, ablate_step))
                    print(render_ablation(f"{name} offline, a typical decode step ({rows} rows, {context} positions)",
                                          r["typical_step"]["ablation"]), flush=True)
                except Exception as e:  # noqa: BLE001 (the throughput above stands without it)
                    print(f"{name}: offline, the typical decode step could not be ablated: {e!r}", flush=True)
            print(f"{name}: offline {r['output_tok_s']:.0f} output tok/s ({r['requests']} requests, "
                  f"{r['output_tokens']} output tokens in {r['seconds']:.1f} s, {r['preemptions']} preemptions)",
                  flush=True)
            out["offline"] = r
    if args.shared_prefix:
        out["shared_prefix"] = {}
        for on in (True, False):
            with tileinfer.LLM(path, max_num_seqs=64, max_context=2048 + 64, enable_prefix_caching=on,
                               progress=False) as llm:
                shared_prefix(llm, n=2, seed=1)  # warm-up (another prefix)
                r = shared_prefix(llm)
                key = "on" if on else "off"
                out["shared_prefix"][key] = r
                print(f"{name}: shared prefix, cache {key}: {r['computed_prompt_tokens']} of {r['prompt_tokens']} "
                      f"prompt tokens computed in {r['seconds']:.3f} s", flush=True)
        sp = out["shared_prefix"]
        assert sp["on"]["first_tokens"] == sp["off"]["first_tokens"], "prefix caching changed a first token"
    return out


def single(args, name: str, cfg, path: Path, kv: str = "bf16", peer: bool = True) -> dict:
    """Batch-1 decode and prefill on the single-sequence path (tileinfer.generate) with a `kv` cache,
    and the peer at batch 1."""
    t = time.perf_counter()
    with tileinfer.load_model(path, progress=False, max_batch_tokens=max(4096, args.context)) as model:
        load_s = time.perf_counter() - t
        row = dict(model=name, batch=1, context=args.context, new=args.new, dtype="bf16", kv=kv, load_s=load_s,
                   weight_GB=weight_bytes(cfg) / 1e9, load_GB_s=model.weights.nbytes / 1e9 / model.weights.load_seconds)
        row.update(bench_decode(model, args.context, args.new, args.repeats, kv))
        print(f"{name}: {kv} cache, decode {row['decode_tok_s']:.1f} tok/s ({row['GB_s']:.0f} GB/s, "
              f"{100 * row['roofline_fraction']:.1f}% of roofline); GPU time per step {row['graph_step_ms']:.3f} ms "
              f"({row['graph_GB_s']:.0f} GB/s), wall {row['wall_step_ms']:.3f} ms", flush=True)
        if args.profile:
            row["profile"] = profile_step(model)
            print(render_profile(name, row["profile"]), flush=True)
        if args.ablate:
            row["ablation"] = ablate_step(model)
            print(render_ablation(name, row["ablation"]), flush=True)
        row["prefill"] = [bench_prefill(model, int(n), args.repeats, args.prefill_pause)
                          for n in args.prefill.split(",") if n]
        for p in row["prefill"]:
            print(f"{name}: prefill {p['prefill_tokens']} tokens {p['prefill_tok_s']:.0f} tok/s "
                  f"({p['TFLOP_s']:.0f} TFLOP/s; runs {prefill_runs(p)})", flush=True)
            if args.profile and p["prefill_tokens"] <= model.max_batch_tokens:
                p["profile"] = profile_prefill(model, p["prefill_tokens"])
                print(render_profile(name, p["profile"], f"prefill of {p['prefill_tokens']} tokens"), flush=True)
    if args.peer and peer:
        peer = run_peer(args.peer, name, args.context, args.new, args.peer_timeout)
        row["peer"] = peer
        if peer:
            print(f"{name}: peer {peer['decode_tok_s_per_seq']:.1f} tok/s", flush=True)
    return row


def save(out: Path, results: list[dict], run: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(dict(run=run, results=results), indent=1))
    (out / "bench.md").write_text(render(results, run))


def render(results: list[dict], run: str) -> str:
    lines = [f"Run: {run}; bf16 weights; synthetic checkpoints", ""]
    single = [r for r in results if "decode_tok_s" in r]
    if single:
        lines += ["Batch 1, single-sequence path:", "",
                  "| model | KV cache | context | decode tok/s | GB/s | % roofline | roofline tok/s | peer tok/s | ratio | GPU ms/step | wall ms/step |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in single:
            peer = r.get("peer")
            p = peer["decode_tok_s_per_seq"] if peer else None
            lines.append(f"| {r['model']} | {r.get('kv', 'bf16').upper()} | {r['context']} | {r['decode_tok_s']:.1f} | {r['GB_s']:.0f} | "
                         f"{100 * r['roofline_fraction']:.1f} | {r['roofline_tok_s']:.0f} | "
                         f"{'%.1f' % p if p else '-'} | {'%.2fx' % (r['decode_tok_s'] / p) if p else '-'} | "
                         f"{r['graph_step_ms']:.3f} | {r['wall_step_ms']:.3f} |")
        lines += ["", "| model | prompt tokens | prefill tok/s | TFLOP/s | % of 790 TFLOP/s |", "|---|---|---|---|---|"]
        for r in single:
            for p in r["prefill"]:
                lines.append(f"| {r['model']} | {p['prefill_tokens']} | {p['prefill_tok_s']:.0f} | {p['TFLOP_s']:.0f} | "
                             f"{100 * p['matmul_fraction']:.1f} |")
    engine_rows = [(r, b) for r in results for b in r.get("engine", {}).get("batch_decode", [])]
    if engine_rows:
        lines += ["", "Engine (tileinfer.LLM) decode, every sequence at `context` + up to `new` positions:", "",
                  "| model | KV cache | batch | context | tok/s total | ms/step | GB/s | % roofline | peer tok/s total (BF16) | ratio |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r, b in engine_rows:
            cfg = preset(r["model"])
            kv = b.get("kv", "bf16")
            step_bytes = weight_bytes(cfg) + b["batch"] * kv_bytes(cfg, b["context"] + b["new"] // 2, kv)
            gbs = step_bytes / (b["ms_per_step"] / 1e3) / 1e9
            peer = b.get("peer")
            p = peer["decode_tok_s_total"] if peer else None
            lines.append(f"| {r['model']} | {kv.upper()} | {b['batch']} | {b['context']} | {b['decode_tok_s']:.0f} | "
                         f"{b['ms_per_step']:.3f} | {gbs:.0f} | {100 * gbs * 1e9 / ROOFLINE_BYTES_PER_S:.1f} | "
                         f"{'%.0f' % p if p else '-'} | {'%.2fx' % (b['decode_tok_s'] / p) if p else '-'} |")
    for r in results:
        e = r.get("engine", {})
        if "capture_s" in e:
            lines.append(f"\n{r['model']}: {e['num_graphs']} decode graphs captured in {e['capture_s']:.2f} s")
        if "offline" in e:
            o = e["offline"]
            lines.append(f"\n{r['model']} offline: {o['requests']} requests, {o['prompt_tokens']} prompt + "
                         f"{o['output_tokens']} output tokens in {o['seconds']:.1f} s = **{o['output_tok_s']:.0f} output "
                         f"tok/s** ({o['total_tok_s']:.0f} tok/s in total, {o['preemptions']} preemptions)")
            if "decode_seconds" in o:
                lines.append(f"(decode steps: {o['decode_steps']} in {o['decode_seconds']:.2f} s, "
                             f"{o['decode_rows'] / max(1, o['decode_steps']):.1f} rows each; steps with prompt chunks: "
                             f"{o['prefill_steps']} in {o['prefill_step_seconds']:.2f} s; outside the steps "
                             f"{o['outside_step_seconds']:.2f} s)")
        if "shared_prefix" in e:
            for key, sp in e["shared_prefix"].items():
                lines.append(f"\n{r['model']} shared prefix, cache {key}: {sp['computed_prompt_tokens']} of "
                             f"{sp['prompt_tokens']} prompt tokens computed, {sp['seconds']:.3f} s")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
