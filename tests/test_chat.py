"""ChatSession on the CPU: prefix reuse, reasoning dropped by the template, edits, overflow.

The fake model plays scripted replies and records every step it is asked to run, so the tests
see exactly which positions each turn computes. The template is TileInfer's Qwen3 ChatML
(earlier turns' <think>...</think> dropped), the tokenizer the real Qwen3 one.
"""
from __future__ import annotations

import numpy as np
import pytest
import tokenizers

from tileinfer.chat import ChatSession, ContextFullError, common_prefix, render_chat
from tileinfer.kv import BlockManager
from tileinfer.model import tokenizer as tok

IM_END = 151645


class FakeCache:
    def __init__(self, positions: int, page_size: int = 16):
        self.manager = BlockManager(-(-positions // page_size), page_size)
        self.capacity = self.manager.num_pages * page_size


class FakeModel:
    """A runner that replies with the next scripted text (then <|im_end|>, repeated past the script's
    end); records (start, count) of every step."""

    max_batch_tokens = 64
    max_num_seqs = 1
    use_graphs = False

    def __init__(self, replies: list[str]):
        self.tokenizer = tokenizers.Tokenizer.from_str(tok.qwen3_tokenizer_json())
        self.replies = [self.tokenizer.encode(r, add_special_tokens=False).ids + [IM_END] for r in replies]
        self.eos_token_ids = [IM_END, 151643]
        self.config = type("Config", (), {"max_position_embeddings": 40960, "vocab_size": 151936})()
        self.checkpoint = type("Checkpoint", (), {"chat_template": tok.CHAT_TEMPLATE, "path": "unused"})()
        self.cache = None
        self.steps: list[tuple[int, int]] = []
        self.turn = -1
        self.decoded = 0
        self.pending: dict[int, list[int]] = {}
        self.slot = 0

    def launch(self, batch, sampling=None, *, sample=True, penalties=None, masked=None, token_src=None):
        out = self.step(batch, sampling, sample=sample)
        if out is None:
            return None
        self.slot ^= 1
        self.pending[self.slot] = out
        return self.slot

    def collect(self, slot, n):
        return None if slot is None else np.asarray(self.pending.pop(slot))

    def ensure_cache(self, max_tokens: int, page_size: int = 16, *, kv_quantize=None, smoothing=True):
        self.kv_quantize = kv_quantize
        if self.cache is None or self.cache.capacity < max_tokens:
            self.cache = FakeCache(max_tokens, page_size)
        return self.cache

    def step(self, batch, sampling=None, *, sample=True):
        (seq, ids, start), = batch
        assert seq.num_positions >= start + len(ids), "positions must be reserved up to this step"
        self.steps.append((start, len(ids)))
        if not sample:
            return None
        if len(ids) > 1:  # a turn's last prefill chunk (every test turn adds more than one token)
            self.turn += 1
            self.decoded = 0
        reply = self.replies[self.turn]
        token = reply[min(self.decoded, len(reply) - 1)]
        self.decoded += 1
        return [token]

    def computed_in_last_turn(self, since: int) -> int:
        return sum(n for _, n in self.steps[since:])


def make(replies, **kw) -> tuple[ChatSession, FakeModel]:
    model = FakeModel(replies)
    return ChatSession(model, max_context=kw.pop("max_context", 4096), **kw), model


def test_render_matches_the_qwen3_format():
    text = render_chat(tok.CHAT_TEMPLATE, [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}])
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    off = render_chat(tok.CHAT_TEMPLATE, [{"role": "user", "content": "Hi"}], enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    with pytest.raises(ValueError, match="failed to render"):
        render_chat("{{ raise_exception('no tools here') }}", [])


def test_second_turn_computes_only_its_message_and_the_framing():
    chat, model = make(["Hello there, how can I help?", "Fine, thanks."])
    first = chat.send("Hi!")
    assert first == "Hello there, how can I help?"
    ids1 = chat.render(chat.messages[:1])  # turn 1's prompt
    reply1 = model.replies[0][:-1]
    mark = len(model.steps)
    chat.send("How are you?")
    t = chat.last_turn
    assert t.reused_tokens == len(ids1) + len(reply1)        # everything up to the new message
    framing = chat.render(chat.messages[:3])[t.reused_tokens:]
    assert model.tokenizer.decode(framing, skip_special_tokens=False) == \
        "<|im_end|>\n<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n"
    assert t.computed_tokens == len(framing)
    # The model saw the framing (prefill), then one step per fed reply token (and, pipelined, one step
    # launched before the end token was read back).
    assert model.steps[mark][0] == t.reused_tokens
    assert model.computed_in_last_turn(mark) - (len(framing) + t.new_tokens - 1) in (0, 1)
    assert chat._seq.num_positions == len(chat._cached)


def test_after_a_reasoning_reply_the_prefix_ends_where_the_reply_started():
    chat, model = make(["<think>\nThe user greets me.\n</think>\n\nHello!", "Sure."])
    chat.send("Hi")
    assert chat.messages[-1]["content"].startswith("<think>")
    ids1 = chat.render(chat.messages[:1])
    chat.send("Again?")
    assert chat.last_turn.reused_tokens == len(ids1)       # the reply is prefilled again without its reasoning
    rendered = model.tokenizer.decode(chat.render(chat.messages[:3]), skip_special_tokens=False)
    assert "<think>" not in rendered and "<|im_start|>assistant\nHello!<|im_end|>" in rendered


def test_editing_history_reprefills_from_the_first_changed_token():
    chat, model = make(["One.", "Two.", "Three."], system="Be brief.")
    chat.send("First question")
    chat.send("Second question")
    old = list(chat._cached)
    chat.messages[1]["content"] = "First question, edited"
    new = chat.render(chat.messages)
    first_change = common_prefix(old, new)
    mark = len(model.steps)
    chat.send("Third question")
    assert chat.last_turn.reused_tokens == first_change
    assert model.steps[mark][0] == first_change
    assert first_change < len(chat.render(chat.messages[:2]))  # inside the edited message


def test_context_overflow_raises_or_drops_the_oldest_turns():
    replies = ["A fairly long answer number %d, with some words in it." % i for i in range(6)]
    chat, _ = make(replies, max_context=100, system="S")
    chat.send("question one", max_tokens=20)
    chat.send("question two", max_tokens=20)
    with pytest.raises(ContextFullError, match="on_overflow='drop_oldest'"):
        chat.send("question three " * 12, max_tokens=20)
    assert len(chat.messages) == 5  # unchanged: system + two turns
    dropping, _ = make(replies, max_context=100, system="S", on_overflow="drop_oldest")
    dropping.send("question one", max_tokens=20)
    dropping.send("question two", max_tokens=20)
    dropping.send("question three " * 12, max_tokens=20)
    assert dropping.last_turn.dropped_turns >= 1
    assert dropping.messages[0] == {"role": "system", "content": "S"}
    assert dropping.messages[1]["content"] != "question one"  # the oldest turn went first
    assert dropping.last_turn.prompt_tokens + 20 <= 100


def test_abandoned_stream_leaves_history_and_cache_consistent():
    chat, model = make(["Hello there, my friend, how are you today?", "Ok."])
    gen = chat.stream("Hi")
    next(gen)
    gen.close()
    assert chat.messages == []
    assert chat._seq.num_positions == len(chat._cached)
    model.turn, model.decoded = 0, 0   # replay the second script line
    assert chat.send("Hi again") == "Ok."


def test_bad_arguments():
    chat, _ = make(["x"])
    with pytest.raises(ValueError, match="non-empty"):
        chat.send("")
    with pytest.raises(ValueError, match="temperature"):
        chat.send("hi", temperature=-1)
    with pytest.raises(ValueError, match="on_overflow"):
        make(["x"], on_overflow="truncate")
    with pytest.raises(ValueError, match="kv_quantize"):
        make(["x"], kv_quantize="fp8")


# ---------------------------------------------------------------------------- the CLI's chat loop


def scripted(lines):
    """An input() stand-in: returns the lines, then raises what is left (EOFError by default)."""
    items = list(lines)

    def read(prompt=""):
        if not items:
            raise EOFError
        item = items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item
    return read


def test_chat_loop_answers_resets_and_exits(capsys):
    import io

    from tileinfer.cli import chat_loop
    chat, model = make(["Hello!", "Again.", "Fresh start."])
    out, err = io.StringIO(), io.StringIO()
    rc = chat_loop(chat, dict(max_tokens=32), read=scripted(["hi", "", "more", "/reset", "new", "/exit", "never"]),
                   out=out, err=err)
    assert rc == 0
    assert out.getvalue() == "Hello!\nAgain.\nFresh start.\n"
    assert "(conversation cleared)" in err.getvalue() and "tok/s" in err.getvalue()
    assert [m["content"] for m in chat.messages] == ["new", "Fresh start."]


def test_chat_loop_ends_cleanly_on_eof_and_ctrl_c():
    import io

    from tileinfer.cli import chat_loop
    chat, _ = make(["Hello!"])
    assert chat_loop(chat, {}, read=scripted([]), out=io.StringIO(), err=io.StringIO()) == 0
    assert chat_loop(chat, {}, read=scripted([KeyboardInterrupt()]), out=io.StringIO(), err=io.StringIO()) == 130


def test_cli_help_and_errors(capsys):
    from tileinfer import cli
    parser = cli.build_parser()
    for command in ("generate", "chat", "size"):
        with pytest.raises(SystemExit) as e:
            parser.parse_args([command, "--help"])
        assert e.value.code == 0
    assert "--max-context" in capsys.readouterr().out
    rc = cli.main(["generate", "--model", "/nonexistent/dir", "--prompt", "x"])
    assert rc == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tileinfer: error: ") and "/nonexistent/dir" in err
    # A bad flag or a missing value: one line naming it, exit status 2.
    for argv in (["generate", "--prompt", "x", "--bogus"], ["generate"], ["chat", "--top-k", "many"], ["frobnicate"]):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and "error: " in err, (argv, err)


# ---------------------------------------------------------------------------- speculative turns


class TableLM(FakeModel):
    """A runner whose next token is a fixed function of the last one (into ids 1000-1099, which decode
    to text): step() for plain steps and the draft, verify() for speculative rounds. `disagree` of the
    draft's table entries differ from the target's."""

    VOCAB = 151936
    max_num_seqs = 4

    def __init__(self, seed: int = 0, disagree: float = 0.0):
        super().__init__([])
        rng = np.random.default_rng(seed)
        self.next = rng.integers(1000, 1100, self.VOCAB)
        flip = np.random.default_rng(seed + 1).random(self.VOCAB) < disagree
        self.next[flip] = np.random.default_rng(seed + 2).integers(1000, 1100, int(flip.sum()))
        self.max_verify_tokens = 64
        self.prev: list[int] = []

    def launch(self, batch, sampling=None, *, sample=True, penalties=None, masked=None, token_src=None):
        if token_src is not None:
            batch = [(seq, [self.prev[src]] if src >= 0 else ids, start)
                     for (seq, ids, start), src in zip(batch, token_src)]
        return super().launch(batch, sampling, sample=sample)

    def step(self, batch, sampling=None, *, sample=True):
        for seq, ids, start in batch:
            assert seq.num_positions >= start + len(ids)
            self.steps.append((start, len(ids)))
        self.prev = [int(self.next[ids[-1]]) for _, ids, _ in batch]
        return self.prev if sample else None

    def verify(self, batch, *, logits="argmax", graph_width=None, drafted=None, meanwhile=None):
        assert logits == "argmax" and drafted is None and meanwhile is None
        return np.concatenate([self.next[np.asarray(ids)] for _, ids, _ in batch]).astype(np.int32)


def test_speculative_turns_equal_plain_turns_and_reuse_the_targets_cache():
    plain = ChatSession(TableLM(), system="S")
    target, draft = TableLM(), TableLM(disagree=0.3)
    spec = ChatSession(target, system="S", draft_model=draft, num_draft_tokens=3)
    for i, message in enumerate(["Hello there", "And a second question", "Third"]):
        a = plain.send(message, max_tokens=20)
        b = spec.send(message, max_tokens=20)
        assert a == b, f"turn {i + 1}: speculation changed the greedy reply"
        t, s = plain.last_turn, spec.last_turn
        assert (s.reused_tokens, s.token_ids) == (t.reused_tokens, t.token_ids)
        stats = s.speculation
        assert 0 < stats.accepted < stats.drafted and stats.target_steps < len(s.token_ids)
        # The target's cache holds only conversation tokens, exactly its record; the draft's pages all
        # come back when the turn ends.
        conversation = spec.render(spec.messages[:-1]) + s.token_ids
        assert spec._seq.num_positions == len(spec._cached) and spec._cached == conversation[:len(spec._cached)]
        assert draft.cache.manager.num_free_pages == draft.cache.manager.num_pages
    with pytest.raises(ValueError, match="itself"):
        ChatSession(target, draft_model=target).send("x")


def test_abandoned_speculative_turn_keeps_the_cache_record_true():
    target, draft = TableLM(), TableLM(disagree=0.3)
    chat = ChatSession(target, draft_model=draft, num_draft_tokens=4)
    gen = chat.stream("Tell me a long story", max_tokens=60)
    next(gen)
    gen.close()
    assert chat.messages == []
    assert chat._seq.num_positions == len(chat._cached)
    assert chat.send("Hi", max_tokens=10) == ChatSession(TableLM()).send("Hi", max_tokens=10)
