"""hf_relpos models: a pre-norm Transformer whose attention uses one of hf_relpos' position schemes.

Read top to bottom, in the order data flows: outputs, attention (self-attention through the
scheme's seam, cross-attention), the decoder layer, the pre-trained base, ``RelPosModel`` and the heads
(causal LM, sequence classification, encoder-decoder). Beside it: the norms and MLP in ``feed_forward_relpos.py``,
the schemes in ``position_schemes_relpos.py``, ``PositionContext`` in ``position_context_relpos.py``, the attention
backends in ``attention_backends_relpos.py``; the input checks and keyword arguments in ``inputs_relpos.py``; the generation and
continuous-batching hooks (mixins the heads inherit) in ``generation_relpos.py``; the checkpoint check before
loading and the Auto classes' refusals in ``loading_relpos.py``.

Positions come from one place: ``RelPosModel.forward`` checks its inputs (``inputs_relpos.check_inputs``), which
read the cache once (``position_context_relpos.read_cache``) into one record, ``Geometry``: how many tokens precede, the
key range and the memory's length; ``PositionContext.from_inputs`` builds the positions and the mask from it
before the first layer, with Transformers' mask functions; the forward asks the scheme for its per-forward terms
(one for every layer, or one per layer where the scheme has per-layer tables) and hands each layer its own.
"""

import os
from dataclasses import dataclass, fields
from typing import Any, Optional

import torch
from torch import nn

from transformers.cache_utils import Cache, DynamicCache, EncoderDecoderCache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BaseModelOutput,
    BaseModelOutputWithPast,
    BaseModelOutputWithPastAndCrossAttentions,
    CausalLMOutputWithPast,
    Seq2SeqLMOutput,
    SequenceClassifierOutput,
)
from transformers.modeling_utils import PreTrainedModel, slice_logits_to_keep
from transformers.processing_utils import Unpack
from transformers.utils.generic import TransformersKwargs, can_return_tuple
from transformers.utils.output_capturing import capture_outputs

from .adaptive_softmax_relpos import AdaptiveEmbedding, ProjectedAdaptiveLogSoftmax, tied_names
from .attention_backends_relpos import TRITON, cross_attention, triton_refusal
from .configuration_relpos import RelPosConfig
from .feed_forward_relpos import RelPosMLP, RelPosRMSNorm, make_norm
from .flex_backend_relpos import flex_refusal
from .generation_relpos import CausalLMGenerationMixin, Seq2SeqGenerationMixin
from .initialization_relpos import init_module, mark_t5_init
from .inputs_relpos import (
    CACHE_FIELD,
    CAUSAL_LOSS_KWARGS,
    MODEL_KWARGS,
    TOKEN_LOSS_KWARGS,
    attention_implementation,
    check_inputs,
    one_cache,
    refuse_unknown_kwargs,
    split_loss_kwargs,
)
from .loading_relpos import AUTO_CLASS_OF, AUTO_MAP, check_checkpoint_fits, check_holds
from .model_card_relpos import model_card, write_card
from .position_context_relpos import PositionContext
from .position_schemes_relpos import POSITION_SCHEMES

# ----------------------------------------------------------------------------------
# Outputs
# ----------------------------------------------------------------------------------


class _MemsLast:
    """``to_tuple`` in the order of the fields (``mems`` last), as upstream tuples are, even when
    ``capture_outputs`` fills ``hidden_states`` and ``attentions`` after the output was built."""

    def to_tuple(self) -> tuple:
        return tuple(self[f.name] for f in fields(self) if self.get(f.name) is not None)


@dataclass
class RelPosModelOutput(_MemsLast, BaseModelOutputWithPast):
    """``BaseModelOutputWithPast`` plus Transformer-XL's ``mems``."""

    mems: Optional[list] = None


@dataclass
class RelPosCausalLMOutput(_MemsLast, CausalLMOutputWithPast):
    """``CausalLMOutputWithPast`` plus Transformer-XL's ``mems``."""

    mems: Optional[list] = None


@dataclass
class RelPosSequenceClassifierOutput(_MemsLast, SequenceClassifierOutput):
    """``SequenceClassifierOutput`` plus Transformer-XL's ``mems``."""

    mems: Optional[list] = None


# ----------------------------------------------------------------------------------
# Attention and decoder layer
# ----------------------------------------------------------------------------------


def attention_scaling(config: RelPosConfig) -> float:
    """The factor of ``q·k``: ``config.attention_scale``, or ``1/sqrt(head_dim)`` (Vaswani et al. 2017, eq. 1)
    when None; T5 attends without it (1.0)."""
    return config.head_dim**-0.5 if config.attention_scale is None else float(config.attention_scale)


class RelPosAttention(nn.Module):
    def __init__(self, config: RelPosConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.scaling = attention_scaling(config)
        self.attention_dropout = config.attention_dropout
        self.is_causal = config.is_decoder
        inner = config.num_attention_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, inner, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, inner, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, inner, bias=config.attention_bias)
        self.o_proj = nn.Linear(inner, config.hidden_size, bias=config.attention_bias)
        self.relative = POSITION_SCHEMES[config.position_encoding].layer_module(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        term: Any,
        ctx: PositionContext,
        memory: Optional[torch.Tensor] = None,
        cache: Optional[Cache] = None,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        scheme = ctx.scheme
        batch, length, _ = hidden_states.shape
        shape = (batch, -1, self.num_heads, self.head_dim)
        query = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        # Transformer-XL memory: keys and values also come from the (stop-gradient) previous segment.
        kv_input = hidden_states if memory is None else torch.cat([memory, hidden_states], dim=1)
        key = self.k_proj(kv_input).view(shape).transpose(1, 2)
        value = self.v_proj(kv_input).view(shape).transpose(1, 2)
        query, key = scheme.rotate(query, key, term, ctx)
        query, key = scheme.prepare(self, hidden_states, query, key, ctx)
        if ctx.paged is not None:  # a paged cache updates kwargs in place (this layer's cu_seq_lens_k): a copy each
            key, value = cache.update(key, value, self.layer_idx, dict(ctx.paged))
        elif cache is not None:
            key, value = cache.update(key, value, self.layer_idx)
        out, weights = scheme.attend(self, query, key, value, term, ctx)
        return self.o_proj(out.reshape(batch, length, -1)), weights


class RelPosCrossAttention(nn.Module):
    """An encoder-decoder's attention from decoder queries to the encoder's states, without a position
    term (as T5). Its keys and values are projected once per source and kept in the cross-attention cache."""

    def __init__(self, config: RelPosConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim
        self.scaling = attention_scaling(config)
        self.attention_dropout = config.attention_dropout
        self.is_causal = False
        inner = config.num_attention_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, inner, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, inner, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, inner, bias=config.attention_bias)
        self.o_proj = nn.Linear(inner, config.hidden_size, bias=config.attention_bias)

    def forward(
        self,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        encoder_mask: Optional[torch.Tensor],
        ctx: PositionContext,
        cache: Optional[EncoderDecoderCache] = None,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        batch, length, _ = hidden_states.shape
        query = self.q_proj(hidden_states).view(batch, length, self.num_heads, self.head_dim).transpose(1, 2)
        cross_cache = cache.cross_attention_cache if cache is not None else None
        if cross_cache is not None and any(cross_cache.is_sliding[self.layer_idx : self.layer_idx + 1]):
            raise ValueError(
                "cache.cross_attention_cache has sliding-window layers (a cache built from a config with "
                "sliding_window): they would keep only the last source tokens. Build it without the window, e.g. "
                "EncoderDecoderCache(DynamicCache(config=config), DynamicCache()), as generate does"
            )
        if cross_cache is not None and cache.is_updated.get(self.layer_idx):
            key, value = cross_cache.layers[self.layer_idx].keys, cross_cache.layers[self.layer_idx].values
        else:
            shape = (batch, -1, self.num_heads, self.head_dim)
            key = self.k_proj(encoder_hidden_states).view(shape).transpose(1, 2)
            value = self.v_proj(encoder_hidden_states).view(shape).transpose(1, 2)
            if cross_cache is not None:
                key, value = cross_cache.update(key, value, self.layer_idx)
                cache.is_updated[self.layer_idx] = True
        out, weights = cross_attention(self, query, key, value, encoder_mask, ctx)
        return self.o_proj(out.reshape(batch, length, -1)), weights


class RelPosDecoderLayer(GradientCheckpointingLayer):
    """Pre-norm: self-attention with the position scheme, then (an encoder-decoder's decoder) cross-attention
    to the encoder's states, then the MLP; each adds to the residual stream. Post-norm (``norm_position="post"``,
    the released Transformer-XL): ``norm(x + attention(x))``, then ``norm(o + MLP(o))``; its memory is not normed."""

    def __init__(self, config: RelPosConfig, layer_idx: int):
        super().__init__()
        self.post_norm = config.norm_position == "post"
        self.self_attn = RelPosAttention(config, layer_idx)
        self.input_layernorm = make_norm(config)
        if config.is_encoder_decoder and config.is_decoder:
            self.encoder_attn = RelPosCrossAttention(config, layer_idx)
            self.encoder_attn_layernorm = make_norm(config)
        self.mlp = RelPosMLP(config)
        self.post_attention_layernorm = make_norm(config)
        self.dropout = nn.Dropout(config.hidden_dropout)

    def forward(
        self,
        hidden_states: torch.Tensor,
        term: Any,
        encoder_hidden_states: Optional[torch.Tensor] = None,
        ctx: PositionContext = None,
        memory: Optional[torch.Tensor] = None,
        cache: Optional[Cache] = None,
        encoder_mask: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        self_cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
        if self.post_norm:  # an encoder-decoder is pre-norm (checked by the config)
            attended, _ = self.self_attn(hidden_states, term, ctx, memory, self_cache)
            hidden_states = self.input_layernorm(hidden_states + self.dropout(attended))
            return self.post_attention_layernorm(hidden_states + self.dropout(self.mlp(hidden_states)))
        residual = hidden_states
        normed_memory = None if memory is None else self.input_layernorm(memory)
        hidden_states, _ = self.self_attn(
            self.input_layernorm(hidden_states), term, ctx, normed_memory, self_cache
        )
        hidden_states = residual + self.dropout(hidden_states)
        if encoder_hidden_states is not None:
            residual = hidden_states
            cross_cache = cache if isinstance(cache, EncoderDecoderCache) else None
            hidden_states, _ = self.encoder_attn(
                self.encoder_attn_layernorm(hidden_states), encoder_hidden_states, encoder_mask, ctx, cross_cache
            )
            hidden_states = residual + self.dropout(hidden_states)
        residual = hidden_states
        hidden_states = self.mlp(self.post_attention_layernorm(hidden_states))
        return residual + self.dropout(hidden_states)


# ----------------------------------------------------------------------------------
# Pre-trained base
# ----------------------------------------------------------------------------------

class RelPosPreTrainedModel(PreTrainedModel):
    config_class = RelPosConfig
    config: RelPosConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["RelPosDecoderLayer"]
    _skip_keys_device_placement = ["cache", "past_key_values"]
    _supports_sdpa = True
    _supports_flash_attn = False
    # FlexAttention (flex_backend_relpos.py) for every scheme whose term is a score function
    # (PositionScheme.score_form).
    _supports_flex_attn = True
    # A decode step with a StaticCache traces into one graph (torch.compile fullgraph=True) for every scheme:
    # the cache's offset stays a tensor (PositionContext.traced_offset), never read on the host.
    _can_compile_fullgraph = True
    # Transformers' `capture_outputs` records these modules' outputs for `output_hidden_states` (each
    # layer's input, then the final normed state) and `output_attentions` (the attention's second output).
    _can_record_outputs = {"hidden_states": RelPosDecoderLayer, "attentions": RelPosAttention}
    # The layer stacks: the config field counting each one's layers, and its name before `layers.<i>.`.
    _layer_stacks = (("num_hidden_layers", ""),)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """Transformers' ``from_pretrained``, after the config is checked against the checkpoint (a local folder or a
        ``state_dict``): a config asking for parameters of other shapes, or for far more than the checkpoint holds,
        is a ``ValueError`` naming the field before anything is allocated."""
        check_checkpoint_fits(cls, pretrained_model_name_or_path, kwargs)
        return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        """``set_attn_implementation`` may switch these models: their layers read ``config._attn_implementation``
        on every call (attention_backends_relpos.py). Transformers guesses it from the modeling file's source (a call of
        ``ALL_ATTENTION_FUNCTIONS.get_interface``), which lives in the backends' module here."""
        return True

    def _flex_attn_can_dispatch(self, is_init_check: bool = False) -> bool:
        """Transformers' check of ``attn_implementation="flex_attention"`` (config, ``from_pretrained``,
        ``set_attn_implementation``), and the scheme's: one ``ValueError`` where its term is no score function."""
        refusal = flex_refusal(POSITION_SCHEMES[self.config.position_encoding], self.config)
        if refusal is not None:
            raise ValueError(refusal)
        return super()._flex_attn_can_dispatch(is_init_check)

    def get_correct_attn_implementation(self, requested_attention: Optional[str], is_init_check: bool = False) -> str:
        """Transformers' check of the requested implementation, and, for the Triton kernel, the scheme's and the
        config's (the device is checked at the forward, where it is known): one ``ValueError``."""
        if requested_attention == TRITON:
            refusal = triton_refusal(POSITION_SCHEMES[self.config.position_encoding], self.config)
            if refusal is not None:
                raise ValueError(refusal)
        return super().get_correct_attn_implementation(requested_attention, is_init_check)

    @property
    def supports_context_parallel(self) -> bool:
        """Context parallelism shards the sequence and keeps only a plain causal mask: a position term
        in attention (a bias over global distances, Shaw's and Transformer-XL's terms) or a window would
        be dropped. Only schemes that act before attention, on position ids, survive it."""
        return POSITION_SCHEMES[self.config.position_encoding].context_parallel and self.config.sliding_window is None

    def post_init(self):
        """With ``initialization="t5"``, each module T5 initialises its own way gets its std before Transformers
        initialises the weights (``initialization_relpos.mark_t5_init``)."""
        if self.config.initialization == "t5":
            mark_t5_init(self, self.config)
        super().post_init()

    @torch.no_grad()
    def _init_weights(self, module):
        super()._init_weights(module)
        init_module(module, self.config.initializer_range)

    def resize_token_embeddings(self, *args, **kwargs):
        if self.config.cutoffs is not None:
            raise ValueError(
                f"RelPosConfig.cutoffs={self.config.cutoffs}: an adaptive input and softmax cannot be resized (each "
                "cluster has its own table); convert or build the model with the vocabulary it needs"
            )
        return super().resize_token_embeddings(*args, **kwargs)

    def _token_loss(self, logits, labels, **kwargs) -> torch.Tensor:
        """Transformers' loss of token logits (loss kwargs reach it); every label ignored gives 0, not NaN.
        An infinite or NaN loss of counted labels is returned as it is: only the labels tell the two apart."""
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        counted = kwargs.get("shift_labels")
        if counted is None:  # a causal LM's loss shifts its labels; ForMaskedLM's are aligned with the logits
            counted = labels if self.loss_type == "ForMaskedLM" else labels[..., 1:]
        # A mean over no label is 0 / 0: 0 instead, its gradient 0 as the logits' are. Chosen on the device, not
        # read on the host, so that torch.compile traces the loss whole; on the loss's device (a device map puts
        # the labels on the first GPU and the head on the last: Transformers' loss moves them there too).
        any_counted = (counted != kwargs.get("ignore_index", -100)).any().to(loss.device)
        return torch.where(any_counted, loss, loss.nan_to_num(0.0))

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Save safetensors, the config with a complete ``auto_map``, the code files (remote code) and a model card.

        ``auto_map`` names every Auto class, the ones that cannot hold this config too: loaded with remote code,
        a mismatched Auto class then reaches a class of ours, which refuses it in one line naming
        ``is_encoder_decoder`` and the Auto class to use (instead of Transformers' "Unrecognized configuration
        class"). The card (``README.md``, ``model_card_relpos``) is written unless the folder holds a README that
        is not an unedited card of ours: a user's README is never replaced."""
        self.config.auto_map = dict(AUTO_MAP)
        if type(self)._auto_class is None:
            type(self).register_for_auto_class(AUTO_CLASS_OF.get(type(self).__name__, "AutoModel"))
        if type(self.config)._auto_class is None:
            type(self.config).register_for_auto_class()
        result = super().save_pretrained(save_directory, *args, **kwargs)
        is_main_process = args[0] if args else kwargs.get("is_main_process", True)
        # Who writes, as Transformers decides it: should_save_on_this_rank (rank 0 under torch.distributed).
        writes = getattr(self, "should_save_on_this_rank", lambda main: main)(is_main_process)
        if writes and os.path.isdir(save_directory):
            name = next(c.__name__ for c in type(self).__mro__ if c.__name__ in AUTO_CLASS_OF)
            card = model_card(self.config, type(self).__name__, AUTO_CLASS_OF[name], self.num_parameters())
            write_card(save_directory, card)
        return result


# ----------------------------------------------------------------------------------
# The model
# ----------------------------------------------------------------------------------


class RelPosModel(RelPosPreTrainedModel):
    def __init__(self, config: RelPosConfig, *, stack: bool = False):
        """``stack=True``: one of an encoder-decoder's stacks, which ``RelPosForConditionalGeneration`` builds from
        its config's ``stack_config``; otherwise an encoder-decoder's config is refused."""
        if not stack:
            check_holds(type(self).__name__, config, encoder_decoder=False)
        super().__init__(config)
        # An encoder-decoder's pad id is also its decoder start token (T5): its row is trained, as upstream's.
        self.padding_idx = None if config.is_encoder_decoder else config.pad_token_id
        if config.cutoffs is None:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        else:  # adaptive input (Baevski & Auli): no padding row, as TransfoXL's
            self.embed_tokens = AdaptiveEmbedding(
                config.vocab_size, config.hidden_size, config.adaptive_embedding_size, config.cutoffs, config.div_val
            )
        self.position = POSITION_SCHEMES[config.position_encoding](config)
        if self.position.token_init_std is not None:
            self.embed_tokens.init_std = self.position.token_init_std
        self.layers = nn.ModuleList(RelPosDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        # No final norm where the layers end normed (post-norm) or a checkpoint has none (TransfoXL pre_lnorm).
        self.norm = make_norm(config) if config.final_norm else nn.Identity()
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def _checkpointing(self) -> bool:
        return self.gradient_checkpointing and self.training and torch.is_grad_enabled()

    # -- the forward ---------------------------------------------------------------------------

    @capture_outputs
    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        cache: Optional[Cache] = None,
        inputs_embeds: Optional[torch.FloatTensor] = None,
        use_cache: Optional[bool] = None,
        mems: Optional[list] = None,
        encoder_hidden_states: Optional[torch.Tensor] = None,
        encoder_attention_mask: Optional[torch.Tensor] = None,
        past_key_values: Optional[Cache] = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> RelPosModelOutput:
        """``output_attentions``, ``output_hidden_states`` and ``return_dict`` (call arguments or config
        fields) are served by Transformers' ``capture_outputs``. Packed sequences (one row of documents
        whose ``position_ids`` restart at 0, read as Transformers does only without an ``attention_mask``
        and a past, or the ``cu_seq_lens_q`` / ``seq_idx`` kwargs of ``DataCollatorWithFlattening``) attend
        only within their document.

        An encoder-decoder's decoder also takes ``encoder_hidden_states`` (with ``encoder_attention_mask``)
        and an ``EncoderDecoderCache``, whose self-attention part holds the positions.

        The cache is ``cache`` (Transformers 5.24's name) or ``past_key_values`` (its name before); a keyword
        argument that is neither named here nor one of Transformers' model keyword arguments is a ``TypeError``."""
        config = self.config
        cache = one_cache(cache, past_key_values)
        geometry = check_inputs(
            self, input_ids, inputs_embeds, attention_mask, position_ids, cache, mems, encoder_hidden_states,
            encoder_attention_mask, kwargs,
        )
        cross = config.is_encoder_decoder and config.is_decoder
        # The cache that holds the positions: an encoder-decoder's self-attention part.
        self_cache = cache.self_attention_cache if isinstance(cache, EncoderDecoderCache) else cache
        if use_cache is None:
            use_cache = config.use_cache and not self.training
        # A checkpointed layer would add its keys twice; Transformer-XL memory replaces the cache within a forward.
        use_cache = use_cache and not self._checkpointing() and not (mems is not None and self_cache is None)
        if use_cache and self_cache is None:
            self_cache = DynamicCache(config=config)
            # The cross-attention cache holds the whole source: no window, whatever the config's sliding_window.
            cache = EncoderDecoderCache(self_cache, DynamicCache()) if cross else self_cache

        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        ctx = self._position_context(inputs_embeds, attention_mask, position_ids, geometry, mems, kwargs)
        encoder_mask = _key_padding_mask(encoder_attention_mask) if cross else None
        hidden_states = self.dropout(self.position.embed(inputs_embeds, ctx))
        terms = self.position.terms(ctx, inputs_embeds.device, hidden_states.dtype, len(self.layers))

        new_mems = [] if config.mem_len > 0 else None
        for layer_idx, (layer, term) in enumerate(zip(self.layers, terms)):
            memory = mems[layer_idx] if mems is not None else None
            if new_mems is not None:
                new_mems.append(self._update_memory(memory, hidden_states))
            # Tensors that need gradients positionally: reentrant checkpointing carries gradients only for those.
            hidden_states = layer(
                hidden_states, term, encoder_hidden_states,
                ctx=ctx, memory=memory, cache=cache, encoder_mask=encoder_mask,
            )
        hidden_states = self.norm(hidden_states)
        if config.dropout_rule != "residual":  # T5's and Transformer-XL's stacks drop their output
            hidden_states = self.dropout(hidden_states)
        outputs = {"last_hidden_state": hidden_states, CACHE_FIELD: cache if use_cache else None}
        if cross:
            return BaseModelOutputWithPastAndCrossAttentions(**outputs)
        return RelPosModelOutput(**outputs, mems=new_mems)

    def _position_context(self, inputs_embeds, attention_mask, position_ids, geometry, mems, kwargs) -> PositionContext:
        """Where this forward's queries and keys sit (``geometry``, from ``check_inputs``): a continuous-batching
        step's requests at their own positions, else after what the cache and the memory hold."""
        config = self.config
        output_attentions = kwargs.get("output_attentions")
        output_attentions = bool(config.output_attentions if output_attentions is None else output_attentions)
        if geometry.paged is not None:
            cu_q, cu_k, key_length = geometry.paged
            update = {name: kwargs.get(name) for name in ("read_index", "write_index", "block_table", "max_length_k")}
            return PositionContext.from_paged(
                config, self.position, inputs_embeds, position_ids, cu_q, cu_k, key_length,
                {**update, "cu_seq_lens_k": kwargs["cu_seq_lens_k"]},
                attn_implementation=attention_implementation(config), output_attentions=output_attentions,
            )
        return PositionContext.from_inputs(
            config, self.position, inputs_embeds, attention_mask, position_ids, geometry, mems, kwargs,
            attn_implementation=attention_implementation(config), output_attentions=output_attentions,
        )

    def _update_memory(self, memory: Optional[torch.Tensor], hidden_states: torch.Tensor) -> torch.Tensor:
        """Dai et al.'s memory: the last ``mem_len`` inputs of this layer, cut from the graph; with ``ext_len`` the
        last ``mem_len`` before the segment's final ``ext_len`` tokens (their code's ``_update_mems``)."""
        with torch.no_grad():
            states = hidden_states if memory is None else torch.cat([memory, hidden_states], dim=1)
            if self.config.ext_len:
                states = states[:, : states.shape[1] - min(self.config.ext_len, hidden_states.shape[1])]
            return states[:, -self.config.mem_len :].detach()


def _key_padding_mask(attention_mask: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    """The decoder's view of the source: bool ``[B, 1, 1, S]`` (True = may attend), None when nothing is padding.

    Own code, not ``create_bidirectional_mask``: that renders ``[B, 1, Q, S]`` (a float one under eager), while the
    cross-attention takes the keys' mask once for all query rows, as T5 does."""
    if attention_mask is None or (not torch.compiler.is_compiling() and bool(attention_mask.all())):
        return None
    return attention_mask.bool()[:, None, None, :]


class RelPosCrossDecoder(RelPosModel):
    """An encoder-decoder's decoder stack: ``RelPosModel`` whose layers also cross-attend to the encoder
    (its config has ``is_encoder_decoder`` and ``is_decoder``); its outputs add ``cross_attentions``."""

    _can_record_outputs = {**RelPosModel._can_record_outputs, "cross_attentions": RelPosCrossAttention}


# ----------------------------------------------------------------------------------
# Heads
# ----------------------------------------------------------------------------------


class RelPosForCausalLM(RelPosPreTrainedModel, CausalLMGenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: RelPosConfig):
        check_holds(type(self).__name__, config, encoder_decoder=False)
        if not config.is_decoder:
            raise ValueError(
                "RelPosForCausalLM needs config.is_decoder=True (causal attention), got is_decoder=False"
            )
        super().__init__(config)
        self.model = RelPosModel(config)
        if config.cutoffs is None:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        else:  # Grave et al.'s adaptive softmax: the logits are log-probabilities
            self.lm_head = ProjectedAdaptiveLogSoftmax(
                config.vocab_size, config.hidden_size, config.adaptive_embedding_size, config.cutoffs, config.div_val
            )
            # Read by Transformers' save_pretrained to drop the tied copies (the class's names a single table).
            self._tied_weights_keys = self.tied_keys(config)
        self.post_init()

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict:
        """With ``cutoffs``: each cluster's output table is its input table (``tie_word_embeddings``), and each output
        projection the input's where ``tie_projs`` says (whatever ``tie_word_embeddings``, as TransfoXL ties them)."""
        if self.config.cutoffs is None:
            return super().get_expanded_tied_weights_keys(all_submodels)
        return self.tied_keys(self.config)

    @staticmethod
    def tied_keys(config: RelPosConfig) -> dict:
        """The adaptive softmax's parameters that are the adaptive input's, by full name (``cutoffs`` set)."""
        names = tied_names(len(config.cutoffs) + 1, config.hidden_size, config.adaptive_embedding_size,
                           config.div_val, config.tie_word_embeddings, config.projection_ties)
        return {f"lm_head.{target}": f"model.embed_tokens.{source}" for target, source in names.items()}

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def init_mems(self, batch_size: int) -> list:
        """Empty Transformer-XL memories, one ``[batch_size, 0, hidden_size]`` per layer: the first segment then
        attends to itself alone, as Dai et al.'s code starts (Transformers' TransfoXL started from ``mem_len`` zero
        vectors instead: pass ``[torch.zeros(batch_size, mem_len, hidden_size)] * num_hidden_layers`` for that)."""
        if self.config.mem_len == 0:
            raise ValueError(
                f"init_mems needs a model with memory (RelPosConfig.mem_len > 0), got mem_len=0 with "
                f"position_encoding={self.config.position_encoding!r}"
            )
        parameter = next(self.parameters())
        empty = torch.zeros(batch_size, 0, self.config.hidden_size, dtype=parameter.dtype, device=parameter.device)
        return [empty] * self.config.num_hidden_layers

    @can_return_tuple
    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        cache: Optional[Cache] = None,
        inputs_embeds: Optional[torch.FloatTensor] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        mems: Optional[list] = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: Optional[Cache] = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> RelPosCausalLMOutput:
        """Transformers' model keyword arguments reach the model, and ``num_items_in_batch``, ``ignore_index`` and
        ``shift_labels`` Transformers' loss; a loss is computed from ``labels`` or ``shift_labels``. The cache is
        ``cache`` or ``past_key_values`` (its name before Transformers 5.24); any other keyword is a ``TypeError``.
        Continuous batching's steps also pass ``logits_indices`` (the rows it reads: ``logits_to_keep`` when given)."""
        logits_indices = kwargs.pop("logits_indices", None)
        kwargs.pop("logits_processor_args", None)  # read by continuous batching's processors, not the model
        logits_to_keep = self._check_logits_indices(logits_indices, logits_to_keep, input_ids, inputs_embeds)
        loss_kwargs = split_loss_kwargs(type(self).__name__, kwargs, CAUSAL_LOSS_KWARGS)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=one_cache(cache, past_key_values),
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            mems=mems,
            return_dict=True,  # the head builds its own output (a tuple when asked for, by can_return_tuple)
            **kwargs,
        )
        hidden = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
        if self.config.scale_decoder_outputs:  # T5 v1.0's d_model**-0.5 before the (tied) output layer, as seq2seq's
            hidden = hidden * self.config.hidden_size**-0.5
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None or loss_kwargs.get("shift_labels") is not None:
            for name, target in (("labels", labels), ("shift_labels", loss_kwargs.get("shift_labels"))):
                if target is not None and target.shape != logits.shape[:2]:
                    raise ValueError(
                        f"{name} must be [batch, seq_len] = {list(logits.shape[:2])}, got {tuple(target.shape)}"
                    )
            loss = self._token_loss(logits, labels, **loss_kwargs)
        return RelPosCausalLMOutput(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            mems=outputs.mems,
            **{CACHE_FIELD: getattr(outputs, CACHE_FIELD)},
        )

    @staticmethod
    def _check_logits_indices(logits_indices, logits_to_keep, input_ids, inputs_embeds):
        """Check a step's ``logits_indices`` (the rows continuous batching reads): row indices, the same rows as a
        tensor ``logits_to_keep`` (it passes both when the model takes ``logits_to_keep``, which slices here)."""
        if logits_indices is None:
            return logits_to_keep
        length = (input_ids if input_ids is not None else inputs_embeds).shape[1]
        if not isinstance(logits_indices, torch.Tensor) or logits_indices.dim() != 1 or logits_indices.is_floating_point():
            raise ValueError(f"logits_indices must be a 1-D tensor of row indices, got {logits_indices!r:.80}")
        if not torch.compiler.is_compiling():
            if logits_indices.numel() and (int(logits_indices.min()) < 0 or int(logits_indices.max()) >= length):
                raise ValueError(f"logits_indices must index the {length} input rows, got {logits_indices.tolist()}")
            keep = logits_to_keep
            if not (isinstance(keep, int) and keep == 0) and not (
                isinstance(keep, torch.Tensor) and torch.equal(keep.cpu().long(), logits_indices.cpu().long())
            ):
                raise ValueError(
                    f"logits_indices {logits_indices.tolist()} and logits_to_keep {keep!r:.80} name different rows"
                )
        return logits_to_keep  # 0: every row, which the caller then indexes by logits_indices itself

class RelPosForSequenceClassification(RelPosPreTrainedModel):
    """Pools the last non-padding token (causal models) or the mean of non-padding tokens (bidirectional)."""

    def __init__(self, config: RelPosConfig):
        check_holds(type(self).__name__, config, encoder_decoder=False)
        super().__init__(config)
        self.num_labels = config.num_labels
        self.model = RelPosModel(config)
        self.score = nn.Linear(config.hidden_size, config.num_labels, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    @can_return_tuple
    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.LongTensor] = None,
        inputs_embeds: Optional[torch.FloatTensor] = None,
        labels: Optional[torch.LongTensor] = None,
        mems: Optional[list] = None,
        use_cache: Optional[bool] = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> RelPosSequenceClassifierOutput:
        """Transformers' model keyword arguments reach the model; any other keyword is a ``TypeError``. A classifier
        keeps no cache: ``use_cache`` may be None or False."""
        refuse_unknown_kwargs(type(self).__name__, kwargs, MODEL_KWARGS)
        if use_cache:
            raise ValueError("use_cache=True: RelPosForSequenceClassification keeps no cache (pass None or False)")
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            use_cache=False,
            mems=mems,
            return_dict=True,  # the head builds its own output (a tuple when asked for, by can_return_tuple)
            **kwargs,
        )
        hidden = outputs.last_hidden_state
        batch, length = hidden.shape[:2]
        if attention_mask is not None:
            keep = attention_mask[:, -length:].to(hidden.dtype)
        elif input_ids is not None and self.config.pad_token_id is not None:
            keep = (input_ids != self.config.pad_token_id).to(hidden.dtype)
        else:
            keep = torch.ones(batch, length, dtype=hidden.dtype, device=hidden.device)
        if self.config.is_decoder:
            # The last kept token sees the whole sequence; works for left and right padding.
            index = (keep * torch.arange(1, length + 1, device=hidden.device, dtype=hidden.dtype)).argmax(-1)
            pooled = hidden[torch.arange(batch, device=hidden.device), index]
        else:
            pooled = (hidden * keep[..., None]).sum(1) / keep.sum(1, keepdim=True).clamp_min(1.0)
        logits = self.score(pooled)
        loss = None
        if labels is not None:
            loss = self.loss_function(labels=labels, pooled_logits=logits, config=self.config)
        return RelPosSequenceClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions,
            mems=outputs.mems,
        )


class RelPosForConditionalGeneration(RelPosPreTrainedModel, Seq2SeqGenerationMixin):
    """An encoder-decoder in T5's layout: one token table (``shared``) for the encoder, the decoder and (with
    ``tie_word_embeddings``) the output layer; a bidirectional encoder and a causal decoder (``RelPosModel``
    stacks, each with its own position parameters: T5's one bias table per stack); the decoder's layers
    cross-attend to the encoder's last states. ``labels`` give the loss, and ``decoder_input_ids`` default
    to the labels shifted right behind ``decoder_start_token_id`` (T5's ``_shift_right``)."""

    _layer_stacks = (("num_hidden_layers", "encoder."), ("num_decoder_layers", "decoder."))
    # Both stacks always read the shared table; the output layer does when tie_word_embeddings (see below).
    _tied_weights_keys = {
        "encoder.embed_tokens.weight": "shared.weight",
        "decoder.embed_tokens.weight": "shared.weight",
        "lm_head.weight": "shared.weight",
    }

    def __init__(self, config: RelPosConfig):
        check_holds(type(self).__name__, config, encoder_decoder=True)
        super().__init__(config)
        self.loss_type = "ForMaskedLM"  # labels are aligned with the logits (no shift inside the loss), as T5's
        self.shared = nn.Embedding(config.vocab_size, config.hidden_size)  # no padding_idx: see RelPosModel
        self.encoder = RelPosModel(config.stack_config(decoder=False), stack=True)
        self.decoder = RelPosCrossDecoder(config.stack_config(decoder=True), stack=True)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_expanded_tied_weights_keys(self, all_submodels: bool = False) -> dict:
        """Transformers ties ``_tied_weights_keys`` only with ``tie_word_embeddings``; here the stacks' tables
        are always the shared one (they are one table in T5), the output layer only when tied."""
        tied = dict(self._tied_weights_keys)
        if not self.config.tie_word_embeddings:
            del tied["lm_head.weight"]
        return tied

    def get_input_embeddings(self):
        return self.shared

    def set_input_embeddings(self, value):
        self.shared = value
        self.encoder.set_input_embeddings(value)
        self.decoder.set_input_embeddings(value)

    def get_encoder(self, modality: Optional[str] = None):
        return self.encoder

    def resize_token_embeddings(self, *args, **kwargs) -> nn.Embedding:
        """Transformers updates ``config.vocab_size``; the stacks' configs are copies (``stack_config``) whose
        ``vocab_size`` bounds the token ids each stack accepts: they follow."""
        embeddings = super().resize_token_embeddings(*args, **kwargs)
        for stack in (self.encoder, self.decoder):
            stack.config.vocab_size = self.config.vocab_size
        return embeddings

    def _shift_right(self, labels: torch.Tensor) -> torch.Tensor:
        """T5's decoder inputs from labels: ``decoder_start_token_id`` then the labels but the last, ``-100`` as padding."""
        start, pad = self.config.decoder_start_token_id, self.config.pad_token_id
        if start is None or pad is None:
            raise ValueError(
                "decoder_start_token_id and pad_token_id must be set to derive decoder_input_ids from labels, got "
                f"decoder_start_token_id={start!r}, pad_token_id={pad!r}"
            )
        shifted = labels.new_full(labels.shape, start)
        shifted[..., 1:] = labels[..., :-1]
        return shifted.masked_fill(shifted == -100, pad)

    def prepare_decoder_input_ids_from_labels(self, labels: torch.Tensor) -> torch.Tensor:
        return self._shift_right(labels)

    @can_return_tuple
    def forward(
        self,
        input_ids: Optional[torch.LongTensor] = None,
        attention_mask: Optional[torch.Tensor] = None,
        decoder_input_ids: Optional[torch.LongTensor] = None,
        decoder_attention_mask: Optional[torch.Tensor] = None,
        encoder_outputs: Optional[Any] = None,
        cache: Optional[Cache] = None,
        inputs_embeds: Optional[torch.FloatTensor] = None,
        decoder_inputs_embeds: Optional[torch.FloatTensor] = None,
        labels: Optional[torch.LongTensor] = None,
        use_cache: Optional[bool] = None,
        logits_to_keep: int | torch.Tensor = 0,
        past_key_values: Optional[Cache] = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> Seq2SeqLMOutput:
        """Encode (unless ``encoder_outputs`` are given, as ``generate`` does after its first step), decode, and
        score. Transformers' model keyword arguments reach both stacks, and ``num_items_in_batch`` and
        ``ignore_index`` Transformers' loss. The cache (an ``EncoderDecoderCache``) is ``cache`` or
        ``past_key_values`` (its name before Transformers 5.24); any other keyword is a ``TypeError``."""
        loss_kwargs = split_loss_kwargs(type(self).__name__, kwargs, TOKEN_LOSS_KWARGS)
        cache = one_cache(cache, past_key_values)
        if encoder_outputs is None:
            encoder_outputs = self.encoder(
                input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, return_dict=True,
                **kwargs,
            )
        elif not isinstance(encoder_outputs, BaseModelOutput):
            encoder_outputs = BaseModelOutput(
                last_hidden_state=encoder_outputs[0],
                hidden_states=encoder_outputs[1] if len(encoder_outputs) > 1 else None,
                attentions=encoder_outputs[2] if len(encoder_outputs) > 2 else None,
            )
        if labels is not None:
            if labels.dim() != 2:
                raise ValueError(f"labels must be [batch, target_len], got shape {tuple(labels.shape)}")
            if decoder_input_ids is None and decoder_inputs_embeds is None:
                decoder_input_ids = self._shift_right(labels)
        decoder_outputs = self.decoder(
            input_ids=decoder_input_ids,
            attention_mask=decoder_attention_mask,
            inputs_embeds=decoder_inputs_embeds,
            cache=cache,
            encoder_hidden_states=encoder_outputs.last_hidden_state,
            encoder_attention_mask=attention_mask,
            use_cache=use_cache,
            return_dict=True,
            **kwargs,
        )
        hidden = slice_logits_to_keep(decoder_outputs.last_hidden_state, logits_to_keep)
        if self.config.scale_decoder_outputs:  # T5 v1.0: the tied output layer reads d_model**-0.5-scaled states
            hidden = hidden * self.config.hidden_size**-0.5
        logits = self.lm_head(hidden)
        loss = None
        if labels is not None:
            if labels.shape != logits.shape[:2]:
                raise ValueError(f"labels must be [batch, target_len] = {list(logits.shape[:2])}, got {tuple(labels.shape)}")
            loss = self._token_loss(logits, labels, **loss_kwargs)
        return Seq2SeqLMOutput(
            loss=loss,
            logits=logits,
            **{CACHE_FIELD: getattr(decoder_outputs, CACHE_FIELD)},
            decoder_hidden_states=decoder_outputs.hidden_states,
            decoder_attentions=decoder_outputs.attentions,
            cross_attentions=decoder_outputs.cross_attentions,
            encoder_last_hidden_state=encoder_outputs.last_hidden_state,
            encoder_hidden_states=encoder_outputs.hidden_states,
            encoder_attentions=encoder_outputs.attentions,
        )


__all__ = [
    "RelPosPreTrainedModel",
    "RelPosModel",
    "RelPosForCausalLM",
    "RelPosForSequenceClassification",
    "RelPosForConditionalGeneration",
    "POSITION_SCHEMES",
]
