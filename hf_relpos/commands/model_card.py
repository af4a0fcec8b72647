"""Model cards: a trained or converted folder's README.md, filled in from the scheme's template.

The templates are the repository's top-level ``model_cards/*.md``, shipped in the wheel as the package data
``hf_relpos.model_cards`` (``pyproject.toml``'s package-dir mapping; an editable install maps it the same way).
"""

from __future__ import annotations

import json
import math
import time
from importlib import resources
from pathlib import Path

from ..model_card_relpos import BIBTEX  # one source: save_pretrained's card cites the same papers

# one ``<scheme>.md`` per scheme, and ``seq2seq.md`` and ``t5_encoder.md`` for convert-t5
TEMPLATES = "hf_relpos.model_cards"


def _templates():
    """The installed templates (a wheel or an editable install maps them to ``hf_relpos.model_cards``), else the
    checkout's top-level ``model_cards/``: hf_relpos run from a source tree on ``sys.path`` (PYTHONPATH), not
    installed, has no such package."""
    try:
        return resources.files(TEMPLATES)
    except ModuleNotFoundError:
        return Path(__file__).resolve().parents[2] / "model_cards"


def read_template(name: str) -> str:
    """The text of ``model_cards/<name>.md`` from wherever the package is installed (or checked out)."""
    template = _templates() / f"{name}.md"
    if not template.is_file():
        raise FileNotFoundError(f"model card template {template} is missing from the installed package")
    return template.read_text(encoding="utf-8")


def format_ppl(value) -> str:
    """A perplexity as a card or table shows it; inf where the scheme cannot run (past a position table)."""
    return "∞ (cannot run: past the position table)" if math.isinf(value) else f"{value:.2f}"


def write_model_card(folder: Path, summary: dict) -> None:
    """README.md from the scheme's template: the exact command, the evaluation at L, 2L, 4L (and with
    memory) as a table and as YAML ``model-index`` metrics, and the paper to cite."""
    scheme = summary["position_encoding"]
    L = summary["seq_len"]
    by_length = {int(n): p for n, p in summary["test_ppl_by_length"].items()}
    training = "\n".join(
        [
            f"Command: `{summary['command']}`",
            "",
            "| | |",
            "| --- | --- |",
            f"| corpus | {summary['corpus']} |",
            f"| training tokens | {summary['train_tokens']:,} |",
            f"| model size | preset `{summary['preset']}`, {summary['parameters']:,} parameters "
            f"({summary['position_parameters']:,} in the position scheme) |",
            f"| sequence length | {L} tokens" + (f", memory {summary['mem_len']}" if summary["mem_len"] else "") + " |",
            f"| steps × batch | {summary['steps']} × {summary['batch_size']}, learning rate {summary['learning_rate']}, seed {summary['seed']} |",
            f"| final training loss | {summary['final_train_loss']:.3f} |" if summary["final_train_loss"] else "| final training loss | n/a |",
            f"| trained on | {summary['date']}, torch {summary['torch']}, {summary['train_seconds']} s of training in all |",
            "",
            f"Test perplexity ({summary['test_tokens']:,} held-out tokens, non-overlapping segments; L = {L}):",
            "",
            "| evaluation length | perplexity |",
            "| --- | ---: |",
        ]
        + [f"| {n} ({n // L}L) | {format_ppl(p)} |" for n, p in sorted(by_length.items())]
        + ([f"| {L} with memory {summary['mem_len']} | {summary['test_ppl_with_memory']:.2f} |"]
           if "test_ppl_with_memory" in summary else [])
        + ["", "Cite the scheme's paper:", "", "```bibtex", BIBTEX[scheme], "```"]
    )
    metrics = [(f"Perplexity at {n} tokens ({n // L}x the training length)", p) for n, p in sorted(by_length.items())]
    if "test_ppl_with_memory" in summary:
        metrics.append((f"Perplexity at {L} tokens with memory {summary['mem_len']}", summary["test_ppl_with_memory"]))
    index = [
        "model-index:",
        f"  - name: hf_relpos-{scheme}",
        "    results:",
        "      - task: {type: text-generation, name: Causal language modeling}",
        f"        dataset: {{type: text, name: {json.dumps(summary['corpus'])}}}",
        "        metrics:",
    ] + [
        f"          - {{type: perplexity, name: {json.dumps(name)}, value: {json.dumps(round(value, 4)) if math.isfinite(value) else '.inf'}}}"
        for name, value in metrics
    ]
    card = read_template(scheme).replace("{{training}}", training)
    head, sep, rest = card.partition("\n---\n")  # the front matter's closing line
    card = head + "\n" + "\n".join(index) + sep + rest
    (folder / "README.md").write_text(card)


def write_seq2seq_card(out: Path, src: Path, config, parity: dict, torch_version: str,
                       source_class: str = "T5ForConditionalGeneration") -> None:
    """README.md of a ``convert-t5`` folder: the source and its class, the converted shape and the parity found
    before writing (an encoder alone: its hidden states)."""
    kind = "v1.1 / Flan style (gated GELU, untied output layer)" if config.mlp_activation[1] else "v1.0 style (ReLU)"
    if not config.is_encoder_decoder:
        kind = "gated GELU" if config.mlp_activation[1] else "ReLU"
    if config.is_encoder_decoder:
        layers = f"{config.num_hidden_layers} encoder, {config.num_decoder_layers} decoder"
        output = (f"{'tied to the token table' if config.tie_word_embeddings else 'untied'}"
                  f"{', states scaled by d_model**-0.5' if config.scale_decoder_outputs else ''}")
        parity_row = (f"max abs logit difference {parity['max_abs_logit_diff']:.1e}; greedy "
                      f"{'identical' if parity['greedy_identical'] else 'different'}, beam search "
                      f"{'identical' if parity['beam_identical'] else 'different'}")
    else:
        layers = f"{config.num_hidden_layers} encoder (an encoder alone: `AutoModel` loads it)"
        output = "none (the encoder's last_hidden_state)"
        parity_row = f"max abs last_hidden_state difference {parity['max_abs_logit_diff']:.1e} at every real token"
    provenance = "\n".join([
        f"Converted by `hf-relpos convert-t5 {src} {out}` ({time.strftime('%Y-%m-%d')}, torch {torch_version}) from an "
        f"upstream `{source_class}`, {kind}:",
        "",
        "| | |",
        "| --- | --- |",
        f"| layers | {layers} |",
        f"| width | d_model {config.hidden_size}, {config.num_attention_heads} heads × d_kv {config.head_dim}, d_ff "
        f"{config.intermediate_size} (`{config.feed_forward_proj}`) |",
        f"| attention | without 1/sqrt(d_kv), as T5 (`attention_scale` {config.attention_scale}) |",
        "| position bias | " + ("a table in every layer, as UMT5 (`relative_attention_per_layer`; an hf_relpos installed "
                                 "from before that field would build one shared table, left random, and drop these: load "
                                 "with this folder's code or a newer hf_relpos)"
                                 if config.relative_attention_per_layer else "one table shared by all layers, as T5")
        + " |",
        f"| output layer | {output} |",
        f"| parity with the source (random padded inputs, fp32) | {parity_row} |",
    ])
    card = read_template("seq2seq" if config.is_encoder_decoder else "t5_encoder")
    for key, value in (("title", f"{src.name} converted"), ("scheme", config.position_encoding),
                       ("provenance", provenance), ("bibtex", BIBTEX["t5_bias"])):
        card = card.replace("{{" + key + "}}", value)
    (out / "README.md").write_text(card)
