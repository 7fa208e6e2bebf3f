#!/usr/bin/env python3
"""Revisions of TileInfer measured against each other on one machine, their runs alternated.

A change's gain is measured against the code before it on the same machine start, each tree run more than
once, in turns: between machine starts the same code moves by more than most changes gain. Two steps:

In a git checkout: each revision's package (tileinfer/ without the demo model's files, graphs/, cuda_src/), its
tests and scripts into ab-trees/NAME (a GPU machine without the repository's history needs only that folder
beside a checkout). A command that uses the demo model by default (`tileinfer generate` without --model,
bench_goals.py's cold start) fails under a tree: give it the checkout's, tileinfer/demo/target.

    python3 scripts/ab.py prepare main tma-split-push

On the GPU machine, from the checkout's root: a check under each tree first (a tree whose check fails is left
out of the timing), then each command under each tree, `--repeats` rounds, the trees' order reversed every
other round (A B, B A, ...), each run's output kept under --logs; last a table of every figure found:

    python3 scripts/ab.py run --trees main,tma-split-push --repeats 2 \\
        --check 'cd $TREE && python3 -m pytest -q -x tests/gpu/test_gemm.py' \\
        --cmd "python3 scripts/bench.py --models qwen3-4b --no-single --prefill '' --batches 144,256"

A tree is a package first on PYTHONPATH: the commands (this checkout's scripts, the tree's tests from $TREE) import
its `tileinfer`, and its kernels compile from its own cuda_src (each tree's cubins are cached under their own
keys). The tree `.` is this checkout as it is. A figure is a number followed by one of --units on a line of a
run's output; the text before it names the row, so the n-th row of a label in one run meets the n-th of that
label in the others.
"""
from __future__ import annotations

import argparse
import io
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREES = ROOT / "ab-trees"
UNITS = ("output tok/s", "tok/s", "TFLOP/s", "GB/s")
# A revision's tree: the package as installed (graphs/ inside it; cuda_src/ beside it, where the compiler looks
# first), its tests with their configuration, which a check runs from $TREE, and its scripts (a script only a
# branch has: $TREE/scripts/NAME.py; its neighbours still come from this checkout's scripts/).
TREE_PATHS = ("tileinfer", "graphs", "cuda_src", "tests", "scripts", "pyproject.toml")


def slug(name: str) -> str:
    """A tree's name as a file name."""
    return "checkout" if name == "." else name.replace("/", "_")


def tree_dir(name: str) -> Path:
    return ROOT if name == "." else TREES / slug(name)


def prepare(revisions: list[str]) -> None:
    for rev in revisions:
        out = tree_dir(rev)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev, *TREE_PATHS],
                                 capture_output=True)
        if archive.returncode != 0:
            sys.exit(f"ab.py: git archive {rev} failed: {archive.stderr.decode().strip()}")
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(out, filter="data")
        (out / "graphs").rename(out / "tileinfer" / "graphs")  # installed as tileinfer.graphs (pyproject.toml)
        demo = out / "tileinfer" / "demo"
        for path in demo.iterdir() if demo.is_dir() else ():
            if path.suffix != ".py":  # the demo model's weights and logs: megabytes no benchmark reads
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], capture_output=True, text=True)
        (out / "REVISION").write_text(f"{rev} {sha.stdout.strip()}\n")
        size = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
        print(f"{rev} ({sha.stdout.strip()}): {out} ({size // 1024} KB)")


def tree_env(name: str) -> dict[str, str]:
    """The tree first on PYTHONPATH, then scripts/ (the benchmarks import their neighbours); PYTHONSAFEPATH keeps
    Python from putting the working directory (this checkout, with its own tileinfer) or a script's folder
    before them. $TREE names the tree's folder (its tests: `cd $TREE && python3 -m pytest tests/gpu/...`)."""
    path = (str(tree_dir(name)), str(ROOT / "scripts"), os.environ.get("PYTHONPATH"))
    return dict(os.environ, PYTHONUNBUFFERED="1", PYTHONSAFEPATH="1", PYTHONPATH=os.pathsep.join(p for p in path if p),
                TREE=str(tree_dir(name)))


def imported_from(name: str) -> Path:
    """Where `import tileinfer` resolves under the tree's environment (it must be the tree)."""
    r = subprocess.run([sys.executable, "-c", "import tileinfer; print(tileinfer.__file__)"], env=tree_env(name),
                       capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(f"tree {name}: import tileinfer failed:\n{r.stderr[-2000:]}")
    return Path(r.stdout.strip()).resolve().parent


def figures(text: str, units: tuple[str, ...]) -> list[tuple[str, float]]:
    """(label, value) for the first figure of each line that has one: a number (thousands commas allowed)
    followed by a unit; the label is the line's text before the number, its spaces collapsed. Markdown table
    rows are passed over: their cells carry no units, and a header's unit ("% of 790 TFLOP/s") is no figure."""
    unit = "|".join(re.escape(u) for u in sorted(units, key=len, reverse=True))
    pattern = re.compile(rf"(?<![\w.])(\d[\d,]*(?:\.\d+)?) ?(?:{unit})(?!\w)")
    out = []
    for line in text.splitlines():
        m = None if line.lstrip().startswith("|") else pattern.search(line)
        if m:
            out.append((" ".join(line[:m.start()].split()), float(m.group(1).replace(",", ""))))
    return out


def keyed(found: list[tuple[str, float]]) -> dict[tuple[str, int], float]:
    """The n-th figure of each label, keyed (label, n)."""
    seen: dict[str, int] = {}
    out = {}
    for label, value in found:
        n = seen.get(label, 0)
        seen[label] = n + 1
        out[(label, n)] = value
    return out


def table(trees: list[str], runs: dict[str, list[dict[tuple[str, int], float]]]) -> str:
    """One row a figure: each tree's values in run order, and each tree's median against the first tree's."""
    rows: list[tuple[str, int]] = []
    for tree in trees:
        for run in runs[tree]:
            rows.extend(k for k in run if k not in rows)
    head = "| figure | " + " | ".join(trees) + " | " + " | ".join(f"{t} / {trees[0]}" for t in trees[1:]) + " |"
    lines = [head, "|" + "---|" * (1 + 2 * len(trees) - 1)]
    for key in rows:
        values = {t: [run[key] for run in runs[t] if key in run] for t in trees}
        cells = [" and ".join(f"{v:,.1f}" for v in values[t]) or "-" for t in trees]
        base = statistics.median(values[trees[0]]) if values[trees[0]] else None
        changes = []
        for t in trees[1:]:
            ok = base and values[t]
            changes.append(f"{statistics.median(values[t]) / base - 1:+.1%}" if ok else "-")
        label = key[0] + (f" (#{key[1] + 1})" if key[1] else "")
        lines.append(f"| {label} | " + " | ".join(cells) + " | " + " | ".join(changes) + " |")
    return "\n".join(lines)


def run_one(name: str, command: str, log: Path, timeout: float) -> tuple[str, float, int]:
    t0 = time.perf_counter()
    try:
        r = subprocess.run(["bash", "-c", command], env=tree_env(name), cwd=ROOT, capture_output=True, text=True,
                           timeout=timeout)
        text, rc = r.stdout + r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:
        text = (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
        text, rc = text + f"\nab.py: timed out after {timeout:.0f} s\n", 124
    log.write_text(text)
    return text, time.perf_counter() - t0, rc


def run(args: argparse.Namespace) -> int:
    trees = args.trees.split(",")
    logs = Path(args.logs or os.path.join(os.environ.get("OUT", "."), "ab"))
    logs.mkdir(parents=True, exist_ok=True)
    for name in trees:
        where = imported_from(name)
        if where != (tree_dir(name) / "tileinfer").resolve():
            sys.exit(f"ab.py: under tree {name}, tileinfer imports from {where}, not {tree_dir(name)}")
        rev = tree_dir(name) / "REVISION"
        print(f"tree {name}: {rev.read_text().strip() if rev.exists() else 'this checkout'}", flush=True)
    if args.check:
        kept = []
        for name in trees:
            text, seconds, rc = run_one(name, args.check, logs / f"check_{slug(name)}.log", args.timeout)
            tail = text.strip().splitlines()[-1:] or ["(no output)"]
            print(f"check {name} ({seconds:.0f} s, exit {rc}): {tail[0]}", flush=True)
            if rc == 0:
                kept.append(name)
        if len(kept) < len(trees):
            print(f"left out of the timing (check failed): {', '.join(t for t in trees if t not in kept)}", flush=True)
        trees = kept
    if not trees:
        return 1
    runs: dict[str, list[dict[tuple[str, int], float]]] = {t: [] for t in trees}
    failed = False
    for r in range(args.repeats):
        for name in trees if r % 2 == 0 else trees[::-1]:
            found: list[tuple[str, float]] = []
            for c, command in enumerate(args.cmd):
                log = logs / f"{slug(name)}_r{r + 1}_c{c + 1}.log"
                text, seconds, rc = run_one(name, command, log, args.timeout)
                these = figures(text, tuple(args.units.split("|")))
                found += these
                print(f"round {r + 1} {name} command {c + 1}: {seconds:.0f} s, exit {rc}, {len(these)} figures",
                      flush=True)
                failed |= rc != 0
            runs[name].append(keyed(found))
    print(table(trees, runs), flush=True)
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="step", required=True)
    pp = sub.add_parser("prepare", help="write each revision's package into ab-trees/NAME (needs git)")
    pp.add_argument("revisions", nargs="+")
    pr = sub.add_parser("run", help="check, then time the trees in turns")
    pr.add_argument("--trees", required=True, help="comma-separated: names given to prepare, or . for this checkout")
    pr.add_argument("--cmd", action="append", required=True, help="a shell command to time (repeatable)")
    pr.add_argument("--check", help="a shell command each tree must pass before it is timed")
    pr.add_argument("--repeats", type=int, default=2)
    pr.add_argument("--units", default="|".join(UNITS), help="the units a figure ends in, |-separated")
    pr.add_argument("--timeout", type=float, default=600.0, help="seconds a command may take")
    pr.add_argument("--logs", help="where each run's output goes (default $OUT/ab, else ./ab)")
    args = p.parse_args()
    if args.step == "prepare":
        prepare(args.revisions)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
