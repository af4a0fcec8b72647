"""The embedded corpus, the tokenizer and the datasets of the command line.

The default corpus is real English that ships with Python itself: the documentation topics of
``pydoc_data.topics`` (79 topics, about 455 KiB), read at run time, never downloaded. Each topic
is split into train / validation / test (85 / 5 / 10 %).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Optional, Sequence

import torch
from torch.utils.data import Dataset

SPECIAL_TOKENS = ["<pad>", "</s>", "<unk>"]  # ids 0, 1, 2: RelPosConfig's pad/eos defaults


def _cut(text: str, fraction: float) -> int:
    """A cut point near ``fraction`` of ``text``, moved to the next line break so no line is split."""
    point = int(len(text) * fraction)
    newline = text.find("\n", point)
    return len(text) if newline < 0 else newline + 1


def embedded_corpus() -> dict[str, str]:
    """Python's bundled documentation topics as train / validation / test text.

    Each topic gives its first 85% to train, the next 5% to validation and its last 10% to test
    (cut at line breaks), so held-out text is unseen but of the same kinds as the training text.
    """
    from pydoc_data.topics import topics

    split = {"train": [], "validation": [], "test": []}
    for name in sorted(topics):
        text = topics[name]
        a, b = _cut(text, 0.85), _cut(text, 0.90)
        split["train"].append(text[:a])
        split["validation"].append(text[a:b])
        split["test"].append(text[b:])
    return {part: "\n\n".join(t for t in texts if t.strip()) for part, texts in split.items()}


# The most text the command line reads (--max-train-bytes, --max-eval-bytes). Training the BPE tokenizer on the text
# and encoding it take about 200 bytes of memory per byte of text (measured: 8 MiB of text peaks at 2.0 GiB resident,
# 2 MiB at 0.86 GiB, of which 0.4 GiB is the process itself), so a 400 MB file was killed at 24 GB with no message.
MAX_TEXT_BYTES = 8 * 2**20


def read_text_files(paths: Sequence[str | Path], flag: str = "--train-file", max_bytes: Optional[int] = None,
                    limit_flag: str = "--max-train-bytes") -> dict[str, str]:
    """User text files: the last 10% of the characters of each file are held out (half validation, half test).

    A file that is missing, unreadable, not UTF-8 text or shorter than 1000 characters raises ``ValueError``
    naming ``flag`` and the file; files of more than ``max_bytes`` in all, before any is read, one naming their
    size and ``limit_flag``.
    """
    for path in paths:
        if not Path(path).is_file():
            raise ValueError(f"{flag} {str(path)!r} does not exist or is not a file")
    total = sum(Path(path).stat().st_size for path in paths)
    if max_bytes is not None and total > max_bytes:
        what = f"{str(paths[0])!r} is" if len(paths) == 1 else f"{len(paths)} files are"
        raise ValueError(
            f"{flag} {what} {total:,} bytes, more than {limit_flag} {max_bytes:,} (training the tokenizer and "
            f"encoding take about 200 bytes of memory per byte of text): pass a larger {limit_flag} if this machine "
            "has the memory, or less text"
        )
    train, validation, test = [], [], []
    for path in paths:
        path = Path(path)
        try:
            raw = path.read_bytes()
        except OSError as error:
            raise ValueError(f"{flag} {str(path)!r} cannot be read: {error.strerror}") from None
        try:
            if b"\0" in raw:
                raise UnicodeDecodeError("utf-8", raw, raw.index(b"\0"), raw.index(b"\0") + 1, "NUL byte")
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{flag} {str(path)!r} is not a UTF-8 text file (binary content)") from None
        if len(text.strip()) < 1000:
            raise ValueError(f"{flag} {str(path)!r} holds {len(text.strip())} characters of text; at least 1000 are needed")
        cut, mid = int(len(text) * 0.9), int(len(text) * 0.95)
        train.append(text[:cut])
        validation.append(text[cut:mid])
        test.append(text[mid:])
    return {"train": "\n\n".join(train), "validation": "\n\n".join(validation), "test": "\n\n".join(test)}


def train_tokenizer(texts: Iterable[str], vocab_size: int = 2048):
    """A byte-level BPE (GPT-2 style) trained on ``texts`` with ``tokenizers``; reloads with ``AutoTokenizer``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(texts), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="</s>", unk_token="<unk>"
    )


def encode(tokenizer, text: str) -> torch.Tensor:
    """The whole text as one stream of token ids (no special tokens)."""
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


class Chunks(Dataset):
    """Non-overlapping chunks of ``length`` tokens of one stream, for causal-LM training (labels = inputs)."""

    def __init__(self, stream: torch.Tensor, length: int, limit: Optional[int] = None):
        count = stream.numel() // length
        if count < 1:
            raise ValueError(f"the token stream holds {stream.numel()} tokens, fewer than one chunk of {length}")
        if limit is not None:
            count = min(count, limit)
        self.data = stream[: count * length].view(count, length)

    def __len__(self) -> int:
        return self.data.shape[0]

    def __getitem__(self, index: int) -> dict:
        ids = self.data[index]
        return {"input_ids": ids, "labels": ids.clone()}


__all__ = ["embedded_corpus", "read_text_files", "MAX_TEXT_BYTES", "train_tokenizer", "encode", "Chunks", "SPECIAL_TOKENS"]
