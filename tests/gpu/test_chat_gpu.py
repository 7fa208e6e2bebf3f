"""ChatSession on the GPU: every reply of a multi-turn greedy chat equals a fresh generation of
the same rendered conversation with a full prefill, while each turn computes only its new tokens.

The model runs batch-invariant (runner/gpu.py): a chat turn prefills only its new tokens, in
other chunks than a full prefill, and the default kernels may then differ in the last bits.
"""
from __future__ import annotations

import pytest

import tileinfer
from tileinfer.chat import ChatSession
from tileinfer.model.synthetic import cached_checkpoint

pytestmark = pytest.mark.gpu


def test_five_turn_chat_equals_fresh_generations():
    with tileinfer.load_model(cached_checkpoint("qwen3-0.6b"), batch_invariant=True, progress=False) as model:
        chat = ChatSession(model, max_context=2048, system="You are a helpful assistant.")
        for i, message in enumerate(["Hello!", "What is the capital of France?", "And of Italy?",
                                     "Write one line about the sea.", "Thanks, bye."]):
            before = [dict(m) for m in chat.messages] + [{"role": "user", "content": message}]
            prompt = chat.render(before)
            chat.send(message, max_tokens=24)
            turn = chat.last_turn
            fresh = tileinfer.generate(model, prompt, max_new_tokens=24, stop_at_eos=True)
            print(f"turn {i + 1}: prompt {turn.prompt_tokens} tokens, {turn.reused_tokens} reused, "
                  f"{turn.computed_tokens} computed, {turn.new_tokens} generated")
            assert turn.token_ids == fresh.token_ids, f"turn {i + 1} differs from a fresh generation"
            if i:
                assert turn.reused_tokens > 0 and turn.computed_tokens < turn.prompt_tokens
        assert chat._seq.num_positions == len(chat._cached)
