"""The app ``hf-relpos serve`` runs on Transformers 5.25 and later: their server (``transformers serve``'s model
manager, request handlers and FastAPI app from ``transformers.cli.serving``), whose model runs in a process of its
own, spawned and loaded through a ``ModelLoader``. Three changes:

- the loader is hf_relpos': the model process loads the folder with hf_relpos' installed classes (``transformers
  serve`` resolves ``transformers.<architectures[0]>``, which no hf_relpos model is; no code from the folder runs);
- an encoder-decoder's answer is its decoder's output (Transformers cuts the prompt's length off what ``generate``
  returns, as for a decoder-only model);
- requests are checked before they reach the model (:mod:`.serve_requests`), and the served length is the one a
  scheme has: a position table's size, none for relative schemes (Transformers' is ``max_position_embeddings``).

Transformers 5.21-5.24 generate in the server's own process: :mod:`.serve_app_524`.
"""

from __future__ import annotations

import functools

from transformers.cli.serving.chat_completion import ChatCompletionHandler
from transformers.cli.serving.completion import CompletionHandler
from transformers.cli.serving.model_manager import ModelLoader, ModelManager
from transformers.cli.serving.server import build_server
from transformers.cli.serving.utils import EngineDeadError, GenerationState, Modality

from .common import position_table
from .serve_requests import RequestChecks, Served, finish_app, greedy_unless_asked


def _answer_after_prompt(generate):
    """An encoder-decoder's ``generate`` returns its decoder's sequence (the start token, then the answer), and the
    prompt went to the encoder: returned behind the prompt instead, Transformers' cut of the prompt's length leaves
    the answer. (A streamed answer is unchanged: the first tokens a streamer gets are skipped as the prompt.)"""
    import torch

    @functools.wraps(generate)
    def wrapped(*args, input_ids=None, **kwargs):
        sequences = generate(*args, input_ids=input_ids, **kwargs)
        return torch.cat([input_ids.to(sequences.device), sequences[:, 1:]], dim=-1)

    return wrapped


# Continuous batching on 5.25 samples per request with the temperature, top-k and top-p processors the model's
# generation config sets up when batching starts (none for a greedy config, nor for temperature or top_p at 1.0):
# the model process's config asks for all three so that each request can set its own. Every request sets them
# (a greedy one sends top_k=1: its one token left is the argmax), so these values never decide an answer.
CB_SAMPLING = dict(do_sample=True, temperature=0.5, top_k=50, top_p=0.5)


class FolderLoader(ModelLoader):
    """Loads the one folder ``hf-relpos serve`` serves, whatever model id Transformers asks for, with hf_relpos'
    installed classes; pickled into the model process, so it holds only plain values."""

    def __init__(self, folder: str, device: str, dtype: str, generation: dict, continuous_batching: bool = False):
        super().__init__(device=device, dtype="auto")
        self.folder, self.serve_device, self.serve_dtype, self.generation = folder, device, dtype, generation
        self.continuous_batching = continuous_batching

    def load_config(self, model_id: str):
        from transformers import GenerationConfig

        from ..configuration_relpos import RelPosConfig

        config = RelPosConfig.from_pretrained(self.folder, local_files_only=True)
        return config, GenerationConfig(**self.generation)

    def load_processor(self, model_id: str):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(self.folder, local_files_only=True)

    def load_model_and_processor(self, model_id: str, on_progress=None):
        import torch
        from transformers import GenerationConfig
        from transformers.utils import logging as hf_logging

        from .common import load_folder

        hf_logging.disable_progress_bar()  # the model process shares the terminal: no "Loading weights" bar there
        model, tokenizer = load_folder(self.folder, encoder_decoder=True)
        if self.serve_dtype != "auto":
            model = model.to(getattr(torch, self.serve_dtype))
        model = model.to(self.serve_device)
        sampling = CB_SAMPLING if self.continuous_batching else {}
        model.generation_config = GenerationConfig(**self.generation, **sampling)
        if model.config.is_encoder_decoder:
            model.generate = _answer_after_prompt(model.generate)
        return model, tokenizer


class FolderGenerationState(GenerationState):
    """The longest request is what the scheme has: a ``learned``/``sinusoidal`` table's positions, no end for the
    others (Transformers refuses prompts past ``max_position_embeddings``, a field relative schemes do not use)."""

    def context_length(self, config):
        # an encoder-decoder's table bounds its encoder's prompt and its decoder's answer apart (checked by the
        # request checks): Transformers' bound of prompt and answer together does not apply
        return None if config.is_encoder_decoder else position_table(config)


class FolderModelManager(ModelManager):
    def list_models(self, cache_dir=None) -> list:
        """``/v1/models``: the served model alone, under its name."""
        return [{"id": self.force_model, "object": "model", "created": 0, "owned_by": "hf-relpos"}]


class FolderCompletionHandler(RequestChecks, CompletionHandler):
    async def handle_request(self, body: dict, request_id: str):
        self.check_completion_request(body)
        return await super().handle_request(body, request_id)

    def _build_generation_kwargs(self, body, model_generation_config):
        return greedy_unless_asked(body, super()._build_generation_kwargs(body, model_generation_config))


class FolderChatCompletionHandler(RequestChecks, ChatCompletionHandler):
    token_fields = ("max_tokens", "max_completion_tokens")

    async def handle_request(self, body: dict, request_id: str):
        self.check_chat_request(body, Modality.LLM)
        return await super().handle_request(body, request_id)

    def _build_generation_kwargs(self, body, model_generation_config):
        return greedy_unless_asked(body, super()._build_generation_kwargs(body, model_generation_config))


class _Stopper:
    """What ``hf-relpos serve`` calls at shutdown, on the event loop: ``stop_generating`` cancels the requests still
    generating in the model process, which answers them with the tokens they have, and ``WAITING`` seconds later
    fails those that never started (the model process runs one ``generate`` at a time and drops a cancelled request
    it has not started; continuous batching drops every cancelled one) with a 503, or an error event in a stream;
    ``shutdown`` stops the model process."""

    WAITING = 0.5

    def __init__(self, manager: FolderModelManager):
        self.manager = manager

    def stop_generating(self):
        import asyncio

        for engine in self.manager.engines.values():
            if engine.requests_queue is None:
                continue
            if not engine.use_cb:
                for request_id in list(engine.pending_requests):
                    engine.requests_queue.put(("cancel", request_id))
            asyncio.get_running_loop().call_later(self.WAITING, self._fail_waiting, engine)

    @staticmethod
    def _fail_waiting(engine):
        for future, _ in list(engine.pending_requests.values()):
            if not future.done():
                future.set_result(EngineDeadError("the server stopped before this request was answered"))

    def shutdown(self):
        self.manager.shutdown()


def build_app(served: Served, folder: str, *, device: str, dtype: str, generation: dict, cb_config=None):
    """The FastAPI app of ``transformers serve`` for the folder, its model process started (it returns once the
    model is loaded), and what stops it (see ``_Stopper``). Continuous-batching requests sample each with their own
    settings (``CB_SAMPLING``)."""
    served.per_request_sampling = served.continuous_batching
    loader = FolderLoader(folder, device, dtype, generation, continuous_batching=served.continuous_batching)
    state = FolderGenerationState(continuous_batching=served.continuous_batching, cb_config=cb_config)
    manager = FolderModelManager(loader=loader, generation_state=state, force_model=served.name)
    completion = FolderCompletionHandler(model_manager=manager, generation_state=state)
    chat = FolderChatCompletionHandler(model_manager=manager, generation_state=state)
    completion.served = chat.served = served
    app = build_server(manager, chat, completion_handler=completion, response_handler=None,
                       transcription_handler=None, systemone_handler=None)
    return finish_app(app, EngineDeadError, "engine_dead"), _Stopper(manager)
