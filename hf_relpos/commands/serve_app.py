"""The app ``hf-relpos serve`` runs: Transformers' own server (``transformers serve``'s model manager, request
handlers, generation managers and FastAPI app from ``transformers.cli.serving``) with three changes: the model is
the folder's, loaded by hf_relpos (``transformers serve`` resolves ``transformers.<architectures[0]>``, which no
hf_relpos model is); an encoder-decoder's answer is its decoder's output; requests are checked before they
reach ``generate`` and errors have the OpenAI shape ``{"error": {"message", "type", "param", "code"}}``.

Imported only once the serving packages are known to be installed (``hf_relpos.commands.serve``).
"""

from __future__ import annotations

import functools
import math
import threading
import time

import torch

from fastapi import HTTPException
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler
from transformers.cli.serving.model_manager import ModelManager
from transformers.cli.serving.server import build_server
from transformers.cli.serving.utils import CBWorkerDeadError, GenerateManager, GenerationState

from .common import position_table

# transformers serve's routes that serve nothing for a text-only folder (responses, decisions, audio) or would
# load or drop models at a client's request (/load_model, /reset): answered 404.
DROPPED_ROUTES = ("/v1/responses", "/v1/systemone", "/v1/audio/transcriptions", "/load_model", "/reset")


# OpenAI's request fields that Transformers' handlers accept and ignore, with the values that ask for nothing
IGNORED_FIELDS = {"n": (None, 1), "best_of": (None, 1), "echo": (None, False), "logprobs": (None, False),
                  "top_logprobs": (None,), "presence_penalty": (None, 0), "logit_bias": (None, {})}


def _refuse(status: int, message: str, param: str | None = None, code: str | None = None):
    raise HTTPException(status_code=status, detail={"message": message, "param": param, "code": code})


class _Stopping(StoppingCriteria):
    """Every row done once ``event`` is set (the server shutting down): a ``generate`` still running ends with the
    tokens it has, instead of running on in its thread past the process' exit."""

    def __init__(self, event: threading.Event):
        self.event = event

    def __call__(self, input_ids, scores, **kwargs):
        return torch.full((input_ids.shape[0],), self.event.is_set(), dtype=torch.bool, device=input_ids.device)


def _generate_stoppable(generate, stopping: threading.Event):
    """``model.generate`` as the generation managers call it, plus a criterion that ends it once ``stopping`` is
    set (the server shutting down)."""

    @functools.wraps(generate)
    def wrapped(*args, stopping_criteria=None, **kwargs):
        stopping_criteria = StoppingCriteriaList([*(stopping_criteria or []), _Stopping(stopping)])
        return generate(*args, stopping_criteria=stopping_criteria, **kwargs)

    return wrapped


class FolderModelManager(ModelManager):
    """Transformers' model manager pinned to one model (``force_model``: a request naming another is refused),
    whose model and tokenizer are the ones hf_relpos loaded from the folder (no code from the folder runs)."""

    def __init__(self, name: str, model, tokenizer, stopping: threading.Event):
        model.generate = _generate_stoppable(model.generate, stopping)
        self._model, self._tokenizer, self._created = model, tokenizer, int(time.time())
        # model_timeout is ignored for a pinned model (never unloaded)
        super().__init__(device=str(model.device), dtype="auto", force_model=name)

    def _load_processor(self, model_id_and_revision, gguf_file=None):
        return self._tokenizer

    def _load_model(self, model_id_and_revision, tqdm_class=None, progress_callback=None, gguf_file=None):
        return self._model

    def list_models(self, cache_dir=None) -> list:
        """``/v1/models``: the served model alone (Transformers would list its Hub cache)."""
        return [{"id": self.force_model, "object": "model", "created": self._created, "owned_by": "hf-relpos"}]

    get_gen_models = list_models  # the name of list_models before Transformers 5.24


class _GenerateManager(GenerateManager):
    """An encoder-decoder's ``generate`` returns the decoder's sequence (its start token, then the answer); the
    prompt went to the encoder. Transformers cuts the prompt's length off the front, as for a decoder-only model."""

    async def generate_non_streaming(self, model, processor, inputs, gen_config, request_id):
        if not model.config.is_encoder_decoder:
            return await super().generate_non_streaming(model, processor, inputs, gen_config, request_id)
        sequences = await self.async_submit(model.generate, **inputs, generation_config=gen_config,
                                            tokenizer=processor)
        generated_ids = sequences[0, 1:]  # after decoder_start_token_id
        text = processor.decode(generated_ids, skip_special_tokens=True)
        return text, inputs["input_ids"].shape[-1], generated_ids


class FolderGenerationState(GenerationState):
    def get_manager(self, model_id: str, use_cb: bool = False):
        if not use_cb and model_id not in self._generate_managers:
            self._generate_managers[model_id] = _GenerateManager()
        return super().get_manager(model_id, use_cb=use_cb)


class _Checks:
    """What a request may ask, checked before Transformers' handler runs it: a 400 naming the field instead of a
    500 from ``generate`` (or a generation that runs past the model's position table)."""

    max_tokens_limit: int = 1024
    continuous_batching: bool = False
    token_fields = ("max_tokens",)

    def _check(self, body: dict) -> None:
        manager = self.model_manager
        model = body.get("model")
        # the answers name the model as Transformers does ("NAME@main"): a client may send that name back (which
        # Transformers' own check then refuses: it compares it with the name as given)
        if model is not None and not (isinstance(model, str) and manager.process_model_name(model)
                                      == manager.process_model_name(manager.force_model)):
            _refuse(404, f"The model {model!r} does not exist: this server serves {manager.force_model!r} "
                         "(see /v1/models)", "model", "model_not_found")
        if model is not None:
            body["model"] = manager.force_model
        for field in self.token_fields:
            value = body.get(field)
            if value is None:
                continue
            if type(value) is not int or value < 1:
                _refuse(400, f"{field} must be a positive integer, got {value!r}", field, "invalid_value")
            if value > self.max_tokens_limit:
                _refuse(400, f"{field} is {value}: this server generates at most {self.max_tokens_limit} tokens a "
                             "request (hf-relpos serve --max-tokens)", field, "invalid_value")
        for field, low, high in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0), ("frequency_penalty", -2.0, 2.0)):
            value = body.get(field)
            if value is None:
                continue
            if type(value) not in (int, float) or not math.isfinite(value) or not low <= value <= high:
                _refuse(400, f"{field} must be a number from {low:g} to {high:g}, got {value!r}", field, "invalid_value")
        if body.get("top_p") == 0:
            _refuse(400, "top_p must be > 0, got 0", "top_p", "invalid_value")
        if body.get("frequency_penalty") is not None and body["frequency_penalty"] <= -1:
            _refuse(400, f"frequency_penalty must be above -1 (it is generate's repetition_penalty - 1), got "
                         f"{body['frequency_penalty']!r}", "frequency_penalty", "invalid_value")
        # OpenAI's fields that Transformers' handlers ignore (a warning in the log): refused, not answered as if
        # absent (one choice for n=2, no logprobs, no echoed prompt)
        for field, allowed in IGNORED_FIELDS.items():
            if body.get(field) not in allowed:
                _refuse(400, f"{field} {body[field]!r} is not supported by hf-relpos serve (leave it out)", field,
                        "unsupported_value")
        if self.continuous_batching:
            # Transformers' continuous batching takes one generation config for all requests, the first one's: a
            # sampled first request would make every later greedy one sample (and a greedy one ignore later sampling)
            for field, asked in (("temperature", (body.get("temperature") or 0) > 0),
                                 ("top_p", body.get("top_p") not in (None, 1)),
                                 ("frequency_penalty", body.get("frequency_penalty") not in (None, 0))):
                if asked:
                    _refuse(400, f"{field} {body[field]!r}: with --continuous-batching this server answers greedily "
                                 "(Transformers' continuous batching shares one sampling setting among all requests); "
                                 "leave it out, or serve without --continuous-batching", field, "unsupported_value")
        if body.get("seed") is not None and type(body["seed"]) is not int:
            _refuse(400, f"seed must be an integer, got {body['seed']!r}", "seed", "invalid_value")
        if body.get("stream") is not None and type(body["stream"]) is not bool:
            _refuse(400, f"stream must be true or false, got {body['stream']!r}", "stream", "invalid_value")
        stop = body.get("stop")
        if stop is not None and not (isinstance(stop, str) or (
                isinstance(stop, list) and stop and all(isinstance(s, str) and s for s in stop))):
            _refuse(400, f"stop must be a string or a list of non-empty strings, got {stop!r}", "stop", "invalid_value")
        if body.get("generation_config") is not None:
            _refuse(400, "generation_config is not taken by hf-relpos serve: give max_tokens, temperature, top_p, "
                         "stop or seed", "generation_config", "invalid_value")

    def _fit(self, body: dict, prompt_length: int, field: str = "max_tokens", prompt: str = "prompt") -> None:
        """The tokens to generate: the request's, or the server's limit; within an absolute position table."""
        config = self.model_manager._model.config
        if prompt_length == 0:
            _refuse(400, "the prompt is empty: give some text", prompt, "invalid_value")
        asked = body.get(field)
        new_tokens = asked if asked is not None else self.max_tokens_limit
        table = position_table(config)
        if table is not None:
            # an encoder-decoder's prompt goes to the encoder, its answer (after the start token) to the decoder
            prompt_end, answer_end = ((prompt_length, 1 + new_tokens) if config.is_encoder_decoder
                                      else (prompt_length, prompt_length + new_tokens))
            scheme = config.position_encoding
            if prompt_end > table or (config.is_encoder_decoder and table < 2) or (
                    not config.is_encoder_decoder and prompt_end >= table):
                _refuse(400, f"the prompt is {prompt_length} tokens and the model's {scheme} position table holds "
                             f"{table} positions: give a shorter prompt", prompt, "context_length_exceeded")
            if answer_end > table:
                room = table - (1 if config.is_encoder_decoder else prompt_length)
                if asked is not None:
                    _refuse(400, f"{field} is {asked}: the model's {scheme} position table holds {table} positions, "
                                 f"room for {room} new tokens after this prompt of {prompt_length} tokens", field,
                            "context_length_exceeded")
                new_tokens = room
        body[field] = new_tokens


class FolderCompletionHandler(_Checks, CompletionHandler):
    async def handle_request(self, body: dict, request_id: str):
        self._validate_request(body)
        self._check(body)
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            _refuse(400, f"prompt must be a string, got {type(prompt).__name__}", "prompt", "invalid_value")
        if body.get("suffix") is not None and not isinstance(body["suffix"], str):
            _refuse(400, "suffix must be a string", "suffix", "invalid_value")
        tokenizer = self.model_manager._tokenizer
        self._fit(body, len(tokenizer(prompt)["input_ids"]))
        return await super().handle_request(body, request_id)

    def _build_generation_config(self, body, model_generation_config, use_cb=False):
        return _sampling(body, super()._build_generation_config(body, model_generation_config, use_cb=use_cb))


class FolderChatCompletionHandler(_Checks, ChatCompletionHandler):
    token_fields = ("max_tokens", "max_completion_tokens")

    async def handle_request(self, body: dict, request_id: str):
        self._validate_request(body)
        self._check(body)
        tokenizer = self.model_manager._tokenizer
        if not getattr(tokenizer, "chat_template", None):
            _refuse(400, f"the model {self.model_manager.force_model!r} has no chat template (its tokenizer has "
                         "none): send the text to /v1/completions instead", "messages", "no_chat_template")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), (str, list)) for m in messages):
            _refuse(400, "messages must be a non-empty list of {\"role\": ..., \"content\": ...} objects",
                    "messages", "invalid_value")
        if body.get("tools"):
            _refuse(400, "tools are not supported by hf-relpos serve", "tools", "invalid_value")
        try:
            inputs = self.get_processor_inputs_from_messages(messages, self.model_manager.get_model_modality(
                self.model_manager._model, processor=tokenizer))
            ids = tokenizer.apply_chat_template(inputs, add_generation_prompt=True, tokenize=True, return_dict=True)
        except Exception as error:  # noqa: BLE001 - a template's own error (jinja raise_exception, a missing key)
            _refuse(400, f"the chat template cannot render these messages: {' '.join(str(error).split())}",
                    "messages", "invalid_value")
        field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        self._fit(body, len(ids["input_ids"]), field, prompt="messages")
        return await super().handle_request(body, request_id)

    def _build_generation_config(self, body, model_generation_config, use_cb=False):
        return _sampling(body, super()._build_generation_config(body, model_generation_config, use_cb=use_cb))


def _sampling(body: dict, generation_config):
    """A request samples when it asks for a temperature above 0 (the folder's generation config is greedy);
    without one, or at 0, it is greedy."""
    temperature = body.get("temperature")
    generation_config.do_sample = temperature is not None and temperature > 0
    if not generation_config.do_sample:
        generation_config.temperature = generation_config.top_p = generation_config.top_k = None
    return generation_config


def _error(status: int, message: str, param=None, code=None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status)


async def _http_error(_request, exc: StarletteHTTPException):
    detail = exc.detail
    if isinstance(detail, dict):
        return _error(exc.status_code, detail.get("message", ""), detail.get("param"), detail.get("code"))
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return _error(exc.status_code, str(detail), code=code)


async def _validation_error(_request, exc: RequestValidationError):
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return _error(400, f"the request body is not valid JSON ({first.get('ctx', {}).get('error', 'JSON')})",
                      code="invalid_json")
    return _error(400, f"the request body must be a JSON object: {first.get('msg', 'invalid body')}",
                  code="invalid_value")


async def _cb_dead(_request, exc: CBWorkerDeadError):
    return _error(503, str(exc), code="cb_worker_dead")


async def _unexpected(_request, exc: Exception):
    return _error(500, f"{type(exc).__name__}: {' '.join(str(exc).split())}", code="internal_error")


def build_app(name: str, model, tokenizer, *, continuous_batching: bool = False, cb_config=None,
              max_tokens: int = 1024):
    """The FastAPI app of ``transformers serve`` for this model, and its generation state (to stop at exit)."""
    stopping = threading.Event()
    manager = FolderModelManager(name, model, tokenizer, stopping)
    state = FolderGenerationState(continuous_batching=continuous_batching, cb_config=cb_config)
    state.stopping = stopping  # set at shutdown: the generate calls still running end
    completion = FolderCompletionHandler(model_manager=manager, generation_state=state)
    chat = FolderChatCompletionHandler(model_manager=manager, generation_state=state)
    completion.max_tokens_limit = chat.max_tokens_limit = max_tokens
    completion.continuous_batching = chat.continuous_batching = continuous_batching
    app = build_server(manager, chat, completion_handler=completion, response_handler=None,
                       transcription_handler=None, systemone_handler=None, generation_state=state)
    app.router.routes = [r for r in app.router.routes if getattr(r, "path", None) not in DROPPED_ROUTES]
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(CBWorkerDeadError, _cb_dead)
    app.add_exception_handler(Exception, _unexpected)
    return app, state
