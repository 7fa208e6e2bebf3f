#!/usr/bin/env python3
"""Tensor parallelism's decode speed on the GPUs of one machine: a preset at each --tp size and batch size.

    python3 scripts/bench_tp.py --preset qwen3-32b --tp 1,2 --batches 1,64
    python3 scripts/bench_tp.py --preset apertus-70b --tp 2 --batches 1          # does not fit one H200

Each case loads a config-only directory of the preset (config.json and the tokenizer files, written here as
scripts/make_checkpoint.py --config-only writes them) with load_format="dummy" (random weights of its shapes,
made as they load), as LLM(tensor_parallel_size=N): B requests of a --context-token prompt decode --new tokens
together (bench_engine.batch_decode: tokens/s over the steps in which all B decode). The roofline of a step:
every weight once (the embedding once, as the LM head) and each request's cache, split over the N GPUs, each
reading at 4.3 TB/s. Batch 1's speed-up of TP N over TP 1 is the issue's figure (goal: at least 1.6x at TP 2).

The collectives' share of a step (TP > 1): a decode step's collectives alone, in forward.py's order and sizes
(the embedding's all-reduce, o_proj's and down_proj's in every layer, all of [batch, hidden] float32, and the LM
head's all-gather of [batch, vocabulary part] float32), captured in one graph on each of N processes (one GPU
each, their own communicator) and replayed back to back: their GPU time (the slowest rank's) over the step's.
In the step they wait on each other as they do here, one after another on the critical path.
--collectives-only measures that alone, at every --tp size, including 1 (a one-rank communicator: the calls'
fixed cost, on a machine with one GPU).

Prints a markdown table; writes bench_tp.json to $OUT (or --out).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import kv_bytes, weight_bytes  # noqa: E402
from bench_engine import batch_decode  # noqa: E402

from tileinfer import LLM  # noqa: E402
from tileinfer.model.config import PRESETS  # noqa: E402
from tileinfer.model.sharding import vocab_part  # noqa: E402
from tileinfer.model.synthetic import checkpoints_dir, write_text_files  # noqa: E402

HBM_TBS = 4.3  # an H200's measured read bandwidth (docs/benchmarks.md, Rooflines)


def config_dir(preset: str) -> Path:
    """The preset's config-only directory (written on first use)."""
    out = checkpoints_dir() / f"{preset}-config"
    if not (out / "config.json").is_file():
        out.mkdir(parents=True, exist_ok=True)
        write_text_files(PRESETS[preset], out)
    return out


def case(path: Path, cfg, tp: int, batch: int, context: int, new: int, device: str = "cuda") -> dict:
    with LLM(path, load_format="dummy", tensor_parallel_size=tp, max_num_seqs=max(batch, 1), device=device,
             max_context=context + new + 16, progress=False) as llm:
        r = batch_decode(llm, batch, context, new)
    positions = context + new // 2  # the mean position of the timed tokens
    step_bytes = weight_bytes(cfg) + batch * kv_bytes(cfg, positions)
    roofline = batch / (step_bytes / (tp * HBM_TBS * 1e12))
    return dict(tp=tp, batch=batch, context=context, new=new, tok_s=r["decode_tok_s"], ms_per_step=r["ms_per_step"],
                roofline_tok_s=roofline, of_roofline=r["decode_tok_s"] / roofline)


def collectives_rank(rank: int, world: int, uid: bytes, cfg, rows: int, replays: int, results) -> None:
    """One rank of collectives_ms (a spawned process): its GPU, the group's communicator, a decode step's
    collectives captured in one graph and replayed; puts (rank, GPU ms a replay) or (rank, traceback)."""
    try:
        import numpy as np

        from bench import replay_ms
        from tileinfer.cuda import DeviceArray, Graph, Stream, get_device
        from tileinfer.cuda.nccl import Communicator
        get_device(rank)
        with Communicator(uid, world, rank) as comm:
            stream = Stream()
            resid = DeviceArray.zeros((rows, cfg.hidden_size), np.float32)
            part = DeviceArray.zeros((rows, vocab_part(cfg.vocab_size, world)), np.float32)
            parts = DeviceArray.zeros((world * rows, part.shape[1]), np.float32)

            def step(s) -> None:
                for _ in range(1 + 2 * cfg.num_hidden_layers):  # the embedding's, then two a layer
                    comm.all_reduce(resid, s)
                comm.all_gather(part, parts, s)                 # the LM head's logits parts

            graph = Graph(stream, step, "a decode step's collectives")
            results.put((rank, replay_ms(stream, graph.launch, replays)))
    except BaseException:
        results.put((rank, traceback.format_exc()))


def collectives_ms(cfg, world: int, rows: int, replays: int = 50, timeout: float = 300.0) -> float:
    """GPU milliseconds of a decode step's collectives at TP `world` for `rows` rows (the module docstring), on
    GPUs 0..world-1: the slowest rank's."""
    from tileinfer.cuda.nccl import unique_id
    ctx = multiprocessing.get_context("spawn")
    results, uid = ctx.Queue(), unique_id()
    procs = [ctx.Process(target=collectives_rank, args=(r, world, uid, cfg, rows, replays, results))
             for r in range(world)]
    for proc in procs:
        proc.start()
    try:
        times = []
        for _ in range(world):
            rank, got = results.get(timeout=timeout)
            if isinstance(got, str):
                raise RuntimeError(f"the collectives' rank {rank} failed:\n{got}")
            times.append(got)
        return max(times)
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3-32b", choices=sorted(PRESETS))
    ap.add_argument("--tp", default="1,2", help="tensor-parallel sizes, e.g. 1,2")
    ap.add_argument("--batches", default="1,64", help="batch sizes, e.g. 1,64")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a dry run of the script (TP 1)")
    ap.add_argument("--collectives-only", action="store_true",
                    help="only a decode step's collectives at each --tp size (1 included) and batch")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = ap.parse_args()
    cfg = PRESETS[args.preset]
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for tp in (int(t) for t in args.tp.split(",")):
            if args.collectives_only:
                ms = collectives_ms(cfg, tp, batch)
                rows.append(dict(tp=tp, batch=batch, collectives_ms=ms))
                print(f"{args.preset} TP {tp}, batch {batch}: a decode step's collectives {ms:.3f} ms", flush=True)
                continue
            row = case(config_dir(args.preset), cfg, tp, batch, args.context, args.new, args.device)
            share = ""
            if tp > 1 and args.device == "cuda":
                row["collectives_ms"] = collectives_ms(cfg, tp, batch)
                row["collectives_share"] = row["collectives_ms"] / row["ms_per_step"]
                share = f", its collectives {row['collectives_ms']:.3f} ms ({100 * row['collectives_share']:.1f}%)"
            rows.append(row)
            print(f"{args.preset} TP {tp}, batch {batch}: {row['tok_s']:,.1f} tok/s, {row['ms_per_step']:.3f} ms a step"
                  f"{share}, {100 * row['of_roofline']:.1f}% of {row['roofline_tok_s']:,.1f}", flush=True)
    if not args.collectives_only:
        base = {r["batch"]: r["tok_s"] for r in rows if r["tp"] == 1}
        print(f"\n| {args.preset} | batch | tok/s | % of roofline | over TP 1 | collectives' share |\n"
              f"|---|---|---|---|---|---|")
        for r in rows:
            over = f"{r['tok_s'] / base[r['batch']]:.2f}x" if r["batch"] in base else "-"
            share = f"{100 * r['collectives_share']:.1f}%" if "collectives_share" in r else "-"
            print(f"| TP {r['tp']} | {r['batch']} | {r['tok_s']:,.1f} | {100 * r['of_roofline']:.1f}% | {over} | {share} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_tp.json").write_text(json.dumps(dict(preset=args.preset, rows=rows), indent=1))


if __name__ == "__main__":
    main()
