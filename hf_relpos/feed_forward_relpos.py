"""The norms and the feed-forward block of hf_relpos layers: RMSNorm (Zhang & Sennrich 2019, as Llama's) or
LayerNorm with a bias (``norm_type``), and the MLP, plain or gated (T5 v1.1's ``gated-ACT``), with the dropout
``dropout_placement`` puts on its activations."""

from __future__ import annotations

import torch
from torch import nn

from transformers.activations import ACT2FN

from .configuration_relpos import RelPosConfig


class RelPosRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.float()
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


def make_norm(config: RelPosConfig) -> nn.Module:
    """The norm ``config.norm_type`` names: RMSNorm (weight only, computed in float32), or LayerNorm with a bias
    computed in the model's dtype (as the released Transformer-XL's); ``rms_norm_eps`` is either's epsilon."""
    if config.norm_type == "layer_norm":
        return nn.LayerNorm(config.hidden_size, eps=config.rms_norm_eps)
    return RelPosRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class RelPosMLP(nn.Module):
    """``down(act(up(x)))``, or with ``feed_forward_proj="gated-ACT"`` ``down(act(gate(x)) * up(x))`` (T5 v1.1)."""

    def __init__(self, config: RelPosConfig):
        super().__init__()
        act, gated = config.mlp_activation
        bias = config.attention_bias if config.mlp_bias is None else config.mlp_bias
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias) if gated else None
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act_fn = ACT2FN[act]
        # T5's DenseReluDense and Transformer-XL's CoreNet drop the activations too (dropout_rule).
        self.dropout = nn.Dropout(config.hidden_dropout) if config.dropout_rule != "residual" else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_proj is None:
            return self.down_proj(self.dropout(self.act_fn(self.up_proj(x))))
        return self.down_proj(self.dropout(self.act_fn(self.gate_proj(x)) * self.up_proj(x)))
