"""``hf-relpos convert-transfo-xl``: a Transformers 4.x TransfoXL folder (``transfo-xl-wt103``'s format) as an
hf_relpos causal-LM folder, its ``vocab.pkl`` as a word-level ``tokenizer.json``; nothing unpickled but tensors
(``torch.load(weights_only=True)``) and the vocabulary's plain containers (``transfo_xl_vocab.read_vocab``)."""

from __future__ import annotations

import pickle
from pathlib import Path

from .common import RemoveIfEmptyOnFailure, check_conversion_output, one_line, read_json_object
from .errors import UserError

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


# What a tokenizer's save_pretrained writes: removed from OUT by an --overwrite whose source has no vocab.pkl.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def transfo_xl_tokenizer(vocab_file: Path, vocab_size: int):
    """A ``PreTrainedTokenizerFast`` with the vocabulary's ids (``transfo_xl_vocab.word_level_tokenizer``): its
    unknown-word symbol, and ``<eos>`` (when the vocabulary has it) as the end-of-sequence token, matched only as
    a whole word as TransfoXL's vocabulary lookup matches it. ``ValueError`` where it has ids past ``vocab_size``."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    from ..transfo_xl_vocab import read_vocab, unk_token, word_level_tokenizer

    vocab = read_vocab(vocab_file)
    if len(vocab["sym2idx"]) > vocab_size:
        raise ValueError(f"{str(vocab_file)!r} holds {len(vocab['sym2idx'])} symbols, more than the model's "
                         f"vocab_size={vocab_size} in config.json: not this model's vocabulary")
    special = {}
    if "<eos>" in vocab["sym2idx"]:
        special["eos_token"] = AddedToken("<eos>", single_word=True, normalized=False, special=True)
    return PreTrainedTokenizerFast(tokenizer_object=word_level_tokenizer(vocab), unk_token=unk_token(vocab), **special)


def convert_transfo_xl(src_folder: str, out_folder: str, *, overwrite: bool = False) -> dict:
    """A local TransfoXL folder as an hf_relpos folder (code, card, and the tokenizer where ``vocab.pkl`` is there);
    the converted model is checked against the float64 reference on three segments with memory before anything is
    written. Returns that check's result (:func:`hf_relpos.transfo_xl_conversion.check_transfo_xl_parity`)."""
    from safetensors import SafetensorError

    from ..transfo_xl_conversion import (
        check_transfo_xl_parity, convert_transfo_xl_state, read_transfo_xl_folder, transfo_xl_config,
    )
    from ..transfo_xl_vocab import VocabRefused

    src, out = Path(src_folder), Path(out_folder)
    if not (src / "config.json").is_file():
        raise UserError(f"SRC_FOLDER {str(src)!r} holds no config.json: give a local folder saved by "
                        "TransfoXLLMHeadModel.save_pretrained (nothing is downloaded)")
    if src.resolve() == out.resolve():
        raise UserError(f"OUT_FOLDER {str(out)!r} is SRC_FOLDER: give another folder (the source is never replaced)")
    given = read_json_object(src / "config.json")
    if given.get("model_type") != "transfo-xl":
        raise UserError(f"SRC_FOLDER {str(src)!r} holds a {given.get('model_type')!r} model; convert-transfo-xl "
                        "converts 'transfo-xl' models")
    try:
        vocab_size = transfo_xl_config(given)["vocab_size"]
    except ValueError as error:
        raise UserError(f"{src / 'config.json'}: {one_line(error)}") from None
    weights = [src / name for name in WEIGHT_FILES if (src / name).is_file()]
    if not weights:
        raise UserError(f"SRC_FOLDER {str(src)!r} holds neither {' nor '.join(WEIGHT_FILES)}")
    if weights[0].stat().st_size == 0:
        raise UserError(f"{weights[0]} is empty (0 bytes): the weights were never completely written")
    check_conversion_output(out, overwrite)
    tokenizer = None
    if (src / "vocab.pkl").is_file():  # read before the weights: a refused vocabulary is refused at once
        try:
            tokenizer = transfo_xl_tokenizer(src / "vocab.pkl", vocab_size)
        except (VocabRefused, ValueError) as error:
            raise UserError(f"{one_line(error)}; nothing written") from None
    with RemoveIfEmptyOnFailure(out):
        try:
            upstream, state = read_transfo_xl_folder(src)
        except (SafetensorError, OSError, RuntimeError, ValueError, pickle.UnpicklingError) as error:
            raise UserError(f"{weights[0]} cannot be read ({one_line(error)}); nothing written") from None
        try:
            converted = convert_transfo_xl_state(upstream, state, check=False)
        except (ValueError, TypeError, RuntimeError, AttributeError) as error:
            raise UserError(f"SRC_FOLDER {str(src)!r}: its weights do not match its config.json "
                            f"({one_line(error)}); nothing written") from None
        try:  # before anything is written: a model that differs from its source is refused, not recorded
            parity = check_transfo_xl_parity(upstream, state, converted)
        except ValueError as error:
            raise UserError(f"{src}: {error}; nothing written") from None
        out.mkdir(parents=True, exist_ok=True)
        converted.save_pretrained(out)
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
        else:  # an earlier model's tokenizer (--overwrite) does not describe this one
            for name in TOKENIZER_FILES:
                (out / name).unlink(missing_ok=True)
    print(f"Converted {src} -> {out}/: log-probabilities within {parity['max_abs_log_prob_diff']:.1e} of the float64 "
          f"reference over {parity['segments']} segments with memory"
          + ("; vocab.pkl -> tokenizer.json" if tokenizer is not None else "; no vocab.pkl, no tokenizer"))
    return parity


def convert_transfo_xl_command(args) -> int:
    convert_transfo_xl(args.src_folder, args.out_folder, overwrite=args.overwrite)
    return 0
