"""The app ``hf-relpos serve`` runs on Transformers 5.21-5.24: their server (``transformers serve``'s model
manager, request handlers, in-process generation managers and FastAPI app from ``transformers.cli.serving``) with
three changes: the model is the folder's, loaded by hf_relpos (``transformers serve`` resolves
``transformers.<architectures[0]>``, which no hf_relpos model is); an encoder-decoder's answer is its decoder's
output; requests are checked before they reach ``generate`` (:mod:`.serve_requests`). Transformers 5.25 rewrote
its server: :mod:`.serve_app`.
"""

from __future__ import annotations

import functools
import threading
import time

import torch
from transformers import StoppingCriteria, StoppingCriteriaList
from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler
from transformers.cli.serving.model_manager import ModelManager
from transformers.cli.serving.server import build_server
from transformers.cli.serving.utils import CBWorkerDeadError, GenerateManager, GenerationState, Modality

from .serve_requests import RequestChecks, Served, finish_app, greedy_unless_asked


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


class FolderCompletionHandler(RequestChecks, CompletionHandler):
    async def handle_request(self, body: dict, request_id: str):
        self.check_completion_request(body)
        return await super().handle_request(body, request_id)

    def _build_generation_config(self, body, model_generation_config, use_cb=False):
        return greedy_unless_asked(body, super()._build_generation_config(body, model_generation_config, use_cb=use_cb))


class FolderChatCompletionHandler(RequestChecks, ChatCompletionHandler):
    token_fields = ("max_tokens", "max_completion_tokens")

    async def handle_request(self, body: dict, request_id: str):
        self.check_chat_request(body, Modality.LLM)
        return await super().handle_request(body, request_id)

    def _build_generation_config(self, body, model_generation_config, use_cb=False):
        return greedy_unless_asked(body, super()._build_generation_config(body, model_generation_config, use_cb=use_cb))


class _Stopper:
    """What ``hf-relpos serve`` calls at shutdown: ``stop_generating`` ends the ``generate`` calls still running
    (answered with the tokens they have), ``shutdown`` stops the continuous-batching worker."""

    def __init__(self, state: FolderGenerationState, stopping: threading.Event):
        self.state, self.stopping = state, stopping

    def stop_generating(self):
        self.stopping.set()
        self.state.shutdown()

    def shutdown(self):
        self.state.shutdown()


def build_app(served: Served, model, *, cb_config=None):
    """The FastAPI app of ``transformers serve`` for this model, and what stops it (see ``_Stopper``)."""
    stopping = threading.Event()
    manager = FolderModelManager(served.name, model, served.tokenizer, stopping)
    state = FolderGenerationState(continuous_batching=served.continuous_batching, cb_config=cb_config)
    completion = FolderCompletionHandler(model_manager=manager, generation_state=state)
    chat = FolderChatCompletionHandler(model_manager=manager, generation_state=state)
    completion.served = chat.served = served
    app = build_server(manager, chat, completion_handler=completion, response_handler=None,
                       transcription_handler=None, systemone_handler=None, generation_state=state)
    return finish_app(app, CBWorkerDeadError, "cb_worker_dead"), _Stopper(state, stopping)
