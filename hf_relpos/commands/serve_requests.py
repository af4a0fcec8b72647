"""What ``hf-relpos serve`` checks in a request before Transformers' handler runs it, and how its errors look, the
same on every Transformers server (5.21-5.24's in-process generation managers, :mod:`.serve_app_524`; 5.25's model
process, :mod:`.serve_app`): a 400 naming the field instead of a 500 from ``generate`` (or a generation that runs
past the model's position table), errors in OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.

Imported only once the serving packages are known to be installed (``hf_relpos.commands.serve``).
"""

from __future__ import annotations

import math

from fastapi import HTTPException
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .common import position_table

# transformers serve's routes that serve nothing for a text-only folder (responses, decisions, audio) or would
# load or drop models at a client's request (/load_model, /reset): answered 404.
DROPPED_ROUTES = ("/v1/responses", "/v1/systemone", "/v1/audio/transcriptions", "/load_model", "/reset")

# OpenAI's request fields that Transformers' handlers accept and ignore, with the values that ask for nothing
IGNORED_FIELDS = {"n": (None, 1), "best_of": (None, 1), "echo": (None, False), "logprobs": (None, False),
                  "top_logprobs": (None,), "presence_penalty": (None, 0), "logit_bias": (None, {})}


# apply_chat_template's own arguments, which the handlers set: a request's chat_template_kwargs may not
RESERVED_TEMPLATE_KEYS = frozenset({"add_generation_prompt", "tokenize", "return_dict", "return_tensors", "tools",
                                    "conversation", "chat_template", "continue_final_message"})


def refuse(status: int, message: str, param: str | None = None, code: str | None = None):
    raise HTTPException(status_code=status, detail={"message": message, "param": param, "code": code})


class Served:
    """What the checks need to know of the served model: its name, config and tokenizer, the most tokens a request
    may generate (``--max-tokens``), whether requests are batched continuously, and how many tokens the whole
    paged cache holds (None: no continuous batching, or a budget given as a share of memory)."""

    def __init__(self, name: str, config, tokenizer, *, max_tokens: int, continuous_batching: bool,
                 cache_tokens: int | None = None):
        self.name, self.config, self.tokenizer = name, config, tokenizer
        self.max_tokens, self.continuous_batching, self.cache_tokens = max_tokens, continuous_batching, cache_tokens
        self.per_request_sampling = False  # continuous batching samples per request (set by the 5.25 app)

    def same_model(self, given) -> bool:
        """A request's ``model``: the served name, or the name an answer carries (``NAME@main``, Transformers')."""
        return isinstance(given, str) and given in (self.name, f"{self.name}@main")


class RequestChecks:
    """Mixed into Transformers' completion and chat handlers: ``served`` is set by the app builder."""

    served: Served
    token_fields = ("max_tokens",)

    def check(self, body: dict) -> None:
        served = self.served
        model = body.get("model")
        if model is not None and not served.same_model(model):
            refuse(404, f"The model {model!r} does not exist: this server serves {served.name!r} (see /v1/models)",
                   "model", "model_not_found")
        if model is not None:
            body["model"] = served.name
        for field in self.token_fields:
            value = body.get(field)
            if value is None:
                continue
            if type(value) is not int or value < 1:
                refuse(400, f"{field} must be a positive integer, got {value!r}", field, "invalid_value")
            if value > served.max_tokens:
                refuse(400, f"{field} is {value}: this server generates at most {served.max_tokens} tokens a "
                            "request (hf-relpos serve --max-tokens)", field, "invalid_value")
        for field, low, high in (("temperature", 0.0, 2.0), ("top_p", 0.0, 1.0), ("frequency_penalty", -2.0, 2.0)):
            value = body.get(field)
            if value is None:
                continue
            if type(value) not in (int, float) or not math.isfinite(value) or not low <= value <= high:
                refuse(400, f"{field} must be a number from {low:g} to {high:g}, got {value!r}", field, "invalid_value")
        if body.get("top_p") == 0:
            refuse(400, "top_p must be > 0, got 0", "top_p", "invalid_value")
        if body.get("frequency_penalty") is not None and body["frequency_penalty"] <= -1:
            refuse(400, f"frequency_penalty must be above -1 (it is generate's repetition_penalty - 1), got "
                        f"{body['frequency_penalty']!r}", "frequency_penalty", "invalid_value")
        # OpenAI's fields that Transformers' handlers ignore (a warning in the log): refused, not answered as if
        # absent (one choice for n=2, no logprobs, no echoed prompt)
        for field, allowed in IGNORED_FIELDS.items():
            if body.get(field) not in allowed:
                refuse(400, f"{field} {body[field]!r} is not supported by hf-relpos serve (leave it out)", field,
                       "unsupported_value")
        if served.continuous_batching:
            # Transformers' continuous batching takes one sampling setting for all requests, the first one's
            # (5.21-5.24), or per request temperature, top-k and top-p alone (5.25): what it cannot take per request
            # is refused rather than applied to the other requests or ignored
            asks = {"frequency_penalty": body.get("frequency_penalty") not in (None, 0)}
            if not served.per_request_sampling:
                asks = {"temperature": (body.get("temperature") or 0) > 0, "top_p": body.get("top_p") not in (None, 1),
                        **asks}
            for field, asked in asks.items():
                if asked:
                    refuse(400, f"{field} {body[field]!r} is not taken per request with --continuous-batching on "
                                "this Transformers; leave it out, or serve without --continuous-batching", field,
                           "unsupported_value")
        if body.get("seed") is not None and type(body["seed"]) is not int:
            refuse(400, f"seed must be an integer, got {body['seed']!r}", "seed", "invalid_value")
        if body.get("stream") is not None and type(body["stream"]) is not bool:
            refuse(400, f"stream must be true or false, got {body['stream']!r}", "stream", "invalid_value")
        stop = body.get("stop")
        if stop is not None and not ((isinstance(stop, str) and stop) or (
                isinstance(stop, list) and stop and all(isinstance(s, str) and s for s in stop))):
            refuse(400, f"stop must be a non-empty string or a list of non-empty strings, got {stop!r}", "stop",
                   "invalid_value")
        options = body.get("stream_options")
        if options is not None and not (isinstance(options, dict) and set(options) <= {"include_usage"}
                                        and isinstance(options.get("include_usage", False), bool)):
            refuse(400, f"stream_options must be an object {{\"include_usage\": true or false}}, got {options!r}",
                   "stream_options", "invalid_value")
        template = body.get("chat_template_kwargs")
        if template is not None and not (isinstance(template, dict) and not set(template) & RESERVED_TEMPLATE_KEYS):
            refuse(400, "chat_template_kwargs must be an object of the template's own variables (not "
                        f"{', '.join(sorted(RESERVED_TEMPLATE_KEYS))}), got {template!r}", "chat_template_kwargs",
                   "invalid_value")
        if body.get("generation_config") is not None:
            refuse(400, "generation_config is not taken by hf-relpos serve: give max_tokens, temperature, top_p, "
                        "stop or seed", "generation_config", "invalid_value")
        if body.get("stream") and body.get("stream_options") is None:
            body["stream_options"] = {"include_usage": True}  # the closing usage chunk, as every version sends it

    def fit(self, body: dict, prompt_length: int, field: str = "max_tokens", prompt: str = "prompt") -> None:
        """The tokens to generate: the request's, or the server's limit; within an absolute position table (the only
        end a scheme has: relative ones have none) and within the whole paged cache."""
        config = self.served.config
        if prompt_length == 0:
            refuse(400, "the prompt is empty: give some text", prompt, "invalid_value")
        asked = body.get(field)
        new_tokens = asked if asked is not None else self.served.max_tokens
        table = position_table(config)
        if table is not None:
            # an encoder-decoder's prompt goes to the encoder, its answer (after the start token) to the decoder
            prompt_end, answer_end = ((prompt_length, 1 + new_tokens) if config.is_encoder_decoder
                                      else (prompt_length, prompt_length + new_tokens))
            scheme = config.position_encoding
            if prompt_end > table or (config.is_encoder_decoder and table < 2) or (
                    not config.is_encoder_decoder and prompt_end >= table):
                refuse(400, f"the prompt is {prompt_length} tokens and the model's {scheme} position table holds "
                            f"{table} positions: give a shorter prompt", prompt, "context_length_exceeded")
            if answer_end > table:
                room = table - (1 if config.is_encoder_decoder else prompt_length)
                if asked is not None:
                    refuse(400, f"{field} is {asked}: the model's {scheme} position table holds {table} positions, "
                                f"room for {room} new tokens after this prompt of {prompt_length} tokens", field,
                           "context_length_exceeded")
                new_tokens = room
        cache = self.served.cache_tokens
        if cache is not None and prompt_length + new_tokens > cache:
            refuse(400, f"the prompt of {prompt_length} tokens and {new_tokens} new ones need {prompt_length + new_tokens}"
                        f" tokens of paged cache, which holds {cache} (hf-relpos serve --cb-num-blocks)",
                   prompt if asked is None else field, "context_length_exceeded")
        body[field] = new_tokens

    def check_chat(self, body: dict, modality) -> int:
        """A chat request's messages, rendered by the tokenizer's template: its prompt length (or a 400)."""
        tokenizer = self.served.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            refuse(400, f"the model {self.served.name!r} has no chat template (its tokenizer has none): send the "
                        "text to /v1/completions instead", "messages", "no_chat_template")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), (str, list)) for m in messages):
            refuse(400, "messages must be a non-empty list of {\"role\": ..., \"content\": ...} objects",
                   "messages", "invalid_value")
        if body.get("tools"):
            refuse(400, "tools are not supported by hf-relpos serve", "tools", "invalid_value")
        try:
            inputs = self.get_processor_inputs_from_messages(messages, modality)
            ids = tokenizer.apply_chat_template(inputs, add_generation_prompt=True, tokenize=True, return_dict=True,
                                                **(body.get("chat_template_kwargs") or {}))
        except Exception as error:  # noqa: BLE001 - a template's own error (jinja raise_exception, a missing key)
            refuse(400, f"the chat template cannot render these messages: {' '.join(str(error).split())}",
                   "messages", "invalid_value")
        return len(ids["input_ids"])

    def check_completion_request(self, body: dict) -> None:
        """All a completion request is checked for before Transformers' handler takes it (a 4xx at the first
        fault): Transformers' own validation, the fields, the prompt and what fits."""
        self._validate_request(body)
        self.check(body)
        self.check_completion(body)

    def check_chat_request(self, body: dict, modality) -> None:
        """All a chat request is checked for before Transformers' handler takes it: Transformers' own validation,
        the fields, the messages as the template renders them, and what fits."""
        self._validate_request(body)
        self.check(body)
        prompt_length = self.check_chat(body, modality)
        field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        self.fit(body, prompt_length, field, prompt="messages")

    def check_completion(self, body: dict) -> None:
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            refuse(400, f"prompt must be a string, got {type(prompt).__name__}", "prompt", "invalid_value")
        if body.get("suffix") is not None and not isinstance(body["suffix"], str):
            refuse(400, "suffix must be a string", "suffix", "invalid_value")
        self.fit(body, len(self.served.tokenizer(prompt)["input_ids"]))


def greedy_unless_asked(body: dict, settings):
    """A request samples when it asks for a temperature above 0 (the folder's generation config is greedy); without
    one, or at 0, it is greedy. ``settings``: a GenerationConfig (5.21-5.24) or generate's keyword arguments (5.25)."""
    temperature = body.get("temperature")
    sample = temperature is not None and temperature > 0
    if isinstance(settings, dict):
        settings["do_sample"] = sample
        if not sample:
            settings.update(temperature=None, top_p=None, top_k=None)
        return settings
    settings.do_sample = sample
    if not sample:
        settings.temperature = settings.top_p = settings.top_k = None
    return settings


def error_response(status: int, message: str, param=None, code=None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}},
                        status_code=status)


async def _http_error(_request, exc: StarletteHTTPException):
    detail = exc.detail
    if isinstance(detail, dict):
        return error_response(exc.status_code, detail.get("message", ""), detail.get("param"), detail.get("code"))
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    return error_response(exc.status_code, str(detail), code=code)


async def _validation_error(_request, exc: RequestValidationError):
    errors = exc.errors()
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        return error_response(400, f"the request body is not valid JSON ({first.get('ctx', {}).get('error', 'JSON')})",
                              code="invalid_json")
    return error_response(400, f"the request body must be a JSON object: {first.get('msg', 'invalid body')}",
                          code="invalid_value")


async def _bad_request(_request, exc: ValueError):
    """A ValueError from generation (Transformers 5.25 hands the model process's back): the request's fault."""
    return error_response(400, " ".join(str(exc).split()), code="invalid_value")


async def _unexpected(_request, exc: Exception):
    return error_response(500, f"{type(exc).__name__}: {' '.join(str(exc).split())}", code="internal_error")


def finish_app(app, dead_error: type, dead_code: str):
    """The app's routes cut to what a folder serves, and every error in OpenAI's shape (``dead_error``: the
    Transformers exception for a continuous-batching worker or model process that died, a 503)."""

    async def _dead(_request, exc):
        return error_response(503, str(exc), code=dead_code)

    app.router.routes = [r for r in app.router.routes if getattr(r, "path", None) not in DROPPED_ROUTES]
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(dead_error, _dead)
    app.add_exception_handler(ValueError, _bad_request)
    app.add_exception_handler(Exception, _unexpected)
    return app
