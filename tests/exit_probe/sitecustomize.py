"""On PYTHONPATH only for the processes ``tests/test_distributed.py`` starts under torchrun.

Each rank (a process with ``RANK`` set, when ``HF_RELPOS_EXIT_PROBE`` names a folder) records, in the last
atexit callback, just before the interpreter finalizes, the names of the threads still alive (Linux
``/proc/self/task``): ``threads-rank<RANK>.json``. A gloo worker thread alive at that point can still take the
GIL to release a finished collective's tensors, and one that does so during finalization aborts the process
(SIGABRT): the test asserts that none is left. Any other ``sitecustomize`` on the path is run afterwards.
"""

import atexit
import json
import os
import sys


def _record_threads(path):
    try:
        tasks = os.listdir("/proc/self/task")
        names = sorted(open(f"/proc/self/task/{t}/comm").read().strip() for t in tasks)
    except OSError:
        names = None  # no /proc: nothing to check
    with open(path, "w") as f:
        json.dump(names, f)


if os.environ.get("HF_RELPOS_EXIT_PROBE") and os.environ.get("RANK") is not None:
    atexit.register(_record_threads,
                    os.path.join(os.environ["HF_RELPOS_EXIT_PROBE"], f"threads-rank{os.environ['RANK']}.json"))


def _chain():
    """Run the next ``sitecustomize`` on sys.path, if any (this one shadows it)."""
    import importlib.machinery
    import importlib.util

    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or ".") != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None and spec.loader is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


_chain()
