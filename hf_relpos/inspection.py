"""What a trained model learned about position: the data and the figures behind ``hf-relpos inspect``.

Two kinds of figure:

- the **position term** per head against the distance ``d = i - j`` between a query and an earlier key
  (:func:`position_curves`, drawn by :func:`plot_position`):

  - every additive-bias scheme (T5 bias, log-decay, ALiBi, KERPLE-log, FIRE) through the one seam they
    share, ``AdditiveBiasScheme.bias``: the bias row of a single query at position ``N`` against the keys
    ``0 .. N``, the very tensor the model adds to its attention logits (the same for every layer);
  - Shaw: per layer, ``q̄_h · a^K_{clip(-d)} / sqrt(D)``, the relative key embeddings scored by the
    prompt's mean query of head ``h``;
  - Transformer-XL: per layer, ``(q̄_h + v_h) · (W_{k,R} R_d)_h / sqrt(D)``, the paper's position terms
    (b) + (d) for the prompt's mean query.

  Both query-dependent terms are linear in the query, so the curve of the mean query is the mean, over
  the prompt's queries, of the position term each of them adds to its logits. RoPE, the absolute
  baselines and NoPE add no term to the attention logits: they have no such figure (:data:`NO_POSITION_TERM`).

- the **attention probabilities** of every head of a layer for a prompt (:func:`run_prompt`, drawn by
  :func:`plot_attention`), from the model's ``output_attentions``, position term included.

matplotlib runs with its Agg backend (files only, no display).
"""

from __future__ import annotations

import math
import textwrap
from dataclasses import dataclass
from typing import Optional

import torch

from .functional_relpos import sinusoidal_embedding
from .position_context_relpos import PositionContext
from .position_schemes_relpos import AdditiveBiasScheme

# Why a scheme has no position figure: it adds nothing to the attention logits.
NO_POSITION_TERM = {
    "rope": "no position term in attention (rotary: positions rotate queries and keys)",
    "sinusoidal": "no position term in attention (absolute sinusoids added to the token embeddings)",
    "learned": "no position term in attention (a learned absolute table added to the token embeddings)",
    "nope": "no position information at all (the causal mask alone orders the tokens)",
    "fox": "no fixed position term (FoX's decay sums each layer's forget gates over the tokens between query and key)",
}

MAX_LABELLED_TOKENS = 32  # token strings on the attention maps' axes up to this many tokens


@dataclass
class PositionCurves:
    """The position term per head over distances ``0 .. N``.

    ``values`` is ``[layers, H, N+1]`` for a per-layer term (Shaw, Transformer-XL) or ``[1, H, N+1]`` for a
    term all layers share (additive biases); ``values[l, h, d]`` is the term at distance ``d = i - j``.
    """

    scheme: str
    distances: torch.Tensor  # [N+1]: 0 .. N
    values: torch.Tensor  # [layers | 1, H, N+1], float32 on the CPU
    per_layer: bool
    ylabel: str
    title: str
    note: str = ""  # one line under the title (what the curve depends on)
    clip: Optional[int] = None  # the distance from which the term is constant by construction (Shaw's k)


@dataclass
class PromptRun:
    """One forward of a prompt: its token ids ``[T]``, per-layer attention probabilities ``[H, T, T]`` and
    per-layer queries ``[T, H, D]`` (the outputs of ``q_proj``, split into heads)."""

    input_ids: torch.Tensor
    attentions: list
    queries: list


def _base(model):
    return getattr(model, "model", model)  # RelPosForCausalLM or RelPosModel


@torch.no_grad()
def run_prompt(model, input_ids: torch.Tensor) -> PromptRun:
    """Run ``input_ids`` (``[T]`` or ``[1, T]``) through the model with ``output_attentions=True``, capturing each
    layer's queries with a forward hook on its ``q_proj``."""
    input_ids = input_ids.reshape(1, -1)
    base = _base(model)
    config = model.config
    queries = [None] * len(base.layers)
    hooks = []
    for index, layer in enumerate(base.layers):
        def keep(module, inputs, output, index=index):
            queries[index] = output[0].reshape(output.shape[1], config.num_attention_heads, -1).float().cpu()

        hooks.append(layer.self_attn.q_proj.register_forward_hook(keep))
    try:
        out = model(input_ids=input_ids.to(model.device), output_attentions=True, use_cache=False, return_dict=True)
    finally:
        for hook in hooks:
            hook.remove()
    attentions = [a[0].float().cpu() for a in out.attentions]
    return PromptRun(input_ids=input_ids[0].cpu(), attentions=attentions, queries=queries)


def has_position_term(model) -> bool:
    base = _base(model)
    relative = base.layers[0].self_attn.relative if len(base.layers) else None
    return isinstance(base.position, AdditiveBiasScheme) or hasattr(relative, "rel_k") or hasattr(relative, "r_net")


@torch.no_grad()
def position_curves(model, max_distance: int, queries: Optional[list] = None) -> Optional[PositionCurves]:
    """The position term per head over distances ``0 .. max_distance`` (None for schemes without one).

    ``queries`` (from :func:`run_prompt`) are needed for Shaw and Transformer-XL, whose term depends on the
    query: their curves are for the mean query of each layer.
    """
    base = _base(model)
    config = model.config
    scheme = config.position_encoding
    position = base.position
    distances = torch.arange(max_distance + 1)
    if isinstance(position, AdditiveBiasScheme):
        tables = getattr(position, "layers", None)  # a T5 table per layer (relative_attention_per_layer)
        rows = [_bias_row(table, max_distance, model.device) for table in (tables or [position])]
        shared = f"shared by all {config.num_hidden_layers} layers" if tables is None else "a table per layer"
        return PositionCurves(
            scheme=scheme, distances=distances, values=torch.stack(rows), per_layer=tables is not None,
            ylabel="bias added to the attention logit",
            title=f"{scheme}: position bias per head ({shared})",
            note=(f"the bias row of a query at position {max_distance} against the keys 0 .. {max_distance}"
                  + {"fire": " (FIRE's bias also depends on the query's position)",
                     "log_decay": " (fixed: the same for every head)"}.get(scheme, "")),
        )
    relative = base.layers[0].self_attn.relative if len(base.layers) else None
    if not (hasattr(relative, "rel_k") or hasattr(relative, "r_net")):
        return None
    if queries is None or any(q is None for q in queries):
        raise ValueError(f"position_curves needs the prompt's queries (run_prompt) for {scheme!r}")
    mean_queries = [q.mean(dim=0) for q in queries]  # per layer [H, D]
    if hasattr(relative, "rel_k"):
        k = config.max_relative_position
        index = (-distances).clamp(-k, k) + k  # Shaw's r_ij = clip(j - i, -k, k) + k
        values = torch.stack([
            (mean_q @ layer.self_attn.relative.rel_k.float().cpu()[index].T) * layer.self_attn.scaling
            for mean_q, layer in zip(mean_queries, base.layers)
        ])  # fmt: skip
        return PositionCurves(
            scheme=scheme, distances=distances, values=values, per_layer=True,
            ylabel="position score (logit)",
            title=rf"{scheme}: position score $\bar q_h \cdot a^K_{{\mathrm{{clip}}(-d)}} / \sqrt{{D}}$ per head",
            note=f"q̄: the prompt's mean query of each layer; distances clipped at k = {k}", clip=k,
        )
    clamped = distances.clamp(max=config.clamp_len) if config.clamp_len > 0 else distances
    values = []
    for mean_q, layer in zip(mean_queries, base.layers):
        rel = layer.self_attn.relative
        weight = rel.r_net.weight
        r = rel.r_net(sinusoidal_embedding(clamped.to(weight.device), config.hidden_size).to(weight.dtype))
        r = r.float().cpu().view(len(distances), config.num_attention_heads, -1)  # [N+1, H, D]
        v = rel.r_r_bias.float().cpu()  # the paper's v (position bias)
        values.append(torch.einsum("hd,nhd->hn", mean_q + v, r) * layer.self_attn.scaling)
    return PositionCurves(
        scheme=scheme, distances=distances, values=torch.stack(values), per_layer=True,
        ylabel="position score (logit)",
        title=rf"{scheme}: position score $(\bar q_h + v_h) \cdot W_{{k,R}} R_d / \sqrt{{D}}$ per head",
        note="q̄: the prompt's mean query of each layer" + (
            f"; distances clamped at clamp_len = {config.clamp_len}" if config.clamp_len > 0 else ""),
        clip=config.clamp_len if config.clamp_len > 0 else None,
    )


def _bias_row(position: AdditiveBiasScheme, n: int, device) -> torch.Tensor:
    """``[H, n+1]``: the scheme's bias for one query at position ``n`` against keys ``0 .. n``, reversed so that
    column ``d`` holds distance ``d`` — built as ``RelPosModel.forward`` builds its context."""
    ctx = PositionContext(
        query_length=1, key_length=n + 1, q_offset=n, past_length=n, causal=True, mask=None,
        position_ids=torch.tensor([[n]], device=device), attn_implementation="eager", output_attentions=False,
        alive=None, scheme=position,
    )
    bias = position.bias(ctx, device, torch.float32)  # [1, H | 1, 1, n+1]; key j at distance n - j
    return bias[0, :, 0].float().cpu().flip(-1).expand(position.num_heads, -1)  # log-decay: one row for all heads


# ----------------------------------------------------------------------------------------------
# figures
# ----------------------------------------------------------------------------------------------


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _head_colors(plt, heads: int) -> list:
    cmap = plt.get_cmap("tab10" if heads <= 10 else "tab20")
    return [cmap(h % cmap.N) for h in range(heads)]


def _grid(count: int) -> tuple:
    cols = math.ceil(math.sqrt(count))
    return math.ceil(count / cols), cols


def plot_position(curves: PositionCurves, path, *, train_length: Optional[int] = None) -> None:
    """One line per head over the distance; one panel per layer for a per-layer term. A dashed line marks the
    longest distance seen in training (``train_length - 1``), a dotted one the scheme's clipping distance."""
    plt = _pyplot()
    panels, heads = curves.values.shape[0], curves.values.shape[1]
    rows, cols = _grid(panels)
    fig, axes = plt.subplots(rows, cols, figsize=(6.4 * cols + 1.6, 3.9 * rows + 0.9), squeeze=False,
                             layout="constrained")
    colors = _head_colors(plt, heads)
    x = curves.distances.numpy()
    for panel in range(rows * cols):
        ax = axes.flat[panel]
        if panel >= panels:
            ax.set_visible(False)
            continue
        for h in range(heads):
            ax.plot(x, curves.values[panel, h].numpy(), color=colors[h], linewidth=1.4, label=f"head {h}",
                    drawstyle="steps-mid" if curves.scheme == "t5_bias" else "default")  # T5: a value per bucket
        if train_length is not None and 0 < train_length - 1 <= x[-1]:
            ax.axvline(train_length - 1, color="0.4", linestyle="--", linewidth=1,
                       label=f"longest distance in training ({train_length - 1})")
        if curves.clip is not None and 0 < curves.clip < x[-1]:
            ax.axvline(curves.clip, color="0.4", linestyle=":", linewidth=1,
                       label=f"clipped: constant from distance {curves.clip}")
        ax.set_title(f"{curves.scheme}, layer {panel}" if curves.per_layer else f"{curves.scheme}, all layers",
                     fontsize=10)
        ax.set_xlabel("distance d = i − j (query position − key position)")
        ax.set_ylabel(curves.ylabel)
        ax.set_xlim(x[0], x[-1])
        ax.grid(True, alpha=0.3)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside right center", fontsize=8, ncol=1 if heads <= 16 else 2, frameon=False)
    note = "\n".join(textwrap.wrap(curves.note, 90))  # a long note would run off the figure's edges
    fig.suptitle(curves.title + ("\n" + note if note else ""), fontsize=11)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def token_labels(tokenizer, input_ids) -> list:
    """Each token as text (newlines and tabs escaped), for the attention maps' axes."""
    return [tokenizer.decode([int(t)]).replace("\n", "\\n").replace("\t", "\\t") for t in input_ids]


def plot_attention(weights: torch.Tensor, path, *, scheme: str, layer: int, labels: Optional[list] = None) -> None:
    """A grid of heads, each the attention probabilities ``[query, key]`` of one layer (``weights``:
    ``[H, T, T]``); token strings on the axes when ``labels`` is given and holds at most 32 tokens."""
    from matplotlib.colors import PowerNorm

    plt = _pyplot()
    heads, length = weights.shape[0], weights.shape[-1]
    labelled = labels is not None and length <= MAX_LABELLED_TOKENS
    rows, cols = _grid(heads)
    side = 4.2 if labelled and length > 12 else 3.2
    fig, axes = plt.subplots(rows, cols, figsize=(side * cols + 1.2, side * rows + 0.8), squeeze=False,
                             layout="constrained")
    norm = PowerNorm(gamma=0.5, vmin=0.0, vmax=1.0)  # small probabilities of long rows stay visible
    image = None
    for h in range(rows * cols):
        ax = axes.flat[h]
        if h >= heads:
            ax.set_visible(False)
            continue
        image = ax.imshow(weights[h].numpy(), cmap="viridis", norm=norm, interpolation="nearest")
        ax.set_title(f"{scheme}, layer {layer}, head {h}", fontsize=9)
        if labelled:
            ticks = list(range(length))
            ax.set_xticks(ticks, labels, rotation=90, fontsize=6)
            ax.set_yticks(ticks, labels, fontsize=6)
        else:
            ax.tick_params(labelsize=7)
        ax.set_xlabel("key", fontsize=8)
        ax.set_ylabel("query", fontsize=8)
    fig.suptitle(f"{scheme}, layer {layer}: attention probabilities (query × key) for the prompt ({length} tokens)",
                 fontsize=11)
    bar = fig.colorbar(image, ax=axes, shrink=0.8)
    bar.set_label("attention probability (square-root colour scale)")
    fig.savefig(path, dpi=110)
    plt.close(fig)
