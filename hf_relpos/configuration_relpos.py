"""RelPosConfig: one configuration for every position scheme of hf_relpos."""

from __future__ import annotations

import copy
import math

from transformers import PreTrainedConfig

from .functional_relpos import t5_exact_buckets

POSITION_ENCODINGS = (
    "t5_bias", "shaw", "transformer_xl", "log_decay", "alibi", "kerple_log", "fire", "rope", "sinusoidal", "learned", "nope",
    "fox",
)
# Schemes defined for causal attention only: NoPE's positions come from the causal mask alone, and FIRE
# normalises distances by the query's position, which bounds them only for keys at or before it; FoX's forget
# gates decay the past, summed from each key up to the query.
CAUSAL_ONLY = ("fire", "nope", "fox")
HIDDEN_ACTS = ("gelu", "gelu_new", "relu", "silu")
# T5's feed-forward names: "ACT" or "gated-ACT"; T5 maps "gated-gelu" to gelu_new (its v1.1 checkpoints).
FEED_FORWARD_PROJS = HIDDEN_ACTS + tuple(f"gated-{act}" for act in HIDDEN_ACTS)
NORM_TYPES = ("rms_norm", "layer_norm")
# "pre": x + f(norm(x)) (Llama, T5); "post": norm(x + f(x)) (Vaswani et al., released Transformer-XL).
NORM_POSITIONS = ("pre", "post")
# Where hidden_dropout applies besides the residual branches and the embeddings: "t5" also drops the MLP's
# activations and the stack's output (T5); "transfo_xl" also drops the sinusoid R once per forward (Dai et al.).
DROPOUT_PLACEMENTS = ("residual", "t5", "transfo_xl")
# How weights start: "default" (N(0, initializer_range), a scheme's own parameters at its recipe's std) or "t5"
# (T5's: each projection at its fan-in's std, token tables at 1.0).
INITIALIZATIONS = ("default", "t5")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _int_at_least(minimum: int):
    return lambda value: _is_int(value) and value >= minimum


_POSITIVE_INT = (_int_at_least(1), "a positive int")
_OPTIONAL_POSITIVE_INT = (lambda value: value is None or _int_at_least(1)(value), "a positive int")
_POSITIVE_FLOAT = (lambda value: _is_real(value) and math.isfinite(value) and value > 0, "a finite float > 0")
_PROBABILITY = (lambda value: _is_real(value) and 0.0 <= value < 1.0, "a float in [0, 1)")
_BOOLEAN = (lambda value: isinstance(value, bool), "True or False")

# Each field's own rule: (valid(value), what is allowed), read by one loop (RelPosConfig._validate_fields) whose
# error is "RelPosConfig.<field> must be <allowed>, got <value>". Rules that relate fields (divisibility, rope
# parity, T5 bucket room, mem_len, the window, token ids within the vocabulary) are in validate_architecture.
FIELD_RULES = {
    "position_encoding": (lambda value: value in POSITION_ENCODINGS, f"one of {list(POSITION_ENCODINGS)}"),
    "vocab_size": _POSITIVE_INT,
    "hidden_size": _POSITIVE_INT,
    "intermediate_size": _POSITIVE_INT,
    "num_hidden_layers": _POSITIVE_INT,
    "num_attention_heads": _POSITIVE_INT,
    "max_position_embeddings": _POSITIVE_INT,
    "fire_mlp_width": _POSITIVE_INT,
    "head_dim": _OPTIONAL_POSITIVE_INT,
    "hidden_act": (lambda value: value in HIDDEN_ACTS, f"one of {list(HIDDEN_ACTS)}"),
    "feed_forward_proj": (
        lambda value: value is None or value in FEED_FORWARD_PROJS,
        f"None (hidden_act, not gated) or one of {list(FEED_FORWARD_PROJS)}",
    ),
    "relative_attention_num_buckets": (_int_at_least(2), "an int >= 2"),
    "max_relative_position": (_int_at_least(0), "an int >= 0"),
    "mem_len": (_int_at_least(0), "an int >= 0"),
    "clamp_len": (lambda value: _is_int(value) and (value == -1 or value >= 1), "-1 (no clamping) or an int >= 1"),
    "log_decay_scale": _POSITIVE_FLOAT,
    "fire_threshold": _POSITIVE_FLOAT,
    "rope_theta": _POSITIVE_FLOAT,
    "rms_norm_eps": _POSITIVE_FLOAT,
    "initializer_range": _POSITIVE_FLOAT,
    "initialization": (lambda value: value in INITIALIZATIONS, f"one of {list(INITIALIZATIONS)}"),
    "attention_scale": (
        lambda value: value is None or (_is_real(value) and math.isfinite(value) and value > 0),
        "None (1/sqrt(head_dim)) or a finite float > 0",
    ),
    "hidden_dropout": _PROBABILITY,
    "attention_dropout": _PROBABILITY,
    "is_decoder": _BOOLEAN,
    "is_encoder_decoder": _BOOLEAN,
    "shaw_value_embeddings": _BOOLEAN,
    "relative_attention_per_layer": _BOOLEAN,
    "attention_bias": _BOOLEAN,
    "use_cache": _BOOLEAN,
    "tie_word_embeddings": _BOOLEAN,
    "scale_decoder_outputs": _BOOLEAN,
    "num_decoder_layers": _OPTIONAL_POSITIVE_INT,
    "cutoffs": (
        lambda value: value is None or (isinstance(value, list) and all(_is_int(c) and c >= 1 for c in value)),
        "None (one token table and output layer) or a list of positive ints (the adaptive clusters' first ids)",
    ),
    "div_val": _POSITIVE_INT,
    "embedding_size": _OPTIONAL_POSITIVE_INT,
    "tie_projs": (
        lambda value: value is None or (isinstance(value, list) and all(isinstance(t, bool) for t in value)),
        "None (all but the first) or a list of bools, one per adaptive cluster",
    ),
    "norm_type": (lambda value: value in NORM_TYPES, f"one of {list(NORM_TYPES)}"),
    "norm_position": (lambda value: value in NORM_POSITIONS, f"one of {list(NORM_POSITIONS)}"),
    "final_norm": _BOOLEAN,
    "mlp_bias": (lambda value: value is None or isinstance(value, bool), "None (attention_bias), True or False"),
    "dropout_placement": (
        lambda value: value is None or value in DROPOUT_PLACEMENTS,
        f"None (T5's for an encoder-decoder, else residual only) or one of {list(DROPOUT_PLACEMENTS)}",
    ),
    "same_length": _BOOLEAN,
    "ext_len": (_int_at_least(0), "an int >= 0"),
}


class RelPosConfig(PreTrainedConfig):
    r"""Configuration of a pre-norm Transformer whose attention uses one of hf_relpos' position schemes.

    ``position_encoding`` picks the scheme:

    - ``"t5_bias"``: T5's learned scalar per log-spaced distance bucket and head, one table shared by all
      layers (``relative_attention_num_buckets``, ``relative_attention_max_distance``), or with
      ``relative_attention_per_layer`` one table in each layer (UMT5's).
    - ``"shaw"``: Shaw et al. 2018's relative key (and, with ``shaw_value_embeddings``, value) embeddings
      for distances clipped to ``[-max_relative_position, max_relative_position]``.
    - ``"transformer_xl"``: Dai et al. 2019's relative attention with sinusoidal ``R``, per-layer ``u``, ``v``,
      ``W_{k,R}`` and segment-level memory (``mem_len``, ``clamp_len``).
    - ``"log_decay"``: the fixed bias ``-log_decay_scale * ln(1 + |i - j|)``.
    - ``"alibi"``: Press et al. 2022's fixed linear biases.
    - ``"kerple_log"``: Chi et al. 2022's learned ``-r1_h * ln(1 + r2_h * |i - j|)``, ``r1_h, r2_h > 0`` per head.
    - ``"fire"``: Li et al. 2024's learned MLP (width ``fire_mlp_width``) of the progressively normalised log
      distance, with a learned threshold initialised at ``fire_threshold``; causal only.
    - ``"nope"``: no position information at all (Kazemnejad et al. 2023); causal only.
    - ``"fox"``: the Forgetting Transformer (Lin et al. 2025): no position encoding, and a learned forget gate
      per layer and head that adds ``Σ_{l=j+1..i} log f_l`` to query ``i``'s score of key ``j``; causal only.
    - baselines: ``"rope"`` (rotary, ``rope_theta``), ``"sinusoidal"`` and ``"learned"`` absolute positions
      (up to ``max_position_embeddings``).

    ``is_decoder=True`` (the default) makes attention causal; ``False`` makes it bidirectional.
    ``is_encoder_decoder=True`` describes ``RelPosForConditionalGeneration``: a bidirectional encoder of
    ``num_hidden_layers`` layers and a causal decoder of ``num_decoder_layers`` (default: as many), each
    with the scheme in self-attention and its own position parameters, cross-attention without a position
    term (as T5); generation starts from ``decoder_start_token_id`` (default: ``pad_token_id``, as T5).
    Fields named as upstream T5 names them: ``feed_forward_proj`` (``"relu"``, ``"gated-gelu"``, ...; default:
    ``hidden_act``, not gated), ``head_dim`` (T5's ``d_kv``; default ``hidden_size // num_attention_heads``)
    and ``scale_decoder_outputs`` (T5 v1.0's ``hidden_size**-0.5`` before a tied output layer).
    ``attention_scale`` multiplies ``q·k`` in every attention (default None: ``1/sqrt(head_dim)``; T5 attends
    without it, ``1.0``, which ``from_t5`` sets); Shaw and Transformer-XL keep their papers' ``1/sqrt(head_dim)``.
    ``initialization="t5"`` starts the weights as T5 does (Mesh TensorFlow's, Transformers' ``T5PreTrainedModel``,
    factor ``initializer_range / 0.02``): ``q_proj`` at std ``(hidden_size * head_dim)**-0.5``, ``k_proj``,
    ``v_proj``, the MLP's input projections and T5 bias tables at ``hidden_size**-0.5``, ``o_proj`` at
    ``(heads * head_dim)**-0.5``, ``down_proj`` at ``intermediate_size**-0.5``, token tables and the output layer at
    1.0, norm scales at 1.0 (each times the factor); with ``attention_scale=1.0`` a model attends and trains as T5 did. ``"default"``: N(0, initializer_range).
    ``sliding_window=W`` lets each query attend only to the ``W`` latest positions (itself included;
    bidirectional: distances up to ``W`` on both sides), in the model's masks and in Transformers' caches;
    for Transformer-XL with memory it is ``mem_len + 1``. In an encoder-decoder it limits both stacks'
    self-attention; cross-attention (and its cache) always covers the whole source.

    The released Transformer-XL's options (``from_transfo_xl`` sets them; new models may use them too):
    ``cutoffs`` (a list) replaces the token table and output layer with an adaptive input (Baevski & Auli 2019)
    and adaptive softmax (Grave et al. 2017) whose clusters start at those ids, vectors of ``embedding_size //
    div_val**i`` (``embedding_size`` defaults to ``hidden_size``), output projections tied to the input's where
    ``tie_projs`` says (default all but the first); the causal LM's logits are then log-probabilities.
    ``norm_type`` (``"rms_norm"`` or ``"layer_norm"``, with a bias; ``rms_norm_eps`` is either's epsilon),
    ``norm_position`` (``"pre"``: ``x + f(norm(x))``; ``"post"``: ``norm(x + f(x))``), ``final_norm`` (the norm
    after the last layer), ``mlp_bias`` (default ``attention_bias``) and ``dropout_placement`` (``"residual"``,
    ``"t5"``: also the MLP's activations and the stack's output, ``"transfo_xl"``: also the sinusoid ``R``).
    ``same_length`` (Transformer-XL with memory): every query sees ``mem_len`` keys, itself included (the window
    is ``mem_len``); ``ext_len``: the memory ends ``ext_len`` tokens before the segment's end (Dai et al.'s code).

    Example:

    ```python
    >>> from hf_relpos import RelPosConfig, RelPosForCausalLM
    >>> config = RelPosConfig(position_encoding="shaw", max_relative_position=8, hidden_size=64,
    ...                       num_attention_heads=4, intermediate_size=128, num_hidden_layers=2)
    >>> model = RelPosForCausalLM(config)
    ```
    """

    model_type = "relpos"
    # Outputs Trainer leaves out of predictions: the cache under its name from Transformers 5.24 and before it.
    keys_to_ignore_at_inference = ["cache", "past_key_values", "mems"]

    vocab_size: int = 384
    hidden_size: int = 256
    intermediate_size: int = 1024
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    hidden_act: str = "gelu"
    max_position_embeddings: int = 2048
    position_encoding: str = "t5_bias"
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    relative_attention_per_layer: bool = False
    max_relative_position: int = 16
    shaw_value_embeddings: bool = True
    mem_len: int = 0
    clamp_len: int = -1
    log_decay_scale: float = 1.0
    fire_mlp_width: int = 32
    fire_threshold: float = 512.0
    rope_theta: float = 10000.0
    is_decoder: bool = True
    is_encoder_decoder: bool = False
    num_decoder_layers: int | None = None
    decoder_start_token_id: int | None = None
    feed_forward_proj: str | None = None
    head_dim: int | None = None
    scale_decoder_outputs: bool = False
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    initialization: str = "default"
    attention_scale: float | None = None
    attention_bias: bool = False
    use_cache: bool = True
    tie_word_embeddings: bool = True
    cutoffs: list[int] | None = None
    div_val: int = 1
    embedding_size: int | None = None
    tie_projs: list[bool] | None = None
    norm_type: str = "rms_norm"
    norm_position: str = "pre"
    final_norm: bool = True
    mlp_bias: bool | None = None
    dropout_placement: str | None = None
    same_length: bool = False
    ext_len: int = 0
    pad_token_id: int | None = 0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = 1

    def __post_init__(self, **kwargs):
        self._window = None
        self._validate_fields()
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_decoder_layers is None:
            self.num_decoder_layers = self.num_hidden_layers
        if self.is_encoder_decoder and self.decoder_start_token_id is None:
            self.decoder_start_token_id = self.pad_token_id
        self._validate_fields()
        super().__post_init__(**kwargs)

    # Validation runs at construction and again on save (``validate``), so that a bad value fails where it is
    # written, not at the first forward: each field's own rule first (FIELD_RULES), then the rules between fields.
    def _validate_fields(self) -> None:
        for name, (valid, allowed) in FIELD_RULES.items():
            value = getattr(self, name)
            if not valid(value):
                raise ValueError(f"RelPosConfig.{name} must be {allowed}, got {value!r}")
        self.validate_architecture()

    def validate_architecture(self) -> None:
        """The rules between fields (every field already passed its own rule in ``FIELD_RULES``)."""
        if self.position_encoding in CAUSAL_ONLY and self.is_decoder is not True:
            raise ValueError(
                f"RelPosConfig.is_decoder must be True for position_encoding={self.position_encoding!r} (defined for "
                f"causal attention only), got {self.is_decoder!r}"
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"RelPosConfig.hidden_size must be divisible by num_attention_heads={self.num_attention_heads} "
                f"(or head_dim given), got {self.hidden_size}"
            )
        head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if self.position_encoding == "rope" and head_dim % 2:
            raise ValueError(f"RelPosConfig.head_dim must be even for rope (rotated pairs), got {head_dim}")
        if self.position_encoding in ("sinusoidal", "transformer_xl") and self.hidden_size % 2:
            raise ValueError(
                f"RelPosConfig.hidden_size must be even for {self.position_encoding} (sin and cos halves), "
                f"got {self.hidden_size}"
            )
        # T5 buckets: each direction needs one exact bucket and room for log-spaced ones.
        bidirectional = not self.is_decoder or self.is_encoder_decoder  # an encoder-decoder's encoder
        max_exact = t5_exact_buckets(bidirectional, self.relative_attention_num_buckets)
        if max_exact < 1:
            raise ValueError(
                "RelPosConfig.relative_attention_num_buckets must be >= 4 for a bidirectional model "
                f"(is_decoder=False or is_encoder_decoder=True), got {self.relative_attention_num_buckets}"
            )
        max_distance = self.relative_attention_max_distance
        if not _is_int(max_distance) or max_distance <= max_exact:
            raise ValueError(
                f"RelPosConfig.relative_attention_max_distance must be an int > {max_exact} (the exact-bucket "
                f"region of {self.relative_attention_num_buckets} buckets), got {max_distance!r}"
            )
        if self.relative_attention_per_layer is True and self.position_encoding != "t5_bias":
            raise ValueError(
                "RelPosConfig.relative_attention_per_layer must be False unless position_encoding='t5_bias' (a "
                f"T5 bias table per layer), got True with position_encoding={self.position_encoding!r}"
            )
        if self.attention_scale is not None and self.position_encoding in ("shaw", "transformer_xl"):
            raise ValueError(
                f"RelPosConfig.attention_scale must be None for position_encoding={self.position_encoding!r} (its "
                f"attention divides by sqrt(head_dim) as its paper does), got {self.attention_scale!r}"
            )
        if self.mem_len > 0 and self.position_encoding != "transformer_xl":
            raise ValueError(
                f"RelPosConfig.mem_len must be 0 unless position_encoding='transformer_xl', got mem_len={self.mem_len} "
                f"with position_encoding={self.position_encoding!r}"
            )
        self._check_adaptive()
        memory = self.position_encoding == "transformer_xl" and self.mem_len > 0
        for name, value, default in (("same_length", self.same_length, False), ("ext_len", self.ext_len, 0)):
            if value != default and not memory:
                raise ValueError(
                    f"RelPosConfig.{name} must be {default!r} unless position_encoding='transformer_xl' with mem_len > 0, "
                    f"got {value!r} with position_encoding={self.position_encoding!r}, mem_len={self.mem_len}"
                )
        if self.dropout_placement == "transfo_xl" and self.position_encoding != "transformer_xl":
            raise ValueError(
                "RelPosConfig.dropout_placement='transfo_xl' (which drops the sinusoid R) needs "
                f"position_encoding='transformer_xl', got {self.position_encoding!r}"
            )
        if self.memory_window is None:  # with memory the window is mem_len (+ 1), whatever was set before mem_len
            self._check_window(getattr(self, "_window", None))
        if self.is_encoder_decoder:
            self._check_encoder_decoder()
            if self.norm_position != "pre":
                raise ValueError(f"RelPosConfig.norm_position must be 'pre' for an encoder-decoder, got {self.norm_position!r}")
        for name in ("pad_token_id", "bos_token_id", "decoder_start_token_id"):
            value = getattr(self, name)
            if value is not None and not (_is_int(value) and 0 <= value < self.vocab_size):
                raise ValueError(
                    f"RelPosConfig.{name} must be None or an int in [0, vocab_size={self.vocab_size}), got {value!r}"
                )
        eos = self.eos_token_id
        eos_ids = eos if isinstance(eos, list) else [eos]
        if eos is not None and (not eos_ids or not all(_is_int(i) and 0 <= i < self.vocab_size for i in eos_ids)):
            raise ValueError(
                f"RelPosConfig.eos_token_id must be None, an int or a list of ints in [0, vocab_size={self.vocab_size}), "
                f"got {eos!r}"
            )

    def _check_adaptive(self) -> None:
        """Adaptive input and softmax (``cutoffs``): clusters inside the vocabulary, each with a vector of at least
        one value; ``div_val``, ``embedding_size`` and ``tie_projs`` mean something only with them."""
        cutoffs = self.cutoffs
        if cutoffs is None:
            for name, default in (("div_val", 1), ("embedding_size", None), ("tie_projs", None)):
                if getattr(self, name) != default:
                    raise ValueError(
                        f"RelPosConfig.{name} must be {default!r} without cutoffs (an adaptive input and softmax), "
                        f"got {getattr(self, name)!r}"
                    )
            return
        if any(b <= a for a, b in zip(cutoffs, cutoffs[1:])) or (cutoffs and cutoffs[-1] >= self.vocab_size):
            raise ValueError(
                f"RelPosConfig.cutoffs must increase strictly and stay below vocab_size={self.vocab_size}, got {cutoffs}"
            )
        if self.is_encoder_decoder:
            raise ValueError(f"RelPosConfig.cutoffs must be None for an encoder-decoder (one shared table), got {cutoffs}")
        if self.position_encoding == "sinusoidal":  # both would scale the token vectors by sqrt(hidden_size)
            raise ValueError(
                f"RelPosConfig.cutoffs must be None for position_encoding='sinusoidal' (the adaptive input is already "
                f"scaled by sqrt(hidden_size), as the scheme would scale it again), got {cutoffs}"
            )
        smallest = self.adaptive_embedding_size // self.div_val ** len(cutoffs)
        if smallest < 1:
            raise ValueError(
                f"RelPosConfig.div_val must leave the last cluster a vector (embedding_size // div_val**{len(cutoffs)} "
                f">= 1, embedding_size={self.adaptive_embedding_size}), got {self.div_val}"
            )
        if self.tie_projs is not None and len(self.tie_projs) != len(cutoffs) + 1:
            raise ValueError(
                f"RelPosConfig.tie_projs must have one bool per cluster (len(cutoffs) + 1 = {len(cutoffs) + 1}), "
                f"got {self.tie_projs}"
            )

    @property
    def adaptive_embedding_size(self) -> int:
        """The adaptive clusters' largest vector size (TransfoXL's ``d_embed``): ``embedding_size`` or ``hidden_size``."""
        return self.embedding_size if self.embedding_size is not None else self.hidden_size

    @property
    def projection_ties(self) -> list:
        """Which output projections of the adaptive softmax are the input's (``tie_projs``; by default all but the
        head's, TransfoXL's ``proj_share_all_but_first``)."""
        if self.tie_projs is not None:
            return list(self.tie_projs)
        return [False] + [True] * len(self.cutoffs or [])

    def validate(self) -> None:
        """Transformers validates a config before saving it: every rule runs again, so that a field set to a bad
        value after construction fails there too."""
        super().validate()
        self._validate_fields()

    def _check_encoder_decoder(self) -> None:
        """What an encoder-decoder needs: a scheme defined for the bidirectional encoder, and no Transformer-XL
        memory (its ``mems`` belong to a decoder-only forward). A ``sliding_window`` applies to both stacks'
        self-attention, never to cross-attention, which always sees the whole source."""
        if self.position_encoding in CAUSAL_ONLY:
            allowed = [p for p in POSITION_ENCODINGS if p not in CAUSAL_ONLY]
            raise ValueError(
                f"RelPosConfig.position_encoding must be one of {allowed} for an encoder-decoder "
                f"(is_encoder_decoder=True: its encoder is bidirectional), got {self.position_encoding!r}"
            )
        if self.mem_len:
            raise ValueError(f"RelPosConfig.mem_len must be 0 for an encoder-decoder, got {self.mem_len}")

    def stack_config(self, decoder: bool) -> "RelPosConfig":
        """The config of an encoder-decoder's encoder (bidirectional, no cache) or decoder (causal, with
        ``num_decoder_layers`` layers and cross-attention), as T5 derives its stacks."""
        config = copy.deepcopy(self)
        config.is_decoder = decoder
        if decoder:
            config.num_hidden_layers = self.num_decoder_layers
        else:
            config.use_cache = False
        return config

    def get_text_config(self, decoder=None, encoder=None):
        """An encoder-decoder's decoder config when ``decoder=True``: generate sizes its caches from it, so a
        decoder deeper than the encoder gets a cache layer per decoder layer."""
        if self.is_encoder_decoder and decoder and not encoder:
            return self.stack_config(decoder=True)
        return super().get_text_config(decoder=decoder, encoder=encoder)

    @property
    def memory_window(self) -> int | None:
        """Transformer-XL with memory: the window of its sliding decoding memory, ``mem_len + 1`` (the
        window counts the query itself), ``mem_len`` with ``same_length``; None for every other configuration."""
        if self.position_encoding == "transformer_xl" and _is_int(self.mem_len) and self.mem_len > 0:
            # same_length (Dai et al.'s evaluation): every query sees mem_len keys, itself included.
            return self.mem_len if self.same_length is True else self.mem_len + 1
        return None

    @property
    def sliding_window(self) -> int | None:
        """Each query sees the ``sliding_window`` latest positions (itself included) when causal, the
        positions within that distance on both sides when bidirectional (as Transformers' masks do).

        Transformers' caches read it to keep that many keys. For Transformer-XL with memory it is always
        ``mem_len + 1`` (its decoding memory), following ``mem_len`` when that changes.
        """
        return self.memory_window or getattr(self, "_window", None)

    @sliding_window.setter
    def sliding_window(self, value) -> None:
        self._check_window(value)
        self._window = None if value == self.memory_window else value

    def _check_window(self, window) -> None:
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"RelPosConfig.sliding_window must be None or an int >= 1, got {window!r}")
        memory = self.memory_window
        if memory is not None and window not in (None, memory):
            raise ValueError(
                f"RelPosConfig.sliding_window must be None or {memory} for transformer_xl with mem_len={self.mem_len} "
                f"and same_length={self.same_length} (its decoding memory is that window), got {window!r}"
            )

    def to_dict(self):
        output = super().to_dict()
        output.pop("_window", None)
        output["sliding_window"] = self.sliding_window
        return output

    @property
    def dropout_rule(self) -> str:
        """``dropout_placement``, or where unset T5's for an encoder-decoder and the residual branches otherwise."""
        if self.dropout_placement is not None:
            return self.dropout_placement
        return "t5" if self.is_encoder_decoder else "residual"

    @property
    def mlp_activation(self) -> tuple[str, bool]:
        """The feed-forward activation and whether it is gated (``act(gate) * up``), from ``feed_forward_proj``."""
        if self.feed_forward_proj is None:
            return self.hidden_act, False
        gated = self.feed_forward_proj.startswith("gated-")
        act = self.feed_forward_proj.removeprefix("gated-")
        return ("gelu_new" if gated and act == "gelu" else act), gated


__all__ = ["RelPosConfig", "POSITION_ENCODINGS", "CAUSAL_ONLY", "FEED_FORWARD_PROJS"]
