"""An offline tokenizer for the tiny models (real checkpoints bring their own).

A byte-level BPE trained in well under a second on a small built-in corpus plus any extra text, with
the special tokens of every supported family added first so their ids are small and stable. Byte-level
means any string encodes, so prompts outside the corpus still work.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# Qwen chat and vision markers, then LLaVA-OneVision's placeholders (its LM is Qwen2 and shares the chat markers).
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|video_pad|>",
    "<|image_pad|>",
    "<video>",
    "<image>",
]

BASE_CORPUS = [
    "system user assistant You are a helpful assistant.",
    "Describe the video. What happens in this video? Summarize the video in one sentence.",
    "a the and then in of on to at is are was it this that with from left right up down middle",
    "red green blue yellow white black purple orange cyan pink gray brown",
    "circle square triangle cross star ball box small large big tiny moves stays still appears leaves turns",
    "0 1 2 3 4 5 6 7 8 9 . , ? ! : ; ' \" ( ) - first second frame frames video scene object objects",
]


def build_tokenizer(vocab_size: int = 512, extra_corpus: list[str] | None = None) -> PreTrainedTokenizerFast:
    """Trains the tiny byte-level BPE; deterministic for the same corpus and size."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(BASE_CORPUS + list(extra_corpus or []), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    return fast
