"""The position schemes of hf_relpos models, one small class each behind one seam.

``modeling_relpos.RelPosModel`` builds the ``PositionContext`` once per forward (``position_context_relpos.py``) and
asks its scheme for the per-forward term; every attention layer hands queries, keys and values to ``scheme.attend``,
which computes it through ``attention_backends_relpos.py``. A scheme says what its term is; the backend module decides
how it is computed:

- nothing beyond the mask (NoPE, the absolute baselines) or rotated queries and keys (RoPE): the mask, through
  ``interface_attention``;
- an additive bias (``AdditiveBiasScheme``: T5, log-decay, ALiBi, KERPLE, FIRE; FoX per layer): a dense bias and,
  where it has one, a compact form on small tables (``compact_form``), through ``bias_term`` and ``attend_bias``;
- a whole attention call of its own (Shaw's relative values, Transformer-XL's position-dependent query), through
  ``functional_relpos.py``'s exact computations and their fused CPU paths.

Adding a scheme means one function in ``functional_relpos.py``, one class here and one line in ``POSITION_SCHEMES``.
"""

import itertools
import math
from collections.abc import Iterable
from dataclasses import replace
from typing import Any, Optional

import torch
from torch import nn
from torch.nn import functional as F

from transformers import initialization as init

from .attention_backends_relpos import attend_bias, bias_term, interface_attention, mask_term
from .configuration_relpos import CAUSAL_ONLY, RelPosConfig
from .functional_relpos import (
    KEY_BIAS_SPAN,
    alibi_bias,
    alibi_key_bias,
    alibi_slopes,
    fire_bias,
    fox_bias,
    fox_key_bias,
    fox_query_key_bias,
    kerple_log_bias,
    log_decay_bias,
    shaw_attention,
    sinusoidal_embedding,
    t5_bias_by_distance,
    t5_position_bias,
    t5_relative_position_bucket,
    t5_saturation_distance,
    transformer_xl_attention,
)
from .position_context_relpos import PositionContext
from .transformer_xl_relpos import RelativeDistances, TransformerXLRelative

# ----------------------------------------------------------------------------------
# Position schemes: the seam
# ----------------------------------------------------------------------------------


class PositionScheme(nn.Module):
    """A position scheme answers five questions; the default answer is "nothing".

    - ``embed``: what it adds to the token embeddings (absolute baselines);
    - ``forward``: the per-forward term, computed once for the new query rows against all keys and
      handed to every layer (a bias merged into the mask, RoPE's cos/sin, Transformer-XL's distances);
    - ``rotate``: what it does to queries and keys before the cache (RoPE);
    - ``prepare``: what it derives from each layer's input before the cache (FoX's forget gate, carried in
      ``key_channels`` extra channels of the keys, so that every cache operation keeps it with its key);
    - ``attend``: the attention call, returning the output ``[B, Q, H, D]`` and the probabilities
      ``[B, H, Q, K]`` when ``ctx.output_attentions`` (else None); the default runs Transformers'
      attention interface with the term as the mask, so an additive bias rides in SDPA's fused kernel.

    Per-layer parameters (Shaw's embeddings, Transformer-XL's ``W_{k,R}``, ``u``, ``v``) come from
    ``layer_module`` and live in each attention module as ``relative``.
    """

    # The std the token embeddings start with, where the scheme's recipe asks for one (None: initializer_range).
    token_init_std: Optional[float] = None
    # Channels the scheme appends to the keys (and so to the cache's keys) beyond head_dim, in ``prepare``.
    key_channels: int = 0
    # The compact form of the scheme's bias that a fused path takes (a key of attention_backends_relpos.COMPACT_PATHS:
    # "distance", a bias per clipped distance; "key", a bias per key of causal attention), None without one.
    compact_form: Optional[str] = None
    # The term as FlexAttention's score function (a key of flex_backend_relpos.SCORE_MODS: "distance", a bias per signed
    # distance; "query_key", a bias per query plus one per key; "": nothing beyond the mask), or None where the term
    # is no function of a score and two small tables, and ``score_refusal`` says why (flex refused).
    score_form: Optional[str] = ""
    score_refusal: Optional[str] = None
    # The config fields sizing each dimension of the scheme's parameters, by the end of their names (the loading
    # check names the field when a config does not describe its checkpoint: loading_relpos.parameter_fields).
    parameter_fields: tuple = ()
    # Context parallelism shards the sequence and keeps only a plain causal mask: a scheme survives it only if it
    # acts before attention, on position ids (a bias over global distances, Shaw's and Transformer-XL's terms
    # would be dropped).
    context_parallel: bool = False
    # Whether the model takes a segment memory (``mems``, Transformer-XL's) where the config's mem_len > 0.
    takes_memory: bool = False

    @staticmethod
    def continuous_batching_refusal(config: RelPosConfig) -> Optional[str]:
        """Why a causal model of this scheme cannot take part in continuous batching (None when it can)."""
        return None

    def __init__(self, config: RelPosConfig):
        super().__init__()
        if config.position_encoding in CAUSAL_ONLY and not config.is_decoder:  # is_decoder set after construction
            raise ValueError(
                f"RelPosConfig.is_decoder must be True for position_encoding={config.position_encoding!r} (defined "
                f"for causal attention only), got {config.is_decoder!r}"
            )
        self.num_heads = config.num_attention_heads
        self.head_dim = config.head_dim

    @staticmethod
    def layer_module(config: RelPosConfig) -> Optional[nn.Module]:
        return None

    def check_positions(self, position_ids: torch.Tensor) -> None:
        """Refuse positions the scheme cannot embed (an absolute table's end); runs before any layer."""

    def embed(self, inputs_embeds: torch.Tensor, ctx: PositionContext) -> torch.Tensor:
        return inputs_embeds

    def forward(self, ctx: PositionContext, device, dtype) -> Any:
        return mask_term(ctx, device)

    def terms(self, ctx: PositionContext, device, dtype, layers: int) -> Iterable:
        """The term of each of the ``layers`` layers, in order: the one ``forward`` term for all of them; a scheme
        with a term of its own per layer (UMT5's T5 tables) gives one each."""
        return itertools.repeat(self(ctx, device, dtype), layers)

    def rotate(self, query, key, term, ctx):
        return query, key

    def prepare(self, attn: nn.Module, hidden_states, query, key, ctx: PositionContext):
        """Queries and keys after what the scheme derives from the layer's input ``hidden_states`` (what
        ``q_proj`` reads), before the cache update; ``attend`` gets the keys as cached."""
        return query, key

    def attend(self, attn: nn.Module, query, key, value, term, ctx: PositionContext):
        return interface_attention(attn, query, key, value, term if isinstance(term, torch.Tensor) else None, ctx)


class AdditiveBiasScheme(PositionScheme):
    """A scheme whose whole position term is an additive ``[1, H, Q, K]`` bias.

    The bias is computed once per forward and merged with the mask into one float tensor
    (masked entries at the dtype's minimum) that every layer passes to the kernel as its mask. That
    tensor is the whole per-forward term, so that it reaches the layers as a positional tensor, which
    reentrant activation checkpointing needs to carry a trained bias's gradient back to its table.

    A scheme whose bias has a compact form (T5's bias per clipped distance, causal ALiBi's bias per key) names it
    in ``compact_form`` (a key of ``attention_backends_relpos.COMPACT_PATHS``) and returns it from ``compact`` (None
    where it does not apply); the backend asks for it only where a fused path takes it (``bias_term``).
    """

    score_form = "distance"
    # A bias of the signed distance alone that never stops changing (ALiBi's, log-decay's, KERPLE's): a bidirectional
    # model's scheme hands it over as the bias of every distance (compact_form "distance", ``compact``).
    of_distance_alone: bool = False

    def __init__(self, config: RelPosConfig):
        super().__init__(config)
        self.attention_dropout = config.attention_dropout
        if self.of_distance_alone and not config.is_decoder:
            self.compact_form = "distance"

    def bias(self, ctx: PositionContext, device, dtype) -> torch.Tensor:
        raise NotImplementedError

    def compact(self, ctx: PositionContext, device, dtype) -> Optional[torch.Tensor]:
        """A bidirectional bias of the distance alone as the bias of every distance ``-(n-1) .. n-1`` (``[H, 2n-1]``,
        each value as the dense bias computes it: ``bias_by_distance``), which saturating_bias_attention takes with
        ``s = n - 1`` and the fused kernel reads as a view; None elsewhere (causal, a cache, explicit positions)."""
        n = ctx.query_length
        if self.compact_form != "distance" or ctx.causal or n < 2 or ctx.key_length != n:
            return None
        return None if ctx.relative_position is not None else self.bias_by_distance(ctx, device)

    def bias_by_distance(self, ctx: PositionContext, device) -> torch.Tensor:
        """``[H, Q + K - 1]``: the bias of every signed distance ``j - (past + i)`` the forward holds, at index
        ``j - i + Q - 1`` (FlexAttention's score form "distance"): the scheme's own ``bias`` of one query at
        ``past + Q - 1`` over ``Q + K - 1`` keys, so each value is computed as the dense bias computes it."""
        row = replace(ctx, query_length=1, key_length=ctx.key_length + ctx.query_length - 1,
                      past_length=ctx.past_length + ctx.query_length - 1)
        bias = self.bias(row, device, torch.float32)[0, :, 0]
        # At least float32 (a half-precision model's), and float64 kept: a float64 model's KERPLE bias was rounded
        # to float32 here, 5e-7 from the dense bias's.
        bias = bias.to(torch.promote_types(bias.dtype, torch.float32))
        return bias.expand(self.num_heads, -1).contiguous()  # a bias the same for every head (log-decay's)

    def kernel_term(self, ctx: PositionContext, device) -> tuple:
        """The term as the Triton kernel computes it (``triton_attention_relpos.TERMS``): ``(name, values, index)``."""
        raise NotImplementedError

    def forward(self, ctx: PositionContext, device, dtype) -> torch.Tensor:
        """The bias term as the backend computes it: the compact form, the bias merged with the mask, or the
        bias of each distance (FlexAttention)."""
        dropout = self.attention_dropout if self.training else 0.0
        return bias_term(
            ctx, device, dtype, dropout, self.compact_form,
            compact=lambda: self.compact(ctx, device, dtype), dense=lambda: self.bias(ctx, device, dtype),
            score=lambda: self.bias_by_distance(ctx, device), kernel=lambda: self.kernel_term(ctx, device),
        )

    def attend(self, attn, query, key, value, bias, ctx):
        return attend_bias(attn, query, key, value, bias, ctx, self.compact_form)


class T5BiasScheme(AdditiveBiasScheme):
    """Raffel et al. 2020: a learned scalar per (distance bucket, head), one table for all layers; with
    ``relative_attention_per_layer`` one table per layer instead (UMT5, Chung et al. 2023), each a scheme of one
    table in ``layers``, whose terms ``terms`` computes one layer at a time."""

    compact_form = "distance"

    # A per-layer table is "layers.{i}.relative_attention_bias.weight": the same field sizes it
    parameter_fields = (
        (r"relative_attention_bias\.weight", (("relative_attention_num_buckets",), ("num_attention_heads",))),
    )

    def __init__(self, config: RelPosConfig, *, one_table: bool = False):
        super().__init__(config)
        self.bidirectional = not config.is_decoder
        self.max_distance = config.relative_attention_max_distance
        self.layers = None
        if config.relative_attention_per_layer and not one_table:
            self.layers = nn.ModuleList(T5BiasScheme(config, one_table=True) for _ in range(config.num_hidden_layers))
            return
        self.relative_attention_bias = nn.Embedding(config.relative_attention_num_buckets, config.num_attention_heads)
        # Upstream T5's initialisation of the table (T5PreTrainedModel._init_weights, factor 1), not initializer_range.
        self.relative_attention_bias.init_std = config.hidden_size**-0.5

    def terms(self, ctx, device, dtype, layers):
        if self.layers is None:
            return super().terms(ctx, device, dtype, layers)
        if layers != len(self.layers):
            raise ValueError(f"{len(self.layers)} T5 bias tables for {layers} layers")
        return (table(ctx, device, dtype) for table in self.layers)  # each computed when its layer comes

    def bias(self, ctx, device, dtype):
        return t5_position_bias(
            self._weight(device),
            ctx.query_length,
            ctx.key_length,
            bidirectional=self.bidirectional,
            max_distance=self.max_distance,
            past_length=ctx.past_length,
            relative_position=ctx.relative_position,
        )

    def _weight(self, device) -> torch.Tensor:
        table = self.relative_attention_bias
        return table(torch.arange(table.num_embeddings, device=device))

    def compact(self, ctx, device, dtype):
        """The bias per clipped distance ``[H, 2s+1]``: beyond ``s`` it is constant, and those key ranges run
        in the fused kernel (saturating_bias_attention, which takes the band once the sequence is long
        enough to pay); no ``[1, H, Q, K]`` bias is formed."""
        weight = self._weight(device)
        return t5_bias_by_distance(weight, bidirectional=self.bidirectional, max_distance=self.max_distance).to(dtype)

    def kernel_term(self, ctx, device):
        """The table ``[H, buckets]`` read through the bucket of each distance ``-s .. s`` (constant beyond ``s``),
        from T5's own bucket function: no logarithm in the kernel, exact at the bucket edges."""
        weight = self._weight(device)
        s = t5_saturation_distance(self.bidirectional, weight.shape[0], self.max_distance)
        distances = torch.arange(-s, s + 1, device=device)
        buckets = t5_relative_position_bucket(distances, self.bidirectional, weight.shape[0], self.max_distance)
        return "table", weight.t(), buckets


class LogDecayScheme(AdditiveBiasScheme):
    """The fixed bias ``-λ·ln(1 + |i - j|)``, the same for every head."""

    of_distance_alone = True

    def __init__(self, config: RelPosConfig):
        super().__init__(config)
        self.scale = config.log_decay_scale

    def bias(self, ctx, device, dtype):
        bias = log_decay_bias(
            ctx.query_length, ctx.key_length, scale=self.scale, past_length=ctx.past_length, device=device,
            dtype=torch.float32, relative_position=ctx.relative_position,
        )
        return bias[None, None]

    def kernel_term(self, ctx, device):
        """``-λ·ln(1 + 1·|d|)``: KERPLE's closed form with ``a = λ``, ``c = 1`` for every head."""
        ones = torch.ones(self.num_heads, device=device)
        return "log", torch.stack([ones * self.scale, ones]), None


class AlibiScheme(AdditiveBiasScheme):
    """Press et al. 2022: ``-m_h·|i - j|`` with fixed geometric head slopes."""

    compact_form = "key"  # causal; a bidirectional model's scheme takes "distance" (AdditiveBiasScheme.__init__)
    of_distance_alone = True

    def __init__(self, config: RelPosConfig):
        super().__init__(config)
        # The fixed slopes in float32 as a plain attribute, not a buffer, which `.to(bf16)` would round (and
        # `from_pretrained` would rebuild in float32: a model that changes when reloaded); made here, on the CPU
        # (also under from_pretrained's meta device), not in forward, where torch.export's strict tracing would
        # lift a fresh tensor under the path it reached the module by (after Transformers' DynamoExporter,
        # `model.forward.__self__...`, which unlifting cannot find).
        self.slopes = alibi_slopes(self.num_heads, device="cpu", dtype=torch.float32)

    def bias(self, ctx, device, dtype):
        return alibi_bias(
            self.slopes.to(device), ctx.query_length, ctx.key_length, past_length=ctx.past_length,
            relative_position=ctx.relative_position,
        )

    def compact(self, ctx, device, dtype):
        """Causal ALiBi as a bias per key ``[H, K]`` (softmax ignores the row constant), which rides in the
        fused causal kernel (causal_key_bias_attention); in float64, so that the kernel's per-chunk
        differences of it are exact. Bidirectional ALiBi as the bias of every distance (``AdditiveBiasScheme``)."""
        if self.compact_form == "distance":
            return super().compact(ctx, device, dtype)
        if not ctx.causal or ctx.query_length < 2:
            return None
        return alibi_key_bias(alibi_slopes(self.num_heads, device=device, dtype=torch.float64), ctx.key_length)

    def kernel_term(self, ctx, device):
        """``-m_h·|d|`` in closed form (the second row unused)."""
        slopes = self.slopes.to(device)
        return "linear", torch.stack([slopes, torch.zeros_like(slopes)]), None


class KerpleLogScheme(AdditiveBiasScheme):
    """Chi et al. 2022 (KERPLE, logarithmic variant): ``-r1_h·ln(1 + r2_h·|i - j|)``, learned ``r1_h, r2_h > 0``."""

    of_distance_alone = True

    # KERPLE's code keeps r1, r2 positive by clamping them at this floor.
    floor = 1e-2
    parameter_fields = ((r"position\.r[12]", (("num_attention_heads",),)),)

    def __init__(self, config: RelPosConfig):
        super().__init__(config)
        self.r1 = nn.Parameter(torch.ones(config.num_attention_heads))
        self.r2 = nn.Parameter(torch.ones(config.num_attention_heads))

    def init_position_weights(self, std: float) -> None:
        """``_init_weights``: as KERPLE's code, r1 ~ U(0, 2), r2 ~ U(0, 1)."""
        init.uniform_(self.r1, 0.0, 2.0)
        init.uniform_(self.r2, 0.0, 1.0)

    def bias(self, ctx, device, dtype):
        r1, r2 = self._clamped()
        return kerple_log_bias(
            r1, r2, ctx.query_length, ctx.key_length, past_length=ctx.past_length,
            relative_position=ctx.relative_position,
        )

    def _clamped(self):
        # Clamped in value, not in gradient (straight through): a parameter below the floor can still come back,
        # as with KERPLE's in-place clamp of the data; a plain clamp_min would freeze it there for good.
        return tuple(r + (r.clamp_min(self.floor) - r).detach() for r in (self.r1, self.r2))

    def kernel_term(self, ctx, device):
        """``-r1_h·ln(1 + r2_h·|d|)`` in closed form; the kernel returns the gradients of ``r1`` and ``r2``."""
        return "log", torch.stack(self._clamped()).to(device), None


class FireScheme(AdditiveBiasScheme):
    """Li et al. 2024 (FIRE): a learned MLP of the progressively normalised log distance, causal."""

    score_form = None
    score_refusal = (
        "FIRE's bias depends on each query's position as well as the distance (its normaliser psi(max(L, i))), "
        "so it is no table of distances, and its MLP inside the kernel would run once per query-key pair"
    )

    parameter_fields = (
        (r"position\.mlp\.2\.bias", (("num_attention_heads",),)),
        (r"position\.mlp\.0\.weight", (("fire_mlp_width",), ())),
        (r"position\.mlp\.0\.bias", (("fire_mlp_width",),)),
        (r"position\.mlp\.2\.weight", (("num_attention_heads",), ("fire_mlp_width",))),
        (r"position\.(c|threshold_scale)", ()),
    )

    def __init__(self, config: RelPosConfig):
        super().__init__(config)
        self.init_threshold = config.fire_threshold
        self.mlp = nn.Sequential(
            nn.Linear(1, config.fire_mlp_width), nn.ReLU(), nn.Linear(config.fire_mlp_width, config.num_attention_heads)
        )
        # PyTorch's default Linear initialisation, as the paper's code: with the model's (zero biases, inputs
        # >= 0) every unit with a negative input weight would start, and stay, dead under the ReLU.
        for linear in (self.mlp[0], self.mlp[2]):
            linear.torch_default_init = True
        self.c = nn.Parameter(torch.tensor(0.1))
        # The threshold L as the paper's code learns it: a multiplier of its initial value.
        self.threshold_scale = nn.Parameter(torch.tensor(1.0))

    def init_position_weights(self, std: float) -> None:
        """``_init_weights``: as FIRE's code, c = 0.1 and the threshold multiplier 1 (the MLP's Linear layers are
        initialised as PyTorch does, ``torch_default_init``)."""
        init.constant_(self.c, 0.1)
        init.constant_(self.threshold_scale, 1.0)

    def bias(self, ctx, device, dtype):
        first, last = self.mlp[0], self.mlp[2]
        threshold = (self.threshold_scale * self.init_threshold).abs()
        # The normaliser reads each query's position in its sequence (ctx.position_ids: a sliding window's
        # dropped keys, left padding and packed documents make it differ from its index among the keys).
        return fire_bias(
            first.weight, first.bias, last.weight, last.bias, self.c, threshold, ctx.query_length, ctx.key_length,
            past_length=ctx.past_length, positions=ctx.position_ids, relative_position=ctx.relative_position,
        )


class ForgetGate(nn.Module):
    """One layer's FoX forget gate, ``log f_t = logsigmoid(fgate_proj(x_t))`` per head, in float32.

    Named and initialised as the authors' ``fgate_proj`` (zhixuan-lin/forgetting-transformer,
    ``modeling_forgetting_transformer.py``, ``fgate_type="full"``): ``Linear(hidden, heads, bias=True)``, weights
    ``N(0, initializer_range)`` and zero bias (their ``_init_weights``; the model's), so ``f`` starts near 1/2.
    """

    def __init__(self, config: RelPosConfig):
        super().__init__()
        self.fgate_proj = nn.Linear(config.hidden_size, config.num_attention_heads, bias=True)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[B, T, hidden] -> [B, H, T]``."""
        return F.logsigmoid(self.fgate_proj(hidden_states).float()).transpose(1, 2)


class FoxScheme(PositionScheme):
    """Lin et al. 2025 (the Forgetting Transformer): no position encoding, and a forget gate per layer and
    head: query ``i`` scores key ``j <= i`` with ``q_i·k_j + Σ_{l=j+1..i} log f_l`` (causal only).

    ``prepare`` computes each token's ``log f`` from the layer's input and carries it as one more channel of
    its key (keys cached as ``[B, H, T, head_dim + 1]``), so the cache's every operation (beam reorder, crop,
    batch select, a StaticCache's slots, a sliding window) keeps it with its key; ``attend`` splits it off and
    takes ``c = cumsum(log f)`` over the keys it holds: the fused per-key path (``-c_j``) for self-attention of
    a fresh forward on CPU, else the exact ``c_{past+i} - c_j`` merged with the mask. In half precision the
    cached ``log f`` rounds to the keys' dtype (the same for cached and uncached calls).
    """

    key_channels = 1
    compact_form = "key"  # -c_j, a bias per key
    score_form = "query_key"  # c_{past+i}, then -c_j
    parameter_fields = (  # the forget gate
        (r"fgate_proj\.weight", (("num_attention_heads",), ("hidden_size",))),
        (r"fgate_proj\.bias", (("num_attention_heads",),)),
    )

    @staticmethod
    def continuous_batching_refusal(config):
        return (
            "position_encoding='fox': FoX carries each token's forget gate in one more channel of its cached key, "
            "which the paged cache's blocks (sized head_dim) have no room for; use generate"
        )

    @staticmethod
    def layer_module(config):
        return ForgetGate(config)

    def forward(self, ctx, device, dtype):
        return None  # the term depends on each layer's gate: made in attend

    def prepare(self, attn, hidden_states, query, key, ctx):
        log_forget = attn.relative(hidden_states)  # [B, H, T]
        return query, torch.cat([key, log_forget.to(key.dtype)[..., None]], dim=-1)

    def attend(self, attn, query, key, value, term, ctx):
        key, log_forget = key[..., :-1], key[..., -1]
        dropout = attn.attention_dropout if attn.training else 0.0
        bias = bias_term(
            ctx, query.device, query.dtype, dropout, self.compact_form,
            compact=lambda: fox_key_bias(log_forget),
            dense=lambda: fox_bias(log_forget, ctx.query_length, past_length=ctx.past_length),
            score=lambda: fox_query_key_bias(log_forget, ctx.query_length, past_length=ctx.past_length),
            kernel=lambda: ("query_key", fox_query_key_bias(log_forget, ctx.query_length, past_length=ctx.past_length),
                            None),
        )
        # c_j grows along the sequence without bound: the fused path keeps its spread over a chunk of rows small.
        return attend_bias(attn, query, key, value, bias, ctx, self.compact_form, span=KEY_BIAS_SPAN)


class RopeScheme(PositionScheme):
    """Su et al. 2021: rotate query/key pairs by ``position · θ^(-2k/d)`` (the plain-SDPA floor)."""

    context_parallel = True

    def __init__(self, config: RelPosConfig):
        super().__init__(config)
        self.theta = config.rope_theta

    def forward(self, ctx, device, dtype):
        exponents = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32) / self.head_dim
        freqs = ctx.position_ids[..., None].float() * (1.0 / self.theta**exponents)[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)  # [B|1, Q, D]
        return super().forward(ctx, device, dtype), emb.cos().to(dtype), emb.sin().to(dtype)

    def rotate(self, query, key, term, ctx):
        _, cos, sin = term
        cos, sin = cos[:, None], sin[:, None]

        def rotate_half(x):
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat((-x2, x1), dim=-1)

        return query * cos + rotate_half(query) * sin, key * cos + rotate_half(key) * sin

    def attend(self, attn, query, key, value, term, ctx):
        return super().attend(attn, query, key, value, term[0], ctx)


class AbsoluteScheme(PositionScheme):
    """Absolute positions added to the token embeddings, limited to ``max_position_embeddings``."""

    context_parallel = True

    def __init__(self, config: RelPosConfig):
        super().__init__(config)
        self.max_positions = config.max_position_embeddings
        self.encoding = config.position_encoding

    def check_positions(self, position_ids):
        if not torch.compiler.is_compiling():  # a host read: eager calls only
            first, last = int(position_ids.min()), int(position_ids.max())
            if first < 0:
                raise ValueError(
                    f"position_ids hold a negative position {first}: the {self.encoding!r} position table starts at 0"
                )
            if last >= self.max_positions:
                raise ValueError(
                    f"position {last} is past max_position_embeddings={self.max_positions} of the "
                    f"{self.encoding!r} position table: inputs (with cache) may hold at most "
                    f"{self.max_positions} tokens"
                )


class SinusoidalScheme(AbsoluteScheme):
    """Vaswani et al. 2017's fixed sinusoidal absolute positions."""

    def __init__(self, config: RelPosConfig):
        super().__init__(config)
        self.hidden_size = config.hidden_size
        # The paper's (tensor2tensor's) token embeddings start at std d_model**-0.5: times sqrt(d_model),
        # unit-size vectors beside unit-amplitude sinusoids.
        self.token_init_std = config.hidden_size**-0.5

    def embed(self, inputs_embeds, ctx):
        """Vaswani et al. 2017, sec. 3.4: the token embeddings are multiplied by ``sqrt(d_model)`` before the
        unit-amplitude sinusoids are added, so that neither drowns the other as training moves them."""
        positions = ctx.position_ids.flatten().float()
        table = sinusoidal_embedding(positions, self.hidden_size).view(*ctx.position_ids.shape, -1)
        return inputs_embeds * math.sqrt(self.hidden_size) + table.to(inputs_embeds.dtype)


class LearnedScheme(AbsoluteScheme):
    """A learned absolute position embedding table (GPT-2 style)."""

    parameter_fields = ((r"position_embeddings\.weight", (("max_position_embeddings",), ("hidden_size",))),)

    def __init__(self, config: RelPosConfig):
        super().__init__(config)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        # GPT-2's recipe: the position table starts at half the token embeddings' std (0.01 beside 0.02).
        self.position_embeddings.init_std = config.initializer_range / 2

    def embed(self, inputs_embeds, ctx):
        return inputs_embeds + self.position_embeddings(ctx.position_ids).to(inputs_embeds.dtype)


class NoPEScheme(PositionScheme):
    """Kazemnejad et al. 2023: no position information; the causal mask alone orders the tokens."""


class ShawRelative(nn.Module):
    """One layer's relative key (and value) embeddings for distances ``-k .. k`` (shared by heads)."""

    def __init__(self, config: RelPosConfig):
        super().__init__()
        n = 2 * config.max_relative_position + 1
        self.rel_k = nn.Parameter(torch.zeros(n, config.head_dim))
        self.rel_v = nn.Parameter(torch.zeros(n, config.head_dim)) if config.shaw_value_embeddings else None

    def init_position_weights(self, std: float) -> None:
        """``_init_weights``: N(0, std), as every table of the model."""
        init.normal_(self.rel_k, mean=0.0, std=std)
        if self.rel_v is not None:
            init.normal_(self.rel_v, mean=0.0, std=std)

    def forward(self):
        # called (not just read) so that accelerate's offload hooks load these parameters
        return self.rel_k, self.rel_v


class ShawScheme(PositionScheme):
    """Shaw et al. 2018: learned relative key/value embeddings, distances clipped to ``[-k, k]``."""

    score_form = None
    score_refusal = (
        "Shaw et al.'s relative values add to the attention's output, not to its scores, which is all a score "
        "function can change"
    )

    parameter_fields = ((r"rel_[kv]", (("max_relative_position",), ("head_dim",))),)

    def __init__(self, config: RelPosConfig):
        super().__init__(config)
        self.max_relative_position = config.max_relative_position

    @staticmethod
    def layer_module(config):
        return ShawRelative(config)

    def forward(self, ctx, device, dtype):
        return None

    @staticmethod
    def _mask(ctx: PositionContext, device) -> Optional[torch.Tensor]:
        """Padding alone as a key mask (the band keeps it); bidirectional attention also masks a static
        cache's unfilled slots, which causality hides otherwise."""
        if ctx.key_mask is not None:
            return ctx.key_mask
        return ctx.mask if ctx.causal else ctx.full_mask(device)

    def attend(self, attn, query, key, value, term, ctx):
        rel_k, rel_v = attn.relative()
        out = shaw_attention(
            query,
            key,
            value,
            rel_k,
            rel_v,
            max_relative_position=self.max_relative_position,
            attention_mask=self._mask(ctx, query.device),
            is_causal=ctx.causal,
            past_length=ctx.past_length,
            dropout_p=attn.attention_dropout if attn.training else 0.0,
            need_weights=ctx.output_attentions,
            relative_position=ctx.relative_position,
        )
        out, weights = out if ctx.output_attentions else (out, None)
        return out.transpose(1, 2), weights



class TransformerXLScheme(PositionScheme):
    """Dai et al. 2019: sinusoidal ``R`` for distances ``K-1 .. 0`` (and negative ones when bidirectional)."""

    parameter_fields = (
        (r"r_net\.weight", (("num_attention_heads", "head_dim"), ("hidden_size",))),
        (r"r_[wr]_bias", (("num_attention_heads",), ("head_dim",))),
    )
    takes_memory = True  # Dai et al.'s segment memory (``mems``), where mem_len > 0
    score_form = None
    score_refusal = (
        "Transformer-XL's position term multiplies each query (plus v) with a projected sinusoid of each distance, "
        "a [B, H, Q, K] term of the query, not a small table"
    )

    @staticmethod
    def continuous_batching_refusal(config):
        if config.mem_len == 0:
            return None
        return (
            f"position_encoding='transformer_xl' with mem_len={config.mem_len}: Transformer-XL's memory (the hidden "
            "states of the previous segment) has no place in a paged cache of keys and values; use generate, or a "
            "model with mem_len=0"
        )

    def __init__(self, config: RelPosConfig):
        super().__init__(config)
        self.clamp_len = config.clamp_len
        self.hidden_size = config.hidden_size
        # Dai et al.'s code drops R once per forward, shared by every layer (dropout_placement="transfo_xl").
        self.sinusoid_dropout = config.hidden_dropout if config.dropout_rule == "transfo_xl" else 0.0

    @staticmethod
    def layer_module(config):
        return TransformerXLRelative(config)

    def _distances(self, values, low, high, reach) -> "RelativeDistances":
        if not (self.training and self.sinusoid_dropout > 0):
            return RelativeDistances(values, low, high, reach=reach)
        sinusoid = F.dropout(sinusoidal_embedding(values, self.hidden_size), self.sinusoid_dropout, training=True)
        return RelativeDistances(values, low, high, reach=reach, sinusoid=sinusoid)

    def forward(self, ctx, device, dtype):
        """Distances from the last query's, ``past + Q - 1``, down over the ``R`` positions the relative shift
        reads: ``K`` (causal) or ``K + Q - 1``. The keys end at the last query (``past + Q = K``) except in a
        StaticCache, whose unfilled slots get negative distances that the mask hides."""
        length = ctx.key_length if ctx.causal else ctx.key_length + ctx.query_length - 1
        high = ctx.past_length + ctx.query_length - 1
        if ctx.relative_position is not None:  # explicit positions: every distance K-1 .. 0 a pair may have
            high = ctx.key_length - 1
        values = high - torch.arange(length, device=device)
        # A query sees keys up to K-1 behind it and, bidirectional, up to Q-1 ahead (the cache ends at its last one).
        reach = (0 if ctx.causal else 1 - ctx.query_length, ctx.key_length - 1)
        if self.clamp_len > 0:
            values = values.clamp(-self.clamp_len, self.clamp_len)
            reach = tuple(min(max(d, -self.clamp_len), self.clamp_len) for d in reach)
        if ctx.traced_offset:  # a traced static cache: the kept projections, gathered (see TransformerXLRelative)
            return self._distances(values, None, None, reach), dtype
        low = high - length + 1
        if self.clamp_len > 0:
            high, low = min(high, self.clamp_len), max(low, -self.clamp_len)
        return self._distances(values, low, high, reach), dtype

    def attend(self, attn, query, key, value, term, ctx):
        distances, dtype = term
        r, u, w = attn.relative(distances, dtype)
        out = transformer_xl_attention(
            query,
            key,
            value,
            r,
            u,
            w,
            # The kernel's causality assumes the keys end at the last query: a StaticCache's do not.
            attention_mask=ctx.mask if ctx.keys_end_at_query else ctx.full_mask(query.device),
            is_causal=ctx.causal,
            dropout_p=attn.attention_dropout if attn.training else 0.0,
            need_weights=ctx.output_attentions,
            relative_position=ctx.relative_position,
        )
        out, weights = out if ctx.output_attentions else (out, None)
        return out.transpose(1, 2), weights


POSITION_SCHEMES: dict[str, type[PositionScheme]] = {
    "t5_bias": T5BiasScheme,
    "shaw": ShawScheme,
    "transformer_xl": TransformerXLScheme,
    "log_decay": LogDecayScheme,
    "alibi": AlibiScheme,
    "kerple_log": KerpleLogScheme,
    "fire": FireScheme,
    "fox": FoxScheme,
    "rope": RopeScheme,
    "sinusoidal": SinusoidalScheme,
    "learned": LearnedScheme,
    "nope": NoPEScheme,
}
