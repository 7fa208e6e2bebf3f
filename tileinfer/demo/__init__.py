"""The demo models, shipped with the package: what `tileinfer generate`, `chat` and `serve` use when no
--model is given, so a fresh machine answers in real (if simple) English.

    TARGET: a 16.1M-parameter model of the Qwen3 architecture (hidden 384, 8 layers, 4 query heads and
            2 KV heads of 128, intermediate 896, an 8,192-token byte-level BPE with Qwen3's special
            tokens, tied embeddings), 32.3 MB in bf16;
    DRAFT:  a 3.3M-parameter draft model with the same tokenizer (hidden 256, 2 layers), 6.6 MB;
    DFLASH: a 2.8M-parameter DFlash drafter of TARGET (two layers of its width reading its layers 1, 3 and
            5, blocks of 16, <|fim_pad|> as the mask token), 5.6 MB.

TARGET and DRAFT were trained by scripts/train_demo.py on chitchat-dataset conversations (MIT) and the Python
3.11 documentation (PSF), prepared by scripts/prepare_demo_data.py, DFLASH by scripts/train_dflash.py on the
same text with TARGET's hidden states and greedy tokens; each folder's NOTICE names the sources and licences,
train-log.jsonl and dflash-train-log.jsonl are the training runs' logs. TARGET and DRAFT are Hugging Face
Qwen3 checkpoints (transformers loads them unchanged), DFLASH is in z-lab's DFlashDraftModel layout.
"""
from pathlib import Path

TARGET = Path(__file__).resolve().parent / "target"
DRAFT = Path(__file__).resolve().parent / "draft"
DFLASH = Path(__file__).resolve().parent / "dflash"
