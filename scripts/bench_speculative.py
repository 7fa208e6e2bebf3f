#!/usr/bin/env python3
"""Speculative decoding's costs beside plain decoding, batch 1, on synthetic checkpoints (or, given directories,
on those: e.g. the demo target and its DFlash drafter).

    python scripts/bench_speculative.py [--target qwen3-8b] [--draft qwen3-0.6b] [--k 4] [--context 512]
    python scripts/bench_speculative.py --target qwen3-8b --draft dflash-qwen3-8b --k 15
    python scripts/bench_speculative.py --target tileinfer/demo/target --draft tileinfer/demo/dflash --k 15 --profile

Measures, in one process:
  * t_decode: one plain decode step of the target (tileinfer.generate's graph replay; wall time per
    token over --new tokens);
  * t_verify: one greedy verify step of the target, k + 1 positions through the runner's verify
    (the graph of bucket 1 x (k + 1) tokens the engine replays; their argmaxes read back) on a
    sequence of --context positions, then truncated back (wall time, median of --repeats);
  * the GPU time of both target steps (graph replays timed with events), with --profile each
    step's per-kernel GPU time, and with --ablate what each kernel group costs inside each step's
    graph (bench.ablate_step: the graph without the group, subtracted);
  * t_draft: one decode step of the draft model (as t_decode);
  * oracle: decode tokens/s of generate() with an OracleDraft proposing the target's own greedy
    continuation (acceptance 1, drafting free), against plain decode's tokens/s, and its end-to-end
    tokens/s (prefill included);
and prints the speedup expected at acceptance rates 0.6 and 0.8 from those measured costs:

    tokens per round  E = (1 - a^(k+1)) / (1 - a)      (a = per-token acceptance rate)
    time per round    T = k t_draft + t_verify
    speedup           S = E t_decode / T

With a DFlash drafter (--draft dflash-*, written beside the target as a synthetic checkpoint) one forward
drafts all k tokens, so t_draft is one draft after a verify step: the context pass over the step's k + 1
positions (their hidden states read where the verify step left them on the GPU) and the block of k + 1
tokens (wall time, median of --repeats); a round is T = t_draft + t_verify, and at an acceptance length L
(tokens per target step) the expected speedup is L t_decode / T, printed for L = 3, 5, 7. The engine
overlaps parts of a round (the drafts go to the verify step on the device, the context pass is launched
while the verify step runs), so T is an upper bound. Its random weights are accepted about never, so
generate() with it measures a round's whole cost too (decode seconds per target step).

Writes bench_speculative.json to $OUT or --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np

import bench  # scripts/bench.py: the decode step's GPU time and the per-kernel profile
import tileinfer
from tileinfer.kv import Sequence
from tileinfer.model.dflash_config import DFLASH_PRESETS, is_dflash_dir
from tileinfer.model.synthetic import cached_checkpoint, checkpoints_dir, write_checkpoint
from tileinfer.runner.base import ContextRow, DraftRow
from tileinfer.runner.gpu import verify_kind
from tileinfer.runner.gpu_dflash import GPUDFlashRunner

ACCEPTED_CONTEXT = 4  # context positions a round keeps (accepted drafts + 1) before the next draft
CHUNK = 128           # the prompt's prefill chunks in dflash_costs (each fits one step of the target's extend)


def decode_step_seconds(model, context: int, new: int) -> tuple[float, list[int], list[int]]:
    """Wall seconds per plain decode token after a `context`-token prompt; (seconds, prompt, tokens)."""
    prompt = np.random.default_rng(0).integers(0, min(model.config.vocab_size, 151643), context).tolist()
    tileinfer.generate(model, prompt, max_new_tokens=16, stop_at_eos=False)  # warm-up: kernels, graph
    r = tileinfer.generate(model, prompt, max_new_tokens=new, stop_at_eos=False)
    return 1.0 / r.decode_tokens_per_second, prompt, r.token_ids


# Kernel groups of a verify step whose in-graph cost --ablate measures (every product is a swap-AB GEMM
# at k + 1 <= 64 rows; the RMSNorm launches are separate).
VERIFY_ABLATE_GROUPS = (
    ("attention: attn_input, attention, combine", ("attn_input", "attention")),
    ("matrix products (LM head included)", ("gemm", "gemv")),
    ("RMSNorm", ("rmsnorm",)),
)


def verify_step_seconds(model, prompt: list[int], k: int, repeats: int, profile: bool = False,
                        ablate: bool = False) -> tuple[float, float, list | None, dict | None]:
    """One greedy verify step: k + 1 positions appended to a sequence holding the prompt, their
    argmaxes read back (what the engine's greedy rounds ask for). Returns its wall seconds
    (median of `repeats`), its GPU seconds (replays of the captured verify graph and the argmax,
    timed with events: bench.replay_ms, as for a decode step), with `profile` its per-kernel profile
    (bench.profile_graph) and with `ablate` each kernel group's cost inside its graph."""
    cache = model.ensure_cache(len(prompt) + k + 1)
    seq = Sequence()
    n = k + 1
    try:
        model.extend(seq, prompt, logits="none")
        feed = prompt[-n:]
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            cache.manager.reserve(seq, n)
            model.verify([(seq, feed, len(prompt))], logits="argmax", graph_width=n)
            times.append(time.perf_counter() - start)
            cache.manager.truncate(seq, len(prompt))
        # The step buffers still hold the last verify step's inputs; replaying it rewrites the same
        # (now truncated, still unused) cache slots. Its graph computes the argmaxes itself.
        stream = model.stream
        graph = model.graphs.graph(verify_kind(n, "argmax"), 1)
        gpu = bench.replay_ms(stream, lambda s: graph.launch(s), repeats) / 1e3
        enqueue = lambda s: model._enqueue_verify(1, n, "argmax", s, None)  # noqa: E731
        prof = bench.profile_graph(model, enqueue) if profile else None
        ablation = bench.ablate_step(model, enqueue=enqueue, groups=VERIFY_ABLATE_GROUPS) if ablate else None
        return statistics.median(times[1:]), gpu, prof, ablation
    finally:
        cache.manager.release(seq)


def checkpoint(name: str) -> Path:
    """A checkpoint directory as given, or a preset's synthetic checkpoint (written on first use)."""
    return Path(name) if Path(name).is_dir() else cached_checkpoint(name)


def dflash_checkpoint(name: str) -> Path:
    """The synthetic DFlash drafter of a preset (DFLASH_PRESETS), written on first use."""
    out = checkpoints_dir() / f"{name}-seed0"
    marker = out / ".tileinfer-complete"
    if not marker.is_file():
        write_checkpoint(DFLASH_PRESETS[name][1], out, seed=0, progress=False)
        marker.write_text(name)
    return out


def dflash_costs(target, path: Path, prompt: list[int], k: int, new: int, repeats: int) -> dict:
    """A DFlash round's parts on the target (bound to the drafter here): one draft after a verify step of k + 1
    tokens (the context pass over its k + 1 positions, ACCEPTED_CONTEXT of them kept, then the block of k + 1,
    its drafts read back; wall seconds, median), and generate()'s decode seconds per target step with this
    drafter."""
    drafter = GPUDFlashRunner(path, max_num_seqs=1)
    try:
        drafter.bind_target(target)
        cfg = drafter.config
        n = len(prompt)
        drafter.ensure_cache(n + 2 * (ACCEPTED_CONTEXT + k + 1))
        manager, seq = drafter.cache.manager, Sequence()
        block = [int(prompt[-1])] + [cfg.mask_token_id] * k
        cache, tseq = target.ensure_cache(n + k + 1), Sequence()
        manager.reserve(seq, n)  # the prompt's context, once, a prefill chunk at a time
        for at in range(0, n, CHUNK):
            part = prompt[at:at + CHUNK]
            target.extend(tseq, part, logits="none")
            drafter.add_context([ContextRow(seq, at, np.arange(at, at + len(part)), 0)])
        times = []
        for _ in range(repeats + 1):
            cache.manager.reserve(tseq, k + 1)
            target.verify([(tseq, prompt[-(k + 1):], n)], logits="argmax", graph_width=k + 1)
            start = time.perf_counter()
            manager.reserve(seq, k + 1)  # the context pass over the verify step's positions, as a round's
            drafter.add_context([ContextRow(seq, n, np.arange(n, n + k + 1), 0)])
            manager.truncate(seq, n + ACCEPTED_CONTEXT)  # the round kept ACCEPTED_CONTEXT of them
            manager.reserve(seq, k + 1)
            drafter.draft([DraftRow(seq, block, n + ACCEPTED_CONTEXT)]).tokens()
            times.append(time.perf_counter() - start)
            manager.truncate(seq, n)
            cache.manager.truncate(tseq, n)
        manager.release(seq)
        cache.manager.release(tseq)
        r = tileinfer.generate(target, prompt, max_new_tokens=new, stop_at_eos=False, draft_model=drafter,
                               num_draft_tokens=k)
        s = r.speculation
        return dict(t_draft_ms=1e3 * statistics.median(times[1:]),
                    round_ms=1e3 * r.decode_seconds / max(s.target_steps, 1), tokens_per_target_step=s.tokens_per_target_step)
    finally:
        drafter.close()


def speedup(a: float, k: int, t_decode: float, t_draft: float, t_verify: float) -> float:
    tokens = (1 - a ** (k + 1)) / (1 - a)
    return tokens * t_decode / (k * t_draft + t_verify)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen3-8b")
    ap.add_argument("--draft", default="qwen3-0.6b")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--profile", action="store_true",
                    help="also print the per-kernel GPU time of the target's decode and verify steps")
    ap.add_argument("--ablate", action="store_true",
                    help="also print what each kernel group costs inside the decode and verify graphs")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = ap.parse_args()
    k = args.k
    row: dict = dict(target=args.target, draft=args.draft, k=k, context=args.context)
    dflash = args.draft in DFLASH_PRESETS or is_dflash_dir(args.draft)
    with tileinfer.load_model(checkpoint(args.target), progress=False) as target:
        t_decode, prompt, continuation = decode_step_seconds(target, args.context, args.new)
        gpu_decode = bench.graph_step_ms(target) / 1e3
        if args.ablate:  # over the last decode step's buffers, before the verify steps overwrite them
            row["decode_ablation"] = bench.ablate_step(target)
        t_verify, gpu_verify, verify_profile, verify_ablation = verify_step_seconds(
            target, prompt, k, args.repeats, args.profile, args.ablate)
        row.update(gpu_decode_ms=1e3 * gpu_decode, gpu_verify_ms=1e3 * gpu_verify,
                   gpu_verify_over_decode=gpu_verify / gpu_decode)
        if args.profile:
            row["decode_profile"] = bench.profile_step(target)
            row["verify_profile"] = verify_profile
            print(bench.render_profile(f"{args.target} decode", row["decode_profile"]), flush=True)
            print(bench.render_profile(f"{args.target}, k={k}", verify_profile, "one verify step"), flush=True)
        if args.ablate:
            row["verify_ablation"] = verify_ablation
            print(bench.render_ablation(args.target, row["decode_ablation"]), flush=True)
            print(bench.render_ablation(f"{args.target}, k={k}", verify_ablation, "verify step"), flush=True)
        plain_tok_s = 1.0 / t_decode
        # The oracle proposes the greedy continuation itself. A verify step (k + 1 rows on the swap-AB
        # GEMM) and a decode step (one row on the GEMV) round differently, so at a near-tie the
        # speculative greedy output can differ from the plain one; from there on a fixed proposal
        # would be rejected. So propose what speculation itself produced, until it accepts everything
        # (each attempt moves the first difference later; the count is reported).
        proposals = continuation
        for attempt in range(1, 9):
            oracle = tileinfer.generate(target, prompt, max_new_tokens=args.new, stop_at_eos=False,
                                        draft_model=tileinfer.OracleDraft(len(prompt), proposals), num_draft_tokens=k)
            if oracle.token_ids == proposals:
                break
            proposals = oracle.token_ids
        else:
            raise RuntimeError("the oracle draft's proposals were still rejected after 8 attempts")
        same = next((i for i, (a, b) in enumerate(zip(oracle.token_ids, continuation)) if a != b), len(continuation))
        row.update(oracle_attempts=attempt, oracle_tokens_equal_to_plain_greedy=same)
        # Decode tokens/s on both sides (plain decode's figure excludes its prefill too); end to end
        # (the prompt's prefill included) beside it.
        oracle_tok_s = len(oracle.token_ids) / oracle.decode_seconds
        oracle_e2e = len(oracle.token_ids) / (oracle.prefill_seconds + oracle.decode_seconds)
        row.update(t_decode_ms=1e3 * t_decode, t_verify_ms=1e3 * t_verify, verify_over_decode=t_verify / t_decode,
                   plain_tok_s=plain_tok_s, oracle_tok_s=oracle_tok_s, oracle_speedup=oracle_tok_s / plain_tok_s,
                   oracle_end_to_end_tok_s=oracle_e2e, oracle_prefill_ms=1e3 * oracle.prefill_seconds,
                   oracle_tokens_per_step=oracle.speculation.tokens_per_target_step)
        if dflash:
            path = Path(args.draft) if Path(args.draft).is_dir() else dflash_checkpoint(args.draft)
            row["dflash"] = d = dflash_costs(target, path, prompt, k, args.new, args.repeats)
            t_round = d["t_draft_ms"] / 1e3 + t_verify
            row["expected_speedup"] = {str(L): L * t_decode / t_round for L in (3, 5, 7)}
            print(f"{args.draft}: draft {d['t_draft_ms']:.3f} ms (the context of the verify step's {k + 1} positions, "
                  f"a block of {k + 1}), round {1e3 * t_round:.3f} ms "
                  f"from its parts; generate() with it: {d['round_ms']:.3f} ms per target step "
                  f"({d['tokens_per_target_step']:.2f} tokens a step)")
    if not dflash:
        with tileinfer.load_model(checkpoint(args.draft), progress=False) as draft:
            t_draft, _, _ = decode_step_seconds(draft, args.context, args.new)
        row["t_draft_ms"] = 1e3 * t_draft
        row["expected_speedup"] = {str(a): speedup(a, k, t_decode, t_draft, t_verify) for a in (0.6, 0.8)}
    print(f"{args.target} target, k={k}, context {args.context}: decode step {row['t_decode_ms']:.3f} ms, "
          f"verify step {row['t_verify_ms']:.3f} ms ({row['verify_over_decode']:.2f}x)"
          + ("" if dflash else f", {args.draft} draft step {row['t_draft_ms']:.3f} ms"))
    print(f"GPU time (graph replays): decode step {row['gpu_decode_ms']:.3f} ms, verify step {row['gpu_verify_ms']:.3f} ms "
          f"({row['gpu_verify_over_decode']:.2f}x)")
    print(f"oracle draft: {oracle_tok_s:.1f} decode tok/s vs plain {plain_tok_s:.1f} ({row['oracle_speedup']:.2f}x; "
          f"end to end {oracle_e2e:.1f} tok/s with a {row['oracle_prefill_ms']:.1f} ms prefill; "
          f"{row['oracle_tokens_per_step']:.2f} tokens per target step; {attempt} oracle attempt(s), the first "
          f"{same} of {len(continuation)} tokens equal to plain greedy)")
    for a, s in row["expected_speedup"].items():
        if dflash:
            print(f"acceptance length {a} tokens per target step: expected speedup {s:.2f}x")
        else:
            print(f"acceptance {a}: E = (1 - a^(k+1)) / (1 - a) = {(1 - float(a) ** (k + 1)) / (1 - float(a)):.2f} "
                  f"tokens per round, expected speedup {s:.2f}x")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "bench_speculative.json").write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
