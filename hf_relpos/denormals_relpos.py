"""Denormal floats flushed to zero on every intra-op thread, for the duration of a CPU attention kernel.

A relative bias that decays with distance (ALiBi's ``-m·|i-j|``, FoX's forget gates) drives the softmax weights of
far keys to ``exp(-87) .. exp(-104)``: float32 denormals, which x86 cores compute with microcode assists, up to
about 100 times slower than normal numbers. On an AVX-512 Xeon the fused kernel's forward + backward with ALiBi's
bias took 2.5 times as long as without a bias, 1.16 times with denormals flushed (``scripts/bench_denormals.py``), and
the causal ALiBi model 1.67 times rope's (the floor), 0.99 flushed (``results/bench-cpu-avx512.md``;
``docs/guides/performance.md``). Flushing changes nothing
above about ``1.2e-38`` in absolute value (float32's smallest normal number; float64's is far smaller): a denormal
input or result becomes 0.

The flush is the x86 MXCSR's FTZ and DAZ bits, a per-thread setting: ``torch.set_flush_denormal`` sets it on the
calling thread alone, while ATen's kernels also run on its OpenMP workers. :func:`flush_denormals` sets both bits on
every thread of the calling thread's OpenMP team (one ``GOMP_parallel`` of glibc's ``fesetenv``), and after it
sets each thread's own previous state again (saved by its number in the team before). A compiled graph
(``torch.compile``) calls the kernels without it: wrap a compiled step in ``flush_denormals()`` for the same speed. It does nothing (a no-op context) where that cannot be done as written: not Linux on
x86-64 with glibc, ATen not on OpenMP, or inside a ``torch.compile`` trace (which must not see host calls).

Flat module (remote code copies it beside ``modeling_relpos.py``): no Transformers, no relative imports.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import platform
import sys

import torch

__all__ = ["flush_denormals", "flushing_backward", "flushing_denormals", "supported"]

_FENV_BYTES = 32  # glibc's fenv_t on x86-64: the x87 environment (28 bytes), then MXCSR
_MXCSR_AT = 28
_FTZ_DAZ = 0x8000 | 0x0040  # MXCSR bit 15: flush results to zero; bit 6: treat denormal inputs as zero


@functools.lru_cache(maxsize=None)
def _runtime():
    """``(libc, GOMP_parallel, fesetenv's address, omp_get_thread_num)`` where the flush can be done, else None."""
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64") or platform.libc_ver()[0] != "glibc":
        return None
    if "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        libc = ctypes.CDLL(None)  # the process's symbols: glibc's, and libgomp's (loaded by torch)
        parallel, fesetenv, fegetenv, thread_num = libc.GOMP_parallel, libc.fesetenv, libc.fegetenv, libc.omp_get_thread_num
    except (AttributeError, OSError):
        return None
    parallel.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint, ctypes.c_uint]
    parallel.restype = None
    fegetenv.argtypes = [ctypes.c_void_p]
    fesetenv.argtypes = [ctypes.c_void_p]
    thread_num.restype = ctypes.c_int
    return libc, parallel, ctypes.cast(fesetenv, ctypes.c_void_p), thread_num


def supported() -> bool:
    """Whether :func:`flush_denormals` flushes here (else it is a no-op)."""
    return _runtime() is not None


_EACH_THREAD = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


@contextlib.contextmanager
def _flushed(runtime):
    libc, parallel, fesetenv, thread_num = runtime
    threads = torch.get_num_threads()  # the team ATen's parallel regions use from this thread
    previous = [ctypes.create_string_buffer(_FENV_BYTES) for _ in range(threads)]

    @_EACH_THREAD
    def save(_):  # each thread's own environment, by its number in the team
        libc.fegetenv(previous[thread_num()])

    @_EACH_THREAD
    def restore(_):
        libc.fesetenv(previous[thread_num()])

    parallel(ctypes.cast(save, ctypes.c_void_p), None, threads, 0)
    flushed = ctypes.create_string_buffer(previous[0].raw, _FENV_BYTES)
    mxcsr = int.from_bytes(previous[0].raw[_MXCSR_AT:_FENV_BYTES], "little") | _FTZ_DAZ
    ctypes.memmove(ctypes.addressof(flushed) + _MXCSR_AT, mxcsr.to_bytes(4, "little"), 4)
    parallel(fesetenv, ctypes.addressof(flushed), threads, 0)
    try:
        yield
    finally:
        parallel(ctypes.cast(restore, ctypes.c_void_p), None, threads, 0)


def flush_denormals():
    """A context in which float denormals are flushed to zero on this thread and its OpenMP workers."""
    if torch.compiler.is_compiling():  # first: a trace must not step into the ctypes below
        return contextlib.nullcontext()
    runtime = _runtime()
    return contextlib.nullcontext() if runtime is None else _flushed(runtime)


def flushing_denormals(function):
    """``function`` run under :func:`flush_denormals` (for an autograd Function's ``forward`` and ``backward``)."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with flush_denormals():
            return function(*args, **kwargs)

    return wrapper


def flushing_backward(backward):
    """An autograd Function's ``backward(ctx, saved, *grads)`` as ``backward(ctx, *grads)``: ``ctx.saved_tensors``
    unpacked first (a checkpointed layer recomputes its forward there, as it first ran), the rest under
    :func:`flush_denormals`."""

    @functools.wraps(backward)
    def wrapper(ctx, *grads):
        saved = ctx.saved_tensors
        with flush_denormals():
            return backward(ctx, saved, *grads)

    return wrapper
