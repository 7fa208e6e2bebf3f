"""The demo model shipped in tileinfer/demo: its float32 reference continuations are the committed ones
(a change to the reference, the loader or the files shows here), and a fresh `tileinfer generate` with no
--model answers with it, in English, on the CPU."""
from __future__ import annotations

import pytest

from tileinfer import LLM, ChatSession, SamplingParams, cli
from tileinfer.chat import render_chat
from tileinfer.demo import DFLASH, DRAFT, TARGET
from tileinfer.model.checkpoint import Checkpoint
from tileinfer.model.reference import ReferenceModel

# Greedy continuations (24 tokens, EOS not stopping them) of three chats, thinking off.
EXPECTED = {
    "Hello! How are you today?": [40, 498, 905, 901, 0, 1494, 369, 310, 30, 8168, 198, 8166, 8167, 304, 198, 40, 421,
                                  2213, 272, 1197, 0, 8168, 198, 8167],
    "What do you like to do on weekends?": [40, 388, 286, 2031, 11, 419, 296, 498, 415, 935, 499, 449, 319, 13, 981,
                                            480, 310, 30, 8168, 198, 8166, 8167, 304, 198],
    "How do I open a file in Python?": [40, 498, 415, 871, 11, 296, 498, 415, 871, 518, 286, 370, 13, 296, 498, 415,
                                        871, 518, 286, 370, 379, 408, 1074, 1516],
}


@pytest.fixture(scope="module")
def demo():
    checkpoint = Checkpoint.open(TARGET)
    return checkpoint, ReferenceModel.from_checkpoint(checkpoint)


def chat_ids(checkpoint, question: str) -> list[int]:
    prompt = render_chat(checkpoint.chat_template, [{"role": "user", "content": question}], enable_thinking=False)
    return checkpoint.tokenizer().encode(prompt, add_special_tokens=False).ids


@pytest.mark.parametrize("question", list(EXPECTED))
def test_the_reference_continues_the_demo_chats_as_committed(demo, question):
    checkpoint, reference = demo
    assert reference.greedy(chat_ids(checkpoint, question), 24) == EXPECTED[question]


def test_the_engine_and_a_chat_session_answer_in_english(demo):
    checkpoint, _ = demo
    question = "Hello! How are you today?"
    with LLM(TARGET, device="cpu", max_num_seqs=2, max_context=512, progress=False) as llm:
        out = llm.generate([chat_ids(checkpoint, question)], SamplingParams(max_tokens=24, temperature=0))[0]
        assert out.token_ids == EXPECTED[question][:out.token_ids.index(8168) + 1]  # ends at <|im_end|>
        reply = ChatSession(llm).send(question, max_tokens=24, temperature=0)
    assert out.text == "I'm doing great! How are you?"
    assert reply and reply.isascii(), reply  # the session's own template (thinking on): still English


def test_the_draft_model_loads_beside_it():
    with LLM(TARGET, device="cpu", max_num_seqs=2, max_context=512, draft_model=DRAFT, progress=False) as llm:
        out = llm.generate(["The Python language"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    with LLM(TARGET, device="cpu", max_num_seqs=2, max_context=512, progress=False) as plain:
        assert plain.generate(["The Python language"], SamplingParams(max_tokens=12, temperature=0,
                                                                      ignore_eos=True))[0].token_ids == out.token_ids
    assert out.speculation is not None and out.speculation.drafted > 0


def test_generate_without_a_model_uses_the_demo(capsys):
    rc = cli.main(["generate", "--device", "cpu", "--prompt", "The capital of France is", "--max-new-tokens", "12"])
    captured = capsys.readouterr()
    assert rc == 0 and "using the demo model" in captured.err
    assert "the best" in captured.out, captured.out  # the demo's greedy continuation


def test_the_dflash_drafter_drafts_for_it(demo):
    # Trained for the target: its blocks are accepted in part (acceptance lengths above one token a target step)
    # and greedy output is the plain engine's.
    checkpoint, _ = demo
    prompt = chat_ids(checkpoint, "How do I open a file in Python?")
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    with LLM(TARGET, device="cpu", max_num_seqs=2, max_context=512, draft_model=DFLASH, progress=False) as llm:
        out = llm.generate([prompt], params)[0]
    with LLM(TARGET, device="cpu", max_num_seqs=2, max_context=512, progress=False) as plain:
        assert plain.generate([prompt], params)[0].token_ids == out.token_ids
    assert out.speculation.tokens_per_target_step > 1.5, out.speculation
