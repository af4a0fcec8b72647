"""The synthetic tasks of Kazemnejad et al. 2023 (arXiv 2305.19466), generated on the fly, and their scoring.

Pure Python (no torch, no Transformers): a task turns a seeded :class:`random.Random` and an instance length (the
paper's: the number of input items) into token ids ``[task] prompt... = answer... </s>``. Items are drawn from
``items`` item types (the paper's 100 by default), one token each (``w0``, ``w1``, ...); digits, ``+`` and the
parity answers have tokens of their own. The paper's natural-language instruction words are reduced to one task
token at the start (see docs/guides/length-generalisation.md for every deviation).

The tasks of the headline (:data:`HEADLINE_TASKS`):

- ``copy``: items ``x1 .. xn`` -> the same items;
- ``repeat_copy`` (the paper's ``rsc``): one item ``x`` repeated n times -> the same;
- ``replace`` (the paper's ``rdc``): ``x y`` then n times ``x`` -> n times ``y``;
- ``reverse``: items -> the items in reverse order.

Also ``sort`` (items -> in the order of their type's index, the paper's single-token sort) and three negative
controls (:data:`CONTROLS`), tasks a model this small does not learn, kept apart from the headline:

- ``addition``: two numbers of ``n`` digits each, ``a + b`` -> ``a + b``, most significant digit first, as written;
- ``summation``: ``n`` digits -> their sum modulo 10 (one digit);
- ``parity``: ``n`` bits -> ``Y`` if the number of 1s is even, else ``N`` (the paper's "Is the number of 1's even?").
"""

from __future__ import annotations

import random
import string
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

PAD, EOS, SEP = "<pad>", "</s>", "="  # ids 0, 1 (RelPosConfig's pad and eos defaults) and 2
HEADLINE_TASKS = ("copy", "repeat_copy", "replace", "reverse")
CONTROLS = ("addition", "summation", "parity")
TASKS = (*HEADLINE_TASKS, "sort", *CONTROLS)
ITEMS = 100  # item types, as in the paper's copy and reverse tasks
MAX_ITEMS = 1000
DIGITS = tuple(string.digits)
# The tokens every vocabulary starts with: the special tokens, one per task, digits, "+" and the parity answers.
# Item k is token ITEM_BASE + k, so every other id is the same whatever the number of item types.
FIXED = (PAD, EOS, SEP, *(f"<{task}>" for task in TASKS), *DIGITS, "+", "Y", "N")
TOKEN_ID = {token: index for index, token in enumerate(FIXED)}
ITEM_BASE = len(FIXED)
PAD_ID, EOS_ID, SEP_ID = TOKEN_ID[PAD], TOKEN_ID[EOS], TOKEN_ID[SEP]
# A length's held-out instances leave training only where the task has this many times as many distinct instances
# there: parity of 2 bits (4 instances) cannot give up its test instances and still be trained on.
HOLD_OUT_FACTOR = 5


def vocabulary(items: int = ITEMS) -> tuple:
    """Every token, by id: :data:`FIXED`, then the ``items`` item types ``w0 .. w<items-1>``."""
    return FIXED + tuple(f"w{k}" for k in range(items))


def vocab_size(items: int = ITEMS) -> int:
    return ITEM_BASE + items


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


def _digits(text: str) -> list:
    return [TOKEN_ID[c] for c in text]


def _items(task: str, rng: random.Random, n: int, items: int) -> tuple[list, list]:
    """The prompt's and the answer's token ids of one instance of length ``n``."""
    if task in ("copy", "reverse", "sort"):
        drawn = [rng.randrange(items) for _ in range(n)]
        answer = {"copy": drawn, "reverse": drawn[::-1], "sort": sorted(drawn)}[task]
        return [ITEM_BASE + k for k in drawn], [ITEM_BASE + k for k in answer]
    if task == "repeat_copy":
        x = ITEM_BASE + rng.randrange(items)
        return [x] * n, [x] * n
    if task == "replace":
        x = rng.randrange(items)
        y = rng.randrange(items - 1)
        y += y >= x  # uniform over the other item types
        return [ITEM_BASE + x, ITEM_BASE + y] + [ITEM_BASE + x] * n, [ITEM_BASE + y] * n
    if task == "addition":
        a, b = _number(rng, n), _number(rng, n)
        return [*_digits(str(a)), TOKEN_ID["+"], *_digits(str(b))], _digits(str(a + b))
    if task == "summation":
        values = [rng.randrange(10) for _ in range(n)]
        return _digits("".join(map(str, values))), _digits(str(sum(values) % 10))
    if task == "parity":
        bits = [rng.randrange(2) for _ in range(n)]
        return _digits("".join(map(str, bits))), [TOKEN_ID["Y" if sum(bits) % 2 == 0 else "N"]]
    raise ValueError(f"unknown task {task!r}: one of {', '.join(TASKS)}")


def make_instance(task: str, rng: random.Random, length: int, items: int = ITEMS) -> Instance:
    """One instance of ``task`` with ``length`` input items over ``items`` item types, drawn from ``rng``."""
    if length < 1:
        raise ValueError(f"an instance has at least one input item, got length {length}")
    if not 2 <= items <= MAX_ITEMS:
        raise ValueError(f"items must be from 2 to {MAX_ITEMS} item types, got {items}")
    prompt, answer = _items(task, rng, length, items)
    head = [TOKEN_ID[f"<{task}>"], *prompt, SEP_ID]
    return Instance(ids=tuple(head + answer + [EOS_ID]), answer_start=len(head), length=length)


def decode(ids: Sequence[int]) -> str:
    """Token ids as text, one token per id (items as ``w<k>``), space-separated (for reading instances)."""
    return " ".join(FIXED[i] if i < ITEM_BASE else f"w{i - ITEM_BASE}" for i in ids)


def max_tokens(task: str, length: int) -> int:
    """The most tokens an instance of ``task`` with ``length`` items can take (sizes absolute position tables)."""
    prompt = {"addition": 2 * length + 1, "replace": length + 2}.get(task, length)
    answer = {"addition": length + 1, "summation": 1, "parity": 1}.get(task, length)
    return 1 + prompt + 1 + answer + 1


def distinct_instances(task: str, length: int, items: int = ITEMS) -> int:
    """How many different instances ``task`` has at ``length``: what decides whether its held-out instances can be
    kept out of training (:func:`held_out`)."""
    if task in ("copy", "reverse", "sort"):
        return items**length
    counts = {"repeat_copy": items, "replace": items * (items - 1),
              "addition": (10 if length == 1 else 9 * 10 ** (length - 1)) ** 2, "summation": 10**length,
              "parity": 2**length}
    return counts[task]


def held_out(task: str, instances: Iterable[Instance], items: int = ITEMS) -> frozenset:
    """The ids of ``instances`` that training must skip: those at a length where the task has at least
    :data:`HOLD_OUT_FACTOR` times as many distinct instances as ``instances`` holds there (elsewhere skipping them
    would leave training few or no instances of that length: with 20 held out per length, parity of 1-6 bits and
    summation of 1 digit)."""
    instances = list(instances)
    per_length = Counter(i.length for i in instances)
    return frozenset(i.ids for i in instances
                     if distinct_instances(task, i.length, items) >= HOLD_OUT_FACTOR * per_length[i.length])


def train_instances(task: str, seed: int, train_length: int, items: int = ITEMS, skip: frozenset = frozenset()):
    """An endless stream of training instances, lengths ~ U(1, ``train_length``), reproducible from ``seed``; an
    instance in ``skip`` (the held-out sets, :func:`held_out`) is drawn again at the same length, so that the
    lengths stay uniform (:func:`held_out` leaves at least 4 of every 5 instances of a length to draw)."""
    rng = random.Random(f"lengthgen-train-{task}-{seed}")
    while True:
        length = rng.randint(1, train_length)
        instance = make_instance(task, rng, length, items)
        while instance.ids in skip:
            instance = make_instance(task, rng, length, items)
        yield instance


def test_instances(task: str, max_length: int, per_length: int, seed: int = 0, items: int = ITEMS) -> list:
    """The test set: ``per_length`` instances at each length 1..``max_length`` (U(1, max_length), stratified), the
    same for every scheme and run seed (its own random stream, apart from training's)."""
    rng = random.Random(f"lengthgen-test-{task}-{seed}")
    return [make_instance(task, rng, n, items) for n in range(1, max_length + 1) for _ in range(per_length)]


def validation_instances(task: str, train_length: int, per_length: int, items: int = ITEMS) -> list:
    """The in-distribution validation set that picks each run's best state: ``per_length`` instances at each length
    1..``train_length``, from a stream of its own (apart from training's and the test set's)."""
    rng = random.Random(f"lengthgen-validation-{task}")
    return [make_instance(task, rng, n, items) for n in range(1, train_length + 1) for _ in range(per_length)]


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
