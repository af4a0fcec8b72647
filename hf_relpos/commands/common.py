"""Model folders: what a command may write where, loading one, and the library's output while a command runs.

Nothing a user made is replaced without ``--overwrite``, and nothing is deleted: an earlier run's checkpoints
are renamed aside.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Optional, Union

from .errors import UserError

RUN_FILE = "hf_relpos_run.json"  # what train did, read back by eval and by the model card
INSPECT_DIR = "inspect"  # where `inspect` writes its figures by default, inside the model folder
# In each checkpoint: training seconds so far (a resumed run counts all of it) and the options that shape the
# model and its data (a resume with other ones would not continue this run).
TIME_FILE = "hf_relpos_time.json"
# What `save_pretrained` and the tokenizer write into a model folder, and what train adds.
MODEL_FILE = re.compile(
    r"(config|generation_config|tokenizer|tokenizer_config|special_tokens_map|chat_template)\.json"
    r"|model(-\d+-of-\d+)?\.safetensors(\.index\.json)?|[a-z_]+\.py|README\.md|chat_template\.jinja"
    + "|" + re.escape(RUN_FILE)
    + "|" + re.escape(INSPECT_DIR)  # inspect's figures: the folder stays one train --overwrite / --resume accepts
)


def is_model_folder(folder: Path) -> bool:
    config = folder / "config.json"
    try:
        return json.loads(config.read_text()).get("model_type") == "relpos"
    except (OSError, ValueError):
        return False


def checkpoints_dir(out: Path) -> Path:
    return out.parent / f"{out.name}-checkpoints"


def last_checkpoint(folder: Path) -> Optional[Path]:
    steps = [(int(p.name.split("-")[1]), p) for p in folder.glob("checkpoint-*") if p.name.split("-")[1].isdigit()]
    return max(steps)[1] if steps else None


def prepare_output(out: Path, *, overwrite: bool, resume: Union[bool, str, None]) -> Optional[Path]:
    """Refuse what would replace or delete a user's work; returns the checkpoint to resume from (or None).

    A non-empty ``out`` must be an hf-relpos model folder holding nothing else, and is replaced only with
    ``--overwrite`` (or continued with ``--resume``). An earlier run's checkpoints are renamed aside, never
    deleted.
    """
    for folder, flag in ((out, "--output-dir"), (checkpoints_dir(out), "--output-dir's checkpoint folder")):
        if folder.exists() and not folder.is_dir():
            raise UserError(f"{flag} {str(folder)!r} is a file: give a folder path")
    contents = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if contents:
        foreign = [name for name in contents if not MODEL_FILE.fullmatch(name)]
        if not is_model_folder(out) or foreign:
            shown = ", ".join((foreign or contents)[:3])
            raise UserError(
                f"--output-dir {str(out)!r} holds files that are not an hf-relpos model ({shown}); "
                "give a new or empty folder (nothing is replaced there, --overwrite or not)"
            )
        if not (overwrite or resume):
            raise UserError(
                f"--output-dir {str(out)!r} already holds a trained model: pass --overwrite to replace it "
                "(its checkpoints are kept) or --resume to continue its training"
            )
    checkpoints = checkpoints_dir(out)
    if resume:
        checkpoint = Path(resume) if isinstance(resume, str) else last_checkpoint(checkpoints)
        if checkpoint is None or not (checkpoint / "trainer_state.json").is_file():
            where = str(checkpoint) if isinstance(resume, str) else f"{str(checkpoints)!r}"
            raise UserError(f"--resume: no checkpoint to resume from in {where}; train without --resume first")
        return checkpoint
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        if not overwrite:
            raise UserError(
                f"{str(checkpoints)!r} holds checkpoints of an earlier run: pass --resume to continue it, or "
                "--overwrite to start afresh (they are then renamed aside, not deleted)"
            )
        if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, rank 0 alone moves files
            aside = checkpoints.with_name(f"{checkpoints.name}.old-{time.strftime('%Y%m%d-%H%M%S')}")
            checkpoints.rename(aside)
            print(f"hf-relpos train: the earlier run's checkpoints were moved to {aside}", file=sys.stderr)
    return None


class RemoveIfEmptyOnFailure:
    """A failed command leaves no empty folder behind: folders it created are removed if still empty."""

    def __init__(self, *folders: Path):
        self.new = [f for f in folders if not f.exists()]

    def __enter__(self):
        return self

    def __exit__(self, kind, *_):
        if kind is not None:
            for folder in self.new:
                if folder.is_dir() and not any(folder.iterdir()):
                    folder.rmdir()
        return False


def load_folder(folder: str):
    """The model and tokenizer of a folder written by ``train``; a UserError says what is wrong with any other."""
    path = Path(folder)
    if not path.exists():
        raise UserError(f"folder {folder!r} does not exist: pass a folder written by `hf-relpos train`")
    if not (path / "config.json").is_file():
        raise UserError(f"folder {folder!r} holds no config.json: pass a folder written by `hf-relpos train`")
    try:
        config = json.loads((path / "config.json").read_text())
    except ValueError:
        raise UserError(f"{folder}/config.json is not valid JSON") from None
    model_type = config.get("model_type")
    if model_type != "relpos":
        raise UserError(f"folder {folder!r} holds a model of model_type {model_type!r}, not an hf-relpos model ('relpos')")
    if config.get("is_encoder_decoder"):
        raise UserError(
            f"folder {folder!r} holds an encoder-decoder (RelPosForConditionalGeneration): this command reads the "
            "causal language models `hf-relpos train` writes; load it with AutoModelForSeq2SeqLM (README: encoder-decoder)"
        )
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        raise UserError(
            f"folder {folder!r} has no tokenizer (tokenizer.json): pass the model folder written by `hf-relpos train`, "
            "not one of its checkpoints"
        )
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
    return model, tokenizer


def position_table(config) -> Optional[int]:
    """How many positions an absolute scheme's table holds (None: relative schemes have no end)."""
    return config.max_position_embeddings if config.position_encoding in ("learned", "sinusoidal") else None


def evaluation_name(seq_len: int, sliding: bool) -> str:
    """How a run is evaluated: non-overlapping segments, or (``compare --sliding``) windows moving by L tokens."""
    return f"sliding windows, stride {seq_len}" if sliding else "non-overlapping segments"


class library_output_off:
    """While a command runs, Transformers' own progress bars ("Loading weights", "Writing model shards" at
    each checkpoint) and info warnings are off: the command shows one bar of its own, or just its result."""

    def __enter__(self):
        from transformers.utils import logging as hf_logging

        self.verbosity = hf_logging.get_verbosity()
        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
        return self

    def __exit__(self, *exc):
        from transformers.utils import logging as hf_logging

        hf_logging.enable_progress_bar()
        hf_logging.set_verbosity(self.verbosity)
        return False
