"""How the models' weights start: each module's initialisation, and T5's (``RelPosConfig.initialization``).

``RelPosPreTrainedModel._init_weights`` calls :func:`init_module` for each module after Transformers' own, and
``post_init`` calls :func:`mark_t5_init` first where the config asks for T5's initialisation.

Flat module (remote code copies it beside ``modeling_relpos.py``): relative imports only.
"""

from __future__ import annotations

import math

from torch import nn
from transformers import initialization as init

from .adaptive_softmax_relpos import AdaptiveProjection, ProjectedAdaptiveLogSoftmax
from .configuration_relpos import RelPosConfig
from .feed_forward_relpos import RelPosRMSNorm


def t5_init_stds(config: RelPosConfig) -> dict:
    """T5's initialisation (Mesh TensorFlow; Transformers' ``T5PreTrainedModel._init_weights``) by module name,
    with T5's ``initializer_factor`` as ``initializer_range / 0.02``: each projection at its fan-in's std (the
    query's also over ``head_dim``, as T5 attends without ``1/sqrt(head_dim)``), token tables and the output
    layer at 1.0."""
    factor = config.initializer_range / 0.02
    model, inner = config.hidden_size, config.num_attention_heads * config.head_dim
    stds = {"q_proj": (model * config.head_dim) ** -0.5, "k_proj": model**-0.5, "v_proj": model**-0.5,
            "o_proj": inner**-0.5, "gate_proj": model**-0.5, "up_proj": model**-0.5,
            "down_proj": config.intermediate_size**-0.5, "relative_attention_bias": model**-0.5,
            "embed_tokens": 1.0, "shared": 1.0, "lm_head": 1.0}
    return {name: factor * std for name, std in stds.items()}


def mark_t5_init(model: nn.Module, config: RelPosConfig) -> None:
    """T5's initialisation marked on ``model``'s modules: each one ``t5_init_stds`` names gets its ``init_std``,
    each RMSNorm its scale's start, T5's factor (``init_value``); :func:`init_module` reads them."""
    stds = t5_init_stds(config)
    for name, module in model.named_modules():
        if name.rpartition(".")[2] in stds:
            module.init_std = stds[name.rpartition(".")[2]]
        elif isinstance(module, RelPosRMSNorm):  # T5 starts its norms' scales at its factor
            module.init_value = config.initializer_range / 0.02


def init_module(module: nn.Module, std: float) -> None:
    """One module's weights at their start: linear layers and embeddings N(0, std) (or the ``init_std`` marked on
    them), biases 0, norms' scales 1 (or ``init_value``), a layer asking for PyTorch's default init
    (``torch_default_init``: FIRE's MLP, as the paper's code) that, and a scheme's own parameters by its
    ``init_position_weights``."""
    if isinstance(module, nn.Linear) and getattr(module, "torch_default_init", False):
        init.kaiming_uniform_(module.weight, a=math.sqrt(5))  # nn.Linear.reset_parameters
        bound = 1 / math.sqrt(module.in_features)
        if module.bias is not None:
            init.uniform_(module.bias, -bound, bound)
    elif isinstance(module, (nn.Linear,)):
        init.normal_(module.weight, mean=0.0, std=getattr(module, "init_std", std))
        if module.bias is not None:
            init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        init.normal_(module.weight, mean=0.0, std=getattr(module, "init_std", std))
    elif isinstance(module, RelPosRMSNorm):
        init.constant_(module.weight, getattr(module, "init_value", 1.0))
    elif isinstance(module, nn.LayerNorm):
        init.ones_(module.weight)
        init.zeros_(module.bias)
    elif isinstance(module, AdaptiveProjection):
        init.normal_(module.weight, mean=0.0, std=std)
    elif isinstance(module, ProjectedAdaptiveLogSoftmax) and hasattr(module, "cluster_weight"):
        init.normal_(module.cluster_weight, mean=0.0, std=std)
        init.zeros_(module.cluster_bias)
    elif hasattr(module, "init_position_weights"):  # a scheme's own parameters (position_schemes_relpos.py)
        module.init_position_weights(std)
