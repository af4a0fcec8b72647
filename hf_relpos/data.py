"""The embedded corpora, the tokenizer and the datasets of the command line.

Both corpora ship with Python itself, read at run time, never downloaded. ``docs`` (the default) is real
English: the documentation topics of ``pydoc_data.topics`` (79 topics, about 455 KiB), each split into
train / validation / test (85 / 5 / 10 %). ``stdlib`` is the source of the running Python's standard library
(about 12 MB of ``.py`` files, tests excluded), split by file (90 / 5 / 5 %) so that no module straddles splits.
"""

from __future__ import annotations

import functools
import os
import platform
import sysconfig
import zlib
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


# The embedded corpora of --corpus; "docs" is the default.
CORPORA = ("docs", "stdlib")
# Folders of test code in the standard library (lib2to3/tests, idlelib/idle_test, tkinter/test, ...): skipped.
_TEST_DIR = ("test", "tests", "idle_test")


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Optional[Path] = None) -> list[str]:
    """The standard library's ``.py`` files as sorted posix paths relative to ``root``: no site-packages or
    dist-packages, no test packages (``test``, ``tests``, ``idle_test`` or any folder named ``test*``)."""
    root = Path(root) if root is not None else stdlib_root()
    found = []
    for folder, dirs, files in os.walk(root):
        # pruned in place, so the walk does not enter them (site-packages alone holds thousands of files)
        dirs[:] = [d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__")
                   and d not in _TEST_DIR and not d.startswith("test")]
        relative = Path(folder).relative_to(root)
        found += [(relative / name).as_posix() for name in files if name.endswith(".py")]
    return sorted(found)


def stdlib_split(path: str) -> str:
    """The split of one file, from its relative path alone (CRC-32 mod 100: 0-89 train, 90-94 validation,
    95-99 test): the same on every machine and file-system order, and a file is never cut between splits."""
    bucket = zlib.crc32(path.encode("utf-8")) % 100
    return "train" if bucket < 90 else "validation" if bucket < 95 else "test"


def stdlib_corpus(root: Optional[Path] = None) -> tuple[dict[str, str], str]:
    """The standard library's source as train / validation / test text (whole files, in sorted path order,
    separated by a blank line), and a description naming the Python version, the files and those skipped
    (not UTF-8)."""
    root = Path(root) if root is not None else stdlib_root()
    split = {"train": [], "validation": [], "test": []}
    skipped = 0
    for path in stdlib_files(root):
        try:
            text = (root / path).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            skipped += 1
            continue
        if text.strip():
            split[stdlib_split(path)].append(text)
    files = {part: len(texts) for part, texts in split.items()}
    description = (f"the Python {platform.python_version()} standard library source ({sum(files.values())} .py files, "
                   f"tests and site-packages excluded; {files['train']}/{files['validation']}/{files['test']} files in "
                   f"train/validation/test, split by file path)" + (f"; {skipped} not UTF-8, skipped" if skipped else ""))
    return {part: "\n\n".join(texts) for part, texts in split.items()}, description


DOCS_DESCRIPTION = "Python's bundled documentation (pydoc_data.topics), split 85/5/10 within each topic"


@functools.lru_cache(maxsize=2)
def corpus(name: str) -> tuple[dict[str, str], str]:
    """An embedded corpus by name (``CORPORA``): its splits and a description. Read once per process."""
    if name == "docs":
        return embedded_corpus(), DOCS_DESCRIPTION
    if name == "stdlib":
        return stdlib_corpus()
    raise ValueError(f"--corpus {name!r} is not one of {', '.join(CORPORA)}")


# Held-out tokens evaluated by default (None: all). The stdlib test split holds about 190k tokens, which would
# make each run's evaluation at L..8L some 14 times slower than the docs corpus' 13.7k; 16384 keeps it alike.
DEFAULT_EVAL_TOKENS = {"docs": None, "stdlib": 16384}


@functools.lru_cache(maxsize=2)
def tokenized(name: str, vocab_size: int):
    """An embedded corpus' tokenizer (trained on its train split) and its three splits as token streams, and its
    description: computed once per process (``compare`` trains many runs alike; on ``stdlib`` this takes about
    15 s). The streams are shared: read them, never write into them."""
    texts, description = corpus(name)
    # in pieces of 1 MB: the same tokenizer and tokens as the whole text at a third of its peak memory (0.9 GB)
    tokenizer = train_tokenizer(_pieces(texts["train"]), vocab_size=vocab_size)
    streams = {part: torch.cat([encode(tokenizer, piece) for piece in _pieces(text)]) for part, text in texts.items()}
    return tokenizer, streams, description


def _pieces(text: str, size: int = 2**20) -> list[str]:
    """``text`` cut into pieces of about ``size`` characters, each cut just after a lone line break (a non-space
    character on either side). The byte-level pre-tokenizer splits there alone, in the whole text as in a piece
    (a line break never joins the word after it; a longer run of spaces would end a piece as one pre-token but
    give its last space to the next word in the whole text), so the tokenizer trained on the pieces, and the
    pieces' tokens joined, are those of the whole text; tokenizing 11 MB at once peaks at 2.7 GB."""
    pieces, start = [], 0
    while len(text) - start > size:
        cut = start + size
        lone = lambda at: text[at - 1] == "\n" and not text[at - 2].isspace() and not text[at].isspace()  # noqa: E731
        while cut < len(text) and not lone(cut):
            cut += 1
        pieces.append(text[start:cut])
        start = cut
    return pieces + [text[start:]]


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


__all__ = ["embedded_corpus", "stdlib_corpus", "stdlib_files", "stdlib_split", "corpus", "tokenized", "CORPORA",
           "DEFAULT_EVAL_TOKENS", "read_text_files", "MAX_TEXT_BYTES", "train_tokenizer", "encode", "Chunks", "SPECIAL_TOKENS"]
