"""``hf-relpos inspect``: figures of what a trained folder learned about position (PNG)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from .common import (
    INSPECT_DIR, RUN_FILE, RemoveIfEmptyOnFailure, check_folder, check_writable, load_folder, position_table,
    training_length,
)
from .errors import UserError


def inspect_folder(folder: str, prompt: str, *, output_dir: Optional[str] = None, distance: Optional[int] = None,
                   overwrite: bool = False) -> Path:
    """Figures of what a trained folder learned about position: ``position.png`` (the position term per head
    over distances 0 .. N; not for schemes without a term in attention) and ``attention-layer{L}.png`` (every
    head's attention probabilities for ``--prompt``), into ``--output-dir`` (default ``FOLDER/inspect``).
    Existing figures there are replaced only with ``overwrite``. Returns the folder written."""
    import torch

    from ..inspection import (
        NO_POSITION_TERM, has_position_term, plot_attention, plot_position, position_curves, run_prompt, token_labels,
    )

    if not prompt.strip():
        raise UserError(f"--prompt is empty (got {prompt!r}): give some text whose attention to show")
    path = check_folder(folder)
    out = Path(output_dir) if output_dir else path / INSPECT_DIR
    check_writable(out, flag="--output-dir")  # before the work, not when the first figure is saved
    model, tokenizer = load_folder(folder)
    config = model.config
    scheme = config.position_encoding
    run_file = path / RUN_FILE
    train_length = training_length(path)  # None: no default distance, no training-length mark
    with_position = has_position_term(model)
    if distance is None and with_position:
        if not train_length:
            raise UserError(
                f"--distance is needed: {run_file} (the training record, whose seq_len sets the default) is "
                "missing, unreadable or without a positive seq_len; pass --distance N (a positive int)"
            )
        distance = 2 * train_length

    names = (["position.png"] if with_position else []) + [
        f"attention-layer{layer}.png" for layer in range(config.num_hidden_layers)
    ]
    existing = [name for name in names if (out / name).exists()]
    if existing and not overwrite:
        shown = ", ".join(existing[:3]) + (f" and {len(existing) - 3} more" if len(existing) > 3 else "")
        raise UserError(
            f"--output-dir {str(out)!r} already holds {shown}: pass --overwrite to replace them, or give another "
            "--output-dir"
        )

    input_ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    table = position_table(config)
    if table is not None and input_ids.numel() > table:
        raise UserError(
            f"--prompt is {input_ids.numel()} tokens, and the {scheme} position table holds {table}: give a "
            "shorter prompt"
        )
    with torch.no_grad():
        prompt_run = run_prompt(model, input_ids)
        curves = position_curves(model, distance, prompt_run.queries) if with_position else None
    labels = token_labels(tokenizer, prompt_run.input_ids)

    with RemoveIfEmptyOnFailure(out):
        out.mkdir(parents=True, exist_ok=True)
        if curves is not None:
            plot_position(curves, out / "position.png", train_length=train_length)
        for layer, weights in enumerate(prompt_run.attentions):
            plot_attention(weights, out / f"attention-layer{layer}.png", scheme=scheme, layer=layer, labels=labels)
    layers = config.num_hidden_layers
    maps = "attention-layer0.png" if layers == 1 else f"attention-layer{{0..{layers - 1}}}.png"
    if curves is not None:
        per = "per layer, " if curves.per_layer else ""
        print(f"{scheme}: wrote {out}/position.png (the position term per head, {per}distances 0..{distance}) and "
              f"{maps} (prompt: {len(labels)} tokens)")
    else:
        print(f"{scheme}: {NO_POSITION_TERM.get(scheme, 'no position term in attention')}; attention maps only: "
              f"wrote {out}/{maps} (prompt: {len(labels)} tokens)")
    return out


def inspect_command(args) -> int:
    inspect_folder(args.folder, args.prompt, output_dir=args.output_dir, distance=args.distance,
                   overwrite=args.overwrite)
    return 0
