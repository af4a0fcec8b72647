"""The synthetic tasks of Kazemnejad et al. 2023 (arXiv 2305.19466), generated on the fly, and their scoring.

Pure Python (no torch, no Transformers): a task turns a seeded :class:`random.Random` and an instance length (the
paper's: the number of input items) into token ids ``[task] prompt... = answer... </s>``. One character-level
vocabulary (:data:`VOCAB`) serves every task; the paper's natural-language instruction words are reduced to one task
token at the start (see docs/guides/length-generalisation.md for every deviation).

- ``copy``: letters ``x1 .. xn`` -> the same letters;
- ``reverse``: letters -> the letters in reverse order;
- ``sort``: letters -> the letters in alphabetical order (the paper's single-token sort);
- ``addition``: two numbers of ``n`` digits each, ``a + b`` -> ``a + b``, most significant digit first, as written;
- ``summation``: ``n`` digits -> their sum modulo 10 (one digit);
- ``parity``: ``n`` bits -> ``Y`` if the number of 1s is even, else ``N`` (the paper's "Is the number of 1's even?").
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass
from typing import Callable, Sequence

PAD, EOS, SEP = "<pad>", "</s>", "="  # ids 0, 1 (RelPosConfig's pad and eos defaults) and 2
TASKS = ("copy", "reverse", "sort", "addition", "summation", "parity")
LETTERS = tuple(string.ascii_lowercase)
DIGITS = tuple(string.digits)
# The vocabulary of every task: the special tokens, one token per task, digits, letters, "+" and the parity answers.
VOCAB = (PAD, EOS, SEP, *(f"<{task}>" for task in TASKS), *DIGITS, *LETTERS, "+", "Y", "N")
TOKEN_ID = {token: index for index, token in enumerate(VOCAB)}
PAD_ID, EOS_ID, SEP_ID = TOKEN_ID[PAD], TOKEN_ID[EOS], TOKEN_ID[SEP]


@dataclass(frozen=True)
class Instance:
    """One instance: ``ids`` = task token, prompt, separator, answer, end-of-sequence; ``answer_start`` indexes the
    first answer token (the separator is at ``answer_start - 1``); ``length`` is the number of input items."""

    ids: tuple
    answer_start: int
    length: int

    @property
    def prompt(self) -> tuple:
        """Everything up to and including the separator: what greedy decoding starts from."""
        return self.ids[: self.answer_start]

    @property
    def answer(self) -> tuple:
        """The answer tokens and the end-of-sequence."""
        return self.ids[self.answer_start:]


def _number(rng: random.Random, digits: int) -> int:
    """A number of exactly ``digits`` digits (0-9 for one digit), uniformly."""
    return rng.randrange(10 ** (digits - 1) if digits > 1 else 0, 10**digits)


def _items(task: str, rng: random.Random, n: int) -> tuple[list, list]:
    """The prompt's and the answer's items (as vocabulary strings) of one instance of length ``n``."""
    if task in ("copy", "reverse", "sort"):
        letters = [rng.choice(LETTERS) for _ in range(n)]
        answer = {"copy": letters, "reverse": letters[::-1], "sort": sorted(letters)}[task]
        return letters, answer
    if task == "addition":
        a, b = _number(rng, n), _number(rng, n)
        return [*str(a), "+", *str(b)], list(str(a + b))
    if task == "summation":
        values = [rng.randrange(10) for _ in range(n)]
        return [str(v) for v in values], [str(sum(values) % 10)]
    if task == "parity":
        bits = [rng.randrange(2) for _ in range(n)]
        return [str(b) for b in bits], ["Y" if sum(bits) % 2 == 0 else "N"]
    raise ValueError(f"unknown task {task!r}: one of {', '.join(TASKS)}")


def make_instance(task: str, rng: random.Random, length: int) -> Instance:
    """One instance of ``task`` with ``length`` input items, drawn from ``rng``."""
    if length < 1:
        raise ValueError(f"an instance has at least one input item, got length {length}")
    prompt, answer = _items(task, rng, length)
    head = [f"<{task}>", *prompt, SEP]
    ids = tuple(TOKEN_ID[t] for t in [*head, *answer, EOS])
    return Instance(ids=ids, answer_start=len(head), length=length)


def decode(ids: Sequence[int]) -> str:
    """Token ids as text, one vocabulary entry per id, space-separated (for reading instances)."""
    return " ".join(VOCAB[i] for i in ids)


def max_tokens(task: str, length: int) -> int:
    """The most tokens an instance of ``task`` with ``length`` items can take (sizes absolute position tables)."""
    prompt = 2 * length + 1 if task == "addition" else length
    answer = {"addition": length + 1, "summation": 1, "parity": 1}.get(task, length)
    return 1 + prompt + 1 + answer + 1


def train_instances(task: str, seed: int, train_length: int):
    """An endless stream of training instances, lengths ~ U(1, ``train_length``), reproducible from ``seed``."""
    rng = random.Random(f"lengthgen-train-{task}-{seed}")
    while True:
        yield make_instance(task, rng, rng.randint(1, train_length))


def test_instances(task: str, max_length: int, per_length: int, seed: int = 0) -> list:
    """The test set: ``per_length`` instances at each length 1..``max_length`` (U(1, max_length), stratified), the
    same for every scheme and run seed (its own random stream, apart from training's)."""
    rng = random.Random(f"lengthgen-test-{task}-{seed}")
    return [make_instance(task, rng, n) for n in range(1, max_length + 1) for _ in range(per_length)]


def buckets(train_length: int) -> list[tuple[int, int]]:
    """Length buckets (inclusive ranges): each half of 1..L in distribution, each half of L+1..2L out of it
    (L = 20: 1-10, 11-20, 21-30, 31-40). Empty halves (L = 1) are left out."""
    half = (train_length + 1) // 2
    edges = [(1, half), (half + 1, train_length), (train_length + 1, train_length + half),
             (train_length + half + 1, 2 * train_length)]
    return [(lo, hi) for lo, hi in edges if lo <= hi]


def bucket_name(bucket: tuple[int, int]) -> str:
    lo, hi = bucket
    return str(lo) if lo == hi else f"{lo}-{hi}"


def accuracy_by_bucket(counts: dict, train_length: int) -> dict:
    """Exact-match accuracy per length bucket and over the in- and out-of-distribution lengths, from ``counts``
    (``{length: (right, total)}``): ``{"1-10": 0.9, ..., "in": ..., "out": ...}`` (``"in"``: lengths 1..L,
    ``"out"``: L+1..2L), each the fraction of that range's instances answered exactly (None: no instance there)."""

    def fraction(keep: Callable[[int], bool]):
        right = sum(r for n, (r, _) in counts.items() if keep(int(n)))
        total = sum(t for n, (_, t) in counts.items() if keep(int(n)))
        return right / total if total else None

    result = {bucket_name(b): fraction(lambda n, b=b: b[0] <= n <= b[1]) for b in buckets(train_length)}
    result["in"] = fraction(lambda n: n <= train_length)
    result["out"] = fraction(lambda n: train_length < n <= 2 * train_length)
    return result
