"""Write a synthetic Qwen3 or Apertus checkpoint, or a DFlash drafter for one, in the Hugging Face layout
(random weights, real shapes).

    python scripts/make_checkpoint.py --preset qwen3-8b --out /data/qwen3-8b-synthetic
    python scripts/make_checkpoint.py --preset apertus-8b --out /data/apertus-8b-synthetic
    python scripts/make_checkpoint.py --preset dflash-qwen3-8b --target /data/qwen3-8b-synthetic --out /data/qwen3-8b-dflash
    python scripts/make_checkpoint.py --preset apertus-70b --config-only --out /data/apertus-70b-config

--config-only writes config.json and the tokenizer files, no weights: such a directory serves with
load_format="dummy" (LLM(..., load_format="dummy"), `tileinfer serve --load-format dummy`), whose weights are
the ones this script writes for seed 0, made as they load.

A DFlash preset needs --target, the model it drafts for: it is checked to fit (hidden size, the layers
it reads, the vocabulary) before anything is written.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from tileinfer.model.config import PRESETS, ConfigError, preset, read_config
from tileinfer.model.dflash_config import DFLASH_PRESETS
from tileinfer.model.synthetic import write_checkpoint, write_text_files


def _config(parser: argparse.ArgumentParser, args):
    """The preset's config; a DFlash preset's checked against --target."""
    if args.preset not in DFLASH_PRESETS:
        if args.target is not None:
            parser.error(f"--target is for the DFlash presets ({', '.join(DFLASH_PRESETS)}), not {args.preset}")
        return preset(args.preset)
    if args.target is None:
        parser.error(f"--preset {args.preset} drafts for a target model: give its checkpoint directory as --target")
    _, config = DFLASH_PRESETS[args.preset]
    try:
        config.check_target(read_config(args.target), source=f"--preset {args.preset}")
    except (ConfigError, ValueError) as e:
        parser.error(f"--target {args.target}: {e}")
    return config


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS) + sorted(DFLASH_PRESETS))
    parser.add_argument("--out", required=True, help="directory to write (created if missing)")
    parser.add_argument("--target", default=None, metavar="DIR",
                        help="with a dflash-* preset: the checkpoint directory of the model it drafts for")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-shard-gb", type=float, default=4.0,
                        help="largest weights file, in GB (10^9 bytes); bigger models are sharded")
    parser.add_argument("--workers", type=int, default=None, help="generator threads (default: all cores)")
    parser.add_argument("--config-only", action="store_true",
                        help="config.json and the tokenizer files only, for load_format='dummy'")
    args = parser.parse_args(argv)
    if args.seed < 0 or args.max_shard_gb <= 0:
        parser.error("--seed must be >= 0 and --max-shard-gb > 0")
    config = _config(parser, args)
    if args.config_only:
        if args.preset in DFLASH_PRESETS or args.seed != 0:
            parser.error("--config-only is for the model presets, whose dummy weights are seed 0's")
        Path(args.out).mkdir(parents=True, exist_ok=True)
        write_text_files(config, Path(args.out))
        print(f"{args.preset}: wrote config.json and the tokenizer files to {args.out} (load_format='dummy')")
        return 0

    start = time.perf_counter()
    nbytes = write_checkpoint(config, args.out, seed=args.seed, max_shard_bytes=int(args.max_shard_gb * 1e9),
                              workers=args.workers)
    seconds = time.perf_counter() - start
    print(f"{args.preset}: wrote {nbytes / 1e9:.2f} GB of weights to {args.out} in {seconds:.1f} s "
          f"({nbytes / 1e9 / seconds:.2f} GB/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
