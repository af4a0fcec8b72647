"""Model folders: what a command may write where, loading one, and the library's output while a command runs.

Nothing a user made is replaced without ``--overwrite``, and nothing is deleted: an earlier run's checkpoints
are renamed aside.
"""

from __future__ import annotations

import json
import os
import re
import sys
import tempfile
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


def one_line(error: BaseException) -> str:
    """An exception's message on one line (a library's message may span several)."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def check_writable(folder: Union[str, Path], flag: str) -> None:
    """An output folder that cannot be written is refused now, before any work, not at the final save: it must be
    a folder (or not exist yet) under which this process can create a file."""
    folder = Path(folder)
    existing = folder
    while not existing.exists() and existing.parent != existing:  # what mkdir(parents=True) would create under
        existing = existing.parent
    if existing == folder and not folder.is_dir():
        raise UserError(f"{flag} {str(folder)!r} is a file: give a folder path")
    if not existing.is_dir():
        raise UserError(f"{flag} {str(folder)!r} cannot be created: {str(existing)!r} is a file, not a folder")
    try:  # the only test that holds for root, read-only mounts and ACLs alike; O_TMPFILE leaves no name behind
        with tempfile.TemporaryFile(dir=existing):
            pass
    except OSError as error:
        where = "" if existing == folder else f" (in {str(existing)!r})"
        raise UserError(
            f"{flag} {str(folder)!r} cannot be written{where}: {error.strerror or one_line(error)}; give a folder you "
            "can write"
        ) from error


def read_json_object(file: Path) -> dict:
    """A JSON file that must hold an object; a UserError names the file otherwise."""
    try:
        value = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise UserError(f"{file} cannot be read as JSON ({one_line(error)})") from error
    if not isinstance(value, dict):
        raise UserError(f"{file} holds a JSON {type(value).__name__}, not an object")
    return value


def training_length(folder: Union[str, Path]) -> Optional[int]:
    """The sequence length a folder was trained at, from train's record; None when missing or unreadable."""
    try:
        run = json.loads((Path(folder) / RUN_FILE).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return None
    seq_len = run.get("seq_len") if isinstance(run, dict) else None
    return seq_len if type(seq_len) is int and seq_len > 0 else None


def check_folder(folder: str) -> Path:
    """What can be checked of a folder before loading it: a causal hf-relpos model written by ``train``, with its
    tokenizer and weights, asking for no code of its own. A UserError says what is wrong with any other."""
    path = Path(folder)
    if not path.exists():
        raise UserError(f"folder {folder!r} does not exist: pass a folder written by `hf-relpos train`")
    if not (path / "config.json").is_file():
        raise UserError(f"folder {folder!r} holds no config.json: pass a folder written by `hf-relpos train`")
    config = read_json_object(path / "config.json")
    model_type = config.get("model_type")
    if model_type != "relpos":
        raise UserError(f"folder {folder!r} holds a model of model_type {model_type!r}, not an hf-relpos model ('relpos')")
    if config.get("is_encoder_decoder"):
        raise UserError(
            f"folder {folder!r} holds an encoder-decoder (RelPosForConditionalGeneration): this command reads the "
            "causal language models `hf-relpos train` writes; load it with AutoModelForSeq2SeqLM (README: encoder-decoder)"
        )
    # The commands run installed code only: the model's classes are hf_relpos' own (the folder's copies of them
    # are never imported), and a tokenizer that names code of its own is refused rather than ignored.
    tokenizer_config = path / "tokenizer_config.json"
    custom = read_json_object(tokenizer_config).get("auto_map") if tokenizer_config.is_file() else None
    config_map = config.get("auto_map")
    if not custom and isinstance(config_map, dict) and config_map.get("AutoTokenizer"):
        custom, tokenizer_config = config_map["AutoTokenizer"], path / "config.json"
    if custom:
        raise UserError(
            f"{tokenizer_config} asks for custom tokenizer code (auto_map {custom!r}): hf-relpos runs no code from a "
            "model folder; use a folder written by `hf-relpos train`"
        )
    if not (path / "tokenizer.json").is_file():
        raise UserError(
            f"folder {folder!r} has no tokenizer (tokenizer.json): pass the model folder written by `hf-relpos train`, "
            "not one of its checkpoints"
        )
    weights = _weights_file(path)
    if not weights.is_file():
        raise UserError(f"folder {folder!r} has no {weights.name} (the model's weights): pass a folder written by "
                        "`hf-relpos train`")
    if weights.stat().st_size == 0:
        raise UserError(f"{weights} is empty (0 bytes): the weights were never completely written; train again or "
                        "restore the file")
    return path


def _weights_file(path: Path) -> Path:
    index = path / "model.safetensors.index.json"
    return index if index.is_file() else path / "model.safetensors"


def load_folder(folder: str):
    """The model and tokenizer of a folder written by ``train``, loaded with hf_relpos' installed classes (no code
    from the folder runs); a UserError (one line) says what is wrong with any other or with a damaged one."""
    path = check_folder(folder)
    from safetensors import SafetensorError
    from transformers import PreTrainedTokenizerFast

    from ..configuration_relpos import RelPosConfig
    from ..modeling_relpos import RelPosForCausalLM

    try:
        config = RelPosConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError) as error:
        raise UserError(f"{path / 'config.json'}: {one_line(error)}") from error
    try:  # the concrete class: it reads tokenizer.json and resolves no tokenizer_class or auto_map
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    except Exception as error:  # noqa: BLE001 - the tokenizers library raises bare Exceptions on a damaged file
        raise UserError(f"{path / 'tokenizer.json'} cannot be loaded ({type(error).__name__}: {one_line(error)})") from error
    weights = _weights_file(path)
    try:
        model, info = RelPosForCausalLM.from_pretrained(
            path, config=config, local_files_only=True, use_safetensors=True, output_loading_info=True,
            ignore_mismatched_sizes=True,  # reported below by name, instead of Transformers' RuntimeError
        )
    except SafetensorError as error:
        raise UserError(f"{weights} is damaged or truncated ({one_line(error)}): train again or restore the file") from error
    except (OSError, ValueError) as error:
        raise UserError(f"{weights}: {one_line(error)}") from error
    mismatched = [f"{name} {list(saved)} in the file, {list(wanted)} for config.json"
                  for name, saved, wanted in sorted(info.get("mismatched_keys") or [])]
    missing = sorted(info.get("missing_keys") or [])
    if mismatched or missing:  # never a model with freshly initialised weights
        shown = "; ".join(mismatched[:2]) if mismatched else "missing " + ", ".join(missing[:3])
        raise UserError(f"{weights} does not match {path / 'config.json'}: {shown}")
    return model.eval(), tokenizer


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
