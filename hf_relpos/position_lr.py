"""The position parameters' own learning rate and initial scale, for every trainer.

Learned relative biases are often trained at a rate of their own: T5's bias table against the content weights,
say (Raffel et al. 2020 train everything at one rate; Kazemnejad et al. 2023's T5 bias starts small and moves at
3e-5). The position parameters are a model's scheme module (``model.position``: T5's tables, KERPLE's and FIRE's
parameters, an absolute table) and the scheme's per-layer modules (``relative``: Shaw's embeddings,
Transformer-XL's ``W_{k,R}``, ``u``, ``v``, FoX's forget gates).

- ``position_parameter_groups(model, lr, position_lr_scale)``: optimizer parameter groups for any optimizer (with
  Transformers' ``Trainer``: ``optimizers=(torch.optim.AdamW(groups), None)``; its scheduler scales each group);
- ``position_lr_trainer(Trainer, scale)``: a ``Trainer`` class whose own optimizer (its class, its weight-decay
  groups) runs the position parameters at ``scale`` times the learning rate (``hf-relpos train``, ``lengthgen``);
- ``scale_position_init(model, scale)``: the position parameters multiplied by ``scale`` (a table started smaller).
"""

from __future__ import annotations

from .position_schemes_relpos import PositionScheme


def position_parameter_names(model) -> list:
    """The names of ``model``'s position parameters: those of its scheme modules and their per-layer modules."""
    prefixes = [name + "." for name, module in model.named_modules()
                if isinstance(module, PositionScheme) or name.endswith(".relative")]
    return [name for name, _ in model.named_parameters() if any(name.startswith(p) for p in prefixes)]


def position_parameter_groups(model, lr: float, position_lr_scale: float, weight_decay: float = 0.0) -> list:
    """Two parameter groups: every trainable parameter but the position ones at ``lr``, the position ones at
    ``lr * position_lr_scale`` (each with ``weight_decay``)."""
    _check_scale("position_lr_scale", position_lr_scale)
    position = set(position_parameter_names(model))
    params = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    return [
        {"params": [p for name, p in params if name not in position], "lr": lr, "weight_decay": weight_decay},
        {"params": [p for name, p in params if name in position], "lr": lr * position_lr_scale,
         "weight_decay": weight_decay},
    ]


def split_position_groups(optimizer, model, scale: float) -> None:
    """Each of ``optimizer``'s parameter groups (before its first step) split in two: its position parameters
    move to a copy of the group at ``scale`` times its learning rate."""
    names = set(position_parameter_names(model))
    position = {id(p) for name, p in model.named_parameters() if name in names and p.requires_grad}
    found = 0
    for group in list(optimizer.param_groups):
        moved = [p for p in group["params"] if id(p) in position]
        found += len(moved)
        if moved:
            group["params"] = [p for p in group["params"] if id(p) not in position]
            optimizer.add_param_group({**{k: v for k, v in group.items() if k != "params"}, "params": moved,
                                       "lr": group["lr"] * scale})
    if position and not found:  # e.g. FSDP1 without use_orig_params: flat parameters, none of the model's own
        raise ValueError("position_lr_scale: the optimizer holds none of the model's position parameters (a wrapper "
                         "that flattens parameters, such as FSDP without use_orig_params=True, hides them)")


def position_lr_trainer(base, scale: float):
    """``base`` (a ``Trainer`` class) whose optimizer runs the position parameters at ``scale`` times the learning
    rate; ``base`` itself when ``scale`` is 1. The scheduler Trainer builds next scales every group alike."""
    _check_scale("position_lr_scale", scale)
    if scale == 1.0:
        return base

    class PositionLRTrainer(base):
        def create_optimizer(self, *args, **kwargs):
            if self.optimizer is None:
                optimizer = super().create_optimizer(*args, **kwargs)
                split_position_groups(optimizer, self.model, scale)
            return self.optimizer

    return PositionLRTrainer


def scale_position_init(model, scale: float) -> None:
    """Multiply ``model``'s position parameters by ``scale`` (after initialisation: a bias table, T5's or an absolute
    one, that starts at ``scale`` times its std; for a scheme whose bias is no linear function of its parameters,
    KERPLE's, FIRE's or FoX's gates, the bias does not scale with them)."""
    import torch

    _check_scale("position_init_scale", scale)
    names = set(position_parameter_names(model))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in names:
                param.mul_(scale)


def _check_scale(name: str, value) -> None:
    import math

    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


__all__ = ["position_parameter_names", "position_parameter_groups", "position_lr_trainer", "split_position_groups",
           "scale_position_init"]
