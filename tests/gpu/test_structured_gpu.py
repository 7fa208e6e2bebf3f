"""Bitmasks handed to a launched step (runner/gpu.py, structured output) on the GPU: the step's sampling
waits for them on a mapped host word, inside the decode graph too.

Every case decodes a few sequences for several steps with random bitmasks on some rows (a few random
tokens allowed each) and seeded sampling on some rows, from the same prompts each time, and compares:
a masked row's token is always one its mask allows; the masked decode graph gives the eager step's
tokens exactly; launching step k + 1 before step k's tokens are read and its masks after (the engine's
order) gives the step-by-step tokens; the rows without a mask get the tokens of a run without any
masks (same batch, same kernels: a row's logits do not depend on the other rows' tokens).
"""
from __future__ import annotations

import numpy as np
import pytest

import tileinfer
from tileinfer.graphs import DECODE, DECODE_MASKED, PREFILL_MASKED
from tileinfer.kv import Sequence
from tileinfer.runner.step import SamplingRow

pytestmark = pytest.mark.gpu

STEPS = 6


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    m = tileinfer.load_model(tiny_checkpoint, max_num_seqs=8, progress=False)
    m.ensure_cache(2048, page_size=16)
    yield m
    m.close()


def random_masks(b: int, vocab: int, seed: int, with_masks: bool = True) -> list[list]:
    """Per step (prefill, then STEPS decode steps) per row: None or a bitmask of 1-40 random tokens. Row 0
    always has one, row 1 never, the others at random (with_masks=False: no row)."""
    rng = np.random.default_rng(seed)
    words = (vocab + 31) // 32
    out = []
    for _ in range(STEPS + 1):
        row = []
        for i in range(b):
            if not with_masks or (i == 1 or (i > 1 and rng.random() < 0.4)):
                row.append(None)
                continue
            m = np.zeros(words, np.uint32)
            for t in rng.choice(vocab, int(rng.integers(1, 41)), replace=False):
                m[t // 32] |= np.uint32(1) << np.uint32(t % 32)
            row.append(m.view(np.int32))
        out.append(row)
    return out


def sampling_rows(b: int) -> list[SamplingRow]:
    return [SamplingRow() if i % 2 == 0 else SamplingRow(temperature=0.9, top_k=50, seed=100 + i) for i in range(b)]


def prompts_of(b: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 151643, int(n)).tolist() for n in rng.integers(3, 40, b)]


def decode(model, prompts, masks, *, pipelined: bool = False, queued: bool = False) -> list[list[int]]:
    """The prompts prefilled (their first token sampled), then STEPS decode steps; tokens [STEPS + 1][rows].
    pipelined: each decode step is launched taking its tokens on the device from the step before, which
    is read back only then; its masks are published after that. queued: as pipelined, but each step is
    launched while the step before it still waits for its masks (published only then, as the engine's
    grammar thread does)."""
    manager = model.cache.manager
    seqs = [Sequence() for _ in prompts]
    rows = sampling_rows(len(prompts))
    try:
        for s, p in zip(seqs, prompts):
            manager.reserve(s, len(p))
        out = [model.step(list(zip(seqs, prompts)), rows, masks=masks[0]).tolist()]
        if not pipelined:
            for k in range(1, STEPS + 1):
                for s in seqs:
                    manager.reserve(s, 1)
                out.append(model.step([(s, [t]) for s, t in zip(seqs, out[-1])], rows, masks=masks[k]).tolist())
            return out
        slot, waiting = None, []  # waiting: the masks of the launched step not yet published
        for k in range(1, STEPS + 1):
            for s in seqs:
                manager.reserve(s, 1)
            given = [m for m in masks[k] if m is not None]
            launched = model.launch([(s, [0]) for s in seqs], rows, masked=[m is not None for m in masks[k]],
                                    token_src=list(range(len(seqs))))
            if waiting:  # queued: step k was launched behind step k - 1, which gets its masks only now
                model.publish_masks(lambda buf, w=waiting: np.copyto(buf, np.stack(w)))
            if slot is not None:
                out.append(model.collect(slot, len(seqs)).tolist())  # while step k waits for its masks
            waiting = given if queued else []
            if given and not queued:
                model.publish_masks(lambda buf: np.copyto(buf, np.stack(given)))
            slot = launched
        if waiting:
            model.publish_masks(lambda buf: np.copyto(buf, np.stack(waiting)))
        out.append(model.collect(slot, len(seqs)).tolist())
        return out
    finally:
        for s in seqs:
            manager.release(s)


def allowed(mask: np.ndarray, token: int) -> bool:
    return bool((int(mask[token // 32]) >> (token % 32)) & 1)


@pytest.mark.parametrize("b", [1, 3, 8])
def test_masked_steps_graphed_eager_and_pipelined_agree_and_obey_the_masks(model, b):
    vocab = model.config.vocab_size
    prompts = prompts_of(b, seed=b)
    masks = random_masks(b, vocab, seed=10 + b)
    model.use_graphs = False
    try:
        eager = decode(model, prompts, masks)
    finally:
        model.use_graphs = True
    plain_graphs = model.graphs.count(DECODE)
    graphed = decode(model, prompts, masks)
    assert model.graphs.count(DECODE_MASKED) >= 1 and model.graphs.count(DECODE) == plain_graphs
    if b == 1:  # one prompt: its first token (row 0 has a mask) comes from a masked prefill graph
        assert model.graphs.count(PREFILL_MASKED) >= 1
    pipelined = decode(model, prompts, masks, pipelined=True)
    queued = decode(model, prompts, masks, pipelined=True, queued=True)
    unmasked = decode(model, prompts, random_masks(b, vocab, seed=0, with_masks=False))
    for k, step in enumerate(masks):
        for i, m in enumerate(step):
            if m is not None:
                assert allowed(m, graphed[k][i]), f"step {k} row {i}: token {graphed[k][i]} is not allowed"
    assert graphed == eager
    assert pipelined == graphed and queued == graphed
    if b > 1:  # row 1 never has a mask
        assert [t[1] for t in graphed] == [t[1] for t in unmasked]
    assert len({tuple(t) for t in graphed}) > 1  # the steps did not all repeat one token


def test_a_step_waiting_for_its_masks_refuses_to_be_waited_for(model):
    manager = model.cache.manager
    seqs = [Sequence(), Sequence()]
    words = (model.config.vocab_size + 31) // 32
    only = np.zeros(words, np.int32)
    only[777 // 32] = 1 << (777 % 32)
    try:
        for s in seqs:
            manager.reserve(s, 5)
        batch = [(s, [1, 2, 3, 4, 5]) for s in seqs]
        slot = model.launch(batch, masked=[True, False])
        with pytest.raises(RuntimeError, match="waits for its bitmasks"):
            model.collect(slot, 2)  # it would wait forever
        with pytest.raises(RuntimeError, match="waits for its bitmasks"):
            model.logits_rows(2)
        model.publish_masks(lambda buf: np.copyto(buf, only[None]))
        assert model.collect(slot, 2)[0] == 777
    finally:
        for s in seqs:
            manager.release(s)
