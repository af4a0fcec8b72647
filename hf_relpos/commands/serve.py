"""``hf-relpos serve``: a trained folder behind an OpenAI-compatible HTTP server, Transformers' own (the app is
built in :mod:`.serve_app`), run by uvicorn on a socket this command binds."""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import socket
import sys

from .common import load_folder, one_line
from .errors import UserError

SERVING_PACKAGES = ("fastapi", "uvicorn", "openai", "pydantic")
CB_OPTIONS = ("cb_block_size", "cb_num_blocks", "cb_max_batch_tokens", "cb_max_memory_percent")
CPU_CACHE_MEMORY = 0.1  # the paged cache's share of a CPU machine's free memory, unless --cb-* says otherwise
# transformers.cli.serving's ModelManager, handlers and build_server: first tested on 5.21 (the oldest supported)
SERVING_TRANSFORMERS = "5.21"


def check_serving() -> None:
    """The serving packages (the ``serve`` extra) and Transformers' serving components, or one line."""
    import importlib.util

    import transformers

    missing = [name for name in SERVING_PACKAGES if importlib.util.find_spec(name) is None]
    if missing:
        raise UserError(f"needs the serving packages ({', '.join(missing)} missing): pip install 'hf_relpos[serve]'")
    try:
        from transformers.cli.serving import server  # noqa: F401
        from transformers.cli.serving.completion import CompletionHandler  # noqa: F401
    except ImportError as error:
        raise UserError(f"needs Transformers' serving components (transformers.cli.serving, Transformers >= "
                        f"{SERVING_TRANSFORMERS}); Transformers {transformers.__version__} has none ({one_line(error)})"
                        ) from error


def _device(given: str):
    import torch

    if given == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(given)
    except (RuntimeError, ValueError):
        raise UserError(f"--device {given!r} is not a device: give auto, cpu, cuda, cuda:N or mps") from None
    available = {"cpu": True, "cuda": torch.cuda.is_available(), "mps": torch.backends.mps.is_available()}
    if not available.get(device.type, False):
        raise UserError(f"--device {given!r}: no {device.type} device here (give auto or cpu)")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise UserError(f"--device {given!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that a taken port or a wrong host is one line, not uvicorn's log."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as error:
        raise UserError(f"--host {host!r} cannot be resolved ({error.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as error:
        sock.close()
        if error.errno == errno.EADDRINUSE:
            raise UserError(f"--port {port} is already in use on {host}: give another port (--port 0 picks a free "
                            "one)") from None
        if error.errno == errno.EADDRNOTAVAIL:
            raise UserError(f"--host {host!r} is not an address of this machine") from None
        raise UserError(f"cannot listen on {host}:{port} ({error.strerror or one_line(error)})") from None
    sock.listen(2048)  # clients that connect before uvicorn accepts (right after the printed line) wait, not fail
    return sock


def exposure_warning(host: str) -> str | None:
    """A warning for a listening address other machines can reach: the server has no authentication."""
    import ipaddress

    try:
        loopback = ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        loopback = False
    if loopback:
        return None
    return (f"hf-relpos serve: warning: listening on {host}, which other machines may reach; the server has no "
            "authentication (the default --host 127.0.0.1 serves this machine only)")


def serve_command(args) -> int:
    given = [f"--{k.replace('_', '-')}" for k in CB_OPTIONS
             if getattr(args, k) is not None]
    if given and not args.continuous_batching:
        raise UserError(f"{given[0]} sets continuous batching's paged cache: give it with --continuous-batching")
    check_serving()
    import torch
    from transformers import GenerationConfig

    from ..inputs_relpos import continuous_batching_refusal

    device = _device(args.device)
    model, tokenizer = load_folder(args.folder, encoder_decoder=True)
    config = model.config
    refusal = continuous_batching_refusal(config) if args.continuous_batching else None
    if refusal:  # an encoder-decoder, Transformer-XL with memory
        raise UserError(f"--continuous-batching: the model in {args.folder!r} cannot take part ({refusal}); serve it "
                        "without --continuous-batching (one generate call at a time)")
    if args.dtype != "auto":
        model = model.to(getattr(torch, args.dtype))
    model = model.to(device)
    # The command's settings, as `hf-relpos generate`'s: greedy unless a request asks for a temperature
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        decoder_start_token_id=config.decoder_start_token_id if config.is_encoder_decoder else None,
    )
    name = args.model_name or _default_name(args.folder)

    import uvicorn

    from .serve_app import build_app

    cb_config = None
    cb = {name[len("cb_"):]: getattr(args, name) for name in CB_OPTIONS}
    sized = cb["num_blocks"] is not None or cb["max_memory_percent"] is not None
    if args.continuous_batching and device.type == "cpu" and not sized:
        # Transformers sizes the paged cache to 90% of the machine's memory on a CPU (of the GPU's on a GPU)
        cb["max_memory_percent"] = CPU_CACHE_MEMORY
    if any(v is not None for v in cb.values()):
        from transformers import ContinuousBatchingConfig

        cb_config = ContinuousBatchingConfig(**{k: v for k, v in cb.items() if v is not None})
    app, state = build_app(name, model, tokenizer, continuous_batching=args.continuous_batching, cb_config=cb_config,
                           max_tokens=args.max_tokens)
    sock = _bind(args.host, args.port)
    host, port = sock.getsockname()[:2]
    warning = exposure_warning(host)
    if warning:
        print(warning, file=sys.stderr, flush=True)
    shown = f"[{host}]" if ":" in host else host
    kind = "encoder-decoder, " if config.is_encoder_decoder else ""
    batching = "continuous batching" if args.continuous_batching else "one request at a time"
    print(f"hf-relpos serve: {name} ({kind}{config.position_encoding}, {device}, {batching}) at "
          f"http://{shown}:{port}/v1 (Ctrl-C stops)", flush=True)
    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None):
            # the requests still generating a second before uvicorn's graceful wait ends are cut there (answered
            # with the tokens they have) rather than cancelled with their generate still running in its thread
            def stop_generating():
                state.stopping.set()
                state.shutdown()

            later = asyncio.get_running_loop().call_later(max(self.config.timeout_graceful_shutdown - 1, 0),
                                                          stop_generating)
            await super().shutdown(sockets)
            later.cancel()
            # continuous batching's worker stopped while the event loop it hands tokens to is still open (after
            # it closed, the worker raised there and the process waited for it)
            state.shutdown()

    server = Server(uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5))
    # a request still running 5 s after Ctrl-C is cancelled: uvicorn's one line says so, not the traceback too
    cancelled = _DropCancelled()
    logging.getLogger("uvicorn.error").addFilter(cancelled)
    # uvicorn shuts down on SIGINT and SIGTERM, then raises the signal again once it has stopped: SIGTERM's default
    # would end the process there, before the lines below
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        server.run(sockets=[sock])
    except (KeyboardInterrupt, _Terminated):
        pass
    finally:
        signal.signal(signal.SIGTERM, previous)
        logging.getLogger("uvicorn.error").removeFilter(cancelled)
        state.shutdown()
        sock.close()
    print("hf-relpos serve: stopped", file=sys.stderr, flush=True)
    return 0


class _Terminated(Exception):
    pass


def _terminated(signum, frame):
    raise _Terminated


class _DropCancelled(logging.Filter):
    def filter(self, record):
        return not (record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError))


def _default_name(folder: str) -> str:
    from pathlib import Path

    return Path(folder).resolve().name
