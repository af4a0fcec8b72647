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
