"""The embedded models' tokenizer: byte-level BPE of 2,048 tokens trained with Hugging Face
`tokenizers` on the training split of the corpus (so its merges are Python's: indentation,
keywords, `self.`), with the special tokens the chat template uses."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from engine_service.model.default_model import SPECIAL_TOKENS, VOCAB_SIZE


def train_tokenizer(texts: Iterable[str]) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def token_stream(tokenizer: Any, texts: list[str]) -> list[int]:
    """The texts' tokens end to end, each file followed by <|endoftext|>."""
    end = tokenizer.token_to_id(SPECIAL_TOKENS[0])
    ids: list[int] = []
    for encoding in tokenizer.encode_batch(texts, add_special_tokens=False):
        ids.extend(encoding.ids)
        ids.append(end)
    return ids
