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


def _engine_server() -> bool:
    """Whether the installed Transformers runs each model in a process of its own (5.25's ``ModelLoader``)."""
    from transformers.cli.serving import model_manager

    return hasattr(model_manager, "ModelLoader")


def _cache_config(args, config, device):
    """Continuous batching's paged cache: the ``--cb-*`` options, and unless one of them sets a budget, sized for
    ``CONCURRENT_REQUESTS`` requests of the longest the server takes (a position table's size, else the config's
    ``max_position_embeddings``) instead of Transformers' share of the machine's free memory. Returns the
    configuration and how many tokens the whole cache holds (None: a share of memory, known only once allocated)."""
    from transformers import ContinuousBatchingConfig

    from ..generation_relpos import size_paged_cache
    from .common import position_table

    given = {name[len("cb_"):]: getattr(args, name) for name in CB_OPTIONS if getattr(args, name) is not None}
    if "block_size" in given:  # Transformers' page_size (block_size is its name before 5.17)
        given["page_size"] = given.pop("block_size")
    longest = position_table(config) or config.max_position_embeddings
    cb_config = size_paged_cache(ContinuousBatchingConfig(**given), None, longest, device)
    tokens = cb_config.num_blocks * cb_config.page_size if cb_config.num_blocks is not None else None
    return cb_config, tokens


def serve_command(args) -> int:
    given = [f"--{k.replace('_', '-')}" for k in CB_OPTIONS
             if getattr(args, k) is not None]
    if given and not args.continuous_batching:
        raise UserError(f"{given[0]} sets continuous batching's paged cache: give it with --continuous-batching")
    check_serving()
    import torch

    from ..inputs_relpos import continuous_batching_refusal

    device = _device(args.device)
    model, tokenizer = load_folder(args.folder, encoder_decoder=True)  # every check of the folder, before binding
    config = model.config
    refusal = continuous_batching_refusal(config) if args.continuous_batching else None
    if refusal:  # an encoder-decoder, Transformer-XL with memory
        raise UserError(f"--continuous-batching: the model in {args.folder!r} cannot take part ({refusal}); serve it "
                        "without --continuous-batching (one generate call at a time)")
    # The command's settings, as `hf-relpos generate`'s: greedy unless a request asks for a temperature
    generation = dict(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                      decoder_start_token_id=config.decoder_start_token_id if config.is_encoder_decoder else None)
    name = args.model_name or _default_name(args.folder)
    cb_config, cache_tokens = _cache_config(args, config, device) if args.continuous_batching else (None, None)

    import uvicorn

    from .serve_requests import Served

    served = Served(name, config, tokenizer, max_tokens=args.max_tokens, continuous_batching=args.continuous_batching,
                    cache_tokens=cache_tokens)
    sock = _bind(args.host, args.port)  # a taken port is one line before the model process starts
    if _engine_server():
        from .serve_app import build_app

        del model  # the model process loads its own
        try:
            app, stopper = build_app(served, str(args.folder), device=str(device), dtype=args.dtype,
                                     generation=generation, cb_config=cb_config)
        except RuntimeError as error:  # the model process failed to load or start
            sock.close()
            raise UserError(f"the model process could not start: {one_line(error)}") from error
    else:
        from transformers import GenerationConfig

        from .serve_app_524 import build_app

        if args.dtype != "auto":
            model = model.to(getattr(torch, args.dtype))
        model = model.to(device)
        model.generation_config = GenerationConfig(**generation)
        app, stopper = build_app(served, model, cb_config=cb_config)
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
            later = asyncio.get_running_loop().call_later(max(self.config.timeout_graceful_shutdown - 1, 0),
                                                          stopper.stop_generating)
            await super().shutdown(sockets)
            later.cancel()
            # continuous batching's worker (or the model process) stopped while the event loop it hands tokens to
            # is still open (after it closed, the worker raised there and the process waited for it)
            stopper.shutdown()

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
        stopper.shutdown()
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
