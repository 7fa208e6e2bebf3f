"""The `tileinfer` command line.

    tileinfer generate --prompt TEXT [--model DIR]     continue a prompt, streaming the text
    tileinfer chat [--model DIR]                        an interactive chat (/reset, /exit)
    tileinfer size MODEL                                KV cache and weight sizes, what fits
    tileinfer serve [--model DIR] [--port 8000]         an OpenAI-compatible HTTP server (pip install tileinfer[serve])
    tileinfer --version

Without --model, the demo model shipped with the package (tileinfer/demo: a small model of the Qwen3
architecture trained on small talk and the Python docs) is used, so the commands answer in English on a
fresh machine with nothing else set up.
The arguments and the checkpoint are checked before the GPU is touched. Errors print one line and
exit with status 1 (a malformed command line: status 2); Ctrl-C exits with status 130, except that
`serve` takes SIGTERM or Ctrl-C as a request to stop gracefully (the requests in flight get
--shutdown-timeout seconds, then status 0; server/graceful.py) and only a second Ctrl-C as an interrupt.
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from tileinfer import __version__, sizing_cli

def _model_path(args) -> Path:
    if args.model:
        return Path(args.model)
    from tileinfer.demo import TARGET
    print(f"tileinfer: no --model given: using the demo model ({TARGET}: 16M parameters of the Qwen3 "
          f"architecture trained on small talk and the Python docs; simple English); pass --model DIR for a "
          f"Qwen3 checkpoint", file=sys.stderr)
    return TARGET


# The CLI option behind each SamplingParams field, to name in its ValueError.
_SAMPLING_OPTIONS = {"max_tokens": "--max-new-tokens", "temperature": "--temperature", "top_k": "--top-k",
                     "top_p": "--top-p", "seed": "--seed"}


def _sampling(args):
    """The sampling options as SamplingParams, whose checks say what is wrong before anything loads."""
    from tileinfer.engine.params import SamplingParams
    try:
        return SamplingParams(max_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                              top_p=args.top_p, seed=args.seed)
    except ValueError as e:
        field = str(e).split(" ", 1)[0]
        raise ValueError(f"{_SAMPLING_OPTIONS.get(field, field)}: {e}") from None


def _check_checkpoint(option: str, path: str | None, *, draft: bool = False, load_format: str = "auto"):
    """The checkpoint directory given as `option` (if any), opened once to validate it: config.json, every tensor
    (a draft's may be a DFlash drafter's; with load_format "dummy", config.json alone). Returns its config (None
    without a path)."""
    if not path:
        return None
    from tileinfer.model.checkpoint import Checkpoint, CheckpointError, load_checkpoint
    if not Path(path).is_dir():
        raise FileNotFoundError(f"{option} {path}: no such checkpoint directory")
    try:
        return (Checkpoint.open_draft(path) if draft else load_checkpoint(path, load_format)).config
    except CheckpointError as e:
        raise ValueError(f"{option}: {e}") from None


def _flag(name: str) -> str:
    """An EngineConfig field as the command line spells it: tensor_parallel_size -> --tensor-parallel-size."""
    return "--" + name.replace("_", "-")


def _check_arguments(args):
    """Everything the command line says, checked without the GPU: sampling, counts, the checkpoints.
    Returns the SamplingParams."""
    from tileinfer.config import check_count, check_tensor_parallel
    sampling = _sampling(args)
    check_count("--tensor-parallel-size", args.tensor_parallel_size)
    check_tensor_parallel(args.tensor_parallel_size, None, cpu=args.device == "cpu",
                          speculative=bool(args.draft_model), option=_flag)
    _check_model_options(args)
    return sampling


def _check_model_options(args, load_format: str = "auto") -> None:
    """The options of the model every command has (--max-context, --num-draft-tokens, --model, --draft-model),
    checked without the GPU; the checkpoints last, as they are read from disk (the model's by load_format)."""
    from tileinfer.config import check_count
    from tileinfer.model.dflash_config import DFlashConfig
    check_count("--max-context", args.max_context)
    if args.num_draft_tokens is not None:
        check_count("--num-draft-tokens", args.num_draft_tokens)
    _check_checkpoint("--model", args.model, load_format=load_format)
    draft = _check_checkpoint("--draft-model", args.draft_model, draft=True)
    if isinstance(draft, DFlashConfig) and (args.num_draft_tokens or 0) > draft.max_draft_tokens:
        raise ValueError(f"--num-draft-tokens {args.num_draft_tokens} exceeds what the DFlash drafter drafts a round "
                         f"(block_size {draft.block_size} - 1 = {draft.max_draft_tokens})")


def _load(args):
    """The model of generate and chat: loaded for one sequence, or with --tensor-parallel-size N > 1 an LLM over N
    GPUs (its pool sized from free memory, --kv-int8 its cache) that runs the one request."""
    import tileinfer
    if args.device == "cuda":
        from tileinfer.cuda import get_device
        from tileinfer.cuda.module import start_compiling
        if args.tensor_parallel_size == 1:  # what the kernel cache lacks compiles beside the loads below
            start_compiling(0, progress=True)
        get_device()  # no GPU: say so before writing a synthetic checkpoint
    if args.tensor_parallel_size > 1:
        return tileinfer.LLM(_model_path(args), tensor_parallel_size=args.tensor_parallel_size, max_num_seqs=1,
                             max_context=args.max_context, kv_quantize="int8" if args.kv_int8 else None,
                             progress=True)
    return tileinfer.load_model(_model_path(args), device=args.device, progress=True)


def _own_cache(args) -> str | None:
    """kv_quantize for generate() and ChatSession: --kv-int8's, unless the model is an LLM (it has its cache)."""
    return "int8" if args.kv_int8 and args.tensor_parallel_size == 1 else None


def _generate(args) -> int:
    import tileinfer
    from tileinfer.engine.detokenize import IncrementalDetokenizer

    sp = _check_arguments(args)
    with _load(args) as model:
        detok = IncrementalDetokenizer(model.tokenizer)

        def show(token: int) -> None:
            if token not in model.eos_token_ids:
                sys.stdout.write(detok.add(token))
                sys.stdout.flush()

        prompt_tokens = len(model.encode(args.prompt))
        if prompt_tokens + args.max_new_tokens > args.max_context:
            raise ValueError(f"the prompt ({prompt_tokens} tokens) + --max-new-tokens ({args.max_new_tokens}) exceed "
                             f"--max-context ({args.max_context}); shorten the prompt or raise --max-context")
        draft = _load_draft(args)
        try:
            result = tileinfer.generate(model, args.prompt, max_new_tokens=sp.max_tokens,
                                        temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p,
                                        seed=sp.seed, on_token=show, kv_quantize=_own_cache(args),
                                        draft_model=draft,
                                        num_draft_tokens=args.num_draft_tokens if draft is not None else None)
        finally:
            if draft is not None:
                draft.close()
    sys.stdout.write("\n")
    spec = ""
    if result.speculation is not None:
        s = result.speculation
        spec = (f", {s.accepted}/{s.drafted} drafts accepted ({100 * s.acceptance_rate:.0f}%), "
                f"{s.tokens_per_target_step:.2f} tokens per target step")
    print(f"[{len(result.token_ids)} tokens, {result.decode_tokens_per_second:.1f} tok/s decode{spec}, "
          f"finish: {result.finish_reason}]", file=sys.stderr)
    _say_compiles_left()
    return 0


def _say_compiles_left() -> None:
    """On a first run, the kernels the run did not need may still be compiling (cuda/module.py start_compiling): the
    process waits for them at its exit, so that later runs find them cached. Say so rather than seem to hang."""
    from tileinfer.cuda.compiler import units_in_flight
    left = units_in_flight()
    if left:
        print(f"tileinfer: finishing {left} kernel compiles for later runs (once; then cached)", file=sys.stderr)


def chat_loop(session, sampling: dict, read=input, out=sys.stdout, err=sys.stderr) -> int:
    """Read lines and stream replies until /exit or end of input (0) or Ctrl-C (130)."""
    print("Type a message; /reset starts over, /exit (or Ctrl-D) quits.", file=err)
    while True:
        try:
            line = read("> ")
        except EOFError:
            out.write("\n")
            return 0
        except KeyboardInterrupt:
            out.write("\n")
            return 130
        text = line.strip()
        if not text:
            continue
        if text == "/exit":
            return 0
        if text == "/reset":
            session.reset()
            print("(conversation cleared)", file=err)
            continue
        try:
            for piece in session.stream(text, **sampling):
                out.write(piece)
                out.flush()
        except KeyboardInterrupt:
            out.write("\n")
            return 130
        out.write("\n")
        t = session.last_turn
        spec = ""
        if t.speculation is not None:
            spec = f"; {t.speculation.accepted}/{t.speculation.drafted} drafts accepted"
        print(f"[{t.new_tokens} tokens, {t.decode_tokens_per_second:.1f} tok/s; prompt {t.prompt_tokens} tokens, "
              f"{t.reused_tokens} reused from the cache, {t.computed_tokens} computed{spec}]", file=err)


def _load_draft(args):
    """The --draft-model, loaded (or None)."""
    if not args.draft_model:
        return None
    import tileinfer
    return tileinfer.load_model(args.draft_model, device=args.device, progress=True)


def _chat(args) -> int:
    from tileinfer.chat import ChatSession

    sp = _check_arguments(args)
    with _load(args) as model:
        draft = _load_draft(args)
        try:
            session = ChatSession(model, max_context=args.max_context, system=args.system,
                                  on_overflow="drop_oldest" if args.drop_oldest else "error",
                                  kv_quantize=_own_cache(args), draft_model=draft,
                                  num_draft_tokens=args.num_draft_tokens)
            sampling = dict(max_tokens=sp.max_tokens, temperature=sp.temperature, top_k=sp.top_k,
                            top_p=sp.top_p, seed=sp.seed, enable_thinking=False if args.no_think else None)
            return chat_loop(session, sampling)
        finally:
            if draft is not None:
                draft.close()
            _say_compiles_left()


# Requests decoding at once when --max-num-seqs is not given: the CPU runner's pool holds that many sequences
# of --max-context in host memory, so it gets few.
_SERVE_MAX_NUM_SEQS = {"cuda": 256, "cpu": 8}


def _check_serve_arguments(args) -> None:
    """The serve command line, checked without the GPU and before anything loads."""
    import math
    from tileinfer.config import check_count, check_tensor_parallel
    from tileinfer.kv.sizing import check_utilization
    if args.max_num_seqs is None:
        args.max_num_seqs = _SERVE_MAX_NUM_SEQS[args.device]
    for option, value in (("--max-num-seqs", args.max_num_seqs), ("--page-size", args.page_size),
                          ("--max-num-batched-tokens", args.max_num_batched_tokens),
                          ("--tensor-parallel-size", args.tensor_parallel_size)):
        check_count(option, value)
    for option, value in (("--num-pages", args.num_pages), ("--max-waiting", args.max_waiting)):
        if value is not None:
            check_count(option, value)
    try:
        check_utilization(args.gpu_memory_utilization)
    except ValueError as e:
        raise ValueError(f"--gpu-memory-utilization: {e}") from None
    if not (math.isfinite(args.shutdown_timeout) and args.shutdown_timeout >= 0):
        raise ValueError(f"--shutdown-timeout must be a number of seconds >= 0, got {args.shutdown_timeout}")
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.api_key is not None and not args.api_key:
        raise ValueError("--api-key is empty: give a key, or leave the option out to serve without one")
    args.allowed_origins = _origins(args.allowed_origins)
    if args.load_format == "dummy" and not args.model:
        raise ValueError("--load-format dummy needs --model DIR: a directory with the model's config.json and "
                         "tokenizer (scripts/make_checkpoint.py --config-only writes one)")
    check_tensor_parallel(args.tensor_parallel_size, args.tensor_parallel_address, cpu=args.device == "cpu",
                          speculative=bool(args.draft_model), option=_flag)
    _check_model_options(args, args.load_format)


def _origins(value: str | None) -> list[str]:
    """--allowed-origins: comma-separated origins (scheme://host[:port]) or "*"."""
    if value is None:
        return []
    origins = [o.strip() for o in value.split(",")]
    for o in origins:
        if o != "*" and not re.fullmatch(r"https?://[^/\s]+", o):
            raise ValueError(f"--allowed-origins: '{o}' is not an origin: give scheme://host[:port] (e.g. "
                             f"http://localhost:3000, no path), comma-separated, or *")
    return origins


def _serve_engine_options(args) -> dict:
    """The serve command line as tileinfer.LLM's keyword arguments (EngineConfig's fields)."""
    return dict(device=args.device, max_num_seqs=args.max_num_seqs, max_context=args.max_context,
                page_size=args.page_size, enable_prefix_caching=not args.no_prefix_caching,
                max_num_batched_tokens=args.max_num_batched_tokens,
                gpu_memory_utilization=args.gpu_memory_utilization, num_pages=args.num_pages,
                kv_quantize="int8" if args.kv_int8 else None, batch_invariant=args.batch_invariant,
                draft_model=args.draft_model,
                num_draft_tokens=args.num_draft_tokens, load_format=args.load_format,
                tensor_parallel_size=args.tensor_parallel_size,
                tensor_parallel_address=args.tensor_parallel_address, progress=True)


def _serve(args) -> int:
    _check_serve_arguments(args)
    try:
        from tileinfer.server.app import create_app
        from tileinfer.server.graceful import serve
    except ImportError as e:
        raise RuntimeError(f"tileinfer serve needs FastAPI and uvicorn ({e.name} is not installed): "
                           f"pip install tileinfer[serve]") from None
    from tileinfer.server.engine_client import EngineClient
    if args.device == "cuda":
        from tileinfer.cuda import get_device
        get_device()  # no GPU: say so before loading
    model = _model_path(args)
    name = args.served_model_name or ("tileinfer-demo" if not args.model else model.resolve().name)
    engine = EngineClient(model, _serve_engine_options(args), max_waiting=args.max_waiting)
    try:
        engine.start()  # the engine process loads the model
        app = create_app(engine, name, api_key=args.api_key, allowed_origins=args.allowed_origins)
        print(f"tileinfer: serving '{name}' at http://{args.host}:{args.port}/v1 (Ctrl-C or SIGTERM stops: requests "
              f"in flight get {args.shutdown_timeout:g} s to finish; a second Ctrl-C aborts them)", file=sys.stderr)
        forced = serve(app, host=args.host, port=args.port, grace=args.shutdown_timeout)
    finally:
        engine.stop()
    return 130 if forced else 0


SERVE_DESCRIPTION = """An OpenAI-compatible HTTP server over one model: /v1/completions, /v1/chat/completions,
/v1/models, /health, /metrics, /tokenize, /detokenize.

Stopping: on SIGTERM or Ctrl-C the server stops taking requests at once (GET /health answers 503
"stopping", a new request 503 in OpenAI's error shape), lets the requests in flight finish for
--shutdown-timeout seconds, then aborts the rest (a streaming client gets an error chunk and [DONE], a
waiting one a 503), frees the GPU and exits with status 0. A second Ctrl-C aborts at once (status 130)."""


def _add_serve_arguments(p: argparse.ArgumentParser) -> None:
    import dataclasses
    from tileinfer.config import EngineConfig
    engine = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    p.add_argument("--model", help="a Hugging Face Qwen3 checkpoint directory (default: the demo model, served as "
                                   "'tileinfer-demo')")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: the GPU (default); cpu: a float32 numpy runner, slow, for a machine without one")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (8000)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every /v1 request (default: no key)")
    p.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                   help="origins whose browser pages may call the server (CORS), comma-separated, e.g. "
                        "http://localhost:3000, or * for any (default: none)")
    p.add_argument("--served-model-name", default=None,
                   help="the model name clients send and /v1/models lists (default: the checkpoint folder's name)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="requests decoding at once (default: 256 on cuda, 8 on cpu)")
    p.add_argument("--max-waiting", type=int, default=None, metavar="N",
                   help="requests waiting for admission at most; more are answered 503 (default: no limit)")
    p.add_argument("--max-context", type=int, default=4096, help="positions of a prompt and its reply (4096)")
    p.add_argument("--max-num-batched-tokens", type=int, default=engine["max_num_batched_tokens"], metavar="N",
                   help=f"tokens in one engine step; long prompts are prefilled in chunks of at most this "
                        f"({engine['max_num_batched_tokens']})")
    p.add_argument("--kv-int8", action="store_true", help="an INT8 KV cache: about half the bytes of BF16")
    p.add_argument("--batch-invariant", action="store_true",
                   help="kernels whose results do not depend on the batch around a request (slower; a reply is then "
                        "the same whatever else the server runs)")
    p.add_argument("--page-size", type=int, default=engine["page_size"], metavar="N",
                   help=f"positions in one KV cache page ({engine['page_size']})")
    p.add_argument("--num-pages", type=int, default=None, metavar="N",
                   help="KV cache pages, instead of sizing the pool from free GPU memory (cpu: from --max-num-seqs "
                        "sequences of --max-context)")
    p.add_argument("--gpu-memory-utilization", type=float, default=engine["gpu_memory_utilization"],
                   metavar="FRACTION",
                   help=f"fraction of the GPU's total memory the weights, workspace and KV cache may use "
                        f"({engine['gpu_memory_utilization']})")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="do not share the KV pages of a common prompt prefix between requests")
    p.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="auto: the checkpoint's weight files; dummy: random weights made from --model's config.json "
                        "(no weight files needed: benchmarks at sizes whose checkpoints do not fit the disk)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split the model over N GPUs (ordinals 0..N-1), one process each, over NCCL (1); needs "
                        "pip install tileinfer[tp]")
    p.add_argument("--tensor-parallel-address", default=None, metavar="HOST:PORT",
                   help="listen there for the other ranks, started by hand with tileinfer tp-worker (other hosts' "
                        "GPUs; $TILEINFER_TP_KEY the same everywhere) instead of starting them here")
    _add_draft_arguments(p)
    p.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="SECONDS",
                   help="on SIGTERM or Ctrl-C, seconds the requests in flight get to finish before they are "
                        "aborted (30)")


def _add_draft_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-model", default=None, metavar="DIR",
                   help="a smaller Qwen3 checkpoint with the same tokenizer, or a DFlash drafter for the model "
                        "(--device cpu): speculative decoding")
    p.add_argument("--num-draft-tokens", type=int, default=None, metavar="N",
                   help="tokens the draft proposes per step (4; a DFlash drafter: its block_size - 1)")


def _add_model_and_sampling(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    p.add_argument("--model", help="a Hugging Face Qwen3 checkpoint directory (default: the demo model shipped "
                                   "with the package, tileinfer/demo)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda: the GPU (default); cpu: a float32 numpy runner, slow, for a machine without one")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="keep the smallest set with this mass (1 = off)")
    p.add_argument("--seed", type=int, default=None, help="seed of the sampler (default: random)")
    p.add_argument("--kv-int8", action="store_true",
                   help="an INT8 KV cache (int8 values + one float32 scale per vector, keys smoothed): about half "
                        "the bytes of BF16")
    _add_draft_arguments(p)
    p.add_argument("--max-context", type=int, default=4096,
                   help="positions the prompt and the reply (chat: the conversation) may use (4096)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="split the model over N GPUs (ordinals 0..N-1), one process each, over NCCL (1); needs "
                        "pip install tileinfer[tp]")


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad command line gets one line (not the usage block) and exit status 2."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tileinfer", description="Qwen3 inference on one GPU.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="continue a prompt, streaming the text")
    g.add_argument("--prompt", required=True, help="the text to continue")
    _add_model_and_sampling(g, 128)
    g.set_defaults(run=_generate)
    c = sub.add_parser("chat", help="an interactive chat with the checkpoint's chat template")
    _add_model_and_sampling(c, 512)
    c.add_argument("--system", default=None, help="a system message")
    c.add_argument("--no-think", action="store_true", help="ask the model not to reason (enable_thinking=False)")
    c.add_argument("--drop-oldest", action="store_true",
                   help="when the conversation is full, drop the oldest turns instead of stopping")
    c.set_defaults(run=_chat)
    s = sub.add_parser("size", help="KV cache and weight sizes, and how much of the cache fits on the GPU",
                       description=sizing_cli.DESCRIPTION)
    sizing_cli.add_arguments(s)
    s.set_defaults(run=sizing_cli.run)
    v = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions)",
                       description=SERVE_DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_serve_arguments(v)
    v.set_defaults(run=_serve)
    k = sub.add_parser("compile", help="compile every kernel into the kernel cache now (no GPU needed), so that the "
                                       "first start on a GPU compiles nothing",
                       description="Compile every kernel of cuda_src/ into the kernel cache (TILEINFER_CACHE, else "
                                   "~/.cache/tileinfer) with NVRTC, as a first start on a GPU would: for instance "
                                   "while building an image for GPU machines. The cache is keyed by the sources, "
                                   "the arch and NVRTC's version, so the machine that runs the kernels needs the same "
                                   "TileInfer and NVRTC (the nvidia-cuda-nvrtc package).")
    k.add_argument("--arch", default=None,
                   help="the GPU arch to compile for: this machine's GPU's, else sm_90a (an H100 or H200)")
    k.set_defaults(run=_compile)
    w = sub.add_parser("tp-worker", help="one rank of a tensor-parallel group whose rank 0 listens at --address",
                       description="Run rank --rank of a tensor-parallel group started by hand (another host's "
                                   "GPUs): rank 0 is an LLM or `tileinfer serve` given the same address as "
                                   "tensor_parallel_address; every rank needs the same $TILEINFER_TP_KEY. Returns "
                                   "when rank 0 closes the group.")
    w.add_argument("--address", required=True, help="HOST:PORT rank 0 listens on")
    w.add_argument("--rank", type=int, required=True, help="this process's rank, 1..N-1")
    w.add_argument("--device", default="cuda", help="this rank's GPU: cuda (GPU 0) or cuda:K")
    w.set_defaults(run=_tp_worker)
    parser.commands = {"generate": g, "chat": c, "size": s, "serve": v, "compile": k, "tp-worker": w}
    return parser


def _compile(args) -> int:
    from tileinfer.cuda import compiler
    from tileinfer.cuda.driver import compute_capability
    from tileinfer.cuda.module import every_unit, nvrtc_arch
    arch = args.arch
    if arch is None:
        try:
            arch = nvrtc_arch(compute_capability(0))
        except Exception:  # noqa: BLE001 (no GPU, no driver: the arch of the GPUs TileInfer is built for)
            arch = "sm_90a"
            print("tileinfer: no GPU here: compiling for sm_90a (an H100 or H200); --arch chooses another",
                  file=sys.stderr)
    found = re.fullmatch(r"sm_(\d+)a?", arch)
    if not found or int(found[1]) < 90:
        raise ValueError(f"--arch must name a GPU arch of sm_90 or newer, as sm_90a (an H100 or H200) does; "
                         f"got {arch!r}")
    units, before = every_unit(), compiler.STATS.compiled
    compiler.compile_all(units, arch, progress=True)
    compiled = compiler.STATS.compiled - before
    print(f"tileinfer: {len(units)} kernel units for {arch} in {compiler.cache_dir()}: {compiled} compiled now, "
          f"{len(units) - compiled} cached already", file=sys.stderr)
    return 0


def _tp_worker(args) -> int:
    from tileinfer.config import parse_address, parse_device
    from tileinfer.runner.tensor_parallel import shared_key, worker_main
    address, key = parse_address(args.address), shared_key()
    kind, ordinal = parse_device(args.device)
    if kind != "cuda":
        raise ValueError(f"--device must be cuda or cuda:K, got {args.device!r}")
    if args.rank < 1:
        raise ValueError(f"--rank must be 1..N-1 (rank 0 is the LLM's own process), got {args.rank}")
    error = worker_main(address, key, args.rank, f"cuda:{ordinal}")
    if error is not None:
        print(f"tileinfer: error: tensor-parallel rank {args.rank} failed (rank 0 was told):\n{error}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # said by the command's own parser, which names the command and its --help
        parser.commands[args.command].error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, RuntimeError, OSError) as e:
        print(f"tileinfer: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
