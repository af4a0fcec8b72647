"""RelPosConfig: one configuration for every position scheme of hf_relpos."""

from __future__ import annotations

import math

from transformers import PreTrainedConfig

POSITION_ENCODINGS = (
    "t5_bias", "shaw", "transformer_xl", "log_decay", "alibi", "kerple_log", "fire", "rope", "sinusoidal", "learned", "nope",
)
# Schemes defined for causal attention only: NoPE's positions come from the causal mask alone, and FIRE
# normalises distances by the query's position, which bounds them only for keys at or before it.
CAUSAL_ONLY = ("fire", "nope")
HIDDEN_ACTS = ("gelu", "gelu_new", "relu", "silu")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class RelPosConfig(PreTrainedConfig):
    r"""Configuration of a pre-norm Transformer whose attention uses one of hf_relpos' position schemes.

    ``position_encoding`` picks the scheme:

    - ``"t5_bias"``: T5's learned scalar per log-spaced distance bucket and head, one table shared by all
      layers (``relative_attention_num_buckets``, ``relative_attention_max_distance``).
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
    - baselines: ``"rope"`` (rotary, ``rope_theta``), ``"sinusoidal"`` and ``"learned"`` absolute positions
      (up to ``max_position_embeddings``).

    ``is_decoder=True`` (the default) makes attention causal; ``False`` makes it bidirectional.
    ``sliding_window=W`` lets each query attend only to the ``W`` latest positions (itself included;
    bidirectional: distances up to ``W`` on both sides), in the model's masks and in Transformers' caches;
    for Transformer-XL with memory it is ``mem_len + 1``.

    Example:

    ```python
    >>> from hf_relpos import RelPosConfig, RelPosForCausalLM
    >>> config = RelPosConfig(position_encoding="shaw", max_relative_position=8, hidden_size=64,
    ...                       num_attention_heads=4, intermediate_size=128, num_hidden_layers=2)
    >>> model = RelPosForCausalLM(config)
    ```
    """

    model_type = "relpos"
    keys_to_ignore_at_inference = ["past_key_values", "mems"]

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
    max_relative_position: int = 16
    shaw_value_embeddings: bool = True
    mem_len: int = 0
    clamp_len: int = -1
    log_decay_scale: float = 1.0
    fire_mlp_width: int = 32
    fire_threshold: float = 512.0
    rope_theta: float = 10000.0
    is_decoder: bool = True
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    rms_norm_eps: float = 1e-6
    initializer_range: float = 0.02
    attention_bias: bool = False
    use_cache: bool = True
    tie_word_embeddings: bool = True
    pad_token_id: int | None = 0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = 1

    def __post_init__(self, **kwargs):
        self._window = None
        self._validate_fields()
        super().__post_init__(**kwargs)

    # Validation runs at construction (and again on save) so that a bad value fails where it is written,
    # not at the first forward.
    def _validate_fields(self) -> None:
        def positive_int(name):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"RelPosConfig.{name} must be a positive int, got {value!r}")

        def int_at_least(name, minimum, allowed):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"RelPosConfig.{name} must be {allowed}, got {value!r}")

        def probability(name):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"RelPosConfig.{name} must be a float in [0, 1), got {value!r}")

        def positive_float(name):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or value <= 0
            ):
                raise ValueError(f"RelPosConfig.{name} must be a finite float > 0, got {value!r}")

        def boolean(name):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"RelPosConfig.{name} must be True or False, got {value!r}")

        if self.position_encoding not in POSITION_ENCODINGS:
            raise ValueError(
                f"RelPosConfig.position_encoding must be one of {list(POSITION_ENCODINGS)}, "
                f"got {self.position_encoding!r}"
            )
        if self.position_encoding in CAUSAL_ONLY and self.is_decoder is not True:
            raise ValueError(
                f"RelPosConfig.is_decoder must be True for position_encoding={self.position_encoding!r} (defined for "
                f"causal attention only), got {self.is_decoder!r}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "max_position_embeddings", "fire_mlp_width"):
            positive_int(name)
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"RelPosConfig.hidden_size must be divisible by num_attention_heads={self.num_attention_heads}, "
                f"got {self.hidden_size}"
            )
        head_dim = self.hidden_size // self.num_attention_heads
        if self.position_encoding == "rope" and head_dim % 2:
            raise ValueError(
                f"RelPosConfig.hidden_size / num_attention_heads must be even for rope (rotated pairs), got {head_dim}"
            )
        if self.position_encoding in ("sinusoidal", "transformer_xl") and self.hidden_size % 2:
            raise ValueError(
                f"RelPosConfig.hidden_size must be even for {self.position_encoding} (sin and cos halves), "
                f"got {self.hidden_size}"
            )
        if self.hidden_act not in HIDDEN_ACTS:
            raise ValueError(f"RelPosConfig.hidden_act must be one of {list(HIDDEN_ACTS)}, got {self.hidden_act!r}")
        # T5 buckets: each direction needs one exact bucket and room for log-spaced ones.
        int_at_least("relative_attention_num_buckets", 2, "an int >= 2")
        one_side = self.relative_attention_num_buckets // (1 if self.is_decoder else 2)
        if one_side // 2 < 1:
            raise ValueError(
                "RelPosConfig.relative_attention_num_buckets must be >= 4 for a bidirectional model "
                f"(is_decoder=False), got {self.relative_attention_num_buckets}"
            )
        int_at_least(
            "relative_attention_max_distance", one_side // 2 + 1,
            f"an int > {one_side // 2} (the exact-bucket region of {self.relative_attention_num_buckets} buckets)",
        )
        int_at_least("max_relative_position", 0, "an int >= 0")
        int_at_least("mem_len", 0, "an int >= 0")
        if isinstance(self.clamp_len, bool) or not isinstance(self.clamp_len, int) or not (
            self.clamp_len == -1 or self.clamp_len >= 1
        ):
            raise ValueError(f"RelPosConfig.clamp_len must be -1 (no clamping) or an int >= 1, got {self.clamp_len!r}")
        if self.mem_len > 0 and self.position_encoding != "transformer_xl":
            raise ValueError(
                f"RelPosConfig.mem_len must be 0 unless position_encoding='transformer_xl', got mem_len={self.mem_len} "
                f"with position_encoding={self.position_encoding!r}"
            )
        self._check_window(getattr(self, "_window", None))
        positive_float("log_decay_scale")
        positive_float("fire_threshold")
        positive_float("rope_theta")
        positive_float("rms_norm_eps")
        positive_float("initializer_range")
        probability("hidden_dropout")
        probability("attention_dropout")
        for name in ("is_decoder", "shaw_value_embeddings", "attention_bias", "use_cache", "tie_word_embeddings"):
            boolean(name)
        for name in ("pad_token_id", "bos_token_id"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.vocab_size
            ):
                raise ValueError(
                    f"RelPosConfig.{name} must be None or an int in [0, vocab_size={self.vocab_size}), got {value!r}"
                )

        eos = self.eos_token_id
        eos_ids = eos if isinstance(eos, list) else [eos]
        if eos is not None and (
            not eos_ids
            or any(isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.vocab_size for i in eos_ids)
        ):
            raise ValueError(
                f"RelPosConfig.eos_token_id must be None, an int or a list of ints in [0, vocab_size={self.vocab_size}), "
                f"got {eos!r}"
            )

    def validate_architecture(self):
        """Called by Transformers' strict validation (e.g. on save): re-check every field."""
        self._validate_fields()

    @property
    def memory_window(self) -> int | None:
        """Transformer-XL with memory: the window of its sliding decoding memory, ``mem_len + 1`` (the
        window counts the query itself); None for every other configuration."""
        if self.position_encoding == "transformer_xl" and _is_int(self.mem_len) and self.mem_len > 0:
            return self.mem_len + 1
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
                f"RelPosConfig.sliding_window must be None or mem_len + 1 = {memory} for transformer_xl with "
                f"mem_len={self.mem_len} (its decoding memory is that window), got {window!r}"
            )

    def to_dict(self):
        output = super().to_dict()
        output.pop("_window", None)
        output["sliding_window"] = self.sliding_window
        return output

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads


__all__ = ["RelPosConfig", "POSITION_ENCODINGS", "CAUSAL_ONLY"]
