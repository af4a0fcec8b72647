"""Model folders: what a command may write where, loading one, and the library's output while a command runs.

Nothing a user made is replaced without ``--overwrite``, and nothing is deleted: an earlier run's checkpoints
are renamed aside.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import socket
import struct
import sys
import tempfile
import time
import zipfile
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


# What a complete checkpoint holds besides hf_relpos_time.json (and, for Transformer-XL with memory,
# mems-rank*.safetensors): the files Transformers' Trainer writes, at least one rng_state*.pth among them.
CHECKPOINT_FILES = ("config.json", "model.safetensors", "trainer_state.json", "optimizer.pt", "scheduler.pt",
                    "training_args.bin")


def _file_problem(path: Path) -> Optional[str]:
    """Why a checkpoint file cannot be read back (None: it can): missing, empty or cut short."""
    if not path.is_file():
        return f"{path.name} is missing"
    size = path.stat().st_size
    if size == 0:
        return f"{path.name} is empty"
    try:
        if path.suffix == ".json":
            json.loads(path.read_text())
        elif path.suffix == ".safetensors":
            with open(path, "rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(length))
            end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
            if 8 + length + end != size:
                return f"{path.name} is cut short ({size} bytes of {8 + length + end})"
        elif path.suffix in (".pt", ".pth", ".bin"):  # torch.save's zip archive: its directory is at the end
            with zipfile.ZipFile(path) as archive:
                last = max(archive.infolist(), key=lambda i: i.header_offset)
                if last.header_offset + last.compress_size > size:
                    return f"{path.name} is cut short"
    except (ValueError, KeyError, struct.error, zipfile.BadZipFile, OSError, TypeError):
        return f"{path.name} is damaged or cut short"
    return None


def checkpoint_problem(folder: Path) -> Optional[str]:
    """Why ``folder`` is not a complete checkpoint of ``hf-relpos train`` (None: it is complete).

    Complete: every file Trainer writes, the time record, and Transformer-XL's memory when the model has one,
    each readable to its end. The one definition used by resume, compare and the fault-injection tests.
    """
    names = list(CHECKPOINT_FILES) + [TIME_FILE]
    rng = sorted(p.name for p in folder.glob("rng_state*.pth"))
    names += rng or ["rng_state.pth"]
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    if config.get("position_encoding") == "transformer_xl" and (config.get("mem_len") or 0) > 0:
        names += sorted(p.name for p in folder.glob("mems-rank*.safetensors")) or ["mems-rank0.safetensors"]
    for name in names:
        problem = _file_problem(folder / name)
        if problem:
            return problem
    return None


def _checkpoints(folder: Path) -> list:
    """The checkpoint-<step> folders in ``folder``, newest step first."""
    steps = [(int(p.name.split("-")[1]), p) for p in folder.glob("checkpoint-*")
             if p.name.split("-")[1].isdigit() and p.is_dir()]
    return [p for _, p in sorted(steps, reverse=True)]


def last_checkpoint(folder: Path) -> Optional[Path]:
    """The newest complete checkpoint in ``folder`` (None if it holds none)."""
    return next((p for p in _checkpoints(folder) if checkpoint_problem(p) is None), None)


def _stamp() -> str:
    return time.strftime("%Y%m%d-%H%M%S")


def _unused_name(path: Path, name: str) -> Path:
    """``name`` beside ``path``, with ``-1``, ``-2``, ... added while that name is taken."""
    aside, n = path.with_name(name), 1
    while aside.exists():
        aside, n = path.with_name(f"{name}-{n}"), n + 1
    return aside


def set_aside(path: Path, why: str, command: str = "train") -> Path:
    """Rename ``path`` beside itself as ``incomplete-<name>-<time>`` (never deleted), saying so in one line."""
    aside = _unused_name(path, f"incomplete-{path.name.lstrip('.')}-{_stamp()}")
    path.rename(aside)
    print(f"hf-relpos {command}: {path} {why}: renamed aside to {aside.name}", file=sys.stderr)
    return aside


def staging_dir(out: Path) -> Path:
    """Where a folder is written before it is renamed into place (a sibling, so the rename is atomic)."""
    return out.with_name(f".{out.name}.saving")


def _replaced_dir(out: Path) -> Path:
    return out.with_name(f".{out.name}.replaced")


def recover_interrupted_save(out: Path, command: str = "train") -> None:
    """Finish what a process killed while saving ``out`` (the model folder) or its checkpoints left.

    A killed swap leaves the old folder as ``.<name>.replaced``: it is put back if ``out`` is missing, removed
    if the new folder was already in place (the run had --overwrite or --resume). A partly written
    ``.<name>.saving`` folder and a partly written checkpoint are renamed aside, never deleted.
    """
    replaced = _replaced_dir(out)
    if replaced.is_dir():
        if not out.exists():
            replaced.rename(out)
            print(f"hf-relpos {command}: restored {out} (a save that was replacing it was interrupted)",
                  file=sys.stderr)
        else:
            shutil.rmtree(replaced)
    for staged in (staging_dir(out), *checkpoints_dir(out).glob(".saving-checkpoint-*")):
        if staged.exists():
            set_aside(staged, "was being written when a run stopped", command)


def replace_folder(staged: Path, out: Path) -> None:
    """Put the fully written ``staged`` folder in place of ``out``: ``out`` is always the old or the new folder,
    and a run killed in between leaves what :func:`recover_interrupted_save` finishes."""
    replaced = _replaced_dir(out)
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if out.exists():
        out.rename(replaced)
    staged.rename(out)
    if replaced.exists():
        shutil.rmtree(replaced)  # the model --overwrite or --resume asked to replace


def is_disk_full(error: BaseException) -> bool:
    """Whether ``error`` (or what it wraps) is a full disk: ENOSPC/EDQUOT, or torch's and safetensors' wrappers."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(error)
        if "No space left on device" in text or "os error 28" in text or (
                "inline_container.cc" in text and "unexpected pos" in text):
            return True
        error = error.__cause__ or error.__context__
    return False


@contextlib.contextmanager
def writing(folder: Path, resume_hint: str = ""):
    """A full disk while writing ``folder`` becomes one line naming it (a :class:`UserError`)."""
    try:
        yield
    except Exception as error:
        if not is_disk_full(error):
            raise
        raise UserError(f"no space left on the device while writing {folder}; free some space{resume_hint}") from error


def output_folder(given: Union[str, Path], flag: str = "--output-dir") -> Path:
    """The folder a command replaces: a symbolic link is followed (the link stays, the folder it points to is
    replaced, as a user who made the link means); a path ending in '.' or '..' has no name of its own for the
    staging folder, the lock and the checkpoints named after it, and is refused."""
    out = Path(given)
    if out.name in ("", ".", ".."):
        raise UserError(f"{flag} {str(given)!r} names no folder of its own: give the folder by its name "
                        f"(e.g. {str(out / 'run')!r})")
    return out.resolve() if out.is_symlink() else out


def check_writable(*folders: Union[str, Path], flag: str = "--output-dir") -> None:
    """Refuse at once (before any work, not at the final save) a folder that cannot be written: each must be a
    folder (or not exist yet) under which this process can create a file. Tried, not guessed from permission
    bits (root, read-only mounts, ACLs, immutable files); the unnamed temporary file leaves nothing behind."""
    for folder in map(Path, folders):
        existing = folder
        while not existing.exists() and existing != existing.parent:  # what mkdir(parents=True) would create under
            existing = existing.parent
        if existing == folder and not folder.is_dir():
            raise UserError(f"{flag} {str(folder)!r} is a file: give a folder path")
        if not existing.is_dir():
            raise UserError(f"{flag} {str(folder)!r} cannot be created: {str(existing)!r} is a file, not a folder")
        try:
            with tempfile.TemporaryFile(dir=existing, prefix=".hf-relpos-write-test"):
                pass
        except OSError as error:
            reason = "no space left on the device" if is_disk_full(error) else (error.strerror or one_line(error))
            where = "" if existing == folder else f" (in {str(existing)!r})"
            raise UserError(f"{flag} {str(folder)!r} cannot be written{where}: {reason}; give a folder you can "
                            "write to") from None



def check_results_folder(out: Path, files: "re.Pattern", what: str, records: str, resume, overwrite: bool,
                         already: str) -> None:
    """The folder rules of a command that writes a results folder (compare, lengthgen): a file or a folder of other
    files is refused (nothing is written there, with or without --overwrite), a folder with results needs --resume or
    --overwrite (``already`` says which does what), --resume needs the ``records`` subfolder; then writability."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--output-dir {str(out)!r} is a file: give a folder path")
    contents = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    foreign = [name for name in contents if not files.fullmatch(name)]
    if foreign:
        raise UserError(
            f"--output-dir {str(out)!r} holds files that are not an hf-relpos {what} ({', '.join(foreign[:3])}); "
            "give a new or empty folder (nothing is replaced there, --overwrite or not)"
        )
    if contents and not (overwrite or resume):
        raise UserError(f"--output-dir {str(out)!r} already holds files: {already}")
    if resume and not (out / records).is_dir():
        raise UserError(f"--resume: no {what} to resume in {str(out)!r}; run without --resume first")
    check_writable(out)


@contextlib.contextmanager
def output_lock(out: Path, command: str, argv=(), flag: str = "--output-dir"):
    """Hold ``out``'s lock (a file beside it, ``.<name>.lock``) while a command writes there.

    A second command on the same folder gets one line naming the process that holds it (its pid, host and
    command line are in ``.<name>.lock.json``). The lock is the kernel's (``filelock``), so it is free again
    when its process dies; a record left by a dead process is reported and replaced. Under torchrun rank 0
    alone locks (the other ranks are its helpers).
    """
    if int(os.environ.get("RANK", "0")) != 0:
        yield
        return
    from filelock import FileLock, Timeout

    out.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out.with_name(f".{out.name}.lock")
    info = out.with_name(f".{out.name}.lock.json")
    lock = FileLock(str(lock_path), timeout=0)
    try:
        lock.acquire()
        if not lock_path.exists():  # held by a run that removed it as it ended: this lock guards nothing now
            lock.release()
            lock.acquire()
    except Timeout:
        try:
            holder = json.loads(info.read_text())
            who = (f"process {holder['pid']} on {holder['host']} ({holder['command']}, since "
                   f"{holder['started']})")
        except (OSError, ValueError, KeyError):
            who = "another process"
        raise UserError(f"{flag} {str(out)!r} is in use by {who}; wait for it to finish or give another "
                        f"{flag}") from None
    except OSError as error:  # a folder (or an unreadable file) where the lock file goes
        raise UserError(f"{flag} {str(out)!r} cannot be locked: {lock_path} cannot be opened as a lock file "
                        f"({error.strerror or one_line(error)}); remove it or give another {flag}") from None
    try:
        try:
            left = json.loads(info.read_text())
            print(f"hf-relpos {command}: took over the lock on {out} left by process {left.get('pid')} on "
                  f"{left.get('host')}, which is no longer running", file=sys.stderr)
        except (OSError, ValueError, AttributeError):
            pass
        record = {"pid": os.getpid(), "host": socket.gethostname(),
                  "command": "hf-relpos " + " ".join(argv) if argv else f"hf-relpos {command}",
                  "started": time.strftime("%Y-%m-%d %H:%M:%S")}
        with writing(info.parent):
            info.write_text(json.dumps(record))
        try:
            yield
        finally:
            with contextlib.suppress(OSError):
                info.unlink()  # this run's own record
                if not out.is_dir():  # a command that wrote no model leaves no lock file (unlinked while held)
                    lock_path.unlink()
    finally:
        lock.release()


def refuse_files(out: Path) -> None:
    """A file where the model folder or its checkpoint folder goes is one line."""
    for folder, flag in ((out, "--output-dir"), (checkpoints_dir(out), "--output-dir's checkpoint folder")):
        if folder.exists() and not folder.is_dir():
            raise UserError(f"{flag} {str(folder)!r} is a file: give a folder path")


def prepare_output(out: Path, *, overwrite: bool, resume: Union[bool, str, None]) -> Optional[Path]:
    """Refuse what would replace or delete a user's work; returns the checkpoint to resume from (or None).

    A non-empty ``out`` must be an hf-relpos model folder holding nothing else, and is replaced only with
    ``--overwrite`` (or continued with ``--resume``). An earlier run's checkpoints are renamed aside, never
    deleted.
    """
    refuse_files(out)
    if int(os.environ.get("RANK", "0")) == 0:
        recover_interrupted_save(out)
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
        if isinstance(resume, str):
            checkpoint = Path(resume)
            if not checkpoint.is_dir():
                raise UserError(f"--resume: no checkpoint to resume from in {resume}; train without --resume first")
            problem = checkpoint_problem(checkpoint)
            if problem:
                raise UserError(f"--resume: {resume} is not a complete checkpoint ({problem}); give another one, or "
                                "--resume alone for the newest complete one")
            return checkpoint
        incomplete = []
        for checkpoint in _checkpoints(checkpoints):
            problem = checkpoint_problem(checkpoint)
            if problem is None:
                if int(os.environ.get("RANK", "0")) == 0:  # newer ones cut short by a kill or a full disk
                    for folder, why in incomplete:
                        set_aside(folder, f"is not a complete checkpoint ({why})")
                return checkpoint
            incomplete.append((checkpoint, problem))
        found = f" ({incomplete[0][0].name} is not complete: {incomplete[0][1]})" if incomplete else ""
        raise UserError(f"--resume: no checkpoint to resume from in {str(checkpoints)!r}{found}; train without "
                        "--resume first (or with --overwrite to start afresh)")
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        if not overwrite:
            raise UserError(
                f"{str(checkpoints)!r} holds checkpoints of an earlier run: pass --resume to continue it, or "
                "--overwrite to start afresh (they are then renamed aside, not deleted)"
            )
        if int(os.environ.get("RANK", "0")) == 0:  # under torchrun, rank 0 alone moves files
            aside = _unused_name(checkpoints, f"{checkpoints.name}.old-{_stamp()}")
            checkpoints.rename(aside)
            print(f"hf-relpos train: the earlier run's checkpoints were moved to {aside}", file=sys.stderr)
    return None


def check_conversion_output(out: Path, overwrite: bool) -> None:
    """A converter's OUT_FOLDER: writable, and new, empty or an hf-relpos model (replaced only with
    ``--overwrite``); a folder holding anything else is never written into."""
    check_writable(out, flag="OUT_FOLDER")
    if out.is_dir() and any(out.iterdir()):
        foreign = sorted(p.name for p in out.iterdir() if not MODEL_FILE.fullmatch(p.name))
        if not is_model_folder(out) or foreign:
            raise UserError(f"OUT_FOLDER {str(out)!r} holds files that are not an hf-relpos model "
                            f"({', '.join((foreign or ['config.json'])[:3])}): give a new or empty folder")
        if not overwrite:
            raise UserError(f"OUT_FOLDER {str(out)!r} already holds an hf-relpos model: pass --overwrite to replace it")


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


def weights_problem(info: dict) -> Optional[str]:
    """What ``from_pretrained(..., output_loading_info=True)`` left unloaded (None: every weight loaded): weights of
    another size, else missing ones, named."""
    mismatched = [f"{name} {list(saved)} in the file, {list(wanted)} for config.json"
                  for name, saved, wanted in sorted(info.get("mismatched_keys") or [])]
    missing = sorted(info.get("missing_keys") or [])
    if mismatched:
        return "; ".join(mismatched[:2])
    return "missing " + ", ".join(missing[:3]) if missing else None


def one_line(error: BaseException) -> str:
    """An exception's message on one line (a library's message may span several)."""
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."


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


def check_folder(folder: str, encoder_decoder: bool = False) -> Path:
    """What can be checked of a folder before loading it: a causal hf-relpos model written by ``train`` (or, with
    ``encoder_decoder``, an encoder-decoder too), with its tokenizer and weights, asking for no code of its own. A
    UserError says what is wrong with any other."""
    path = Path(folder)
    if not path.exists():
        raise UserError(f"folder {folder!r} does not exist: pass a folder written by `hf-relpos train`")
    if not path.is_dir():
        raise UserError(f"{folder!r} is a file, not a folder: pass a folder written by `hf-relpos train`")
    if not (path / "config.json").is_file():
        raise UserError(f"folder {folder!r} holds no config.json: pass a folder written by `hf-relpos train`")
    config = read_json_object(path / "config.json")
    model_type = config.get("model_type")
    if model_type != "relpos":
        raise UserError(f"folder {folder!r} holds a model of model_type {model_type!r}, not an hf-relpos model ('relpos')")
    if config.get("is_encoder_decoder") and not encoder_decoder:
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


def load_folder(folder: str, encoder_decoder: bool = False):
    """The model and tokenizer of a folder written by ``train`` (``encoder_decoder``: or an encoder-decoder's, as
    RelPosForConditionalGeneration), loaded with hf_relpos' installed classes (no code from the folder runs); a
    UserError (one line) says what is wrong with any other or with a damaged one."""
    path = check_folder(folder, encoder_decoder)
    from safetensors import SafetensorError
    from transformers import PreTrainedTokenizerFast

    from ..configuration_relpos import RelPosConfig
    from ..modeling_relpos import RelPosForCausalLM, RelPosForConditionalGeneration

    try:
        config = RelPosConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError, AttributeError) as error:  # AttributeError: a dtype torch lacks
        raise UserError(f"{path / 'config.json'}: {one_line(error)}") from error
    try:  # the concrete class: it reads tokenizer.json and resolves no tokenizer_class or auto_map
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    except Exception as error:  # noqa: BLE001 - the tokenizers library raises bare Exceptions on a damaged file
        raise UserError(f"{path / 'tokenizer.json'} cannot be loaded ({type(error).__name__}: {one_line(error)})") from error
    weights = _weights_file(path)
    try:
        cls = RelPosForConditionalGeneration if config.is_encoder_decoder else RelPosForCausalLM
        model, info = cls.from_pretrained(
            path, config=config, local_files_only=True, use_safetensors=True, output_loading_info=True,
            ignore_mismatched_sizes=True,  # reported below by name, instead of Transformers' RuntimeError
        )
    except SafetensorError as error:
        raise UserError(f"{weights} is damaged or truncated ({one_line(error)}): train again or restore the file") from error
    except (OSError, ValueError) as error:
        raise UserError(f"{weights}: {one_line(error)}") from error
    problem = weights_problem(info)
    if problem:  # never a model with freshly initialised weights
        raise UserError(f"{weights} does not match {path / 'config.json'}: {problem}")
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
