import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)

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
