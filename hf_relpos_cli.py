"""``hf-relpos``: the command line's parser and its one error handler.

This module lives beside the ``hf_relpos`` package, not in it, and imports neither torch nor
Transformers: ``import hf_relpos`` registers the models with Transformers' Auto classes (the
package's contract), which costs seconds, and ``--help``, ``--version`` and argument errors should
answer at once. The commands themselves live in :mod:`hf_relpos.commands` (one module per command
family), imported after parsing through :data:`COMMANDS`; nothing there imports this module.

Exit status: 0 on success; 2 for a user error, printed as one line
``hf-relpos <command>: error: <what was given, what is allowed>`` (a traceback only with ``--debug``
or ``HF_RELPOS_DEBUG=1``); 130 after Ctrl-C; an unexpected exception prints its traceback (1).

Commands: ``train``, ``generate``, ``eval``, ``validate-t5``, ``convert-t5``, ``convert-transfo-xl``, ``compare``,
``inspect``, ``export``, ``serve``, ``lengthgen``. Without ``make``::

    hf-relpos train --position-encoding alibi --output-dir runs/alibi --steps 300
    hf-relpos inspect runs/alibi --prompt "The for statement"   # runs/alibi/inspect/*.png
    python -m hf_relpos.cli inspect runs/alibi --overwrite         # the same, without the console script
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Optional

# hf_relpos.POSITION_ENCODINGS and the preset names of hf_relpos.commands.train.PRESETS, restated so that parsing
# needs no torch (tests/test_cli_safety.py keeps them equal).
SCHEMES = (
    "t5_bias", "shaw", "transformer_xl", "log_decay", "alibi", "kerple_log", "fire", "rope", "sinusoidal", "learned", "nope",
    "fox",
)
PRESET_NAMES = ("micro", "small", "tiny")
# hf_relpos.lengthgen.TASKS, restated: parsing needs no torch
LENGTHGEN_TASKS = ("copy", "repeat_copy", "replace", "reverse", "sort", "addition", "summation", "parity")
LENGTHGEN_ITEMS, LENGTHGEN_MAX_ITEMS = 100, 1000  # hf_relpos.lengthgen.ITEMS and MAX_ITEMS, restated
EXPORT_FORMATS = ("onnx", "pt2")  # hf_relpos.commands.export.FORMATS, restated: parsing needs no torch
INSPECT_PROMPT = "The for statement is used to iterate over the elements of a sequence."
MIN_VOCAB = 259  # the byte-level BPE's 256 byte tokens and its 3 special tokens (hf_relpos.data.SPECIAL_TOKENS)
MAX_TEXT_BYTES = 8 * 2**20  # hf_relpos.data.MAX_TEXT_BYTES, restated: this module imports no torch
CORPORA = ("docs", "stdlib")  # hf_relpos.data.CORPORA, restated: parsing needs no torch

# What each command runs: "module:function", imported only once the command line has parsed. Each function takes
# the parsed namespace and returns the exit status (None: 0).
COMMANDS = {
    "train": "hf_relpos.commands.train:train_command",
    "eval": "hf_relpos.commands.train:eval_command",
    "generate": "hf_relpos.commands.generate:generate_command",
    "validate-t5": "hf_relpos.commands.t5:validate_t5_command",
    "convert-t5": "hf_relpos.commands.t5:convert_t5_command",
    "convert-transfo-xl": "hf_relpos.commands.transfo_xl:convert_transfo_xl_command",
    "compare": "hf_relpos.commands.compare:compare_command",
    "inspect": "hf_relpos.commands.inspect:inspect_command",
    "export": "hf_relpos.commands.export:export_command",
    "serve": "hf_relpos.commands.serve:serve_command",
    "lengthgen": "hf_relpos.commands.lengthgen:lengthgen_command",
}


def _number(kind, minimum, strict: bool, maximum=None):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a{'n int' if kind is int else ' number'}, got {text!r}")
        if kind is float and not math.isfinite(value):  # nan passes every comparison below; inf trains a NaN model
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if value < minimum or (strict and value == minimum):
            bound = f"> {minimum}" if strict else f">= {minimum}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        if maximum is not None and value > maximum:
            raise argparse.ArgumentTypeError(f"must be <= {maximum}, got {text}")
        return value

    return parse


positive_int = _number(int, 1, strict=False)
non_negative_int = _number(int, 0, strict=False)
non_negative_float = _number(float, 0.0, strict=False)
positive_float = _number(float, 0.0, strict=True)
accuracy_fraction = _number(float, 0.0, strict=True, maximum=1.0)  # an exact-match accuracy as a fraction, > 0 to 1
# A sequence of one token has no next token to predict inside it (training's loss is 0, its "perplexity" 1.00) and
# attends to itself alone, so no position scheme does anything: 2 is the shortest length that measures something.
MIN_SEQ_LEN = 2
sequence_length = _number(int, MIN_SEQ_LEN, strict=False)
# What every seeded generator takes (NumPy's, through transformers.set_seed, stops at 2**32 - 1; torch's at 2**64).
MAX_SEED = 2**32 - 1
seed_number = _number(int, 0, strict=False, maximum=MAX_SEED)


vocab_size = _number(int, MIN_VOCAB, strict=False)
port_number = _number(int, 0, strict=False, maximum=65535)
SERVE_DTYPES = ("auto", "float32", "bfloat16", "float16")
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def model_name(text: str) -> str:
    if not text or text != text.strip() or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError(f"must be a non-empty name without spaces, got {text!r}")
    return text


def _package_file(path: str, name: str):
    """A standard-library-only module of the installed hf_relpos, executed from its file: importing the package
    would import torch."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("hf_relpos")
    module_spec = importlib.util.spec_from_file_location(name, Path(spec.submodule_search_locations[0]) / path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # a dataclass reads its module's namespace while it is made
    module_spec.loader.exec_module(module)
    return module


def _versions_report() -> str:
    """``hf_relpos/versions.py``'s report."""
    return _package_file("versions.py", "_hf_relpos_versions").report()


class _VersionAction(argparse.Action):
    """``--version``: several lines, as written (argparse's own version action would reflow them)."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print(_versions_report())
        parser.exit()


class _Parser(argparse.ArgumentParser):
    """An argument error is one line, ``hf-relpos <command>: error: ...``, exit status 2 (no usage block)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default (but not a default of None or False, which says nothing)."""

    def _get_help_string(self, action):
        if action.default in (None, False, argparse.SUPPRESS) or "%(default)" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _train_options():
    """``hf_relpos/commands/options.py``'s ``TrainOptions``, read as a file: importing the package would import torch."""
    return _package_file("commands/options.py", "_hf_relpos_options").TrainOptions


def _add_training_arguments(p, command: str, **defaults) -> None:
    """The training flags, one per field of ``TrainOptions`` that carries ``flag(...)`` (its name, default and
    help; ``defaults`` are the command's own, as ``compare``'s 500 steps); fields of ``command="train"`` only for
    ``train``."""
    import dataclasses

    groups = {}
    for field in dataclasses.fields(_train_options()):
        spec = dict(field.metadata.get("flag") or {})
        if not spec or spec.pop("command", command) != command:
            continue
        type_name, group, cli_default = spec.pop("type_name"), spec.pop("group", None), spec.pop("cli_default", None)
        if type_name is not None:
            spec["type"] = globals()[type_name]
        if "choices" in spec:
            spec["choices"] = globals()[spec["choices"]]
        default = globals()[cli_default] if cli_default else field.default
        spec["help"] = spec["help"].format(**globals())
        if group is not None and group not in groups:
            groups[group] = p.add_mutually_exclusive_group()  # one line naming both flags when both are given
        target = p if group is None else groups[group]
        target.add_argument("--" + field.name.replace("_", "-"), default=defaults.get(field.name, default), **spec)


def parser() -> argparse.ArgumentParser:
    common = _Parser(add_help=False)
    common.add_argument("--debug", action="store_true", help="show a traceback for errors (also HF_RELPOS_DEBUG=1)")

    root = _Parser(
        prog="hf-relpos", formatter_class=_Formatter,
        description="Train, generate, evaluate, compare and inspect relative-position attention models.",
    )
    root.add_argument("--version", action=_VersionAction,
                      help="print hf_relpos', torch's and Transformers' versions and whether they are tested together")
    sub = root.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)

    def command(name, help):
        return sub.add_parser(name, help=help, description=help, parents=[common], formatter_class=_Formatter)

    _add_model_commands(command)
    _add_experiment_commands(command)
    _add_tool_commands(command)
    return root


def _add_model_commands(command) -> None:
    """train, generate, eval, validate-t5, convert-t5, convert-transfo-xl."""
    p = command("train", "train one scheme and write a Hub-ready folder")
    _add_training_arguments(p, "train")

    p = command("generate", "generate text from a trained folder (streams to the terminal)")
    p.add_argument("folder", help="a folder written by `hf-relpos train`")
    p.add_argument("--prompt", default="The", help="the text to continue")
    p.add_argument("--max-new-tokens", type=positive_int, default=64, help="tokens to generate")
    p.add_argument("--temperature", type=non_negative_float, default=0.8, help="sampling temperature; 0 for greedy")
    p.add_argument("--top-k", type=positive_int, default=40, help="sample among the k likeliest tokens")
    p.add_argument("--seed", type=seed_number, default=0, help=f"random seed for sampling (0 to {MAX_SEED})")
    p.add_argument("--quiet", action="store_true", help="print only the generated text")

    p = command("eval", "perplexity of a folder at L, 2L, 4L (and with memory)")
    p.add_argument("folder", help="a folder written by `hf-relpos train`")
    p.add_argument("--seq-len", type=sequence_length, default=None, help=f"L (>= {MIN_SEQ_LEN}; default: the training length)")
    p.add_argument("--factors", type=positive_int, nargs="+", default=[1, 2, 4],
                   help="evaluation lengths as multiples of L (each at most the tokens evaluated)")
    text = p.add_mutually_exclusive_group()
    text.add_argument("--eval-file", nargs="+", default=None, metavar="PATH",
                      help="UTF-8 text files whose last 5%% is evaluated (default: the embedded corpus' test split)")
    text.add_argument("--corpus", choices=CORPORA, default=None,
                      help="evaluate this embedded corpus' test split (default: the one the folder was trained on); "
                           "not with --eval-file")
    p.add_argument("--max-eval-bytes", type=positive_int, default=MAX_TEXT_BYTES, metavar="BYTES",
                   help="refuse --eval-file text larger than this (tokenizing takes ~200 bytes of memory per byte)")
    p.add_argument("--eval-tokens", type=positive_int, default=None, help="cap on held-out tokens evaluated (default: all)")

    command("validate-t5", "check T5 buckets, bias and whole converted models against the installed Transformers")

    p = command("convert-t5", "an upstream T5 or mT5 checkpoint folder as an hf_relpos encoder-decoder or encoder "
                "folder")
    p.add_argument("src_folder", help="a local folder of a transformers T5ForConditionalGeneration, "
                   "MT5ForConditionalGeneration, T5EncoderModel or MT5EncoderModel (safetensors)")
    p.add_argument("out_folder", help="where the converted model, its code and its model card go")
    p.add_argument("--overwrite", action="store_true", help="replace an hf-relpos model already in OUT_FOLDER")

    p = command("convert-transfo-xl", "a transformers 4.x TransfoXL folder (transfo-xl-wt103's format) as an "
                "hf_relpos causal-LM folder, vocab.pkl as tokenizer.json")
    p.add_argument("src_folder", help="a local folder of a TransfoXLLMHeadModel: config.json, model.safetensors or "
                   "pytorch_model.bin (tensors only), vocab.pkl (optional)")
    p.add_argument("out_folder", help="where the converted model, its code, card and tokenizer go")
    p.add_argument("--overwrite", action="store_true", help="replace an hf-relpos model already in OUT_FOLDER")


def _add_experiment_commands(command) -> None:
    """compare, lengthgen."""
    p = command("compare", "the length-extrapolation experiment over every scheme")
    p.add_argument("--output-dir", default=None,
                   help="where the table (md, json), plot and models go (default: a new runs/compare-<date>-<time>)")
    p.add_argument("--schemes", nargs="+", choices=SCHEMES, default=None, help="schemes to compare (default: all)")
    p.add_argument("--quick", action="store_true", help="a few-minute run (at most 60 steps, L <= 64), marked as such")
    p.add_argument("--seeds", type=positive_int, default=3, help="seeds per scheme (--seed, --seed + 1, ...)")
    p.add_argument("--factors", type=positive_int, nargs="+", default=[1, 2, 4, 8],
                   help="evaluation lengths as multiples of L")
    p.add_argument("--sliding", action="store_true",
                   help="evaluate with sliding windows moving by L tokens (default: non-overlapping segments)")
    _add_training_arguments(p, "compare", steps=500)

    p = command("lengthgen", "the length-generalisation protocol of Kazemnejad et al. 2023 on synthetic tasks")
    p.add_argument("--output-dir", default=None,
                   help="where the table (md, json), plot and run records go (default: a new runs/lengthgen-<date>-<time>)")
    p.add_argument("--tasks", nargs="+", choices=LENGTHGEN_TASKS, default=None,
                   help="tasks (default: copy repeat_copy replace reverse; addition, summation and parity are "
                        "negative controls; --quick: copy replace parity)")
    p.add_argument("--schemes", nargs="+", choices=SCHEMES, default=None,
                   help="schemes (default: the paper's five: nope t5_bias alibi rope learned)")
    p.add_argument("--seeds", type=positive_int, default=3, help="seeds per task and scheme (--seed, --seed + 1, ...)")
    p.add_argument("--seed", type=seed_number, default=0, help=f"the first seed (0 to {MAX_SEED})")
    p.add_argument("--train-length", type=positive_int, default=20,
                   help="L: training instances have U(1, L) input items, test instances 1 to 2L")
    p.add_argument("--items", type=_number(int, 2, strict=False, maximum=LENGTHGEN_MAX_ITEMS), default=LENGTHGEN_ITEMS,
                   help=f"item types of copy, repeat_copy, replace, reverse and sort (2 to {LENGTHGEN_MAX_ITEMS})")
    p.add_argument("--steps", type=positive_int, default=5000, help="most optimizer steps per run")
    p.add_argument("--batch-size", type=positive_int, default=64, help="instances per optimizer step")
    p.add_argument("--lrs", type=positive_float, nargs="+", default=[1e-3],
                   help="peak AdamW learning rates (5%% warm-up, cosine decay); with several, the first seed tries "
                        "each and the other seeds use the one best in distribution, per task and scheme")
    p.add_argument("--eval-every", type=positive_int, default=250,
                   help="steps between in-distribution validations (the best state is the one scored)")
    p.add_argument("--stop-at", type=accuracy_fraction, default=1.0,
                   help="stop a run once its validation exact match reaches this (0-1; default 1: the first state "
                        "at 100%% is the one scored, so training on would change nothing)")
    p.add_argument("--gate", type=accuracy_fraction, default=0.95,
                   help="best validation exact match (0-1) a run needs to be reported; below it: not learned")
    p.add_argument("--preset", choices=PRESET_NAMES, default="tiny", help="model size")
    p.add_argument("--position-lr-scale", type=positive_float, default=1.0,
                   help="the position parameters' learning rate (the scheme's tables, per-layer position embeddings, "
                        "gates) as a multiple of each run's")
    p.add_argument("--position-init-scale", type=positive_float, default=1.0,
                   help="multiply the position parameters by this once initialised (a bias table started smaller)")
    p.add_argument("--layers", type=positive_int, default=None, help="layers (default: the preset's)")
    p.add_argument("--attention-scale", type=positive_float, default=None,
                   help="the factor of q.k in attention (default: 1/sqrt(head_dim); T5's: 1.0)")
    p.add_argument("--initialization", choices=("default", "t5"), default="default",
                   help="how weights start: default (N(0, 0.02)) or t5 (T5's, its tied output layer rescaled as T5 v1.0)")
    p.add_argument("--jobs", type=positive_int, default=None,
                   help="runs trained at once, one thread each (default: the CPU cores available)")
    p.add_argument("--quick", action="store_true",
                   help="a few-minute run (at most 200 steps, 1 seed, tasks copy replace parity unless --tasks), marked as such")
    p.add_argument("--resume", action="store_true", help="train only the runs not yet recorded in --output-dir")
    p.add_argument("--report", action="store_true",
                   help="train nothing: write the table and plots of the runs recorded so far (marked partial)")
    p.add_argument("--overwrite", action="store_true", help="train every run again and replace the table in --output-dir")
    p.add_argument("--quiet", action="store_true", help="print only the final line (and errors)")


def _add_tool_commands(command) -> None:
    """inspect, export, serve."""
    p = command("inspect", "figures of what a trained folder learned about position (PNG)")
    p.add_argument("folder", help="a folder written by `hf-relpos train`")
    p.add_argument("--prompt", default=INSPECT_PROMPT, help="the text whose attention maps are drawn")
    p.add_argument("--output-dir", default=None, help="where the PNGs go (default: FOLDER/inspect)")
    p.add_argument("--distance", type=positive_int, default=None,
                   help="largest distance in position.png (default: twice the training length)")
    p.add_argument("--overwrite", action="store_true", help="replace figures already in --output-dir")

    p = command("export", "a trained folder as one ONNX or torch.export program, checked against the model")
    p.add_argument("folder", help="a folder written by `hf-relpos train`")
    p.add_argument("out", help="the folder to write: model.onnx or model.pt2, the tokenizer, export.json and a README")
    p.add_argument("--format", choices=EXPORT_FORMATS, required=True,
                   help="onnx (torch.onnx.export, dynamo; run with onnxruntime) or pt2 (torch.export.save)")
    p.add_argument("--overwrite", action="store_true", help="replace an earlier export in OUT")

    p = command("serve", "serve a trained folder over HTTP: OpenAI-compatible completions (Transformers' server)")
    p.add_argument("folder", help="a folder written by `hf-relpos train` or `convert-t5` (an encoder-decoder)")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=port_number, default=8000, help="the port to listen on (0: a free one, printed)")
    p.add_argument("--model-name", type=model_name, default=None,
                   help="the model's name in requests and /v1/models (default: the folder's name)")
    p.add_argument("--continuous-batching", action="store_true",
                   help="run requests together in Transformers' continuous batching (paged cache; decoder-only)")
    p.add_argument("--cb-block-size", type=positive_int, default=None,
                   help="paged cache page size in tokens (Transformers' page_size; default 256)")
    p.add_argument("--cb-num-blocks", type=positive_int, default=None,
                   help="paged cache blocks of a page per layer (default: room for 8 requests of the longest the "
                        "model takes)")
    p.add_argument("--cb-max-batch-tokens", type=positive_int, default=None, help="most tokens in one batch")
    p.add_argument("--cb-max-memory-percent", type=_number(float, 0.0, strict=True, maximum=1.0), default=None,
                   help="size the paged cache as this share of the device's free memory, > 0 to 1, instead "
                        "(Transformers' own way; on a CPU the whole machine's memory)")
    p.add_argument("--max-tokens", type=positive_int, default=1024,
                   help="most tokens a request may generate (and what a request that names none gets)")
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda, cuda:N or mps")
    p.add_argument("--dtype", choices=SERVE_DTYPES, default="auto", help="the weights' dtype (auto: as saved)")
    p.add_argument("--log-level", choices=LOG_LEVELS, default="warning", help="uvicorn's log level")


def _given(argv: list, command: str) -> list:
    """The options this command line gives itself (not argparse's defaults): parsed again with no defaults."""
    root = parser()
    commands = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    for action in commands.choices[command]._actions:
        action.default = argparse.SUPPRESS
    return sorted(set(vars(root.parse_args(argv))) - {"command"})


def main(argv: Optional[list] = None) -> int:
    args = parser().parse_args(argv)
    if args.command in ("compare", "lengthgen") and args.seed + args.seeds - 1 > MAX_SEED:  # compare runs seeds --seed, --seed + 1, ...
        print(f"hf-relpos {args.command}: error: --seed {args.seed} with --seeds {args.seeds} runs seeds up to "
              f"{args.seed + args.seeds - 1}, past {MAX_SEED} (see hf-relpos {args.command} --help)", file=sys.stderr)
        return 2
    args.argv = list(sys.argv[1:] if argv is None else argv)
    args.given = _given(args.argv, args.command)  # a resume takes the options not given from its checkpoint
    debug = args.debug or os.environ.get("HF_RELPOS_DEBUG", "") not in ("", "0")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        return _run(args, debug)
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"hf-relpos {args.command}: interrupted", file=sys.stderr)
        return 130


def _run(args, debug: bool) -> int:
    """The command's function, imported now (torch and Transformers with it); its user errors as one line."""
    import importlib

    from hf_relpos.commands.common import library_output_off
    from hf_relpos.commands.errors import Interrupted, UserError

    module, _, function = COMMANDS[args.command].partition(":")
    try:
        command = getattr(importlib.import_module(module), function)
        with library_output_off():
            return command(args) or 0
    except UserError as error:
        if debug:
            raise
        print(f"hf-relpos {args.command}: error: {error}", file=sys.stderr)
        return 2
    except Interrupted as stop:
        print(f"hf-relpos {args.command}: {stop} Resume with: {stop.resume}", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
