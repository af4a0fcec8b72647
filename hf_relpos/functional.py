"""The math of every position scheme, in pure PyTorch (no Transformers import): the public module.

``hf_relpos.functional`` is public API (``from hf_relpos import functional``, ``import hf_relpos.functional as F``);
the functions live in ``functional_relpos.py``, and this module re-exports them, the same objects. Why two files:
``save_pretrained`` copies the model code and every module it imports flat into the saved folder (remote code), and
Python started inside that folder has it first on ``sys.path``, so a copied file must not be named like an installed
package or a standard-library module. Every copied file ends in ``_relpos`` (as ``modeling_relpos.py``); this one is
not copied (the model code imports ``functional_relpos``), so it keeps the public name.

Replacing a function here (``monkeypatch.setattr(hf_relpos.functional, ...)``) changes what this module's users see,
not what the models call: the models and the other functions read ``hf_relpos.functional_relpos``.

Each function states its equation, the shapes of its arguments and what it returns, and names the slow, obviously
correct reference it is tested against (in ``tests/oracles.py`` unless said otherwise).

Shapes (the layout of ``torch.nn.functional.scaled_dot_product_attention``: ``[B, H, seq, D]``):

- ``B`` batch, ``H`` heads, ``D`` head size (``D_v`` of the values where it differs);
- ``Q`` query rows of the call, ``K`` keys, ``n`` the length of a self-attention call (``Q = K = n``);
- ``M = K - Q`` Transformer-XL's memory, ``R`` the rows of its relative embeddings ``r``;
- ``k`` Shaw's ``max_relative_position``, ``s`` the distance beyond which a saturating bias is constant;
- ``X|1``: of size ``X`` or 1 (broadcast).

Positions: a query at index ``i`` of a call that follows ``past_length`` earlier tokens sits at absolute
position ``past_length + i``; key ``j`` sits at absolute position ``j``.

``attention_mask`` follows SDPA: a boolean tensor (True = may attend) or an additive
float tensor, broadcastable to ``[B, H, Q, K]``. In an additive mask,
``-inf`` and the dtype's most negative finite value (Transformers' convention) both
mean "masked". A query row with no key left gives zeros, never NaN.

Every function validates its arguments and raises ``ValueError``/``TypeError`` naming
the argument, what was given and what is allowed.
"""

from .functional_relpos import (  # in functional_relpos' order: the API page lists them so (members_order)
    attention_with_bias,
    t5_exact_buckets,
    t5_relative_position_bucket,
    t5_position_bias,
    t5_saturation_distance,
    t5_bias_by_distance,
    saturating_bias_attention,
    shaw_attention,
    transformer_xl_attention,
    sinusoidal_embedding,
    log_decay_bias,
    alibi_slopes,
    alibi_bias,
    alibi_key_bias,
    causal_key_bias_attention,
    fox_key_bias,
    fox_bias,
    fox_query_key_bias,
    kerple_log_bias,
    fire_bias,
)

__all__ = [
    "attention_with_bias",
    "t5_relative_position_bucket",
    "t5_position_bias",
    "t5_exact_buckets",
    "t5_saturation_distance",
    "t5_bias_by_distance",
    "saturating_bias_attention",
    "shaw_attention",
    "transformer_xl_attention",
    "sinusoidal_embedding",
    "log_decay_bias",
    "alibi_slopes",
    "alibi_bias",
    "alibi_key_bias",
    "causal_key_bias_attention",
    "fox_key_bias",
    "fox_bias",
    "fox_query_key_bias",
    "kerple_log_bias",
    "fire_bias",
]
