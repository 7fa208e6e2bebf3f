"""Write tileinfer/cuda/kernel_units.py: which part of each file compiled in parts holds each of its entry points,
and the compile units a short first request launches.

    python3 scripts/kernel_units.py [--dry-run]

PART_OF: every part of every file that says `#define KERNEL_PARTS n`, compiled for sm_90 (NVRTC, no GPU needed; the
entry points are sm_90a's), and the entry points of each part's cubin. A file's first use then loads only the part
that holds the kernel asked for (cuda/module.py Module), and waits only for that part's compile.

FIRST: the units whose kernels a prompt of up to 16 tokens (its prefill graph's 16 rows) and a decode step of one
sequence (its keys split 1 and 33 ways) launch, recorded without a GPU (scripts/host_launches.py step_kernels) for
every preset's shapes but apertus-70b's (tensor parallelism only) and the demo model's, with sampling.cu (the
runner's sampling of a first token). module.start_compiling starts them before every other unit, so that the first
steps of `tileinfer generate` wait for the fewest compiles.

Run it when an entry point is added, removed or moved between parts, or when a route changes which kernels those
steps launch: tests/test_compile.py and tests/test_host_launches.py check the table against the kernels.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))             # host_launches
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))      # the checkout's package, when not installed

TABLE = Path(__file__).resolve().parent.parent / "tileinfer" / "cuda" / "kernel_units.py"
# (token rows, sequences, key splits) of the steps FIRST covers.
FIRST_STEPS = ((16, 1, 1), (1, 1, 1), (1, 1, 33))
RUNNER_UNITS = ("sampling.cu",)  # launched by the runner around forward(), for a sampled first token


def part_of() -> dict[str, dict[str, int]]:
    """{file: {entry point: its part}} of every file compiled in parts."""
    from tileinfer.cuda.compiler import compile_all, compile_file, kernel_files, part_defines
    from tileinfer.cuda.module import entry_points
    table = {}
    for name in kernel_files():
        parts = part_defines(name)
        if parts == [None]:
            continue
        compile_all([(name, defines) for defines in parts], "sm_90")
        table[name] = {entry: p for p, defines in enumerate(parts)
                       for entry in sorted(entry_points(compile_file(name, "sm_90", defines)))}
    return table


def first_models() -> dict:
    """The shapes FIRST is recorded for, by name: every preset's but apertus-70b's, and the demo model's ("demo").
    apertus-70b runs only under tensor parallelism (140 GB of weights), whose steps take no flow builds; on one GPU
    its prompts of 3-32 rows would ask the flow's norm statistics for more partials than they sum (K = 8192 > 6144)."""
    from tileinfer.demo import TARGET
    from tileinfer.model.config import PRESETS, read_config
    return {**{name: config for name, config in PRESETS.items() if name != "apertus-70b"},
            "demo": read_config(TARGET / "config.json")}


def first_units(parts: dict[str, dict[str, int]]) -> list[str]:
    """The units ("file.cu", or "file.cu:p") FIRST_STEPS launch kernels of, for first_models(), and RUNNER_UNITS;
    by file, then part."""
    import host_launches
    units = set(RUNNER_UNITS)
    for config in first_models().values():
        for step in FIRST_STEPS:
            for filename, names in host_launches.step_kernels(config, *step).items():
                units.update(f"{filename}:{parts[filename][n]}" if filename in parts else filename for n in names)
    return sorted(units, key=lambda unit: (unit.split(":")[0], int(unit.split(":")[1]) if ":" in unit else -1))


def render(parts: dict[str, dict[str, int]], first: list[str]) -> str:
    files = "\n".join(f'    "{name}": {{\n' + "".join(f'        "{entry}": {p},\n' for entry, p in table.items()) + "    },"
                      for name, table in parts.items())
    units = "".join(f'    "{unit}",\n' for unit in first)
    return f'''"""Which part of each file compiled in parts holds each of its entry points (a file's first use loads only the
part of the kernel asked for: cuda/module.py Module), and the compile units a prompt of up to 16 tokens and a decode
step of one sequence launch, for every preset's shapes but apertus-70b's and the demo model's, with the runner's
sampling (module.start_compiling starts them first). Written by scripts/kernel_units.py; tests/test_compile.py and
tests/test_host_launches.py check it."""
PART_OF = {{
{files}
}}
FIRST = (
{units})
'''


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="print the table; leave the file as it is")
    args = ap.parse_args(argv)
    parts = part_of()
    text = render(parts, first_units(parts))
    if args.dry_run:
        print(text)
    else:
        TABLE.write_text(text)
        print(f"wrote {TABLE}: {sum(map(len, parts.values()))} entry points of {len(parts)} files in parts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
