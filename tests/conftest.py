import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
# Inductor compiles in this process instead of starting a pool of compile workers per test process: each
# pytest-xdist worker already has a core of its own (measured with a warm inductor cache: the compile tests of
# test_modeling 50 s instead of 54 s; not measured cold).
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# Remote code is copied into HF_MODULES_CACHE under the folder's base name; two test processes (pytest-xdist
# workers, or two runs) loading folders of the same name would write the same files at once. Each test process
# gets its own cache (its subprocesses inherit it), set before Transformers reads it at import, and removes it.
_MODULES = tempfile.mkdtemp(prefix=f"hf-relpos-tests-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}-modules-")
os.environ["HF_MODULES_CACHE"] = _MODULES
atexit.register(shutil.rmtree, _MODULES, ignore_errors=True)

import torch  # noqa: E402

torch.set_num_threads(1)
# The Triton kernel (attn_implementation="relpos_triton", with the optional extra installed): without a GPU it runs on
# CPU tensors through Triton's interpreter, which Triton reads when a kernel is defined, so this is set before
# anything imports Triton (importing torch does not). With a GPU the kernel and backend tests run the compiled
# kernels on it (their DEVICE); TRITON_INTERPRET=1 there runs the interpreter on CPU instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TESTS = os.path.dirname(os.path.abspath(__file__))
if os.environ.get("HF_RELPOS_TEST_INSTALLED"):
    # `make compat`: test the installed wheel, not the checkout (`python -m pytest` puts the checkout first).
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _ROOT]
    sys.path.insert(0, _TESTS)
    import hf_relpos  # noqa: E402

    if os.path.dirname(os.path.abspath(hf_relpos.__file__)) == os.path.join(_ROOT, "hf_relpos"):
        raise RuntimeError(f"HF_RELPOS_TEST_INSTALLED is set but hf_relpos comes from the checkout: {hf_relpos.__file__}")
    print(f"testing the installed hf_relpos: {os.path.dirname(hf_relpos.__file__)}")
else:
    for _p in (_ROOT, _TESTS):
        if _p not in sys.path:
            sys.path.insert(0, _p)

# Shared fixtures over the builders of tiny.py (imported here, after sys.path holds the tests folder).
import pytest  # noqa: E402
import tiny  # noqa: E402

from hf_relpos import POSITION_ENCODINGS  # noqa: E402


@pytest.fixture
def tiny_config():
    """``tiny_config(scheme, preset="default", **overrides)``: a tiny RelPosConfig (presets in tiny.PRESETS)."""
    return tiny.tiny_config


@pytest.fixture
def make_model():
    """``make_model(cls, scheme, impl=None, seed=0, preset="default", **overrides)``: a tiny model in eval mode."""
    return tiny.make_model


@pytest.fixture(params=POSITION_ENCODINGS)
def scheme(request):
    """Every position encoding, one test per scheme (a test's own ``parametrize("scheme", ...)`` overrides it)."""
    return request.param


# ---------------------------------------------------------------------------
# The marker `transformers_dependent`: what `make compat` runs against the oldest supported Transformers
# ---------------------------------------------------------------------------

# Modules that test behaviour reached through a Transformers API that changes between releases: generation and
# caches, continuous batching, the encoder-decoder, Trainer (callbacks, checkpoints, DDP, FSDP) and the commands
# that train and generate through it, the exporters, serving, remote code, loading and the Auto classes, the
# config, and the models' forward through Transformers' attention interface and masks. `make compat` runs every
# test against the newest tested Transformers and these (`-m transformers_dependent`) against the oldest.
TRANSFORMERS_DEPENDENT = {
    "test_attention_backends", "test_attention_scale", "test_auto_classes", "test_checkpoints", "test_cli", "test_cli_safety", "test_compat",
    "test_configuration_relpos", "test_continuous_batching", "test_corpus", "test_distributed", "test_empty_shapes",
    "test_export", "test_export_tools", "test_faults", "test_flex_attention", "test_fox", "test_fsdp", "test_generation",
    "test_inspect",
    "test_integration", "test_lengthgen", "test_loading_safety", "test_memory", "test_model_card", "test_modeling",
    "test_modeling_fuzz", "test_nothing_lost", "test_position_context", "test_position_schemes", "test_reliability",
    "test_position_lr", "test_seq2seq", "test_serve", "test_t5_init", "test_t5_per_layer", "test_training_limits", "test_transformers_behaviour",
    "test_transfo_xl_conversion", "test_transfo_xl_vocab", "test_triton_backend",
}
# The rest, run on the development pin and the newest: the math and its CPU kernels against float64 oracles
# (Transformers only as a fixed reference: T5's bucket function, BLOOM's ALiBi), the worked example, the import
# graph, packaging, and the documentation pages (whose commands the modules above run on the oldest too).
TRANSFORMERS_INDEPENDENT = {
    "test_attention_with_bias", "test_bench", "test_bench_gpu", "test_bias_band", "test_check_site", "test_denormals", "test_demo_biases", "test_distance_bias", "test_docs",
    "test_functional",
    "test_functional_fuzz", "test_gpu_check", "test_import_graph", "test_kernels", "test_key_bias", "test_lengthgen_ablation", "test_packaging",
    "test_shaw_banded", "test_transfo_xl_fixtures", "test_triton_aot", "test_triton_attention", "test_txl_chunked",
}


def pytest_configure(config):
    """A test module in neither set stops the run with one line (here, in the controlling process: a pytest-xdist
    worker's error would be an INTERNALERROR traceback)."""
    if hasattr(config, "workerinput"):
        return
    modules = {path.stem for path in Path(_TESTS).glob("test_*.py")}
    unsorted = sorted(modules - TRANSFORMERS_DEPENDENT - TRANSFORMERS_INDEPENDENT)
    if unsorted:
        raise pytest.UsageError(
            f"tests/conftest.py: {', '.join(unsorted)} in neither TRANSFORMERS_DEPENDENT nor TRANSFORMERS_INDEPENDENT: "
            "say whether the oldest Transformers must run it"
        )


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.stem in TRANSFORMERS_DEPENDENT:
            item.add_marker(pytest.mark.transformers_dependent)
