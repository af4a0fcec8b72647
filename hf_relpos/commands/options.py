"""The options of ``hf-relpos train`` (and of the runs ``compare`` trains): one dataclass, whose fields also make the
command line's training flags.

Standard library only: the torch-free parser (``hf_relpos_cli``) reads this file without importing the package
(whose ``__init__`` imports torch and Transformers), as it reads ``versions.py``.

A field that is a flag carries ``flag(...)`` in its metadata: the argument type's name in ``hf_relpos_cli`` (its
validators: ``positive_int``, ``sequence_length``, ...), the help text (``{NAME}`` filled from ``hf_relpos_cli``'s
constants), and what argparse needs beyond that. The flag's default is the field's, unless ``cli_default`` says
what the command line shows instead (``--max-train-bytes``: the limit itself, where the field's None means it).
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence, Union


def flag(type_name: Optional[str] = None, help: str = "", **argparse_kwargs) -> dict:
    """The metadata of a field that is a command-line flag (``--field-name``)."""
    return {"flag": dict(type_name=type_name, help=help, **argparse_kwargs)}


@dataclasses.dataclass
class TrainOptions:
    """What ``train`` does: the flags of ``hf-relpos train`` (these fields, with their defaults), and the ones
    ``compare`` sets for the runs it trains (``eval_factors``, ``sliding``)."""

    position_encoding: str = dataclasses.field(default="t5_bias", metadata=flag(
        choices="SCHEMES", help="the position scheme", command="train"))
    output_dir: str = dataclasses.field(default="runs/model", metadata=flag(
        help="the model folder (checkpoints go to <output-dir>-checkpoints)", command="train"))
    preset: str = dataclasses.field(default="tiny", metadata=flag(choices="PRESET_NAMES", help="model size"))
    seq_len: int = dataclasses.field(default=128, metadata=flag(
        "sequence_length", "training sequence length L (tokens, >= {MIN_SEQ_LEN})"))
    steps: int = dataclasses.field(default=400, metadata=flag("positive_int", "optimizer steps"))
    batch_size: int = dataclasses.field(default=16, metadata=flag("positive_int", "sequences per optimizer step"))
    learning_rate: float = dataclasses.field(default=2e-3, metadata=flag(
        "positive_float", "peak AdamW learning rate (cosine schedule)"))
    position_lr_scale: float = dataclasses.field(default=1.0, metadata=flag(
        "positive_float", "the position parameters' learning rate (the scheme's tables, per-layer position "
        "embeddings, gates) as a multiple of --learning-rate"))
    position_init_scale: float = dataclasses.field(default=1.0, metadata=flag(
        "positive_float", "multiply the position parameters by this once initialised (a bias table started smaller)"))
    vocab_size: int = dataclasses.field(default=2048, metadata=flag(
        "vocab_size", "BPE vocabulary trained on the corpus (>= {MIN_VOCAB})"))
    # Transformer-XL's memory (None: the sequence length)
    mem_len: Optional[int] = dataclasses.field(default=None, metadata=flag(
        "non_negative_int", "Transformer-XL memory in tokens (transformer_xl only; default: the sequence length)"))
    seed: int = dataclasses.field(default=0, metadata=flag(
        "seed_number", "random seed (model init, data order; 0 to {MAX_SEED})"))
    # None: the embedded corpus. --train-file and --corpus are one mutually exclusive group (one line naming both).
    train_file: Optional[Sequence[str]] = dataclasses.field(default=None, metadata=flag(
        help="your own UTF-8 text files instead of the embedded corpus (Python's bundled docs)", nargs="+",
        metavar="PATH", group="text"))
    # the embedded corpus (data.CORPORA; None: "docs" unless train_file)
    corpus: Optional[str] = dataclasses.field(default=None, metadata=flag(
        choices="CORPORA", help="the embedded corpus: docs (Python's bundled documentation, the default) or stdlib (the "
        "standard library's source, split by module); not with --train-file", group="text"))
    # the most --train-file text read (None: data.MAX_TEXT_BYTES)
    max_train_bytes: Optional[int] = dataclasses.field(default=None, metadata=flag(
        "positive_int", "refuse --train-file text larger than this (tokenizing takes ~200 bytes of memory per byte)",
        metavar="BYTES", cli_default="MAX_TEXT_BYTES"))
    eval_tokens: Optional[int] = dataclasses.field(default=None, metadata=flag(
        "positive_int", "cap on held-out tokens evaluated (default: all)"))
    overwrite: bool = dataclasses.field(default=False, metadata=flag(
        help="replace the model in --output-dir (earlier checkpoints are kept, renamed)", action="store_true"))
    # True: the last checkpoint; a path: that checkpoint
    resume: Union[bool, str, None] = dataclasses.field(default=None, metadata=flag(
        help="continue from the last checkpoint (or the one given)", nargs="?", const=True, metavar="CHECKPOINT"))
    quiet: bool = dataclasses.field(default=False, metadata=flag(
        help="print only the final line (and errors)", action="store_true"))
    eval_factors: Sequence[int] = (1, 2, 4)  # test perplexity at seq_len × each
    sliding: bool = False  # evaluate with windows moving by seq_len tokens (compare --sliding)
    argv: Sequence[str] = ()  # the command line (without "hf-relpos"), recorded and used in the resume hint
    # The options the command line gave (None: all of them); a resume takes the others from its checkpoint.
    given: Optional[Sequence[str]] = None

    @classmethod
    def from_namespace(cls, args) -> "TrainOptions":
        """The options of a parsed ``train`` command line (attributes the command does not have keep defaults)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})
