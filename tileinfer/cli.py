"""The `tileinfer` command line: `tileinfer generate --model DIR --prompt TEXT`, `tileinfer size MODEL`."""
from __future__ import annotations

import argparse
import sys

from tileinfer import sizing_cli


def _generate(args) -> int:
    import tileinfer

    with tileinfer.load_model(args.model) as model:
        result = tileinfer.generate(model, args.prompt, max_new_tokens=args.max_new_tokens,
                                    temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    print(result.text)
    print(f"[{len(result.token_ids)} tokens, {result.decode_tokens_per_second:.1f} tok/s decode, "
          f"finish: {result.finish_reason}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tileinfer", description="Qwen3 inference on one GPU.")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="continue a prompt")
    g.add_argument("--model", required=True, help="a Hugging Face Qwen3 checkpoint directory")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.set_defaults(run=_generate)
    s = sub.add_parser("size", help="KV cache and weight sizes, and how much of the cache fits on the GPU",
                       description=sizing_cli.DESCRIPTION)
    sizing_cli.add_arguments(s)
    s.set_defaults(run=sizing_cli.run)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"tileinfer: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
