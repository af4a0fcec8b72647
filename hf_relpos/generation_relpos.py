"""Generation: the hooks of Transformers' ``GenerationMixin`` and continuous batching that these models need, as
mixins the heads inherit (``modeling_relpos.py`` overrides none of GenerationMixin's methods).

- every head: ``generate``'s own keyword arguments kept out of the model's inputs, and a static cache sized from
  the first keys where a scheme's keys carry more channels (FoX);
- the causal LM: continuous batching refused in one line for a model that cannot take part, requests that cannot
  run refused at the caller, Transformer-XL's ``mems`` never fed back as a cache;
- the encoder-decoder: continuous batching refused, generate's cross-attention cache without a window, the
  encoder handed only what it takes.
"""

import copy
import inspect
import math
from typing import Optional

from transformers.cache_utils import DynamicCache, EncoderDecoderCache, StaticCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_masks_for_generate

from .inputs_relpos import CACHE_FIELD, MODEL_KWARGS, attention_implementation, continuous_batching_refusal
from .position_schemes_relpos import POSITION_SCHEMES


def _request_refusal(prompt: int, max_new_tokens, limit: Optional[int], encoding: str) -> Optional[str]:
    """Why a continuous-batching request of ``prompt`` tokens and ``max_new_tokens`` cannot run (None when it can):
    an empty prompt (its step would have no row to read the next token from), or one that runs past an absolute
    position table of ``limit`` positions (``generate`` raises at the same position)."""
    if prompt == 0:
        return "input_ids is an empty prompt: a request needs at least one token to continue from (a BOS token)"
    if limit is None:
        return None
    last = prompt - 1 + max(int(max_new_tokens or 0) - 1, 0)  # the last token fed to the model (the final one is not)
    if last < limit:
        return None
    answer = f" and max_new_tokens={max_new_tokens}" if max_new_tokens else ""
    return (
        f"a prompt of {prompt} tokens{answer} needs position {last}, past max_position_embeddings={limit} of the "
        f"{encoding!r} position table: prompt plus max_new_tokens may be at most {limit + 1} tokens"
    )


# The paged cache's default size when nothing says how many requests run together (hf-relpos serve's 8 clients),
# and the most tokens one step takes on a CPU: Transformers' 8,192 makes its [1, 1, M, cache + M] masks hundreds of
# megabytes, and 256 tokens a step already keep a CPU busy.
CONCURRENT_REQUESTS = 8
CPU_BATCH_TOKENS = 256
_MOST_REQUESTS = 1024  # Transformers' own bound on requests per batch (FALLBACK_DEFAULTS in continuous batching)


def size_paged_cache(cb_config, workload_hints, nominal_length: int, device):
    """A paged-cache configuration sized for the requests, not for the machine.

    Transformers fills ``max_memory_percent`` (0.6-0.9) of the device's free memory with cache blocks: on a CPU, the
    machine's memory (14 GB for a 2-layer, hidden-32 model on a 24 GB machine). Unless the caller sets a budget
    (``num_blocks`` or ``max_memory_percent``), the cache holds what the requests can need: ``requests x
    ceil(length / page_size)`` blocks, ``requests`` from ``max_requests_per_batch``, the workload (``generate_batch``
    knows its requests) or ``CONCURRENT_REQUESTS``, ``length`` the longest prompt plus the tokens to generate, or
    ``nominal_length`` when nothing says. Returns a new configuration; the caller's is not changed."""
    from transformers import ContinuousBatchingConfig

    cb_config = copy.deepcopy(cb_config) if cb_config is not None else ContinuousBatchingConfig()
    if cb_config.num_blocks is not None or cb_config.max_memory_percent is not None:
        return cb_config  # the caller's budget
    if workload_hints is None or workload_hints.max_prompt_length + workload_hints.max_generated_length == 0:
        length = nominal_length
    elif workload_hints.max_generated_length == 0:  # no max_new_tokens: the answer's length is not known
        length = workload_hints.max_prompt_length + nominal_length
    else:
        length = workload_hints.max_prompt_length + workload_hints.max_generated_length
    length = max(length, 1)
    requests = cb_config.max_requests_per_batch
    if requests is None:
        hinted_requests = workload_hints.num_requests if workload_hints else 0
        requests = min(hinted_requests, _MOST_REQUESTS) if hinted_requests > 0 else CONCURRENT_REQUESTS
        cb_config.max_requests_per_batch = requests
    cb_config.num_blocks = requests * math.ceil(length / cb_config.page_size)
    if cb_config.max_batch_tokens is None and device.type == "cpu":
        cb_config.max_batch_tokens = min(requests * length, CPU_BATCH_TOKENS)
    return cb_config


def _check_requests(manager, add_request, limit: Optional[int], encoding: str, capacity: Optional[int] = None):
    """``add_request`` refusing a request that cannot run (``_request_refusal``), or one longer than the whole paged
    cache holds (``capacity`` tokens), at the caller: its step's forward would raise in the manager's thread, which
    then fails every request and stops; a request the cache can never hold would wait for ever."""
    signature = inspect.signature(add_request)

    def checked(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        new = bound.arguments.get("max_new_tokens")
        new = manager.generation_config.max_new_tokens if new is None else new
        prompt = len(bound.arguments["input_ids"])
        refusal = _request_refusal(prompt, new, limit, encoding)
        if refusal is None and capacity is not None and prompt + int(new or 0) > capacity:
            refusal = (
                f"a prompt of {prompt} tokens and max_new_tokens={new} need {prompt + int(new or 0)} tokens of paged "
                f"cache, which holds {capacity} (give a ContinuousBatchingConfig with more num_blocks)"
            )
        if refusal is not None:
            raise ValueError(refusal)
        return add_request(*args, **kwargs)

    checked._relpos_checked = True
    return checked


class RelPosGenerationMixin(GenerationMixin):
    """``GenerationMixin`` whose model inputs leave out what ``generate`` keeps for its own use: its decoding loop
    (``_sample``) takes ``tokenizer`` / ``assistant_tokenizer`` (given for ``stop_strings``) into the model
    keyword arguments, which upstream forwards swallow in ``**kwargs`` and ours, naming all they take, refuse."""

    def prepare_inputs_for_generation(self, *args, **kwargs):
        for name in ("tokenizer", "assistant_tokenizer"):
            kwargs.pop(name, None)
        return super().prepare_inputs_for_generation(*args, **kwargs)

    # generate (and Transformers' tests) read this method's parameters: `inputs_embeds` among them is what lets
    # `generate(inputs_embeds=...)` run, so it keeps the signature of the method it wraps.
    prepare_inputs_for_generation.__signature__ = inspect.signature(GenerationMixin.prepare_inputs_for_generation)

    def create_masks_for_generate(self, *args, config, **kwargs):
        """generate's mask for a compilable (static) cache, by Transformers' ``create_masks_for_generate``. Under
        FlexAttention the bool ``[B, 1, Q, slots]`` mask it renders for SDPA, of one shape at every decoding
        step (a compiled step keeps its graph), which the model's FlexAttention reads in its mask function: a
        ``BlockMask`` would come with neither the model's own masks (packed documents, a window) nor its checks."""
        if attention_implementation(config) in ("flex_attention", "relpos_triton"):
            config = copy.copy(config)
            config._attn_implementation = "sdpa"
        return create_masks_for_generate(*args, config=config, **kwargs)

    def _get_static_cache_init_shape(self, *args, **kwargs):
        """Transformers sizes an eagerly initialised StaticCache (``prefill_chunk_size``) for keys of head_dim: where
        the scheme carries more channels in its keys (FoX), the cache initialises from the first keys instead."""
        if POSITION_SCHEMES[self.config.get_text_config(decoder=True).position_encoding].key_channels:
            return None  # as Transformers does for keys and values of different sizes (MLA)
        return super()._get_static_cache_init_shape(*args, **kwargs)


class CausalLMGenerationMixin(RelPosGenerationMixin):
    """The causal LM's generation and continuous-batching hooks."""

    def init_continuous_batching(self, generation_config=None, continuous_batching_config=None, workload_hints=None):
        """Transformers' continuous batching (``generate_batch`` and ``continuous_batching_context_manager`` start
        here), refused in one ``ValueError`` for a model that cannot take part (``continuous_batching_refusal``),
        with a paged cache sized for the requests unless the caller sets a budget (``size_paged_cache``)."""
        refusal = continuous_batching_refusal(self.config)
        if refusal is not None:
            raise ValueError(f"{type(self).__name__} cannot use continuous batching (generate_batch): {refusal}")
        if not hasattr(self, "_cached_continuous_batching_manager"):  # a kept manager keeps its own cache
            limit = getattr(self.model.position, "max_positions", None)
            continuous_batching_config = size_paged_cache(
                continuous_batching_config, workload_hints, limit or self.config.max_position_embeddings, self.device
            )
        manager = super().init_continuous_batching(generation_config, continuous_batching_config, workload_hints)
        if not getattr(manager.add_request, "_relpos_checked", False):
            limit = getattr(self.model.position, "max_positions", None)
            cb_config = manager.continuous_batching_config
            capacity = cb_config.num_blocks * cb_config.page_size if cb_config.num_blocks is not None else None
            manager.add_request = _check_requests(
                manager, manager.add_request, limit, self.config.position_encoding, capacity
            )
        return manager

    def generate_batch(self, inputs, generation_config=None, *args, **kwargs):
        """Transformers' ``generate_batch``, with the requests that cannot run (an empty prompt, one past an absolute
        position table) refused before any runs (Transformers' own logs an error raised while adding requests and
        returns no result)."""
        limit = getattr(self.model.position, "max_positions", None)
        config = self.generation_config if generation_config is None else generation_config
        new = kwargs.get("max_new_tokens")
        new = config.max_new_tokens if new is None else new
        kept = getattr(self, "_cached_continuous_batching_manager", None)  # persistent_manager=True before
        kept_config = getattr(kept, "continuous_batching_config", None)
        capacity = None
        if kept_config is not None and kept_config.num_blocks is not None:
            capacity = kept_config.num_blocks * kept_config.page_size
        for index, prompt in enumerate(inputs):
            refusal = _request_refusal(len(prompt), new, limit, self.config.position_encoding)
            if refusal is None and capacity is not None and len(prompt) + int(new or 0) > capacity:
                refusal = (
                    f"{len(prompt) + int(new or 0)} tokens (prompt and max_new_tokens) do not fit the paged cache of "
                    f"the manager kept by persistent_manager=True, which holds {capacity}: call "
                    "destroy_cached_continuous_batching_manager() first (a kept manager keeps its cache)"
                )
            if refusal is not None:
                raise ValueError(f"generate_batch: inputs[{index}]: {refusal}")
        return super().generate_batch(inputs, generation_config, *args, **kwargs)

    def _update_model_kwargs_for_generation(self, outputs, model_kwargs, *args, **kwargs):
        # Transformers' generate before 5.24 reads an output named `mems` as the cache (XLNet's legacy); our
        # decoding memory is the (sliding) KV cache, so never feed mems back as past_key_values. (5.24 reads
        # only `cache`: then this finds nothing to remove.)
        model_kwargs = super()._update_model_kwargs_for_generation(outputs, model_kwargs, *args, **kwargs)
        if isinstance(model_kwargs.get("past_key_values"), list):
            # Removed, not set to None: beam search reorders any cache it finds among the kwargs.
            del model_kwargs["past_key_values"]
        return model_kwargs


class Seq2SeqGenerationMixin(RelPosGenerationMixin):
    """The encoder-decoder's generation hooks."""

    def init_continuous_batching(self, *args, **kwargs):
        """Refused in one ``ValueError``: continuous batching is for decoder-only models (``generate_batch`` too)."""
        raise ValueError(
            f"{type(self).__name__} cannot use continuous batching (generate_batch): "
            f"{continuous_batching_refusal(self.config)}"
        )

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, *args, **kwargs):
        """Transformers builds generate's cross-attention cache from the decoder's config, so with a
        ``sliding_window`` its layers would keep only the last source tokens: rebuild it without the window, of
        the same kind (dynamic or static, offloaded or not), as upstream T5Gemma does."""
        super()._prepare_cache_for_generation(generation_config, model_kwargs, *args, **kwargs)
        cache = model_kwargs.get(CACHE_FIELD)
        if (
            not isinstance(cache, EncoderDecoderCache)
            or getattr(cache, "_is_user_defined", False)
            or not any(cache.cross_attention_cache.is_sliding)
        ):
            return
        cross = cache.cross_attention_cache
        config = self.config.get_text_config(decoder=True)
        config.sliding_window = None
        if isinstance(cross, StaticCache):
            source_length = model_kwargs["encoder_outputs"][0].shape[1]
            cache.cross_attention_cache = StaticCache(
                config=config, max_cache_len=source_length, offloading=cross.offloading
            )
        else:
            cache.cross_attention_cache = DynamicCache(config=config, offloading=cross.offloading)

    def _prepare_text_encoder_decoder_kwargs_for_generation(self, inputs_tensor, model_kwargs, *args, **kwargs):
        """``generate`` hands the encoder every model keyword argument when the encoder's forward takes ``**kwargs``
        (ours does, for Transformers' model keyword arguments), ``logits_to_keep`` included, which the encoder
        would refuse: hand it only what it takes, and keep the rest for the decoding steps."""
        takes = (set(inspect.signature(self.encoder.forward).parameters) | MODEL_KWARGS) - {"cache", "past_key_values"}
        held = {name: model_kwargs.pop(name) for name in list(model_kwargs) if name not in takes}
        model_kwargs = super()._prepare_text_encoder_decoder_kwargs_for_generation(
            inputs_tensor, model_kwargs, *args, **kwargs
        )
        return {**model_kwargs, **held}
