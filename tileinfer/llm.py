"""LLM: many requests at once over one model, the shape vLLM users know.

    with tileinfer.LLM("path/to/Qwen3-0.6B") as llm:
        outs = llm.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=32))
        for o in outs:
            print(o.text, o.finish_reason)

`LLM(model, **options)` builds one EngineConfig (tileinfer/config.py) from the options and validates it
and the checkpoint before touching the GPU; start-up (runner/startup.py) loads the weights, sizes the
KV pool and captures the decode graphs; the engine loop (engine/engine.py) runs every request.
`device="cpu"` runs the float32 numpy reference instead of the GPU (runner/cpu.py): slow and exact.
"""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from .config import EngineConfig
from .engine.engine import Engine
from .engine.outputs import RequestOutput, StreamOutput
from .engine.params import SamplingParams
from .engine.scheduler import FINISHED, Request
from .engine.speculative import make_drafter
from .kv import Sequence
from .model.chat_template import render_chat
from .model.checkpoint import Checkpoint, load_checkpoint
from .model.dflash_config import DFlashConfig
from .model.forward import check_supported
from .model.sharding import check_world
from .model.tokenizer import CHAT_TEMPLATE, encode_text
from .runner.startup import Started, start_cpu, start_gpu
from .runner.tensor_parallel import TensorParallelGroup, TensorParallelRunner, tensor_parallel_group


def check_checkpoints(config: EngineConfig):
    """Open (and so validate) the checkpoint and draft without a GPU, and check that the device runs them; the
    model's config."""
    model = load_checkpoint(config.model, config.load_format).config
    if not config.on_cpu:
        check_supported(model, config.model)
    if config.tensor_parallel_size > 1:
        check_world(model, config.tensor_parallel_size)
    if config.max_context > model.max_position_embeddings:
        raise ValueError(f"max_context {config.max_context} exceeds the model's {model.max_position_embeddings} "
                         f"positions (max_position_embeddings in config.json)")
    if config.draft_model is not None:
        draft = Checkpoint.open_draft(config.draft_model).config
        if isinstance(draft, DFlashConfig):
            _check_dflash(config, draft, model)
        elif not config.on_cpu:
            check_supported(draft, config.draft_model)
        if draft.vocab_size != model.vocab_size:
            raise ValueError(f"draft_model's vocabulary ({draft.vocab_size}) differs from the target's "
                             f"({model.vocab_size}); speculation needs the same tokenizer")
    return model


def _check_dflash(config: EngineConfig, draft: DFlashConfig, model) -> None:
    if not config.on_cpu:
        check_supported(draft.decoder, config.draft_model)
    draft.check_target(model, source=f"draft_model {config.draft_model}")
    if config.num_draft_tokens > draft.max_draft_tokens:
        raise ValueError(f"num_draft_tokens {config.num_draft_tokens} exceeds what the DFlash drafter drafts a round "
                         f"(block_size {draft.block_size} - 1 = {draft.max_draft_tokens})")


class LLM:
    def __init__(self, model: str | Path, **options):
        """model: a Hugging Face Qwen3 or Apertus checkpoint directory; options:
        EngineConfig's fields (max_num_seqs, max_context, page_size, enable_prefix_caching, max_num_batched_tokens,
        gpu_memory_utilization, num_pages, max_tokens, kv_quantize, kv_smoothing, use_graphs, batch_invariant,
        async_scheduling, device, progress, draft_model, num_draft_tokens, load_format, tensor_parallel_size,
        tensor_parallel_address).
        draft_model may be a draft model's directory or a DFlash drafter's (recognised by its config.json).
        tensor_parallel_size=N splits the model over N GPUs, one process each (runner/tensor_parallel.py)."""
        self.config = EngineConfig(model=model, **options)
        self.model_config = check_checkpoints(self.config)
        self._closed = False
        self._requests: dict[int, Request] = {}  # queued with add_request
        self._started: Started | None = None
        self._group: TensorParallelGroup | None = None
        try:
            if self.config.tensor_parallel_size > 1:
                self._group = tensor_parallel_group(self.config)  # the other ranks' processes, started
            self._started = start_cpu(self.config) if self.config.on_cpu else start_gpu(self.config, self._group)
        except BaseException:
            self.close()
            raise
        s = self._started
        self.runner = s.runner if self._group is None else TensorParallelRunner(s.runner, self._group)
        self.memory_report, self.startup = s.memory_report, s.startup
        self.tokenizer = self.runner.tokenizer
        self.eos_token_ids = set(self.runner.eos_token_ids)
        drafter = make_drafter(s.draft, self.runner, self.config.num_draft_tokens) if s.draft is not None else None
        self.engine = Engine(self.config, self.runner, self.tokenizer, self.eos_token_ids, drafter)

    @property
    def stats(self):
        return self.engine.stats

    # ------------------------------------------------------------------ requests
    def _make_requests(self, prompts, sampling_params) -> list[tuple[Request, str | None]]:
        if isinstance(prompts, (str, bytes, bytearray)) or (isinstance(prompts, list) and prompts and
                                                            isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts is empty: give at least one prompt")
        if sampling_params is None:
            params = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts: "
                                 "give one, or one per prompt")
            if not all(isinstance(p, SamplingParams) for p in params):
                raise ValueError("sampling_params must be a SamplingParams or a list of them")
        made = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            ids, text = self.engine.prompt_ids(prompt, i)
            made.append((self.engine.make_request(ids, p), text))
        return made

    def add_request(self, prompt, sampling_params: SamplingParams | None = None) -> int:
        """Queue one request for `step()`; returns its request id."""
        self._check_open()
        (req, _), = self._make_requests([prompt], sampling_params)
        self.engine.add(req)
        self._requests[req.request_id] = req
        return req.request_id

    def step(self) -> list[tuple[int, int, bool]]:
        """Run one engine step over everything queued: (request id, new token, finished) per token read
        back. Finished requests' outputs are then in `finished_outputs()`."""
        self._check_open()
        return [(req.request_id, token, req.status == FINISHED and not req.unresolved)
                for req, token, _ in self.engine.step()]

    def abort_request(self, request_id: int) -> None:
        """End a request queued with add_request where it stands (its pages go back at once); its output,
        with finish reason "abort" and the tokens read back so far, is then in `finished_outputs()`. A request
        that has already finished, or an unknown id, is left alone."""
        self._check_open()
        req = self._requests.get(request_id)
        if req is not None and req.status != FINISHED:
            self.engine.abort(req)

    def has_unfinished_requests(self) -> bool:
        return self.engine.has_unfinished

    def finished_outputs(self) -> list[RequestOutput]:
        """Outputs of the requests queued with add_request that have finished since the last call."""
        done = [r for r in self._requests.values() if r.status == FINISHED and not r.unresolved]
        for r in done:
            del self._requests[r.request_id]
        return [self.engine.output(r) for r in done]

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Continue every prompt (text, or a list of token ids); outputs in the order given."""
        self._check_open()
        made = self._make_requests(prompts, sampling_params)
        for req, _ in made:
            self.engine.add(req)
        try:
            while any(req.status != FINISHED or req.unresolved for req, _ in made):
                self.engine.step()
        except BaseException:
            for req, _ in made:
                self.engine.abort(req)
            raise
        if not self.engine.scheduler.has_unfinished:
            self.engine.drain()  # a step launched ahead for requests that ended: nothing is left in flight
        self.engine.stats.cached_prompt_tokens += sum(req.num_cached_tokens for req, _ in made)
        return [self.engine.output(req, text) for req, text in made]

    def chat(self, messages, sampling_params: SamplingParams | list[SamplingParams] | None = None, *,
             chat_template_kwargs: dict | None = None, tools: list[dict] | None = None) -> list[RequestOutput]:
        """Reply to each conversation, as vLLM's LLM.chat: messages is one conversation (a list of {"role",
        "content"} dicts) or a list of them, each rendered with the checkpoint's chat template and a generation
        prompt (tools and chat_template_kwargs, e.g. {"enable_thinking": False}, go to the template), then
        continued as generate continues a prompt; outputs in the order given. The text is the reply as the model
        wrote it (a Qwen3 reply may open with its <think> block). For one conversation over many turns, with
        its cache kept between them, use ChatSession."""
        self._check_open()
        if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
            conversations = [messages]
        elif isinstance(messages, list) and messages and all(isinstance(c, list) and c for c in messages):
            conversations = messages
        else:
            raise ValueError("messages must be a conversation (a non-empty list of {'role', 'content'} dicts) or "
                             "a list of them")
        template = self.runner.checkpoint.chat_template or CHAT_TEMPLATE
        extra = dict(chat_template_kwargs or {})
        if tools:
            extra["tools"] = tools
        prompts = [render_chat(template, c, **extra) for c in conversations]
        return self.generate(prompts, sampling_params)

    def generate_stream(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
                        ) -> Iterator[StreamOutput]:
        """Like generate, but yields each request's tokens (and text) as the steps produce them.

        Closing the generator early aborts the requests still running and frees their pages."""
        self._check_open()
        made = self._make_requests(prompts, sampling_params)
        index = {req.request_id: i for i, (req, _) in enumerate(made)}
        for req, _ in made:
            self.engine.add(req, stream=True)
        try:
            while any(req.status != FINISHED or req.unresolved for req, _ in made):
                for req, token, _ in self.engine.step():
                    if req.request_id not in index:
                        continue
                    done = req.status == FINISHED and not req.unresolved
                    yield StreamOutput(index=index[req.request_id], request_id=req.request_id, token_ids=[token],
                                       text=req.detokenizer.stream_delta(done), finished=done,
                                       finish_reason=req.finish_reason)
        finally:
            for req, _ in made:
                if req.status != FINISHED:
                    self.engine.abort(req)
            self.engine.stats.cached_prompt_tokens += sum(req.num_cached_tokens for req, _ in made)

    # ------------------------------------------------------------------ one sequence
    def encode(self, text: str) -> list[int]:
        return encode_text(self.tokenizer, text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def logits(self, token_ids: list[int], *, chunk: int | None = None):
        """Teacher-forced next-token logits for every position of token_ids, through the engine's own pool
        (float32 [len, vocab]); the engine must be idle."""
        self._check_open()
        if self.engine.has_unfinished:
            raise RuntimeError("the engine has requests in flight; logits() needs it idle")
        seq = Sequence()
        try:
            return self.runner.extend(seq, list(token_ids), chunk=chunk)
        finally:
            self.runner.cache.manager.release(seq)

    # ------------------------------------------------------------------ lifetime
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this LLM was closed; create a new one")

    def close(self) -> None:
        """Free every allocation (weights, workspace, pool, graphs)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._started is not None:
                for runner in (self._started.draft, self._started.runner):  # a DFlash drafter uses its target's stream
                    if runner is not None:
                        runner.close()
        finally:
            if self._group is not None:
                self._group.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
