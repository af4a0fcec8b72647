"""``hf-relpos export``: a trained folder as one ONNX or torch.export (``.pt2``) program, checked against the model.

OUT is a folder: ``model.onnx`` or ``model.pt2`` (``input_ids`` and ``attention_mask``, both int64
``[batch, sequence]``, to ``logits`` float32 ``[batch, sequence, vocab_size]``; batch and sequence length are
dynamic), the folder's tokenizer, ``export.json`` (what was exported and the check's result) and a README on how to
run it. Before anything is written, the saved program is read back and run (onnxruntime, or ``torch.export.load``) on
an input of another shape than the traced one, with padding, and compared with the model itself.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import re
import shutil
import time
from pathlib import Path

from .common import (
    check_folder, check_writable, load_folder, one_line, output_folder, output_lock, position_table,
    recover_interrupted_save, replace_folder, set_aside, staging_dir, writing,
)
from .errors import UserError

FORMATS = {"onnx": "model.onnx", "pt2": "model.pt2"}
ONNX_PACKAGES = ("onnx", "onnxscript", "onnxruntime")
EXPORT_RECORD = "export.json"
# What an export folder holds: the program (ONNX keeps weights over 2 GB in model.onnx.data), the record, the README
# and what the tokenizer's save_pretrained writes. A folder holding anything else is not replaced, --overwrite or not.
EXPORT_FILE = re.compile(
    r"model\.pt2|model\.onnx(\.data)?|export\.json|README\.md"
    r"|(tokenizer|tokenizer_config|special_tokens_map|chat_template)\.json|chat_template\.jinja"
)
TRACE_SHAPE = (2, 8)  # the example input traced (then capped by a position table)
CHECK_SHAPE = (3, 13)  # the check's input: another batch and length than the traced ones
TOLERANCE = 1e-4  # max |difference| of the logits, relative to max(1, max |logit|): fp32 rounding is ~1e-6


def missing_onnx_packages() -> list:
    return [name for name in ONNX_PACKAGES if importlib.util.find_spec(name) is None]


def is_export_folder(folder: Path) -> bool:
    try:
        return json.loads((folder / EXPORT_RECORD).read_text()).get("hf_relpos_export") == 1
    except (OSError, ValueError, AttributeError):
        return False


def _check_out(folder: Path, out: Path, overwrite: bool) -> None:
    """OUT is a new or empty folder, or (with ``overwrite``) an earlier export holding nothing else."""
    if out.suffix in (".onnx", ".pt2") and not out.exists():
        raise UserError(f"OUT {str(out)!r} names a file: OUT is a folder (it gets {FORMATS['onnx']} or "
                        f"{FORMATS['pt2']}, the tokenizer and a README); give a folder path")
    if out.exists() and not out.is_dir():
        raise UserError(f"OUT {str(out)!r} is a file: give a folder path (OUT is a folder that gets the program, the "
                        "tokenizer and a README)")
    if out.resolve() == folder.resolve():
        raise UserError(f"OUT {str(out)!r} is FOLDER: give another folder (the model folder is never replaced)")
    contents = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not contents:
        return
    foreign = [name for name in contents if not EXPORT_FILE.fullmatch(name)]
    if foreign or not is_export_folder(out):
        shown = ", ".join((foreign or contents)[:3])
        raise UserError(f"OUT {str(out)!r} holds files that are not an hf-relpos export ({shown}); give a new or empty "
                        "folder (nothing is replaced there, --overwrite or not)")
    if not overwrite:
        raise UserError(f"OUT {str(out)!r} already holds an hf-relpos export: pass --overwrite to replace it")


def logits_module(model):
    """The exported function: ``(input_ids, attention_mask) -> logits``, no cache (each call sees the whole text).
    Positions count from each row's first token, as ``generate`` counts them: a left-padded row gives the logits
    of the same row unpadded, for the absolute schemes too."""
    import torch

    class Logits(torch.nn.Module):
        def __init__(self, model):
            super().__init__()
            self.model = model

        def forward(self, input_ids, attention_mask):
            position_ids = (attention_mask.long().cumsum(-1) - 1).masked_fill(attention_mask == 0, 1)
            return self.model(
                input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False
            ).logits

    return Logits(model).eval()


def example_inputs(shape: tuple, vocab_size: int, seed: int):
    """Random token ids and a mask whose second row (if any) is left-padded by a third of its length."""
    import torch

    batch, length = shape
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, shape, generator=generator)
    attention_mask = torch.ones(shape, dtype=torch.long)
    if batch > 1 and length > 1:
        attention_mask[1, : max(1, length // 3)] = 0
    return input_ids, attention_mask


def shapes(config) -> tuple:
    """The traced and the checked ``(batch, length)``: different lengths, within a position table if there is one."""
    table = position_table(config)
    trace = (TRACE_SHAPE[0], min(TRACE_SHAPE[1], table or TRACE_SHAPE[1]))
    check_length = min(CHECK_SHAPE[1], table or CHECK_SHAPE[1])
    if check_length == trace[1]:
        check_length = max(1, trace[1] - 1)
    return trace, (CHECK_SHAPE[0], check_length)


def dynamic_shapes(config) -> dict:
    from torch.export import Dim

    table = position_table(config)
    length = Dim("sequence", min=1, max=table) if table else Dim("sequence", min=1)
    batch = Dim("batch", min=1)
    return {"input_ids": {0: batch, 1: length}, "attention_mask": {0: batch, 1: length}}


@contextlib.contextmanager
def quiet_exporters():
    """torch.onnx's notes while it works (torchvision absent, deprecations inside torch) are not the user's business:
    the command prints its own line, and a failure is an exception."""
    import logging
    import warnings

    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


@contextlib.contextmanager
def memory_left_out(model):
    """Transformer-XL with memory: the program returns the logits alone, so the memory it would hand on (``mems``,
    the last ``mem_len`` states of each layer) is left out of the trace; slicing it from a traced length makes
    torch.export fix that length below ``mem_len``."""
    base = model.model
    if not model.config.mem_len:
        yield
        return
    base._update_memory = lambda memory, hidden_states: hidden_states  # an instance attribute over the method
    try:
        yield
    finally:
        del base._update_memory


def export_program(model, fmt: str, path: Path) -> None:
    """Trace ``model``'s logits and write the program to ``path`` (``torch.export.save`` or ONNX)."""
    import torch

    wrapper = logits_module(model)
    inputs = example_inputs(shapes(model.config)[0], model.config.vocab_size, seed=0)
    with torch.no_grad(), quiet_exporters(), memory_left_out(model):
        if fmt == "pt2":
            program = torch.export.export(wrapper, inputs, dynamic_shapes=dynamic_shapes(model.config), strict=False)
            torch.export.save(program, path)
        else:
            program = torch.onnx.export(
                wrapper, inputs, dynamo=True, dynamic_shapes=dynamic_shapes(model.config),
                input_names=["input_ids", "attention_mask"], output_names=["logits"], verbose=False,
            )
            program.save(str(path))


def run_saved(fmt: str, path: Path, input_ids, attention_mask):
    """The logits of the saved program, read back as a user would: onnxruntime, or ``torch.export.load``."""
    import torch

    if fmt == "pt2":
        with torch.no_grad():
            return torch.export.load(path).module()(input_ids, attention_mask)
    import onnxruntime

    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (logits,) = session.run(["logits"], {"input_ids": input_ids.numpy(), "attention_mask": attention_mask.numpy()})
    return torch.from_numpy(logits)


def check_export(model, fmt: str, path: Path) -> dict:
    """Compare the saved program with the model on an input of another shape than the traced one (padded rows
    compared at their tokens only: a padding position's logits mean nothing). A UserError if they differ."""
    import torch

    shape = shapes(model.config)[1]
    input_ids, attention_mask = example_inputs(shape, model.config.vocab_size, seed=1)
    with torch.no_grad():
        expected = logits_module(model)(input_ids, attention_mask)
    with quiet_exporters():
        got = run_saved(fmt, path, input_ids, attention_mask)
    keep = attention_mask.bool()
    if tuple(got.shape) != tuple(expected.shape):
        raise UserError(f"the exported program gives logits of shape {list(got.shape)} for a {list(shape)} input, the "
                        f"model {list(expected.shape)}: the export is wrong; nothing written (please report it)")
    difference = float((got[keep] - expected[keep]).abs().max())
    tolerance = TOLERANCE * max(1.0, float(expected[keep].abs().max()))
    if not difference <= tolerance:  # NaN included
        raise UserError(f"the exported program differs from the model on a {list(shape)} input: max |difference| of "
                        f"the logits {difference:.2e} > {tolerance:.1e}; the export is wrong; nothing written (please "
                        "report it)")
    runtime = "onnxruntime " + _version("onnxruntime") if fmt == "onnx" else "torch.export.load, torch " + torch.__version__
    return {"input_shape": list(shape), "max_abs_difference": difference, "tolerance": tolerance, "runtime": runtime}


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "unknown"


def export_folder(folder: str, out_folder: str, fmt: str, *, overwrite: bool = False, argv=()) -> dict:
    """Export a folder written by ``train`` to ``out_folder`` as ``fmt`` (``onnx`` or ``pt2``), checked against the
    model before anything is written; the folder appears whole or not at all. Returns the record (``export.json``)."""
    if fmt not in FORMATS:
        raise UserError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}")
    missing = missing_onnx_packages() if fmt == "onnx" else []
    if missing:
        raise UserError(f"--format onnx needs the packages onnx, onnxscript and onnxruntime ({', '.join(missing)} "
                        "missing): pip install 'hf_relpos[export]'")
    path, out = check_folder(folder), output_folder(out_folder, flag="OUT")
    _check_out(path, out, overwrite)
    check_writable(out, flag="OUT")  # before the work (the lock and the staging folder are written beside OUT)
    with output_lock(out, "export", argv, flag="OUT"):
        recover_interrupted_save(out, "export")
        _check_out(path, out, overwrite)  # again, under the lock
        return _export(path, out, fmt)


def _export(path: Path, out: Path, fmt: str) -> dict:
    model, tokenizer = load_folder(str(path))
    model = model.float()  # the program computes in float32 (onnxruntime's CPU kernels lack most half-precision ops)
    config = model.config
    staged = staging_dir(out)
    with writing(out):
        if staged.exists():
            set_aside(staged, "was being written when an export stopped", "export")
        staged.mkdir(parents=True)
        try:
            record = _write(model, tokenizer, path, out, staged, fmt)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)  # this run's own partial files; OUT was never touched
            raise
        replace_folder(staged, out)
    check = record["check"]
    print(f"Exported {path} ({config.position_encoding}) -> {out / FORMATS[fmt]}: read back and run "
          f"({check['runtime']}) on a {check['input_shape']} input with padding, max |difference| to the model "
          f"{check['max_abs_difference']:.1e}")
    return record


def _write(model, tokenizer, path: Path, out: Path, staged: Path, fmt: str) -> dict:
    """The program, checked, then the tokenizer, the record and the README, into ``staged``; returns the record."""
    import torch
    import transformers

    from .. import __version__

    config = model.config
    program_file = staged / FORMATS[fmt]
    try:
        export_program(model, fmt, program_file)
    except Exception as error:  # noqa: BLE001 - torch.export / ONNX raise many kinds; a bug of ours, in one line
        raise UserError(f"{'ONNX' if fmt == 'onnx' else 'torch.export'} export of the {config.position_encoding} "
                        f"model failed ({type(error).__name__}: {one_line(error)}); nothing written (--debug shows "
                        "the traceback)") from error
    try:
        check = check_export(model, fmt, program_file)
    except UserError:
        raise
    except Exception as error:  # noqa: BLE001 - the saved program fails to load or run: the export is wrong
        raise UserError(f"the exported program cannot be run back ({type(error).__name__}: {one_line(error)}); "
                        "nothing written (--debug shows the traceback)") from error
    record = {
        "hf_relpos_export": 1,
        "format": fmt,
        "file": FORMATS[fmt],
        "source": str(path),
        "position_encoding": config.position_encoding,
        "inputs": {"input_ids": "int64 [batch, sequence]",
                   "attention_mask": "int64 [batch, sequence], 1 for a token, 0 for padding"},
        "outputs": {"logits": f"float32 [batch, sequence, {config.vocab_size}]"},
        "max_sequence_length": position_table(config),
        "check": check,
        "versions": {"hf_relpos": __version__, "torch": torch.__version__, "transformers": transformers.__version__,
                     **({name: _version(name) for name in ONNX_PACKAGES} if fmt == "onnx" else {})},
        "date": time.strftime("%Y-%m-%d"),
    }
    tokenizer.save_pretrained(staged)
    (staged / EXPORT_RECORD).write_text(json.dumps(record, indent=2) + "\n")
    (staged / "README.md").write_text(readme(record, out))
    return record


def readme(record: dict, out: Path) -> str:
    """OUT/README.md: what the program takes and gives, and how to run it."""
    fmt, name = record["format"], out.name
    limit = record["max_sequence_length"]
    length = (f"at most {limit} tokens (the {record['position_encoding']} position table)" if limit else
              "any length (no position table)")
    indent = "        " if fmt == "pt2" else "    "  # the loop's body
    stop = f"\n{indent}if ids.shape[1] == {limit}:  # the end of the position table\n{indent}    break" if limit else ""
    if fmt == "onnx":
        run = f"""```python
import numpy as np
import onnxruntime
from tokenizers import Tokenizer

tokenizer = Tokenizer.from_file("{name}/tokenizer.json")
session = onnxruntime.InferenceSession("{name}/model.onnx")
ids = np.array([tokenizer.encode("The for statement", add_special_tokens=False).ids])
for _ in range(20):  # greedy decoding: the whole text each step (the program keeps no cache){stop}
    logits = session.run(["logits"], {{"input_ids": ids, "attention_mask": np.ones_like(ids)}})[0]
    ids = np.concatenate([ids, logits[:, -1:].argmax(-1)], axis=1)
print(tokenizer.decode(ids[0].tolist()))
```

It needs `onnxruntime`, `numpy` and `tokenizers`: neither torch, Transformers nor hf_relpos."""
    else:
        run = f"""```python
import torch
from tokenizers import Tokenizer

tokenizer = Tokenizer.from_file("{name}/tokenizer.json")
model = torch.export.load("{name}/model.pt2").module()
ids = torch.tensor([tokenizer.encode("The for statement", add_special_tokens=False).ids])
with torch.no_grad():
    for _ in range(20):  # greedy decoding: the whole text each step (the program keeps no cache){stop}
        logits = model(ids, torch.ones_like(ids))
        ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
print(tokenizer.decode(ids[0].tolist()))
```

It needs torch and `tokenizers`, not Transformers nor hf_relpos. The program can go on to ExecuTorch or AOTInductor
(`torch._inductor.aoti_compile_and_package`)."""
    check = record["check"]
    return f"""# {record['position_encoding']} model exported to {fmt.upper()}

Written by `hf-relpos export` ({record['date']}) from `{record['source']}`. `{record['file']}` computes the
next-token logits of a batch of texts:

| | |
| --- | --- |
| inputs | `input_ids` {record['inputs']['input_ids']}; `attention_mask` {record['inputs']['attention_mask']} |
| output | `logits` {record['outputs']['logits']} |
| batch and length | dynamic: any batch, {length} |
| check | read back ({check['runtime']}) and run on a {check['input_shape']} input with padding (another shape than the traced one): max abs difference to the model's logits {check['max_abs_difference']:.1e} (tolerance {check['tolerance']:.1e}) |

Pad on either side with `attention_mask` 0: positions count from each row's first token, as `generate` counts
them, so a padded row gives the logits of the same row alone; a padding position's logits mean nothing. `export.json` records
the export and the versions used. From the folder that holds `{out.name}`:

{run}
"""


def export_command(args) -> int:
    export_folder(args.folder, args.out, args.format, overwrite=args.overwrite, argv=getattr(args, "argv", ()))
    return 0
