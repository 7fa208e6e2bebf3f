#!/usr/bin/env python3
"""The demo model (tileinfer/demo) on the GPU: fidelity and speculation, measured on weights that mean
something.

    python scripts/demo_checks.py [--data build/demo-data] [--out DIR] [--parts greedy,top1,...]

  1. greedy: the engine's greedy continuation (128 tokens, EOS not stopping it) of the three chats whose
     reference continuations tests/test_demo.py pins, and of the README's five, against the float32
     reference's; where they part, the reference's top-two logit gap there (a near tie that bf16 rounding
     may flip, or not); and each README chat's reply as the engine gives it (ending at EOS);
  2. transformers: Qwen3ForCausalLM loads the directory unchanged; its float32 logits on a held-out
     chat against the engine's (max |difference|, top-1 agreement);
  3. top-1: teacher-forced agreement of the engine's next-token argmax with the reference's over
     held-out tokens (windows of chat and of docs from scripts/prepare_demo_data.py's held-out split);
  4. INT8 cache: mean KL(BF16 cache || INT8 cache) of the next-token distributions over those
     windows, with and without key smoothing;
  5. speculation with the demo draft (and, given --dflash, a DFlash drafter of the demo target): greedy
     output against plain greedy, acceptance rate, tokens per target step, a round's time and wall-clock
     tokens/s against plain decoding, batch 1, with batch-invariant kernels (where the output must be
     identical) and with the default kernels.

Prints each part and writes demo_checks.json to --out ($OUT by default).
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np

from tileinfer import LLM, SamplingParams
from tileinfer.chat import render_chat
from tileinfer.demo import DRAFT, TARGET
from tileinfer.model.checkpoint import Checkpoint
from tileinfer.model.reference import ReferenceModel

# The chats tests/test_demo.py pins the reference's continuations of, then the README's five.
PINNED = ["Hello! How are you today?", "What do you like to do on weekends?", "How do I open a file in Python?"]
PROMPTS = ["Hello!", "Hi, how are you doing today?", "What is your favourite food?",
           "How do I read a file line by line in Python?", "What does the len() function do in Python?"]
PARTS = ("greedy", "top1", "transformers", "int8", "speculation")
WINDOW = 500  # tokens per held-out window


def chat_ids(checkpoint, tokenizer, question: str) -> list[int]:
    text = render_chat(checkpoint.chat_template, [{"role": "user", "content": question}], enable_thinking=False)
    return tokenizer.encode(text, add_special_tokens=False).ids


def windows(data: Path, tokens: int) -> list[list[int]]:
    """Held-out windows, half chat and half docs, WINDOW tokens each, `tokens` in all."""
    held = np.load(data / "tokens.npz")
    n = max(1, tokens // WINDOW // 2)
    out = []
    for key in ("held_out_chat", "held_out_docs"):
        arr = held[key]
        step = max(WINDOW, (len(arr) - WINDOW) // n)
        out += [arr[i:i + WINDOW].astype(np.int64).tolist() for i in range(0, step * n, step)][:n]
    return out


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def part_greedy(llm, reference, checkpoint, tokenizer) -> dict:
    rows = []
    for q in PINNED + PROMPTS:
        ids = chat_ids(checkpoint, tokenizer, q)
        engine = llm.generate([ids], SamplingParams(max_tokens=128, temperature=0, ignore_eos=True))[0].token_ids
        ref = reference.greedy(ids, 128)
        same = next((i for i, (a, b) in enumerate(zip(engine, ref)) if a != b), len(ref))
        row = dict(prompt=q, pinned=q in PINNED, equal_tokens=same, of=128)
        note = ""
        if same < len(ref):  # the reference's own logits where the two part: how close its top two were
            logits = reference.forward(ids + ref[:same])[-1]
            top2 = np.sort(logits)[-2:]
            row.update(gap=float(top2[1] - top2[0]), gap_std=float((top2[1] - top2[0]) / logits.std()),
                       reference_token=ref[same], engine_token=engine[same],
                       engine_token_logit_below_top=float(top2[1] - logits[engine[same]]))
            note = (f"; they part at token {same}: reference top-two gap {row['gap']:.4f} "
                    f"({row['gap_std']:.4f} std), the engine's token {row['engine_token_logit_below_top']:.4f} "
                    f"below the reference's top")
        if q in PROMPTS:
            row["reply"] = llm.generate([ids], SamplingParams(max_tokens=96, temperature=0))[0].text
            note += f"; reply {row['reply']!r}"
        rows.append(row)
        print(f"greedy {q!r}: engine = reference for {same} of 128 tokens{note}", flush=True)
    pinned = [r for r in rows if r["pinned"]]
    return dict(rows=rows, pinned_all_equal=all(r["equal_tokens"] == 128 for r in pinned),
                all_equal=all(r["equal_tokens"] == 128 for r in rows))


def part_transformers(llm, ids: list[int]) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(TARGET, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(torch.tensor([ids])).logits[0].numpy()
    ours = llm.logits(ids)
    diff = float(np.abs(theirs - ours).max())
    agree = float((theirs.argmax(-1) == ours.argmax(-1)).mean())
    print(f"transformers: {type(model).__name__} loaded; {len(ids)} positions, max |logits difference| {diff:.4f} "
          f"(logits up to {float(np.abs(theirs).max()):.1f}), top-1 agreement {agree:.4f}", flush=True)
    return dict(architecture=type(model).__name__, positions=len(ids), max_abs_diff=diff, top1_agreement=agree)


def part_top1(llm, reference, wins) -> dict:
    agree = total = 0
    for w in wins:
        ours, ref = llm.logits(w), reference.forward(w)
        agree += int((ours.argmax(-1) == ref.argmax(-1)).sum())
        total += len(w)
    print(f"top-1: engine (BF16) = float32 reference on {agree} of {total} held-out positions "
          f"({agree / total:.4f})", flush=True)
    return dict(positions=total, agreement=agree / total)


def part_int8(wins, device: str) -> dict:
    def logits_of(**cache) -> list[np.ndarray]:
        with LLM(TARGET, device=device, max_context=1024, progress=False, **cache) as llm:
            return [llm.logits(w) for w in wins]

    base = [log_softmax(x) for x in logits_of()]
    out = {}
    for smoothing in (True, False):
        kls = [(np.exp(p) * (p - log_softmax(q))).sum(-1)
               for p, q in zip(base, logits_of(kv_quantize="int8", kv_smoothing=smoothing))]
        key = "smoothed" if smoothing else "unsmoothed"
        out[key] = float(np.concatenate(kls).mean())
        print(f"INT8 cache, keys {key}: mean KL(BF16 || INT8) {out[key]:.6f} over {sum(len(w) for w in wins)} "
              f"positions", flush=True)
    return out


def part_speculation(checkpoint, tokenizer, chats: list[str], new: int, device: str, dflash: Path | None,
                     passes: int = 3) -> dict:
    """Batch-1 greedy decoding of the chats plainly, with the demo draft model (k = 4) and, given one, with a
    DFlash drafter (its block's k): each one's tokens against plain's, acceptance, tokens per target step and
    tokens/s (the best of `passes` passes over the chats), in both kernel modes on the GPU: batch-invariant (the
    mode in which greedy output must equal plain greedy's) and the default kernels (what a user runs)."""
    prompts = [chat_ids(checkpoint, tokenizer, q) for q in chats]
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    runs = [("plain", {}), ("draft", dict(draft_model=DRAFT, num_draft_tokens=4))]
    if dflash is not None:
        runs.append(("dflash", dict(draft_model=dflash)))
    summary = dict(prompts=len(prompts), new_tokens=new, passes=passes)
    for mode, invariant in ((("batch-invariant", True), ("default kernels", False)) if device != "cpu"
                            else (("cpu", False),)):
        result = {}
        for name, extra in runs:
            with LLM(TARGET, device=device, batch_invariant=invariant, max_num_seqs=4, max_context=1024,
                     progress=False, **extra) as llm:
                llm.generate([prompts[0]], params)  # warm: kernels compiled, graphs captured
                best = None
                for _ in range(passes):  # batch 1, one chat after another
                    start = time.perf_counter()
                    outs = [llm.generate([p], params)[0] for p in prompts]
                    seconds = time.perf_counter() - start
                    best = seconds if best is None else min(best, seconds)
            r = result[name] = dict(tokens=[o.token_ids for o in outs], tok_s=len(prompts) * new / best)
            if name == "plain":
                r["ms_per_step"] = best / (len(prompts) * new) * 1e3
                continue
            spec = [o.speculation for o in outs]
            drafted, accepted = sum(s.drafted for s in spec), sum(s.accepted for s in spec)
            emitted, steps = sum(s.emitted for s in spec), sum(s.target_steps for s in spec)
            r.update(identical=r["tokens"] == result["plain"]["tokens"], acceptance=accepted / drafted,
                     tokens_per_target_step=emitted / steps, ms_per_round=best / steps * 1e3,
                     speedup=r["tok_s"] / result["plain"]["tok_s"])
            print(f"speculation, {mode}, {name} (batch 1, {len(prompts)} held-out chats x {new} tokens, best of "
                  f"{passes}): greedy identical to plain: {r['identical']}; acceptance {r['acceptance']:.3f}, "
                  f"{r['tokens_per_target_step']:.2f} tokens per target step, {r['ms_per_round']:.3f} ms a round "
                  f"(a plain step {result['plain']['ms_per_step']:.3f} ms); {result['plain']['tok_s']:.1f} -> "
                  f"{r['tok_s']:.1f} tok/s ({r['speedup']:.2f}x)", flush=True)
        summary[mode] = {name: {k: v for k, v in r.items() if k != "tokens"} for name, r in result.items()}
    return summary


def held_out_questions(data: Path, tokenizer, n: int) -> list[str]:
    """The first user turns of held-out chats (their text between <|im_start|>user and <|im_end|>)."""
    text = tokenizer.decode(np.load(data / "tokens.npz")["held_out_chat"][:40000].tolist(), skip_special_tokens=False)
    out = []
    for part in text.split("<|im_start|>user\n")[1:]:
        q = part.split("<|im_end|>")[0].strip()
        if 10 < len(q) < 200:
            out.append(q)
        if len(out) == n:
            break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=Path("build/demo-data"))
    ap.add_argument("--tokens", type=int, default=2000, help="held-out positions for top-1 and KL (2000)")
    ap.add_argument("--device", default="cuda", help="cuda (the measurement) or cpu (a dry run of the script)")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--dflash", type=Path, default=None, help="a DFlash drafter of the demo target for part 5")
    ap.add_argument("--parts", default=",".join(PARTS), help=f"which parts to run (default all: {','.join(PARTS)})")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    if not parts <= set(PARTS):
        ap.error(f"--parts takes {', '.join(PARTS)}; got {args.parts}")
    checkpoint = Checkpoint.open(TARGET)
    tokenizer = checkpoint.tokenizer()
    reference = ReferenceModel.from_checkpoint(checkpoint)
    wins = windows(args.data, args.tokens) if parts & {"top1", "transformers", "int8"} else []
    report = {}
    with LLM(TARGET, device=args.device, batch_invariant=args.device != "cpu", max_context=1024,
             progress=False) as llm:
        if "greedy" in parts:
            report["greedy"] = part_greedy(llm, reference, checkpoint, tokenizer)
        if "top1" in parts:
            report["top1"] = part_top1(llm, reference, wins)
        if "transformers" in parts:
            try:
                report["transformers"] = part_transformers(llm, wins[0][:256])
            except Exception as e:  # noqa: BLE001 (the other parts stand on their own)
                report["transformers"] = dict(error=f"{type(e).__name__}: {e}")
                print(f"transformers: failed: {e}", flush=True)
    if "int8" in parts:
        report["int8_kl"] = part_int8(wins, args.device)
    if "speculation" in parts:
        report["speculation"] = part_speculation(checkpoint, tokenizer, held_out_questions(args.data, tokenizer, 8),
                                                 128, args.device, args.dflash)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "demo_checks.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
