"""TransfoXL's ``vocab.pkl`` read without running anything (hf_relpos/transfo_xl_vocab.py), in each format it
occurs in, and written as a word-level ``tokenizer.json`` that AutoTokenizer loads with the same ids."""

from __future__ import annotations

import collections
import os
import pickle
import re

import pytest
import torch

from hf_relpos.transfo_xl_vocab import VocabRefused, read_vocab, unk_token, word_level_tokenizer

WORDS = ["<eos>", "the", "<unk>", "cat", "sat", "on", "mat", "@,@", "1", "000", "."]


def authors_vocab(**overrides) -> dict:
    """The ``__dict__`` of the authors' Vocab (Dai et al.'s data_utils), as wt103's vocab.pkl holds it."""
    counter = collections.Counter({w: 10 - i for i, w in enumerate(WORDS)})
    vocab = {"counter": counter, "special": ["<eos>"], "min_freq": 0, "max_size": None, "lower_case": False,
             "delimiter": None, "vocab_file": None, "idx2sym": list(WORDS),
             "sym2idx": collections.OrderedDict((w, i) for i, w in enumerate(WORDS)), "eos_idx": 0, "unk_idx": 2}
    vocab.update(overrides)
    return vocab


@pytest.mark.parametrize("form", ["pickle", "legacy torch.save", "zip torch.save"])
def test_every_format_reads_back_the_vocabulary(form, tmp_path):
    path = tmp_path / "vocab.pkl"
    vocab = authors_vocab()
    if form == "pickle":
        path.write_bytes(pickle.dumps(vocab, protocol=2))
    else:
        torch.save(vocab, path, _use_new_zipfile_serialization=form == "zip torch.save")
    read = read_vocab(path)
    assert read["idx2sym"] == WORDS and read["sym2idx"] == {w: i for i, w in enumerate(WORDS)}
    assert read["counter"] == vocab["counter"] and read["special"] == ["<eos>"] and read["unk_idx"] == 2


def test_an_empty_idx2sym_is_rebuilt_and_a_disagreeing_one_refused(tmp_path):
    path = tmp_path / "vocab.pkl"
    path.write_bytes(pickle.dumps(authors_vocab(idx2sym=[])))  # as TransfoXLTokenizer 4.35 saved it
    assert read_vocab(path)["idx2sym"] == WORDS
    path.write_bytes(pickle.dumps(authors_vocab(idx2sym=WORDS[:3] + ["dog"] + WORDS[4:])))
    with pytest.raises(VocabRefused, match="idx2sym and sym2idx disagree from id 3 on"):
        read_vocab(path)
    path.write_bytes(pickle.dumps(authors_vocab(sym2idx={"a": 0, "b": 2})))
    with pytest.raises(VocabRefused, match=r"sym2idx's ids are not 0..1, each once"):
        read_vocab(path)


class _Payload:
    """What a tampered vocab.pkl carries: unpickling calls ``exec`` on code that writes a marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('ran')",)


def test_a_tampered_vocab_pkl_is_refused_in_one_line_and_runs_nothing(tmp_path):
    marker = tmp_path / "ran.txt"
    path = tmp_path / "vocab.pkl"
    path.write_bytes(pickle.dumps(authors_vocab(counter=_Payload(marker))))
    pickle.loads(path.read_bytes())  # the control: an ordinary unpickler runs it
    assert marker.read_text() == "ran"
    marker.unlink()
    with pytest.raises(VocabRefused) as refused:
        read_vocab(path)
    message = str(refused.value)
    assert "names 'builtins'.'exec'" in message and "nothing in it ran" in message and "\n" not in message
    assert not marker.exists()
    # the same inside a legacy torch.save stream and a zip archive
    for zipped in (False, True):
        torch.save(authors_vocab(counter=_Payload(marker)), path, _use_new_zipfile_serialization=zipped)
        with pytest.raises(VocabRefused, match=r"names '(__builtin__|builtins)'\.'exec'"):  # protocol 2: __builtin__
            read_vocab(path)
        assert not marker.exists()


@pytest.mark.parametrize("content, message", [
    (lambda: {"pattern": __import__("re").compile("a"), **authors_vocab()}, "uses the pickle opcode TUPLE2"),
    (lambda: authors_vocab(counter=torch.zeros(2)), "uses the pickle opcode TUPLE"),
    (lambda: authors_vocab(counter=os.system), f"names '{os.system.__module__}'.'system'"),
    (lambda: authors_vocab(counter=collections.ChainMap()), "uses the pickle opcode NEWOBJ"),
])
def test_anything_but_the_plain_containers_is_refused(content, message, tmp_path):
    path = tmp_path / "vocab.pkl"
    torch.save(content(), path) if message.startswith("names torch") else path.write_bytes(pickle.dumps(content()))
    with pytest.raises(VocabRefused, match=message):
        read_vocab(path)


def test_files_that_are_not_a_vocabulary_are_one_line(tmp_path):
    path = tmp_path / "vocab.pkl"
    for data, message in ((b"not a pickle", "is not a readable vocabulary pickle"),
                          (pickle.dumps([1, 2]), "holds a list, not a vocabulary dict"),
                          (pickle.dumps({"idx2sym": ["a"]}), "has no sym2idx mapping")):
        path.write_bytes(data)
        with pytest.raises(VocabRefused, match=message) as refused:
            read_vocab(path)
        assert "\n" not in str(refused.value)


def test_the_word_level_tokenizer_gives_transfo_xls_ids(tmp_path):
    """Whitespace split of pre-tokenised text (str.split's whitespace), the vocabulary's ids, unknown words to
    unk_idx's symbol, special symbols only as whole words; lower-casing where the vocabulary says so; characters
    for delimiter ""; and the same through AutoTokenizer from tokenizer.json."""
    from tokenizers import AddedToken
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    vocab = authors_vocab()
    tokenizer = word_level_tokenizer(vocab)

    def authors(text, v=vocab):  # the authors' Vocab.tokenize + get_idx, written out
        line = text.strip().lower() if v.get("lower_case") else text.strip()
        symbols = line.split() if v.get("delimiter") is None else list(line)
        return [v["sym2idx"].get(w, v["unk_idx"]) for w in symbols]

    for text in ("the cat sat on the mat 1 @,@ 000 . <eos> The dog", "a<eos>b", " the\x1cmat\tcat ", ""):
        assert tokenizer.encode(text).ids == authors(text), text
    lower = authors_vocab(lower_case=True)
    assert word_level_tokenizer(lower).encode("The CAT").ids == authors("The CAT", lower) == [1, 3]
    chars = authors_vocab(delimiter="", sym2idx={c: i for i, c in enumerate("<ab c")}, idx2sym=list("<ab c"),
                          unk_idx=0)
    assert word_level_tokenizer(chars).encode(" ab cab ").ids == authors(" ab cab ", chars)
    with pytest.raises(ValueError, match="delimiter 'x': a TransfoXL vocabulary converts with None"):
        word_level_tokenizer(authors_vocab(delimiter="x"))
    assert unk_token(authors_vocab(unk_idx=None)) == "<unk>" and unk_token(authors_vocab(unk_idx=5)) == "on"
    text = "the cat sat on the mat 1 @,@ 000 . <eos> The dog a<eos>b"
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token=unk_token(vocab),
                                   eos_token=AddedToken("<eos>", single_word=True, normalized=False, special=True))
    fast.save_pretrained(tmp_path / "tok")
    assert not list((tmp_path / "tok").glob("*.pkl"))
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert loaded(text, add_special_tokens=False)["input_ids"] == authors(text)
    assert loaded.decode(authors(text)[:6]) == "the cat sat on the mat" and loaded.eos_token_id == 0


def _text(value: str) -> bytes:
    """SHORT_BINUNICODE: the opcode, a one-byte length, the UTF-8 bytes."""
    data = value.encode()
    return b"\x8c" + bytes([len(data)]) + data


def test_hand_made_pickles_that_break_the_rules_are_refused_in_one_line(tmp_path, monkeypatch):
    """What a review found: a dict key hashed in exponential time (nested pairs of one memoised tuple), state given
    to an allowed class (BUILD), a name with a line break, a non-list idx2sym, a missing file, and sizes past the
    limit, each refused in one line."""
    import io
    import zipfile

    import hf_relpos.transfo_xl_vocab as module

    path = tmp_path / "vocab.pkl"
    nested = b"\x80\x02})" + b"q\x00h\x00\x86" * 60 + b"K\x00s."  # {((t,t),(t,t))...: 0}, 60 deep
    broken_name = b"\x80\x04" + _text("os\nINJECTED") + _text("system") + b"\x93."
    counter_with_state = pickle.dumps(collections.Counter(a=1), protocol=2)[:-1].replace(b"R", b"R}\x8c\x03getb", 1)
    cases = [
        (nested, "uses the pickle opcode TUPLE2"),
        (counter_with_state, "uses the pickle opcode BUILD"),
        (broken_name, "names 'os\\nINJECTED'.'system'"),
        (pickle.dumps({"sym2idx": {"a": 0}, "idx2sym": 5}), "idx2sym is a int, not a list"),
        (pickle.dumps(authors_vocab(special="<eos>")), "special must be a list of strings"),
        (pickle.dumps(authors_vocab(delimiter=5)), "delimiter is a int"),
    ]
    for data, message in cases:
        path.write_bytes(data)
        with pytest.raises(VocabRefused, match=re.escape(message)) as refused:
            read_vocab(path)
        assert "\n" not in str(refused.value), str(refused.value)
    with pytest.raises(VocabRefused, match="is not a file"):
        read_vocab(tmp_path / "missing.pkl")
    monkeypatch.setattr(module, "MAX_BYTES", 1000)
    path.write_bytes(pickle.dumps(authors_vocab(counter=collections.Counter({str(i): i for i in range(300)}))))
    with pytest.raises(VocabRefused, match="is over 0 MB"):
        read_vocab(path)
    archive = io.BytesIO()
    with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("archive/data.pkl", b"\x00" * 100_000)  # unpacks far past the limit from a small file
    path.write_bytes(archive.getvalue())
    assert path.stat().st_size < 1000
    with pytest.raises(VocabRefused, match="data.pkl unpacks to over"):
        read_vocab(path)
