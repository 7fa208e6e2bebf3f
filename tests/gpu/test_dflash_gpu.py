"""The DFlash drafter on the GPU (runner/gpu_dflash.py) and the hidden states it reads (GPURunner's capture):
against the float32 references (runner/cpu.py's capture, model/dflash_reference.py), against a PyTorch forward
written from the drafter's description (z-lab's DFlashDraftModel), and greedy speculation against plain greedy
in batch-invariant mode (a position's logits are then the same in a verify chunk and in a decode step)."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import tileinfer
from tileinfer import LLM, SamplingParams
from tileinfer.kv import Sequence
from tileinfer.model.checkpoint import Checkpoint
from tileinfer.model.forward import BF16
from tileinfer.model.dflash_reference import DFlashReference
from tileinfer.model.reference import ReferenceModel
from tileinfer.cuda import DeviceArray
from tileinfer.engine.dflash import DFlashDrafter
from tileinfer.engine.speculative import accept
from tileinfer.kernels import next_block_inputs
from tileinfer.runner.base import ContextRow, DraftRow
from tileinfer.runner.cpu import CPURunner

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def pair(tiny_checkpoint, dflash_tiny_checkpoint):
    target = tileinfer.load_model(tiny_checkpoint, progress=False, batch_invariant=True)
    drafter = tileinfer.load_model(dflash_tiny_checkpoint)
    drafter.bind_target(target)
    drafter.ensure_cache(2048)
    yield target, drafter
    drafter.close()
    target.close()


@pytest.fixture(scope="module")
def references(tiny_checkpoint, dflash_tiny_checkpoint):
    target = ReferenceModel.from_checkpoint(Checkpoint.open(tiny_checkpoint))
    drafter = DFlashReference.from_checkpoint(Checkpoint.open_draft(dflash_tiny_checkpoint))
    drafter.bind_target(target)
    return target, drafter


def rel_err(got: np.ndarray, want: np.ndarray) -> float:
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def per_layer_err(got: np.ndarray, want: np.ndarray, hidden: int) -> list[float]:
    return [rel_err(got[:, j:j + hidden], want[:, j:j + hidden]) for j in range(0, want.shape[1], hidden)]


def test_captured_states_match_the_reference(pair, tiny_checkpoint):
    # dflash-tiny reads both layers of the tiny target: the first's residual and the last's final-normed state.
    target, _ = pair
    cpu = CPURunner(tiny_checkpoint)
    cpu.capture_hidden_states((0, 1))
    for r in (target, cpu):
        r.ensure_cache(512)
    hidden = target.config.hidden_size
    ids = np.random.default_rng(1).integers(0, 151643, 37).tolist()
    seqs = {r: Sequence() for r in (target, cpu)}
    for r in (target, cpu):
        r.extend(seqs[r], ids, chunk=16, logits="none")  # three chunks: the earlier chunks' states are kept
    got, want = target.last_features, cpu.last_features
    assert got.shape == want.shape == (37, 2 * hidden)
    assert max(per_layer_err(got, want, hidden)) < 0.02, per_layer_err(got, want, hidden)
    for step in range(3):  # eager, then captured, then replayed decode graphs
        for r in (target, cpu):
            r.cache.manager.reserve(seqs[r], 1)
            r.collect(r.launch([(seqs[r], [ids[step]])]), 1)
        got, want = target.last_features, cpu.last_features
        assert got.shape == (1, 2 * hidden) and max(per_layer_err(got, want, hidden)) < 0.02, step
    for width in (None, 5):  # an eager verify step, then a graphed one
        for r in (target, cpu):
            start = seqs[r].num_positions
            r.cache.manager.reserve(seqs[r], 4)
            r.verify([(seqs[r], ids[5:9], start)], logits="argmax", graph_width=width)
        got, want = target.last_features, cpu.last_features
        assert got.shape == (4, 2 * hidden) and max(per_layer_err(got, want, hidden)) < 0.02, width
    for r in (target, cpu):
        r.cache.manager.release(seqs[r])


def torch_dflash(checkpoint: Checkpoint, embed: np.ndarray, lm_head: np.ndarray, features: np.ndarray,
                 context_positions: np.ndarray, block: list[int], start: int) -> np.ndarray:
    """The logits of block rows 1..k, written from the description of DFlash (not from our code): context
    c = hidden_norm(fc(features)); per pre-norm Qwen3 layer, queries from the block, keys and values from
    [c; block] through the layer's own k_proj/v_proj, q/k norm and RoPE at the target positions, attention
    with no mask; then the final norm and the target's LM head."""
    torch = pytest.importorskip("torch")
    cfg = checkpoint.config
    d = cfg.decoder
    H, KV, hd, eps = d.num_attention_heads, d.num_key_value_heads, d.head_dim, d.rms_norm_eps

    def w(name):
        return torch.tensor(np.asarray(checkpoint.read(name), np.float32))

    def norm(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def rope(x, positions):  # x [n, heads, hd]; rotate-half pairs channel i with i + hd/2
        inv = 1.0 / (d.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
        angle = torch.tensor(positions, dtype=torch.float64)[:, None] * inv[None]
        cos, sin = angle.cos().float()[:, None], angle.sin().float()[:, None]
        x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)

    c = norm(torch.tensor(features, dtype=torch.float32) @ w("fc.weight").T, w("hidden_norm.weight"))
    h = torch.tensor(embed[block], dtype=torch.float32)
    n = len(block)
    q_pos = start + np.arange(n)
    kv_pos = np.concatenate([context_positions, q_pos])
    for i in range(d.num_hidden_layers):
        p = f"layers.{i}."
        x = norm(h, w(p + "input_layernorm.weight"))
        both = torch.cat([c, x])
        q = rope(norm((x @ w(p + "self_attn.q_proj.weight").T).view(n, H, hd), w(p + "self_attn.q_norm.weight")), q_pos)
        k = rope(norm((both @ w(p + "self_attn.k_proj.weight").T).view(-1, KV, hd), w(p + "self_attn.k_norm.weight")),
                 kv_pos)
        v = (both @ w(p + "self_attn.v_proj.weight").T).view(-1, KV, hd)
        k, v = k.repeat_interleave(H // KV, dim=1), v.repeat_interleave(H // KV, dim=1)
        o = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        h = h + o.transpose(0, 1).reshape(n, H * hd) @ w(p + "self_attn.o_proj.weight").T
        x = norm(h, w(p + "post_attention_layernorm.weight"))
        gate, up = x @ w(p + "mlp.gate_proj.weight").T, x @ w(p + "mlp.up_proj.weight").T
        h = h + (torch.nn.functional.silu(gate) * up) @ w(p + "mlp.down_proj.weight").T
    return (norm(h, w("norm.weight")) @ torch.tensor(lm_head, dtype=torch.float32).T)[1:].numpy()


def test_drafts_match_the_reference_and_a_torch_forward(pair, references, dflash_tiny_checkpoint):
    # Three rounds on one drafter sequence (each attends to the earlier rounds' cached context), two requests in
    # the later rounds' calls, contexts at gappy target positions; rows 1..k of each block's logits. Each round's
    # context is the states the target just computed for random tokens, read where the target left them on the
    # GPU: the first round's (100 entries) eagerly, the later rounds' in the context graph.
    target, drafter = pair
    ref_target, ref = references
    checkpoint = Checkpoint.open_draft(dflash_tiny_checkpoint)
    manager = drafter.cache.manager
    target.ensure_cache(512)
    rng = np.random.default_rng(7)
    seqs, caches, history = [Sequence(), Sequence()], [ref.new_cache(), ref.new_cache()], [[], []]
    for rnd, (m, k) in enumerate([(100, 3), (30, 7), (5, 15)]):
        n_req = 2 if rnd else 1
        scratch = Sequence()
        target.extend(scratch, rng.integers(0, 151643, n_req * m).tolist(), chunk=n_req * m, logits="none")
        assert target.captured_on_device == (0, n_req * m)
        states = target.last_features
        contexts, blocks, wants = [], [], []
        for r in range(n_req):
            pos = np.sort(rng.choice(np.arange(400 * rnd + 10 * r, 400 * rnd + 10 * r + 3 * m), m, replace=False))
            entry = seqs[r].num_positions
            manager.reserve(seqs[r], m)
            contexts.append(ContextRow(seqs[r], entry, pos, r * m))
            history[r].append((states[r * m:(r + 1) * m], pos))
        drafter.add_context(contexts)
        # the context pass's input: the target's states, rounded to bf16 on the GPU as the host rounds them
        gathered = drafter.features.rows(0, n_req * m).to_host(drafter.stream)
        assert np.array_equal(gathered.view(np.uint16), states.astype(BF16).view(np.uint16))
        target.cache.manager.release(scratch)
        for r in range(n_req):
            feats, pos = history[r][-1]
            start = int(pos[-1]) + 3
            block = ref.block(int(rng.integers(0, 151643)), k)
            manager.reserve(seqs[r], k + 1)
            blocks.append(DraftRow(seqs[r], block, start))
            cache = caches[r]
            entry = cache.append_positions(np.concatenate([pos, start + np.arange(k + 1)]))
            wants.append(ref.forward(feats, pos, block, start, cache, entry))
            cache.truncate(entry + m)
        drafts = drafter.draft(blocks).tokens()
        logits = drafter.workspace.logits.rows(0, sum(len(r.block) for r in blocks)).to_host(drafter.stream)
        at = 0
        for r, (row, want, got_ids) in enumerate(zip(blocks, wants, drafts)):
            got = logits[at + 1: at + len(row.block)]
            at += len(row.block)
            assert got_ids == got.argmax(axis=1).tolist()
            assert rel_err(got, want) < 0.03, (rnd, r, rel_err(got, want))
            feats = np.concatenate([f for f, _ in history[r]])
            pos = np.concatenate([p for _, p in history[r]])
            theirs = torch_dflash(checkpoint, ref_target.embed, ref_target.lm_head, feats, pos, row.block, row.start)
            assert rel_err(got, theirs) < 0.03, (rnd, r, rel_err(got, theirs))
            manager.truncate(seqs[r], sum(len(p) for _, p in history[r]))
    for s in seqs:
        manager.release(s)
    assert manager.num_free_pages == manager.num_pages


def test_a_verify_step_reads_the_drafts_where_the_block_pass_left_them(pair):
    # Three requests' blocks (3, 5 and 2 drafts) in one draft call; the target's verify step over each request's
    # last token and drafts, given placeholders and the drafts' place on the device, equals the step given their
    # ids: argmaxes and logits, eager and graphed (three rows padded to a bucket of four).
    target, drafter = pair
    target.ensure_cache(512)
    manager, dmanager = target.cache.manager, drafter.cache.manager
    rng = np.random.default_rng(11)
    rows, blocks = [], []
    for i, k in enumerate((3, 5, 2)):
        prompt = rng.integers(0, 151643, 20 + 9 * i).tolist()
        seq, dseq = Sequence(), Sequence()
        target.extend(seq, prompt[:-1], logits="none")
        dmanager.reserve(dseq, len(prompt) - 1)
        drafter.add_context([ContextRow(dseq, 0, np.arange(len(prompt) - 1), 0)])
        dmanager.reserve(dseq, k + 1)
        blocks.append(DraftRow(dseq, [prompt[-1]] + [drafter.config.mask_token_id] * k, len(prompt) - 1))
        manager.reserve(seq, k + 1)
        rows.append((seq, prompt[-1], len(prompt) - 1))
    proposals = drafter.draft(blocks)
    drafts = proposals.tokens()
    assert [len(d) for d in drafts] == proposals.counts == [3, 5, 2]
    given = [(seq, [last] + d, start) for (seq, last, start), d in zip(rows, drafts)]
    placeholders = [(seq, [last] + [0] * len(d), start) for (seq, last, start), d in zip(rows, drafts)]
    calls = []
    for width in (None, 6):
        for logits in ("argmax", "all"):
            want = target.verify(given, logits=logits, graph_width=width)
            got = target.verify(placeholders, logits=logits, graph_width=width, drafted=proposals.device,
                                meanwhile=lambda: calls.append(1))
            np.testing.assert_array_equal(got, want, err_msg=f"graph_width {width}, logits {logits}")
    assert len(calls) == 4
    with pytest.raises(ValueError, match="drafts placed for 3 rows, the step has 2"):
        target.verify(placeholders[:2], drafted=proposals.device)
    for (seq, _, _), block in zip(rows, blocks):
        manager.release(seq)
        dmanager.release(block.seq)


def test_next_block_inputs_decides_each_block_as_the_greedy_verdict_does(stream):
    # Rows of awkward sizes (no drafts, every draft accepted, none, some), pages in shuffled order, entries that
    # cross page boundaries: the kernel's step inputs against the host's arithmetic, and nothing written past
    # the pass's rows.
    rng = np.random.default_rng(5)
    page, width, mask = 16, 9, 777
    specs = [(0, 4), (5, 16), (3, 7), (7, 1), (2, 3)]  # (drafts m, block count) a row
    argmax = rng.integers(0, 50, 64).astype(np.int32)
    drafted = rng.integers(0, 50, 96).astype(np.int32)
    rows, want, tables, src, first, out = [], [], [], 0, 0, 0
    for i, (m, count) in enumerate(specs):
        acc = int(rng.integers(0, m + 1))
        drafted[first + 1:first + 1 + acc] = argmax[src:src + acc]  # the verdict accepts exactly acc drafts
        if acc < m:
            drafted[first + 1 + acc] = argmax[src + acc] + 1
        start, entry = int(rng.integers(0, 50)), int(rng.integers(0, 60))
        table = rng.permutation(64)[:width].astype(np.int32)
        rows.append([src, m, first, start, entry, count, out] + table.tolist())
        e = entry + acc + 1
        for t in range(count):
            at = e + t
            want.append((argmax[src + acc] if t == 0 else mask, start + acc + 1 + t,
                         table[at // page] * page + at % page, e + count, out + t, out + t))
            tables.append(table)
        src, first, out = src + m + 1 + i, first + m + 3, out + count
    n, cap = out, out + 3
    fields = {name: DeviceArray.from_host(np.full(cap, -9, np.int32))
              for name in ("tokens", "positions", "slots", "kv_lens", "cu_q", "last_rows")}
    fields["block_tables"] = DeviceArray.from_host(np.full((cap, width), -9, np.int32))
    inputs = SimpleNamespace(**fields)
    next_block_inputs(DeviceArray.from_host(np.array(rows, np.int32)), DeviceArray.from_host(argmax),
                      DeviceArray.from_host(drafted), mask, page, inputs, stream)
    got = {name: a.to_host(stream) for name, a in fields.items()}
    names = ("tokens", "positions", "slots", "kv_lens", "cu_q", "last_rows")
    np.testing.assert_array_equal(np.stack([got[k][:n] for k in names], 1), np.array(want))
    np.testing.assert_array_equal(got["block_tables"][:n], np.array(tables))
    assert got["cu_q"][n] == n
    rest = [got[k][n + 1:] if k == "cu_q" else got[k][n:] for k in names] + [got["block_tables"][n:].ravel()]
    assert all((r == -9).all() for r in rest)


def test_a_block_drafted_ahead_equals_the_block_drafted_after_the_verdict(pair):
    # Two requests (one with fewer drafts) go through a greedy round: the verify step's context pass is followed
    # by draft_ahead, and the next propose takes that pass (no pass launched) with the same drafts a pass launched
    # after the host's verdict gives.
    target, drafter = pair
    target.ensure_cache(512)
    dflash = DFlashDrafter(drafter, target)
    rng = np.random.default_rng(21)
    k, reqs = 7, []
    for rid, length in ((1, 40), (2, 57)):
        committed = rng.integers(0, 151643, length).tolist()
        seq = Sequence()
        target.extend(seq, committed[:-1], logits="none")
        dflash.add_context([(rid, 0, 0, length - 1)])
        reqs.append((rid, seq, committed))
    items = [(rid, committed, k - 3 * i) for i, (rid, _, committed) in enumerate(reqs)]
    proposals = dflash.propose(items)
    batch, context, at = [], [], 0
    for (rid, seq, committed), m in zip(reqs, proposals.counts):
        start = len(committed) - 1
        target.cache.manager.reserve(seq, m + 1)
        batch.append((seq, [committed[-1]] + [0] * m, start))
        context.append((rid, start, at, m + 1))
        at += m + 1
    out = target.verify(batch, logits="argmax", drafted=proposals.device,
                        meanwhile=lambda: dflash.add_context(context, then_draft=k))
    at = 0
    for (rid, seq, committed), props in zip(reqs, proposals.tokens()):
        emitted, accepted = accept(props, out[at:at + len(props) + 1], SamplingParams(temperature=0), None)
        start = len(committed) - 1
        target.cache.manager.truncate(seq, start + 1 + accepted)
        committed += emitted
        dflash.rollback(rid, committed)
        at += len(props) + 1
    items = [(rid, committed, k) for rid, _, committed in reqs]
    passes = drafter._passes
    ahead = dflash.propose(items)
    assert drafter._passes == passes  # taken from the pass launched ahead
    again = dflash.propose(items)     # nothing ahead now: a pass of its own
    assert drafter._passes == passes + 1
    assert ahead.counts == again.counts == [k, k]
    assert ahead.tokens() == again.tokens()
    for rid, seq, _ in reqs:
        target.cache.manager.release(seq)
        dflash.release(rid)


def test_context_rows_must_be_the_targets_last_step(pair):
    target, drafter = pair
    target.ensure_cache(512)
    scratch, seq = Sequence(), Sequence()
    target.extend(scratch, list(range(1, 9)), logits="none")
    drafter.cache.manager.reserve(seq, 4)
    with pytest.raises(ValueError, match=r"rows 6\.\.9 of the target's last step, whose rows 0\.\.7 are on the device"):
        drafter.add_context([ContextRow(seq, 0, np.arange(4), 6)])
    drafter.cache.manager.release(seq)
    target.cache.manager.release(scratch)


def test_greedy_dflash_equals_plain_greedy(pair):
    target, drafter = pair
    prompt = np.random.default_rng(3).integers(0, 151643, 70).tolist()
    want = tileinfer.generate(target, prompt, max_new_tokens=40, stop_at_eos=False).token_ids
    got = tileinfer.generate(target, prompt, max_new_tokens=40, stop_at_eos=False, draft_model=drafter)
    assert got.token_ids == want
    assert got.speculation.target_steps > 0 and got.speculation.drafted > 0


def test_llm_with_a_dflash_drafter_equals_plain_llm(tiny_checkpoint, dflash_tiny_checkpoint):
    # Start-up sizes both pools and the target captures the drafter's layers; a batch of requests of
    # different lengths gives the plain engine's greedy tokens, and every drafter page comes back.
    prompts = [np.random.default_rng(i).integers(0, 151643, 20 + 37 * i).tolist() for i in range(5)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    options = dict(batch_invariant=True, max_num_seqs=4, max_context=512, num_pages=64, progress=False)
    with LLM(tiny_checkpoint, **options) as llm:
        want = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(tiny_checkpoint, draft_model=dflash_tiny_checkpoint, **options) as llm:
        outs = llm.generate(prompts, params)
        manager = llm.engine.drafter.manager
        assert manager.num_free_pages == manager.num_pages
    assert [o.token_ids for o in outs] == want
    assert all(o.speculation is not None and o.speculation.target_steps > 0 for o in outs)
