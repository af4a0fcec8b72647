"""TransfoXL's word-level vocabulary (``vocab.pkl``), read without running anything, and written as a
``tokenizers`` ``tokenizer.json`` with the same ids (issue 39).

``vocab.pkl`` is a pickle of the vocabulary object's ``__dict__``: the authors' ``Vocab`` (Dai et al.'s code, which
the hub's ``transfo-xl-wt103`` came from) holds ``idx2sym`` (a list), ``sym2idx`` (an ``OrderedDict``), ``counter``
(a ``Counter``), ``special``, ``min_freq``, ``max_size``, ``lower_case``, ``delimiter``, ``vocab_file`` and index
fields. Unpickling an arbitrary file runs whatever it names, so :func:`read_vocab` admits exactly what that
vocabulary is made of: dicts, lists, tuples, strings, bytes, numbers, booleans, None, ``collections.OrderedDict``
and ``collections.Counter``. Any other name (a function, a class, a tensor's storage) is refused in one line before
it is called, and a scan refuses the opcodes such a vocabulary never needs (:data:`REFUSED_OPCODES`; a pickle of
protocol 0 or 1 writes every tuple with one of them, so only protocols 2 and up read). The file may be a plain pickle, the legacy ``torch.save`` stream (a magic number, the protocol and
system information, then the object) or a ``torch.save`` zip archive (its ``data.pkl``).
"""

from __future__ import annotations

import collections
import io
import pickle
import pickletools
import zipfile
from pathlib import Path
from typing import Union

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # torch.save's legacy stream starts with this number (torch/serialization.py)
UNK_SYMBOLS = ("<unk>", "<UNK>")  # what TransfoXLTokenizer falls back to when the vocabulary sets no unk_idx
MAX_BYTES = 512 * 2**20  # wt103's vocab.pkl is about 9 MB; a file (or a zip member) past this is refused unread
# Opcodes a vocabulary never needs. Tuples of two or more (TUPLE, TUPLE2, TUPLE3) and frozensets could be built from
# one memoised object again and again as a dict key whose hash then takes exponential time; the rest construct
# objects other than through the two allowed classes, or read data outside the pickle.
REFUSED_OPCODES = {"TUPLE", "TUPLE2", "TUPLE3", "FROZENSET", "BUILD", "INST", "OBJ", "NEWOBJ", "NEWOBJ_EX", "EXT1",
                   "EXT2", "EXT4", "PERSID", "BINPERSID", "NEXT_BUFFER", "READONLY_BUFFER"}


class VocabRefused(ValueError):
    """A ``vocab.pkl`` that is not a plain TransfoXL vocabulary: refused before anything in it ran."""


class _Counter(collections.Counter):
    """The only Counter a vocabulary pickle gets: built from its arguments, never given state (BUILD refused)."""


class _OrderedDict(collections.OrderedDict):
    """The only OrderedDict a vocabulary pickle gets: built from its arguments and items, never given state."""


ALLOWED = {("collections", "OrderedDict"): _OrderedDict, ("collections", "Counter"): _Counter}


def _short(text: str) -> str:
    return repr(text if len(text) <= 80 else text[:77] + "...")


class _PlainUnpickler(pickle.Unpickler):
    """An unpickler whose globals are :data:`ALLOWED` and nothing else; no persistent ids (torch storages)."""

    def __init__(self, stream, where: str):
        super().__init__(stream)
        self.where = where

    def find_class(self, module: str, name: str):
        allowed = ALLOWED.get((module, name))
        if allowed is None:
            raise VocabRefused(
                f"{self.where} names {_short(module)}.{_short(name)}: a TransfoXL vocabulary pickle holds only "
                "dicts, lists, strings, numbers, collections.OrderedDict and collections.Counter, so it was refused "
                "and nothing in it ran")
        return allowed

    def persistent_load(self, pid):
        raise VocabRefused(f"{self.where} holds a persistent object (a tensor's storage?): a TransfoXL vocabulary "
                           "has none, so it was refused and nothing in it ran")


def _scan(data: bytes, where: str) -> None:
    """Refuse the pickles in ``data`` (one, or a legacy stream's several) that use a :data:`REFUSED_OPCODES`
    opcode, before any is loaded."""
    stream = io.BytesIO(data)
    while stream.tell() < len(data):
        for opcode, _, _ in pickletools.genops(stream):
            if opcode.name in REFUSED_OPCODES:
                raise VocabRefused(f"{where} uses the pickle opcode {opcode.name}, which a TransfoXL vocabulary "
                                   "never needs: refused, nothing in it ran")


def _unpickle(data: bytes, where: str) -> dict:
    """The vocabulary dict of a plain pickle or a legacy ``torch.save`` stream."""
    _scan(data, where)
    stream = io.BytesIO(data)
    first = _PlainUnpickler(stream, where).load()
    if type(first) is int and first == LEGACY_MAGIC:
        _PlainUnpickler(stream, where).load()  # the protocol version
        _PlainUnpickler(stream, where).load()  # system information (a dict)
        first = _PlainUnpickler(stream, where).load()
    return first


def read_vocab(path: Union[str, Path]) -> dict:
    """The vocabulary in ``path`` (``vocab.pkl``) as a plain dict, read by an unpickler that constructs only
    :data:`ALLOWED` (after a scan that refuses :data:`REFUSED_OPCODES`); ``idx2sym`` rebuilt from ``sym2idx`` where
    it is empty (TransfoXLTokenizer 4.35 saved it so), and the two checked against each other. Raises
    :class:`VocabRefused` (one line) for anything else."""
    path = Path(path)
    where = repr(str(path))
    try:
        if not path.is_file():
            raise VocabRefused(f"{where} is not a file")
        if path.stat().st_size > MAX_BYTES:
            raise VocabRefused(f"{where} is over {MAX_BYTES // 2**20} MB: not a vocabulary")
        data = path.read_bytes()
        if zipfile.is_zipfile(io.BytesIO(data)):
            with zipfile.ZipFile(io.BytesIO(data)) as archive:
                members = [m for m in archive.infolist() if m.filename.endswith("/data.pkl") or m.filename == "data.pkl"]
                if len(members) != 1:
                    raise VocabRefused(f"{where} is a zip archive without one data.pkl: not a torch.save vocabulary")
                if members[0].file_size > MAX_BYTES:
                    raise VocabRefused(f"{where}'s data.pkl unpacks to over {MAX_BYTES // 2**20} MB: not a vocabulary")
                data = archive.read(members[0])
        return _checked(_unpickle(data, where), where)
    except VocabRefused:
        raise
    except Exception as error:  # truncated, not a pickle at all, or not a vocabulary's shape
        detail = str(error).splitlines()[0][:120] if str(error) else "no detail"
        raise VocabRefused(f"{where} is not a readable vocabulary pickle ({type(error).__name__}: {detail})") from None


def _checked(vocab, where: str) -> dict:
    if type(vocab) is not dict:
        raise VocabRefused(f"{where} holds a {type(vocab).__name__}, not a vocabulary dict")
    sym2idx = vocab.get("sym2idx")
    idx2sym = vocab.get("idx2sym")
    if not isinstance(sym2idx, dict) or not sym2idx:
        raise VocabRefused(f"{where} has no sym2idx mapping: not a TransfoXL vocabulary")
    if idx2sym is not None and type(idx2sym) is not list:
        raise VocabRefused(f"{where}: idx2sym is a {type(idx2sym).__name__}, not a list")
    pairs = list(dict.items(sym2idx))
    if not all(type(s) is str and type(i) is int for s, i in pairs):
        raise VocabRefused(f"{where}: sym2idx must map strings to integer ids")
    if sorted(i for _, i in pairs) != list(range(len(pairs))):
        raise VocabRefused(f"{where}: sym2idx's ids are not 0..{len(pairs) - 1}, each once")
    by_id = [None] * len(pairs)
    for symbol, index in pairs:
        by_id[index] = symbol
    if idx2sym and idx2sym != by_id:
        first = next((i for i, (a, b) in enumerate(zip(idx2sym, by_id)) if a != b), min(len(idx2sym), len(by_id)))
        raise VocabRefused(f"{where}: idx2sym and sym2idx disagree from id {first} on")
    delimiter, special = vocab.get("delimiter"), vocab.get("special") or []
    if delimiter is not None and type(delimiter) is not str:
        raise VocabRefused(f"{where}: delimiter is a {type(delimiter).__name__}, not a string or None")
    if type(special) is not list or not all(type(s) is str for s in special):
        raise VocabRefused(f"{where}: special must be a list of strings")
    counter = vocab.get("counter")
    plain = {key: value for key, value in dict.items(vocab)}
    plain.update(idx2sym=by_id, sym2idx=dict(pairs), special=list(special))
    if isinstance(counter, dict):
        plain["counter"] = collections.Counter(dict(dict.items(counter)))
    return plain


def unk_token(vocab: dict):
    """The symbol unknown words map to, as TransfoXLTokenizer chooses it: ``unk_idx`` if set, else ``<unk>`` or
    ``<UNK>`` if in the vocabulary, else None (an unknown word is then an error)."""
    index = vocab.get("unk_idx")
    if type(index) is int and 0 <= index < len(vocab["idx2sym"]):
        return vocab["idx2sym"][index]
    return next((s for s in UNK_SYMBOLS if s in vocab["sym2idx"]), None)


def word_level_tokenizer(vocab: dict):
    """A ``tokenizers`` word-level tokenizer with the vocabulary's ids: lower-cased first where ``lower_case`` is
    set, split on whitespace as Python's ``str.split`` does (``delimiter`` None: the authors' split of pre-tokenised
    text such as WikiText-103) or into characters (``delimiter`` ""), each piece looked up, unknown words to
    :func:`unk_token`. Special symbols are ordinary entries, found only as whole pieces. Another delimiter is
    refused: TransfoXL keeps the empty pieces between two delimiters as symbols, which ``tokenizers`` drops."""
    from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers

    delimiter = vocab.get("delimiter")
    if delimiter not in (None, ""):
        raise ValueError(f"delimiter {delimiter!r}: a TransfoXL vocabulary converts with None (whitespace) or "
                         "\"\" (characters) only")
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab["sym2idx"], unk_token=unk_token(vocab)))
    # str.split's whitespace includes the separators \x1c-\x1f, which Rust's does not
    steps = [normalizers.Replace(Regex("[\x1c-\x1f]"), " ")] if delimiter is None else []
    steps += [normalizers.Strip()] + ([normalizers.Lowercase()] if vocab.get("lower_case") else [])
    tokenizer.normalizer = normalizers.Sequence(steps)
    if delimiter is None:
        tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    else:  # characters, as TransfoXLTokenizer splits a line then
        tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    return tokenizer
