#!/usr/bin/env python3
"""What structured output costs a batch: engine (tileinfer.LLM) decode with none, all and half of the
requests held to a JSON schema.

    python scripts/bench_structured.py                          # qwen3-0.6b on the GPU, batch 64, 512 positions
    python scripts/bench_structured.py --device cpu --preset tiny --batch 4 --context 16 --new 8   # a dry run

Three runs of `batch` requests with `context`-token random prompts decoding `new` tokens each, timed over
the steps in which all of them decode together (scripts/bench_engine.batch_decode): (a) no request
constrained (greedy, ignore_eos); (b) every request constrained by SCHEMA (greedy); (c) every other
request constrained. Masking cost = (b's step time - a's) / a's: what the masks add to a decode step
(the host computes them while the step's forward runs; the GPU copies them in before sampling). (c)
reports total output tokens/s. SCHEMA cannot be complete in fewer than ~1,000 tokens (minItems), so
no request ends before `new` tokens (batch_decode asserts it), and the engine checks every sampled token
against its grammar (a refused one would end its request early, and fail that assertion).

Prints the three step times, the masking cost as a fraction of the step, the host's grammar time per
step (matchers advanced and masks computed) and tokens/s; writes bench_structured.json to $OUT or --out.

--graphs (GPU) also times what masks cost the GPU alone: the batch's decode graph replayed back to back with
and without its masks, over a live step's buffers (random masks, about half the vocabulary allowed, their
flag set before each replay, so no replay waits for the host).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from cuda.bindings import driver

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench import replay_ms  # noqa: E402
from bench_engine import batch_decode, live_step  # noqa: E402

import tileinfer  # noqa: E402
from tileinfer import SamplingParams, StructuredOutputs  # noqa: E402
from tileinfer.cuda import Graph  # noqa: E402
from tileinfer.cuda.driver import call  # noqa: E402
from tileinfer.model.synthetic import cached_checkpoint  # noqa: E402

# A user record with typed fields and a long list of events: strings, integers, numbers, enums, booleans,
# nested objects and arrays, as an API response schema would have them.
EVENT = {"type": "object", "properties": {
    "t": {"type": "integer", "minimum": 0},
    "what": {"type": "string", "maxLength": 24},
    "level": {"enum": ["debug", "info", "warning", "error"]},
    "ok": {"type": "boolean"}},
    "required": ["t", "what", "level", "ok"], "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0},
    "name": {"type": "string", "maxLength": 40},
    "role": {"enum": ["user", "admin", "guest", "service"]},
    "score": {"type": "number"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
    "events": {"type": "array", "items": EVENT, "minItems": 100}},
    "required": ["id", "name", "role", "score", "tags", "events"], "additionalProperties": False}


def params(new: int, constrained: list[bool]) -> list[SamplingParams]:
    schema = StructuredOutputs(json=SCHEMA)
    return [SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, structured_outputs=schema if c else None)
            for c in constrained]


def report(name: str, r: dict) -> None:
    print(f"{name}: {r['ms_per_step']:.3f} ms/step ({r['gpu_wait_ms_per_step']:.3f} ms waiting for the device, "
          f"{r['grammar_ms_per_step']:.3f} ms in the grammar), {r['decode_tok_s']:.0f} tok/s in total "
          f"over {r['steps']} steps", flush=True)


def masked_graph_us(runner, batch: int, replays: int = 200) -> dict:
    """GPU microseconds of the decode graph of `batch` rows, replayed without ("plain") and with ("masked")
    its bitmasks (every row masked; random masks): live_step's inspect. The masks' flag is set by the stream
    before each replay, so the masked replays never wait for the host."""
    steps = runner.steps
    words = steps.masks.shape[1]
    rng = np.random.default_rng(0)
    steps.masks_host.array((batch, words), np.int32)[:] = rng.integers(-2**31, 2**31, (batch, words)).astype(np.int32)
    steps.host["mask_rows"][:batch] = np.arange(batch)
    flag = steps.mask_flag.device_ptr
    out = {}
    try:
        for name, masked in (("plain", False), ("masked", True), ("plain", False), ("masked", True)):
            graph = Graph(runner.stream, lambda s: runner._enqueue_decode(batch, s, masked=masked))

            def launch(s, graph=graph):
                call(driver.cuStreamWriteValue32, s.handle, flag, 1, 0)
                graph.launch(s)
            try:
                out.setdefault(name, []).append(replay_ms(runner.stream, launch, replays) * 1e3)
            finally:
                graph.destroy()
    finally:
        call(driver.cuStreamWriteValue32, runner.stream.handle, flag, 0, 0)
        runner.stream.synchronize()
        steps.host["mask_rows"][:] = -1
    return out


def workload_arguments(ap: argparse.ArgumentParser) -> None:
    """The model, device and batch options (this script's and structured_timeline.py's)."""
    ap.add_argument("--preset", default="qwen3-0.6b", help="synthetic checkpoint preset (made on first use)")
    ap.add_argument("--model", type=Path, help="a checkpoint directory instead of --preset")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--context", type=int, default=512, help="prompt positions before the timed decode")
    ap.add_argument("--new", type=int, default=128, help="tokens each request decodes")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    workload_arguments(ap)
    ap.add_argument("--graphs", action="store_true",
                    help="also time the decode graph replayed with and without masks (the GPU's cost alone)")
    args = ap.parse_args(argv)
    if args.batch < 2 or args.new < 4:
        ap.error("--batch must be >= 2 (half of it is constrained) and --new >= 4 (steps to time)")

    t = time.perf_counter()
    path = args.model or cached_checkpoint(args.preset)
    name = args.model.name if args.model else args.preset
    print(f"{name}: checkpoint ready in {time.perf_counter() - t:.1f} s", flush=True)
    with tileinfer.LLM(path, device=args.device, max_num_seqs=args.batch, max_context=args.context + args.new + 64,
                       progress=False) as llm:
        device = llm.runner.device.info.name if args.device == "cuda" else "CPU runner"
        print(f"{device}; {name}, batch {args.batch}, {args.context} positions + {args.new} new, bf16 weights"
              f"{' (float32 on the CPU)' if args.device == 'cpu' else ''}", flush=True)
        # Warm-up: kernels, the decode graphs with and without masks at this batch, the grammar's lexer.
        batch_decode(llm, args.batch, 16, 4, params(4, [True] * args.batch))
        plain = batch_decode(llm, args.batch, args.context, args.new)
        report("(a) no request constrained", plain)
        every = batch_decode(llm, args.batch, args.context, args.new, params(args.new, [True] * args.batch))
        report("(b) every request constrained", every)
        half = batch_decode(llm, args.batch, args.context, args.new,
                            params(args.new, [i % 2 == 0 for i in range(args.batch)]))
        report("(c) half the requests constrained", half)
        graphs = None
        if args.graphs and args.device == "cuda":
            graphs = live_step(llm, args.batch, args.context, masked_graph_us)
            plain_us, masked_us = np.mean(graphs["plain"]), np.mean(graphs["masked"])
            print(f"decode graph of {args.batch} rows, GPU time: {plain_us:.1f} us plain, {masked_us:.1f} us with "
                  f"masks ({masked_us - plain_us:+.1f} us; two replay runs of each: "
                  f"{', '.join(f'{x:.1f}' for x in graphs['plain'])} / {', '.join(f'{x:.1f}' for x in graphs['masked'])})",
                  flush=True)
    cost = (every["ms_per_step"] - plain["ms_per_step"]) / plain["ms_per_step"]
    print(f"masking cost, every request constrained: {100 * cost:+.1f}% of the decode step "
          f"({every['ms_per_step'] - plain['ms_per_step']:+.3f} ms of {plain['ms_per_step']:.3f} ms)")
    print(f"half constrained: {half['decode_tok_s']:.0f} output tok/s in total "
          f"({half['decode_tok_s'] / plain['decode_tok_s']:.3f} of the unconstrained batch's)")
    result = dict(device=device, model=name, batch=args.batch, context=args.context, new=args.new, schema=SCHEMA,
                  plain=plain, every=every, half=half, masking_cost_fraction=cost, graph_us=graphs)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_structured.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
