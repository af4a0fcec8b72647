"""Run Transformers' own common model tests (ModelTesterMixin, GenerationTesterMixin, ConfigTester)
against hf_relpos' models, for every position scheme: causal, bidirectional and encoder-decoder (seq2seq).

Usage (from the project root)::

    make upstream-tests                                   # everything
    make upstream-tests UPSTREAM_ARGS="-q -k T5Bias -x"  # pytest arguments pass through
    .venv/bin/python scripts/upstream_common_tests.py [pytest args]
    RELPOS_SCHEMES=t5_bias,shaw .venv/bin/python scripts/upstream_common_tests.py -n 2
    RELPOS_MODES=seq2seq .venv/bin/python scripts/upstream_common_tests.py -q -n 2   # encoder-decoders only

What it does: this file is both the runner and the test module. Run as a script, it lays out a
throw-away folder holding Transformers' ``tests`` package (copied from the sdist at run time; nothing
of Transformers' test code lives in this project), copies itself there as ``test_relpos_upstream.py``
and runs pytest in that folder, so that ``tests.test_modeling_common`` is Transformers' and not this
project's ``tests`` package. Imported by that pytest, it defines one test class per (scheme, mode) from
the upstream mixins and model testers of our own: ``RelPosModelTester`` for the causal
(``RelPosCausal*Test``: RelPosModel, RelPosForCausalLM, RelPosForSequenceClassification) and bidirectional
(``RelPosBidirectional*Test``) modes, ``RelPosSeq2SeqModelTester`` for the seq2seq mode
(``RelPosSeq2Seq*Test``: RelPosForConditionalGeneration; input_ids, attention_mask, decoder_input_ids,
decoder_attention_mask).
The project's own ``make test`` never collects it (``testpaths = ["tests"]`` and the file name does
not match ``test_*.py``).

Where the upstream test files come from:

- ``HF_UPSTREAM_SDIST`` (default ``/work/upstream/transformers-<installed version>``): the unpacked
  PyPI sdist of the installed Transformers. If that folder is absent, the sdist is fetched with
  ``pip download --no-binary :all: --no-deps transformers==<version>`` into ``HF_UPSTREAM_CACHE``
  (default ``~/.cache/hf_relpos/upstream``) and unpacked there.
- The PyPI sdist ships only the top-level ``tests/*_common.py`` files, but ``test_modeling_common.py``
  imports ``tests/generation/test_utils.py`` (GenerationTesterMixin), ``tests/exporters/test_export.py``
  (ExportTesterMixin) and ``tests/utils/test_configuration_utils.py`` (+ ``utils/test_module``).
  ``HF_UPSTREAM_TESTS_EXTRA`` (default ``/work/upstream/transformers-tests-extra``) names a folder laid
  out like a Transformers git checkout (a checkout of the matching tag is best) that supplies the files
  the sdist lacks; the sdist's own files always win. Without it, empty stand-ins are written so that
  ModelTesterMixin and ConfigTester still run; the GenerationTesterMixin tests are then not run (a
  warning says so) and ConfigTester's ``check_config_arguments_init`` checks nothing.

Environment knobs:

- ``RELPOS_SCHEMES``: comma-separated schemes (default: the eleven of POSITION_ENCODINGS, plus the
  seq2seq-only variant ``t5_bias_deep_decoder``) and/or config variants from ``_VARIANTS`` below (a
  Transformer-XL memory, sliding windows, 6 heads, a decoder deeper than the encoder, ...); ``all`` =
  schemes and variants. ``RELPOS_MODES``: comma-separated ``causal``, ``bidirectional``, ``seq2seq``
  (default all three). A (scheme, mode) pair that a config refuses is left out: ``fire`` and ``nope`` are
  causal only (no bidirectional or seq2seq class), seq2seq takes no Transformer-XL memory.
- ``RELPOS_PROBE=1``: also run the upstream tests that hf_relpos' own class flags
  (``_can_compile_fullgraph``, ``_supports_attention_backend``) or its string annotations switch off,
  by flipping them in the test process (see the comment at ``RELPOS_PROBE`` below).
- ``RELPOS_SUMMARY_JSON=path``: write the per-class tally and every failure's first error line as JSON
  (the tally is always printed at the end of the run).
- ``RELPOS_KEEP_RUN_DIR=1`` keeps the throw-away folder; ``OMP_NUM_THREADS`` defaults to 1.

A full run (11 schemes causal, 9 bidirectional, 9 seq2seq plus ``t5_bias_deep_decoder``: 3,974 passed, 0 failed,
2,656 skipped as pytest counts them, of which seq2seq 1,396 passed, 984 skipped) takes 4-7 minutes with
``-n 2`` on 2 CPU cores (6.5 measured on a busy machine); ``RELPOS_MODES=seq2seq`` alone about 3.
``RELPOS_PROBE=1`` changes nothing for seq2seq (1,396 passed). Under Transformers 5.24.0 with its sdist (2026-11-24):
4,094 passed, 0 failed, 2,707 skipped (4.3 minutes with ``-n 1``); 5.24 adds ``test_bc_cache_name_forward``, which
needs the old cache name's ``FutureWarning`` to reach it (the pytest.ini below therefore does not ignore them).

Test-only dependencies the upstream test files need (installed into .venv by ``make upstream-tests``,
always with ``-c constraints-dev.txt`` so that torch stays pinned):
``parameterized`` (test_modeling_common, generation tests), ``pytest-timeout`` (their
``@pytest.mark.timeout``), ``httpx`` (tests/utils/test_configuration_utils.py) and, optionally,
``pytest-xdist`` (``-n 2``).

Opt-outs (class attributes that upstream model tests use for tests that do not apply, or an inherited test
replaced by a skipped one, as upstream test classes do) are listed, with their reasons, in ``_OPT_OUTS``
(every class: none), ``_SEQ2SEQ_OPT_OUTS`` (the seq2seq classes: the two base_model_prefix tests, which
T5's layout does not fit) and ``_VARIANT_OPT_OUTS`` below; there are deliberately very few.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve()
RUN_MARKER = "RELPOS_UPSTREAM_RUN"
TEST_MODULE_NAME = "test_relpos_upstream.py"

# ============================================================================================
# Runner: lay out the upstream `tests` package in a throw-away folder and run pytest there.
# ============================================================================================

# Files that test_modeling_common / test_configuration_common import besides the sdist's top level.
_EXTRA_FILES = (
    "tests/__init__.py",
    "tests/generation/__init__.py",
    "tests/generation/test_utils.py",
    "tests/exporters/__init__.py",
    "tests/exporters/test_export.py",
    "tests/utils/__init__.py",
    "tests/utils/test_configuration_utils.py",
)
_EXTRA_DIRS = ("utils/test_module",)

# Written only where neither the sdist nor HF_UPSTREAM_TESTS_EXTRA has the file: our own minimal
# stand-ins (no upstream code), so that test_modeling_common can be imported.
_STUBS = {
    "tests/__init__.py": "",
    "tests/generation/__init__.py": "",
    "tests/exporters/__init__.py": "",
    "tests/utils/__init__.py": "",
    "tests/generation/test_utils.py": (
        "RELPOS_STUB = True  # written by hf_relpos' harness: the real file was not available\n\n\n"
        "class GenerationTesterMixin:\n    pass\n"
    ),
    "tests/exporters/test_export.py": (
        "RELPOS_STUB = True  # written by hf_relpos' harness: the real file was not available\n\n\n"
        "class ExportTesterMixin:\n    pass\n\n\nclass ExportGenerateTesterMixin(ExportTesterMixin):\n    pass\n"
    ),
    "tests/utils/test_configuration_utils.py": (
        "RELPOS_STUB = True  # written by hf_relpos' harness: the real file was not available\n"
        "config_common_kwargs = {}\n"
    ),
}

_PYTEST_INI = """\
[pytest]
# Written by hf_relpos' scripts/upstream_common_tests.py for one run.
markers =
    generate: GenerationTesterMixin tests
    flash_attn_test: flash attention
    flash_attn_3_test: flash attention 3
    flash_attn_4_test: flash attention 4
    all_flash_attn_test: all flash attentions
    torch_compile_test: torch.compile
    torch_export_test: torch.export
    onnx_export_test: onnx export
    executorch_export_test: executorch export
    is_training_test: training mixin
    bitsandbytes: bitsandbytes
filterwarnings =
    ignore::pytest.PytestUnknownMarkWarning
    ignore::DeprecationWarning
"""

# A per-class tally printed at the end of the run (and written as JSON when RELPOS_SUMMARY_JSON is set).
_CONFTEST = '''\
"""Written by hf_relpos' scripts/upstream_common_tests.py: a per-class tally of the run."""
import collections
import json
import os

_TALLY = collections.defaultdict(collections.Counter)
_FAILED = []
_FAILED_SUBTESTS = set()  # node ids of tests with a failed subtest: the test counts as failed


def pytest_runtest_logreport(report):
    cls = report.nodeid.split("::")[1] if "::" in report.nodeid else report.nodeid
    name = report.nodeid.split("::")[-1]
    if type(report).__name__ == "SubtestReport":  # counted through their top-level test
        if report.failed:
            _FAILED_SUBTESTS.add(report.nodeid)
            crash = getattr(report.longrepr, "reprcrash", None)
            line = crash.message if crash is not None else str(report.longrepr).splitlines()[-1]
            _FAILED.append({"class": cls, "test": name, "subtest": str(getattr(report, "context", "")),
                            "error": line.splitlines()[0][:400] if line else ""})
        return
    if report.when == "call" or (report.when == "setup" and not report.passed):
        outcome = "skipped" if report.skipped else ("passed" if report.passed else "failed")
        if report.nodeid in _FAILED_SUBTESTS:  # pytest reports the test itself as passed (or skipped)
            outcome = "failed"
        if report.when == "setup" and report.failed:
            outcome = "error"
        _TALLY[cls][outcome] += 1
        if outcome in ("failed", "error"):
            line = ""
            if report.longrepr is not None:
                crash = getattr(report.longrepr, "reprcrash", None)
                line = crash.message if crash is not None else str(report.longrepr).splitlines()[-1]
            _FAILED.append({"class": cls, "test": name, "error": line.splitlines()[0][:400] if line else ""})


def pytest_terminal_summary(terminalreporter):
    if not _TALLY:
        return
    tr = terminalreporter
    tr.section("hf_relpos: per-class tally")
    total = collections.Counter()
    for cls in sorted(_TALLY):
        c = _TALLY[cls]
        total.update(c)
        tr.write_line(f"{cls:55s} passed {c['passed']:4d}  failed {c['failed'] + c['error']:4d}  skipped {c['skipped']:4d}")
    tr.write_line(f"{'TOTAL':55s} passed {total['passed']:4d}  failed {total['failed'] + total['error']:4d}  skipped {total['skipped']:4d}")
    path = os.environ.get("RELPOS_SUMMARY_JSON")
    if path:
        with open(path, "w") as f:
            json.dump({"tally": {k: dict(v) for k, v in _TALLY.items()}, "failed": _FAILED}, f, indent=1)
'''


def _installed_transformers_version() -> str:
    from importlib.metadata import version

    return version("transformers")


def _find_sdist() -> Path:
    version = _installed_transformers_version()
    sdist = Path(os.environ.get("HF_UPSTREAM_SDIST", f"/work/upstream/transformers-{version}"))
    if (sdist / "tests" / "test_modeling_common.py").is_file():
        return sdist
    cache = Path(os.environ.get("HF_UPSTREAM_CACHE", Path.home() / ".cache" / "hf_relpos" / "upstream"))
    unpacked = cache / f"transformers-{version}"
    if (unpacked / "tests" / "test_modeling_common.py").is_file():
        return unpacked
    cache.mkdir(parents=True, exist_ok=True)
    print(f"[upstream-tests] {sdist} not found: downloading the transformers=={version} sdist into {cache}", flush=True)
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "--no-build-isolation",
         f"transformers=={version}", "-d", str(cache)],
        check=True,
    )
    archive = cache / f"transformers-{version}.tar.gz"
    with tarfile.open(archive) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(f"transformers-{version}/tests/")]
        tar.extractall(cache, members=members, filter="data")
    return unpacked


def _build_run_dir(sdist: Path, extra: Path | None) -> tuple[Path, list[str]]:
    run = Path(tempfile.mkdtemp(prefix="relpos-upstream-"))
    shutil.copytree(sdist / "tests", run / "tests")
    stubbed = []
    for rel in _EXTRA_FILES:
        target = run / rel
        if target.exists():
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        if extra is not None and (extra / rel).is_file():
            shutil.copy2(extra / rel, target)
        else:
            target.write_text(_STUBS[rel])
            if _STUBS[rel]:
                stubbed.append(rel)
    for rel in _EXTRA_DIRS:
        if not (run / rel).exists() and extra is not None and (extra / rel).is_dir():
            shutil.copytree(extra / rel, run / rel)
    shutil.copy2(HERE, run / TEST_MODULE_NAME)
    (run / "pytest.ini").write_text(_PYTEST_INI)
    (run / "conftest.py").write_text(_CONFTEST)
    return run, stubbed


def main(argv: list[str]) -> int:
    sdist = _find_sdist()
    extra_env = os.environ.get("HF_UPSTREAM_TESTS_EXTRA", "/work/upstream/transformers-tests-extra")
    extra = Path(extra_env) if extra_env and Path(extra_env).is_dir() else None
    run, stubbed = _build_run_dir(sdist, extra)
    print(f"[upstream-tests] sdist: {sdist}", flush=True)
    print(f"[upstream-tests] extra test files: {extra if extra else '(none)'}", flush=True)
    if stubbed:
        print(
            "[upstream-tests] WARNING: not found in the sdist nor HF_UPSTREAM_TESTS_EXTRA, replaced by empty "
            f"stand-ins: {', '.join(stubbed)}. GenerationTesterMixin tests will not run; point "
            "HF_UPSTREAM_TESTS_EXTRA to a transformers git checkout of the matching tag.",
            flush=True,
        )
    print(f"[upstream-tests] run folder: {run}", flush=True)
    env = dict(os.environ)
    env[RUN_MARKER] = "1"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    cmd = [
        sys.executable, "-m", "pytest", "-c", str(run / "pytest.ini"), "--rootdir", str(run),
        "-p", "no:cacheprovider", str(run / TEST_MODULE_NAME), *argv,
    ]
    try:
        return subprocess.call(cmd, cwd=run, env=env)
    finally:
        if os.environ.get("RELPOS_KEEP_RUN_DIR") != "1":
            shutil.rmtree(run, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


# ============================================================================================
# Test module: only when imported by the pytest that main() starts, inside the run folder.
# ============================================================================================

if __name__ != "__main__" and os.environ.get(RUN_MARKER) == "1":
    import unittest

    import torch

    from transformers.cache_utils import StaticCache
    from transformers.models.auto import modeling_auto
    from transformers.testing_utils import require_torch, torch_device

    from hf_relpos import (
        POSITION_ENCODINGS,
        RelPosConfig,
        RelPosForCausalLM,
        RelPosForConditionalGeneration,
        RelPosForSequenceClassification,
        RelPosModel,
    )
    from hf_relpos.configuration_relpos import CAUSAL_ONLY
    from tests.test_configuration_common import ConfigTester
    from tests.test_modeling_common import ModelTesterMixin, ids_tensor
    import tests.generation.test_utils as _generation_test_utils
    from tests.generation.test_utils import GenerationTesterMixin

    if getattr(_generation_test_utils, "RELPOS_STUB", False):
        import warnings

        warnings.warn("tests/generation/test_utils.py is a stand-in: no GenerationTesterMixin test runs")

    # Upstream's common tests decide by class *name* which heads get labels (`_prepare_for_class`), which
    # class is the base model (skipped by the training tests), etc., from the static name tables of the
    # library's own models. A model of the library would be listed there: list ours the same way (in
    # this test process only), so that those tests treat our heads as they treat Llama's.
    modeling_auto.MODEL_MAPPING_NAMES.setdefault("relpos", "RelPosModel")
    modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.setdefault("relpos", "RelPosForCausalLM")
    modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.setdefault("relpos", "RelPosForSequenceClassification")
    modeling_auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES.setdefault("relpos", "RelPosForConditionalGeneration")

    class RelPosModelTester:
        """Tiny configs and inputs for hf_relpos models (our own tester, in the shape upstream's mixins read)."""

        def __init__(
            self,
            parent,
            position_encoding: str,
            is_decoder: bool,
            batch_size: int = 13,
            seq_length: int = 7,
            is_training: bool = True,
            vocab_size: int = 99,
            hidden_size: int = 32,
            num_hidden_layers: int = 2,
            num_attention_heads: int = 4,
            intermediate_size: int = 37,
            max_position_embeddings: int = 512,
            num_labels: int = 3,
            pad_token_id: int = 0,
            eos_token_id: int = 1,
            bos_token_id: int = 2,
            initializer_range: float = 0.02,
            config_overrides: dict | None = None,
        ):
            self.parent = parent
            self.position_encoding = position_encoding
            self.is_decoder = is_decoder
            self.batch_size = batch_size
            self.seq_length = seq_length
            self.is_training = is_training
            self.vocab_size = vocab_size
            self.hidden_size = hidden_size
            self.num_hidden_layers = num_hidden_layers
            self.num_attention_heads = num_attention_heads
            self.head_dim = hidden_size // num_attention_heads
            self.intermediate_size = intermediate_size
            self.max_position_embeddings = max_position_embeddings
            self.num_labels = num_labels
            self.pad_token_id = pad_token_id
            self.eos_token_id = eos_token_id
            self.bos_token_id = bos_token_id
            self.initializer_range = initializer_range
            self.config_overrides = {}
            for key, value in (config_overrides or {}).items():
                if key in ("hidden_size", "num_attention_heads", "intermediate_size", "max_position_embeddings"):
                    setattr(self, key, value)  # fields the upstream tests also read from the tester
                else:
                    self.config_overrides[key] = value
            self.head_dim = self.hidden_size // self.num_attention_heads

        def config_kwargs(self) -> dict:
            kwargs = dict(
                position_encoding=self.position_encoding,
                is_decoder=self.is_decoder,
                vocab_size=self.vocab_size,
                hidden_size=self.hidden_size,
                num_hidden_layers=self.num_hidden_layers,
                num_attention_heads=self.num_attention_heads,
                intermediate_size=self.intermediate_size,
                max_position_embeddings=self.max_position_embeddings,
                # small tables so that clipping and log-spaced buckets are reached within seq_length
                relative_attention_num_buckets=8,
                relative_attention_max_distance=16,
                max_relative_position=4,
                initializer_range=self.initializer_range,
                pad_token_id=self.pad_token_id,
                eos_token_id=self.eos_token_id,
                bos_token_id=self.bos_token_id,
            )
            kwargs.update(self.config_overrides)
            return kwargs

        def get_config(self) -> RelPosConfig:
            return RelPosConfig(**self.config_kwargs(), num_labels=self.num_labels)

        def prepare_config_and_inputs(self):
            # token ids avoid pad (0), eos (1) and bos (2): padding is stated by the attention mask,
            # left-padded as a tokenizer pads for generation (0, 1 or 2 pad tokens per row).
            input_ids = ids_tensor([self.batch_size, self.seq_length], self.vocab_size - 3) + 3
            attention_mask = torch.ones_like(input_ids)
            for row in range(self.batch_size):
                pad = row % 3
                attention_mask[row, :pad] = 0
                input_ids[row, :pad] = self.pad_token_id
            sequence_labels = ids_tensor([self.batch_size], self.num_labels)
            token_labels = ids_tensor([self.batch_size, self.seq_length], self.vocab_size)
            return self.get_config(), input_ids, attention_mask, sequence_labels, token_labels

        def prepare_config_and_inputs_for_common(self):
            config, input_ids, attention_mask, _, _ = self.prepare_config_and_inputs()
            return config, {"input_ids": input_ids, "attention_mask": attention_mask}

        # -- our own shape checks, as upstream testers have them ----------------------------------

        def create_and_check_model(self, config, input_ids, attention_mask):
            model = RelPosModel(config).to(torch_device).eval()
            with torch.no_grad():
                out = model(input_ids, attention_mask=attention_mask)
                out_plain = model(input_ids)
            shape = (self.batch_size, self.seq_length, self.hidden_size)
            self.parent.assertEqual(tuple(out.last_hidden_state.shape), shape)
            self.parent.assertEqual(tuple(out_plain.last_hidden_state.shape), shape)

        def create_and_check_causal_lm(self, config, input_ids, attention_mask, token_labels):
            model = RelPosForCausalLM(config).to(torch_device).eval()
            with torch.no_grad():
                out = model(input_ids, attention_mask=attention_mask, labels=token_labels)
            self.parent.assertEqual(tuple(out.logits.shape), (self.batch_size, self.seq_length, self.vocab_size))
            self.parent.assertEqual(out.loss.dim(), 0)

        def create_and_check_sequence_classification(self, config, input_ids, attention_mask, sequence_labels):
            model = RelPosForSequenceClassification(config).to(torch_device).eval()
            with torch.no_grad():
                out = model(input_ids, attention_mask=attention_mask, labels=sequence_labels)
            self.parent.assertEqual(tuple(out.logits.shape), (self.batch_size, self.num_labels))
            self.parent.assertEqual(out.loss.dim(), 0)

        def create_and_check_decoder_past(self, config, input_ids, attention_mask):
            """Cached decoding of 3 new tokens gives the hidden states of one uncached forward."""
            model = RelPosModel(config).to(torch_device).eval()
            extra = ids_tensor([self.batch_size, 3], self.vocab_size - 3) + 3
            full_ids = torch.cat([input_ids, extra], dim=-1)
            full_mask = torch.cat([attention_mask, torch.ones_like(extra)], dim=-1)
            with torch.no_grad():
                past = model(input_ids, attention_mask=attention_mask, use_cache=True).past_key_values
                cached = model(extra, attention_mask=full_mask, past_key_values=past, use_cache=True).last_hidden_state
                full = model(full_ids, attention_mask=full_mask, use_cache=False).last_hidden_state[:, -3:]
            torch.testing.assert_close(cached, full, atol=1e-4, rtol=1e-4)

    class RelPosSeq2SeqModelTester:
        """Tiny encoder-decoder configs and inputs for RelPosForConditionalGeneration (our own tester).

        The source is padded on either side (a bidirectional encoder takes both), the target on the right
        behind ``decoder_start_token_id`` (as labels are padded). ``seq_length`` is the target's: upstream
        sizes the labels of a seq2seq LM with it. Source and target have the same length and the stacks the
        same depth, as upstream's common tests assume (they reuse the source's length and mask for the target
        and count the decoder's layers by ``num_hidden_layers``); our own ``create_and_check_model`` also feeds
        a longer source, and the ``t5_bias_deep_decoder`` variant makes the decoder deeper than the encoder.
        """

        def __init__(
            self,
            parent,
            position_encoding: str,
            batch_size: int = 13,
            encoder_seq_length: int = 7,
            decoder_seq_length: int = 7,
            is_training: bool = True,
            vocab_size: int = 99,
            hidden_size: int = 32,
            num_hidden_layers: int = 2,
            num_decoder_layers: int | None = None,
            num_attention_heads: int = 4,
            intermediate_size: int = 37,
            max_position_embeddings: int = 512,
            pad_token_id: int = 0,
            eos_token_id: int = 1,
            bos_token_id: int = 2,
            decoder_start_token_id: int = 0,
            initializer_range: float = 0.02,
            config_overrides: dict | None = None,
        ):
            self.parent = parent
            self.position_encoding = position_encoding
            self.batch_size = batch_size
            self.encoder_seq_length = encoder_seq_length
            self.decoder_seq_length = decoder_seq_length
            self.seq_length = decoder_seq_length
            self.is_training = is_training
            self.vocab_size = vocab_size
            self.hidden_size = hidden_size
            self.num_hidden_layers = num_hidden_layers
            self.num_decoder_layers = num_decoder_layers
            self.num_attention_heads = num_attention_heads
            self.intermediate_size = intermediate_size
            self.max_position_embeddings = max_position_embeddings
            self.pad_token_id = pad_token_id
            self.eos_token_id = eos_token_id
            self.bos_token_id = bos_token_id
            self.decoder_start_token_id = decoder_start_token_id
            self.initializer_range = initializer_range
            self.config_overrides = {}
            for key, value in (config_overrides or {}).items():
                if key in ("hidden_size", "num_attention_heads", "intermediate_size", "max_position_embeddings",
                           "num_decoder_layers"):
                    setattr(self, key, value)  # fields the upstream tests (or our checks) also read from the tester
                else:
                    self.config_overrides[key] = value
            self.head_dim = self.hidden_size // self.num_attention_heads
            if self.num_decoder_layers is None:
                self.num_decoder_layers = self.num_hidden_layers

        def config_kwargs(self) -> dict:
            kwargs = dict(
                position_encoding=self.position_encoding,
                is_encoder_decoder=True,
                vocab_size=self.vocab_size,
                hidden_size=self.hidden_size,
                num_hidden_layers=self.num_hidden_layers,
                num_decoder_layers=self.num_decoder_layers,
                num_attention_heads=self.num_attention_heads,
                intermediate_size=self.intermediate_size,
                max_position_embeddings=self.max_position_embeddings,
                relative_attention_num_buckets=8,
                relative_attention_max_distance=16,
                max_relative_position=4,
                initializer_range=self.initializer_range,
                pad_token_id=self.pad_token_id,
                eos_token_id=self.eos_token_id,
                bos_token_id=self.bos_token_id,
                decoder_start_token_id=self.decoder_start_token_id,
            )
            kwargs.update(self.config_overrides)
            return kwargs

        def get_config(self) -> RelPosConfig:
            return RelPosConfig(**self.config_kwargs())

        def prepare_config_and_inputs(self):
            # Token ids avoid pad/start (0), eos (1) and bos (2). Source rows: none, 2 left or 2 right pad tokens;
            # target rows: the start token, then tokens, with 0, 1 or 2 pad tokens at the end.
            input_ids = ids_tensor([self.batch_size, self.encoder_seq_length], self.vocab_size - 3) + 3
            attention_mask = torch.ones_like(input_ids)
            decoder_input_ids = ids_tensor([self.batch_size, self.decoder_seq_length], self.vocab_size - 3) + 3
            decoder_input_ids[:, 0] = self.decoder_start_token_id
            decoder_attention_mask = torch.ones_like(decoder_input_ids)
            for row in range(self.batch_size):
                if row % 3 == 1:
                    attention_mask[row, :2] = 0
                elif row % 3 == 2:
                    attention_mask[row, -2:] = 0
                pad = row % 3
                if pad:
                    decoder_attention_mask[row, -pad:] = 0
            input_ids = input_ids.masked_fill(attention_mask == 0, self.pad_token_id)
            decoder_input_ids = decoder_input_ids.masked_fill(decoder_attention_mask == 0, self.pad_token_id)
            labels = ids_tensor([self.batch_size, self.decoder_seq_length], self.vocab_size - 3) + 3
            labels = labels.masked_fill(decoder_attention_mask == 0, -100)
            return self.get_config(), input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, labels

        def prepare_config_and_inputs_for_common(self):
            config, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, _ = (
                self.prepare_config_and_inputs()
            )
            return config, {
                "input_ids": input_ids,
                "attention_mask": attention_mask,
                "decoder_input_ids": decoder_input_ids,
                "decoder_attention_mask": decoder_attention_mask,
            }

        # -- our own checks, as upstream testers have them ---------------------------------------

        def create_and_check_model(self, config, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask):
            """Shapes of every output, with and without masks, for a source 3 tokens longer than the target (a
            swapped length shows), and the depth of each stack."""
            model = RelPosForConditionalGeneration(config).to(torch_device).eval()
            extra = ids_tensor([self.batch_size, 3], self.vocab_size - 3) + 3
            input_ids = torch.cat([input_ids, extra], dim=-1)
            attention_mask = torch.cat([attention_mask, torch.ones_like(extra)], dim=-1)
            with torch.no_grad():
                out = model(input_ids, attention_mask=attention_mask, decoder_input_ids=decoder_input_ids,
                            decoder_attention_mask=decoder_attention_mask, output_attentions=True,
                            output_hidden_states=True, use_cache=True)
                plain = model(input_ids, decoder_input_ids=decoder_input_ids)
            b, s, t, h, n = (self.batch_size, self.encoder_seq_length + 3, self.decoder_seq_length, self.hidden_size,
                             self.num_attention_heads)
            for o in (out, plain):
                self.parent.assertEqual(tuple(o.logits.shape), (b, t, self.vocab_size))
                self.parent.assertEqual(tuple(o.encoder_last_hidden_state.shape), (b, s, h))
            enc, dec = self.num_hidden_layers, self.num_decoder_layers
            self.parent.assertEqual([tuple(x.shape) for x in out.encoder_attentions], [(b, n, s, s)] * enc)
            self.parent.assertEqual([tuple(x.shape) for x in out.decoder_attentions], [(b, n, t, t)] * dec)
            self.parent.assertEqual([tuple(x.shape) for x in out.cross_attentions], [(b, n, t, s)] * dec)
            self.parent.assertEqual([tuple(x.shape) for x in out.encoder_hidden_states], [(b, s, h)] * (enc + 1))
            self.parent.assertEqual([tuple(x.shape) for x in out.decoder_hidden_states], [(b, t, h)] * (dec + 1))
            cache = out.past_key_values
            self.parent.assertEqual(len(cache.self_attention_cache.layers), dec)
            self.parent.assertEqual(len(cache.cross_attention_cache.layers), dec)
            self.parent.assertEqual(cache.get_seq_length(), t)
            self.parent.assertEqual(tuple(cache.cross_attention_cache.layers[0].keys.shape), (b, n, s, self.head_dim))

        def create_and_check_lm_loss(self, config, input_ids, attention_mask, labels):
            """labels alone: T5's shifted decoder inputs and the mean cross-entropy over non-ignored labels."""
            model = RelPosForConditionalGeneration(config).to(torch_device).eval()
            with torch.no_grad():
                out = model(input_ids, attention_mask=attention_mask, labels=labels)
                shifted = model(input_ids, attention_mask=attention_mask,
                                decoder_input_ids=model.prepare_decoder_input_ids_from_labels(labels))
            expected = torch.nn.functional.cross_entropy(
                shifted.logits.reshape(-1, self.vocab_size), labels.reshape(-1), ignore_index=-100
            )
            self.parent.assertEqual(out.loss.dim(), 0)
            torch.testing.assert_close(out.logits, shifted.logits)
            torch.testing.assert_close(out.loss, expected, atol=1e-5, rtol=1e-5)

        def create_and_check_decoder_past(self, config, input_ids, attention_mask, decoder_input_ids):
            """Cached decoding of the target's last 3 tokens gives the logits of one uncached forward."""
            model = RelPosForConditionalGeneration(config).to(torch_device).eval()
            with torch.no_grad():
                encoder_outputs = model.get_encoder()(input_ids, attention_mask=attention_mask)
                full = model(encoder_outputs=encoder_outputs, attention_mask=attention_mask,
                             decoder_input_ids=decoder_input_ids, use_cache=False).logits
                past = model(encoder_outputs=encoder_outputs, attention_mask=attention_mask,
                             decoder_input_ids=decoder_input_ids[:, :-3], use_cache=True).past_key_values
                steps = []
                for i in range(self.decoder_seq_length - 3, self.decoder_seq_length):
                    out = model(encoder_outputs=encoder_outputs, attention_mask=attention_mask,
                                decoder_input_ids=decoder_input_ids[:, i : i + 1], past_key_values=past, use_cache=True)
                    past = out.past_key_values
                    steps.append(out.logits)
            torch.testing.assert_close(torch.cat(steps, dim=1), full[:, -3:], atol=1e-4, rtol=1e-4)

        def create_and_check_left_padding(self, config):
            """Left padding of the source and of a decoder prompt changes no logit, cached or not (upstream's
            test_left_padding_compatibility leaves encoder-decoders out). Absolute positions count from each
            row's first slot, as in BERT and BART (the seq2seq forward takes no position_ids): those schemes
            are not expected to pass."""
            if self.position_encoding in ("sinusoidal", "learned"):
                self.parent.skipTest("absolute positions count from each row's first slot, padding included")
            model = RelPosForConditionalGeneration(config).to(torch_device).eval()
            b, pad = self.batch_size, 3
            source = ids_tensor([b, self.encoder_seq_length], self.vocab_size - 3) + 3
            prompt = ids_tensor([b, 4], self.vocab_size - 3) + 3
            prompt[:, 0] = self.decoder_start_token_id

            def left_pad(ids):
                filler = torch.full((b, pad), self.pad_token_id, dtype=ids.dtype, device=ids.device)
                mask = torch.cat([torch.zeros_like(filler), torch.ones_like(ids)], dim=-1)
                return torch.cat([filler, ids], dim=-1), mask

            padded_source, source_mask = left_pad(source)
            padded_prompt, prompt_mask = left_pad(prompt)
            with torch.no_grad():
                expected = model(source, decoder_input_ids=prompt).logits[:, -1]
                both = model(padded_source, attention_mask=source_mask, decoder_input_ids=padded_prompt,
                             decoder_attention_mask=prompt_mask)
                past = model(padded_source, attention_mask=source_mask, decoder_input_ids=padded_prompt[:, :-1],
                             decoder_attention_mask=prompt_mask[:, :-1], use_cache=True).past_key_values
                step = model(padded_source, attention_mask=source_mask, decoder_input_ids=padded_prompt[:, -1:],
                             decoder_attention_mask=prompt_mask, past_key_values=past)
            torch.testing.assert_close(both.logits[:, -1], expected, atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(step.logits[:, -1], expected, atol=1e-4, rtol=1e-4)

        def create_and_check_static_cache_generate(self, config, input_ids, attention_mask):
            """generate with a StaticCache (which upstream's test_generate_with_static_cache skips for
            encoder-decoders) gives the tokens of a dynamic cache and of no cache; its self-attention part is
            sized by max length and the decoder's depth, its cross-attention part by the source."""
            config.eos_token_id = None  # generate every step: a longer sequence, nothing padded away
            model = RelPosForConditionalGeneration(config).to(torch_device).eval()
            kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=6, do_sample=False)
            static = model.generate(**kwargs, cache_implementation="static", return_dict_in_generate=True)
            self.parent.assertTrue(torch.equal(static.sequences, model.generate(**kwargs)))
            self.parent.assertTrue(torch.equal(static.sequences, model.generate(**kwargs, use_cache=False)))
            cache = static.past_key_values
            self.parent.assertIsInstance(cache.self_attention_cache, StaticCache)
            self.parent.assertEqual(len(cache.self_attention_cache.layers), self.num_decoder_layers)
            # every token but the last generated one has been through the decoder (a window keeps the latest)
            kept = static.sequences.shape[1] - 1
            kept = min(kept, config.sliding_window) if config.sliding_window else kept
            self.parent.assertEqual(cache.self_attention_cache.get_max_length(0), kept)
            cross_keys = cache.cross_attention_cache.layers[0].keys
            self.parent.assertEqual(tuple(cross_keys.shape),
                                    (self.batch_size, self.num_attention_heads, input_ids.shape[1], self.head_dim))

    # Class attributes that upstream model test classes set for tests that do not apply to a model.
    # Kept to the ones with a reason that holds for every scheme; anything else should fail and be fixed.
    _OPT_OUTS: dict = {
        # None so far. (PipelineTesterMixin is not mixed in: it needs a tokenizer/processor from the Hub.)
    }
    # Opt-ins: upstream runs test_can_init_all_missing_weights only for models whose modeling file carries a
    # "# Copyright 2023+" header (older models are grandfathered); ours has none but is new: run it.
    def _skipped(reason: str):
        """A test method that upstream's would be replaced by, skipped with ``reason`` (as upstream test classes
        override an inherited test that does not apply with ``@unittest.skip``)."""

        @unittest.skip(reason=reason)
        def test(self):
            pass

        return test

    # RelPosForConditionalGeneration only (the RelPosSeq2Seq*Test classes). It has T5's layout (shared, encoder,
    # decoder, lm_head): no base model under base_model_prefix, as T5ForConditionalGeneration, whose upstream test
    # skips test_model_base_model_prefix for that reason; its stacks are RelPosModel where T5's are T5Stack.
    _SEQ2SEQ_OPT_OUTS: dict = {
        "test_model_base_model_prefix": _skipped("T5's layout: no base model without a head (as upstream T5)"),
        "test_base_model_prefix_loads_base_weights": _skipped(
            "T5's layout: the encoder stack is a RelPosModel, not the head's base model (T5's stacks are T5Stack)"
        ),
    }
    _OPT_INS: dict = {"test_can_init_all_missing_weights_before_2023": True}

    # RELPOS_PROBE=1: also run the upstream tests that hf_relpos' own class flags switch off, by flipping
    # those flags in this test process only (the model files are not touched):
    # - `_can_compile_fullgraph` gates the StaticCache generation tests and test_custom_4d_attention_mask
    #   (and the torch.compile ones), although hf_relpos accepts a StaticCache and 4-D masks;
    # - `_supports_attention_backend` gates the padding-free (packed, position_ids) tests, although
    #   hf_relpos documents packed sequences.
    # - modeling_relpos.py's `from __future__ import annotations` leaves `**kwargs: Unpack[TransformersKwargs]`
    #   a string, so upstream's `_can_output_attn` (which reads that annotation) decides that the models
    #   cannot return attentions and skips test_eager_matches_sdpa_inference's output_attentions case:
    #   resolve the annotations of the four forwards.
    # Failures found this way are real (the model accepts those inputs) but upstream would not run them
    # for a model declaring these flags, so a probe run is reported apart from the plain run.
    if os.environ.get("RELPOS_PROBE") == "1":
        import inspect
        import typing

        from hf_relpos import RelPosPreTrainedModel

        RelPosPreTrainedModel._can_compile_fullgraph = True
        RelPosPreTrainedModel._supports_attention_backend = True
        for _model_class in (RelPosModel, RelPosForCausalLM, RelPosForSequenceClassification, RelPosForConditionalGeneration):
            _forward = inspect.unwrap(_model_class.forward)
            _forward.__annotations__ = typing.get_type_hints(_forward, include_extras=True)

    # Config variants, run when RELPOS_SCHEMES names them (or is "all"): settings that change what attention
    # sees (a memory / sliding window shorter than the tester's 7 tokens) or which parameters exist. With a
    # window shorter than the sequence, upstream's generate shape checks (attentions over all past keys, a
    # cache of every past token) fail by construction: upstream's own sliding-window models override them.
    _VARIANTS: dict = {
        "transformer_xl_mem4": ("transformer_xl", {"mem_len": 4}),  # sliding_window = mem_len + 1 = 5
        "t5_bias_window4": ("t5_bias", {"sliding_window": 4}),
        "rope_window4": ("rope", {"sliding_window": 4}),
        "shaw_keys_only": ("shaw", {"shaw_value_embeddings": False, "attention_bias": True, "tie_word_embeddings": False}),
        "transformer_xl_clamp2": ("transformer_xl", {"clamp_len": 2}),
        # the released Transformer-XL's architecture (from_transfo_xl): adaptive input and softmax (log-probability
        # logits), post-norm LayerNorm blocks without a final norm, an MLP with biases, same_length memory window
        "transfo_xl_released": ("transformer_xl", {
            "cutoffs": [30, 60], "div_val": 2, "norm_type": "layer_norm", "norm_position": "post", "final_norm": False,
            "mlp_bias": True, "mem_len": 4, "same_length": True, "dropout_placement": "transfo_xl", "hidden_act": "relu",
        }),
        "alibi_6heads": ("alibi", {"hidden_size": 48, "num_attention_heads": 6}),  # slopes for a non-power of 2
        "t5_bias_6heads": ("t5_bias", {"hidden_size": 48, "num_attention_heads": 6, "relative_attention_num_buckets": 6}),
        # seq2seq only: a decoder deeper than the encoder (3 and 2 layers), so that a swapped depth shows (generate
        # sizes its caches by the decoder's depth, through get_text_config(decoder=True)).
        "t5_bias_deep_decoder": ("t5_bias", {"num_decoder_layers": 3}),
    }
    _SEQ2SEQ_VARIANTS = ("t5_bias_deep_decoder",)
    # Per variant: upstream tests whose expectations the variant breaks by construction.
    _VARIANT_OPT_OUTS: dict = {
        # An adaptive input and softmax (cutoffs) has a table per cluster: no single nn.Embedding to get, set or
        # resize (resize_token_embeddings refuses in one line), and a vocab_size changed on the config object after
        # it was checked (test_load_with_mismatched_shapes) leaves clusters outside the vocabulary.
        "transfo_xl_released": {
            "test_resize_embeddings": False,
            "test_model_get_set_embeddings": _skipped("an adaptive input has one table per cluster, no nn.Embedding"),
            "test_load_with_mismatched_shapes": _skipped(
                "it sets vocab_size below the config's cutoffs after the config was checked"),
        },
        "t5_bias_deep_decoder": {
            # upstream counts the decoder's attentions and hidden states by num_hidden_layers, the encoder's depth
            # (our create_and_check_model counts each stack's)
            "test_attention_outputs": _skipped("upstream counts the decoder's layers by the encoder's depth"),
            "test_hidden_states_output": _skipped("upstream counts the decoder's layers by the encoder's depth"),
        },
    }

    def _class_stem(scheme: str) -> str:
        return "".join(part.capitalize() for part in scheme.split("_"))

    def _make_test_class(variant: str, mode: str):
        if mode == "seq2seq":
            return _make_seq2seq_test_class(variant)
        is_decoder = mode == "causal"
        scheme, overrides = _VARIANTS.get(variant, (variant, {}))
        mode = "Causal" if is_decoder else "Bidirectional"
        model_classes = (
            (RelPosModel, RelPosForCausalLM, RelPosForSequenceClassification)
            if is_decoder
            else (RelPosModel, RelPosForSequenceClassification)
        )
        # GenerationTesterMixin only where a class can generate: upstream's
        # test_generation_tester_mixin_inheritance requires exactly that. (With the stand-in, an empty class,
        # no generation test runs.)
        bases = (ModelTesterMixin,)
        if is_decoder:
            bases += (GenerationTesterMixin,)
        bases += (unittest.TestCase,)

        def setUp(self):
            self.model_tester = RelPosModelTester(
                self, position_encoding=scheme, is_decoder=is_decoder, config_overrides=overrides
            )
            self.config_tester = ConfigTester(self, config_class=RelPosConfig, **self.model_tester.config_kwargs())

        def test_config(self):
            self.config_tester.run_common_tests()

        def test_model(self):
            config, input_ids, attention_mask, _, _ = self.model_tester.prepare_config_and_inputs()
            self.model_tester.create_and_check_model(config, input_ids, attention_mask)

        def test_sequence_classification_model(self):
            config, input_ids, attention_mask, sequence_labels, _ = self.model_tester.prepare_config_and_inputs()
            self.model_tester.create_and_check_sequence_classification(config, input_ids, attention_mask, sequence_labels)

        namespace = {
            "__module__": __name__,
            "__qualname__": f"RelPos{mode}{_class_stem(variant)}Test",
            "all_model_classes": model_classes,
            "pipeline_model_mapping": {},
            "setUp": setUp,
            "test_config": test_config,
            "test_model": test_model,
            "test_sequence_classification_model": test_sequence_classification_model,
            **_OPT_OUTS,
            **_OPT_INS,
            **_VARIANT_OPT_OUTS.get(variant, {}),
        }
        if is_decoder:

            def test_causal_lm_model(self):
                config, input_ids, attention_mask, _, token_labels = self.model_tester.prepare_config_and_inputs()
                self.model_tester.create_and_check_causal_lm(config, input_ids, attention_mask, token_labels)

            def test_decoder_model_past(self):
                config, input_ids, attention_mask, _, _ = self.model_tester.prepare_config_and_inputs()
                self.model_tester.create_and_check_decoder_past(config, input_ids, attention_mask)

            namespace["test_causal_lm_model"] = test_causal_lm_model
            namespace["test_decoder_model_past"] = test_decoder_model_past
        return require_torch(type(namespace["__qualname__"], bases, namespace))

    def _make_seq2seq_test_class(variant: str):
        """RelPosForConditionalGeneration against ModelTesterMixin, GenerationTesterMixin and ConfigTester."""
        scheme, overrides = _VARIANTS.get(variant, (variant, {}))

        def setUp(self):
            self.model_tester = RelPosSeq2SeqModelTester(self, position_encoding=scheme, config_overrides=overrides)
            self.config_tester = ConfigTester(self, config_class=RelPosConfig, **self.model_tester.config_kwargs())

        def test_config(self):
            self.config_tester.run_common_tests()

        def test_model(self):
            config, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask, _ = (
                self.model_tester.prepare_config_and_inputs()
            )
            self.model_tester.create_and_check_model(
                config, input_ids, attention_mask, decoder_input_ids, decoder_attention_mask
            )

        def test_seq2seq_lm_loss(self):
            config, input_ids, attention_mask, _, _, labels = self.model_tester.prepare_config_and_inputs()
            self.model_tester.create_and_check_lm_loss(config, input_ids, attention_mask, labels)

        def test_decoder_model_past(self):
            config, input_ids, attention_mask, decoder_input_ids, _, _ = self.model_tester.prepare_config_and_inputs()
            self.model_tester.create_and_check_decoder_past(config, input_ids, attention_mask, decoder_input_ids)

        def test_left_padding_source_and_prompt(self):
            self.model_tester.create_and_check_left_padding(self.model_tester.get_config())

        def test_generate_with_static_cache_seq2seq(self):
            config, input_ids, attention_mask, _, _, _ = self.model_tester.prepare_config_and_inputs()
            self.model_tester.create_and_check_static_cache_generate(config, input_ids, attention_mask)

        namespace = {
            "__module__": __name__,
            "__qualname__": f"RelPosSeq2Seq{_class_stem(variant)}Test",
            "all_model_classes": (RelPosForConditionalGeneration,),
            "pipeline_model_mapping": {},
            "is_encoder_decoder": True,
            "setUp": setUp,
            "test_config": test_config,
            "test_model": test_model,
            "test_seq2seq_lm_loss": test_seq2seq_lm_loss,
            "test_decoder_model_past": test_decoder_model_past,
            "test_left_padding_source_and_prompt": test_left_padding_source_and_prompt,
            "test_generate_with_static_cache_seq2seq": test_generate_with_static_cache_seq2seq,
            **_OPT_OUTS,
            **_SEQ2SEQ_OPT_OUTS,
            **_VARIANT_OPT_OUTS.get(variant, {}),
            **_OPT_INS,
        }
        bases = (ModelTesterMixin, GenerationTesterMixin, unittest.TestCase)
        return require_torch(type(namespace["__qualname__"], bases, namespace))

    def _applies(variant: str, mode: str) -> bool:
        scheme, overrides = _VARIANTS.get(variant, (variant, {}))
        if mode == "seq2seq":
            # An encoder-decoder's encoder is bidirectional, and its config refuses a Transformer-XL memory.
            return scheme not in CAUSAL_ONLY and not overrides.get("mem_len")
        if variant in _SEQ2SEQ_VARIANTS:
            return False
        return mode == "causal" or scheme not in CAUSAL_ONLY  # a causal-only scheme's config refuses is_decoder=False

    def _selected(env: str, allowed, default=None) -> list:
        value = os.environ.get(env)
        if not value:
            return list(allowed if default is None else default)
        chosen = [v.strip() for v in value.split(",") if v.strip()]
        unknown = [v for v in chosen if v not in allowed]
        if unknown:
            raise ValueError(f"{env}: unknown {unknown}, choose among {list(allowed)}")
        return chosen

    _MODES = ("causal", "bidirectional", "seq2seq")
    _schemes = (*POSITION_ENCODINGS, *_VARIANTS) if os.environ.get("RELPOS_SCHEMES") == "all" else None
    # The default run adds the seq2seq-only variants (they apply to the seq2seq mode alone).
    _default = (*POSITION_ENCODINGS, *_SEQ2SEQ_VARIANTS)
    for _scheme in _schemes or _selected("RELPOS_SCHEMES", (*POSITION_ENCODINGS, *_VARIANTS), _default):
        for _mode in _selected("RELPOS_MODES", _MODES):
            if not _applies(_scheme, _mode):
                continue
            _test_class = _make_test_class(_scheme, _mode)
            globals()[_test_class.__name__] = _test_class
            del _test_class  # a module-level alias would be collected a second time
