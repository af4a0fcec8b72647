"""``save_pretrained`` writes a model card (README.md: class, scheme, sizes, how to load, the scheme's paper) for
every model class, updates its own unedited card on the next save, and never replaces a README that is not one:
the user's, an edited card, or the cards ``hf-relpos train`` and ``convert-t5`` write."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

import hf_relpos
from hf_relpos import (
    RelPosForCausalLM,
    RelPosForConditionalGeneration,
    RelPosForSequenceClassification,
    RelPosModel,
)
from hf_relpos.model_card_relpos import BIBTEX, CARD_FILE, is_own_card
from tiny import make_model

PACKAGE = Path(hf_relpos.__file__).resolve().parent

# (class, scheme, config overrides, the Auto class and Hub task the card names)
CLASSES = [
    (RelPosForCausalLM, "shaw", {}, "AutoModelForCausalLM", "text-generation"),
    (RelPosModel, "alibi", {}, "AutoModel", "feature-extraction"),
    (RelPosForSequenceClassification, "t5_bias", {"num_labels": 3, "is_decoder": False},
     "AutoModelForSequenceClassification", "text-classification"),
    (RelPosForConditionalGeneration, "rope", {"preset": "seq2seq"}, "AutoModelForSeq2SeqLM", "text2text-generation"),
]


def _front_matter(card: str) -> dict:
    match = re.match(r"\A---\n(.*?)\n---\n", card, re.S)
    assert match, "README.md does not open with a YAML front matter block"
    meta, key = {}, None
    for line in match.group(1).splitlines():
        if line.startswith("  - "):
            meta[key].append(line[4:])
        else:
            key, _, value = line.partition(": ")
            key = key.rstrip(":")
            meta[key] = value or []
    return meta


@pytest.mark.parametrize("cls, scheme, overrides, auto, task", CLASSES, ids=[c[0].__name__ for c in CLASSES])
def test_save_pretrained_writes_a_card(tmp_path, cls, scheme, overrides, auto, task):
    model = make_model(cls, scheme, **overrides)
    config = model.config
    model.save_pretrained(tmp_path)
    card = (tmp_path / CARD_FILE).read_text(encoding="utf-8")
    meta = _front_matter(card)
    assert meta["library_name"] == "transformers" and meta["pipeline_tag"] == task
    assert {"custom_code", "hf_relpos", scheme.replace("_", "-")} <= set(meta["tags"])
    assert f"# {cls.__name__} with `position_encoding=\"{scheme}\"`" in card
    assert f"| class | `{cls.__name__}` (`{auto}`) |" in card
    assert f"| parameters | {sum(p.numel() for p in model.parameters()):,} |" in card
    assert f"hidden_size {config.hidden_size}, {config.num_attention_heads} heads × head_dim {config.head_dim}" in card
    assert f"| vocabulary | {config.vocab_size} tokens |" in card
    layers = (f"{config.num_hidden_layers} encoder, {config.num_decoder_layers} decoder" if config.is_encoder_decoder
              else str(config.num_hidden_layers))
    assert f"| layers | {layers} |" in card
    if cls is RelPosForSequenceClassification:
        assert "| labels | 3 |" in card and "bidirectional" in card
    if scheme == "shaw":
        assert f"`max_relative_position={config.max_relative_position}`" in card
    # how to load: remote code, and the installed classes
    assert f'{auto}.from_pretrained("path/to/this/folder", trust_remote_code=True)' in card
    assert 'import hf_relpos' in card and f'{auto}.from_pretrained("path/to/this/folder")' in card
    assert "```bibtex\n" + BIBTEX[scheme] + "\n```" in card
    assert not re.search(r"\{\{\w+\}\}", card)  # no template placeholder left
    assert is_own_card(card)
    assert not [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


def test_card_snippet_loads_the_folder(tmp_path):
    """The card's "with hf_relpos installed" code, run as written on its own folder, loads the saved weights."""
    model = make_model(RelPosForSequenceClassification, "t5_bias", num_labels=2)
    model.save_pretrained(tmp_path)
    card = (tmp_path / CARD_FILE).read_text()
    blocks = re.findall(r"```python\n(.*?)```", card, re.S)
    assert len(blocks) == 2 and "trust_remote_code=True" in blocks[0] and "import hf_relpos" in blocks[1]
    scope = {}
    exec(blocks[1].replace("path/to/this/folder", str(tmp_path)), scope)
    loaded = scope["model"]
    assert type(loaded) is RelPosForSequenceClassification
    assert all((a == b).all() for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))


def test_a_users_readme_survives_save_pretrained(tmp_path):
    readme = "# My model\n\nNotes nobody else may rewrite.\r\n".encode("utf-8")
    (tmp_path / CARD_FILE).write_bytes(readme)
    model = make_model(RelPosForCausalLM, "t5_bias")
    model.save_pretrained(tmp_path)
    model.save_pretrained(tmp_path)
    assert (tmp_path / CARD_FILE).read_bytes() == readme
    assert (tmp_path / "model.safetensors").is_file()


def test_a_second_save_updates_its_own_card_but_not_an_edited_one(tmp_path):
    make_model(RelPosForCausalLM, "t5_bias").save_pretrained(tmp_path)
    first = (tmp_path / CARD_FILE).read_text()
    make_model(RelPosForCausalLM, "shaw").save_pretrained(tmp_path)  # another scheme into the same folder
    second = (tmp_path / CARD_FILE).read_text()
    assert second != first and '`position_encoding="shaw"`' in second and BIBTEX["shaw"] in second
    # edited: the marker's digest no longer matches the text above it, so the card is the user's now
    edited = second.replace("## How to load", "## How to load\n\nOur own notes.\n")
    (tmp_path / CARD_FILE).write_text(edited)
    make_model(RelPosForCausalLM, "alibi").save_pretrained(tmp_path)
    assert (tmp_path / CARD_FILE).read_text() == edited
    assert json.loads((tmp_path / "config.json").read_text())["position_encoding"] == "alibi"


def test_only_the_main_process_writes_the_card(tmp_path):
    make_model(RelPosForCausalLM, "t5_bias").save_pretrained(tmp_path, is_main_process=False)
    assert not (tmp_path / CARD_FILE).exists()


def test_the_card_module_is_flat_remote_code(tmp_path):
    """``model_card_relpos.py`` ships in saved folders beside ``modeling_relpos.py`` and imports nothing of hf_relpos
    or Transformers (remote code may import only the folder's own files)."""
    make_model(RelPosForCausalLM, "t5_bias").save_pretrained(tmp_path)
    source = (PACKAGE / "model_card_relpos.py").read_text()
    assert (tmp_path / "model_card_relpos.py").read_text() == source
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, node.module
            imported.add(node.module.split(".")[0])
    assert imported <= {"__future__", "hashlib", "os", "re", "secrets"}, imported


def test_the_train_card_is_written_over_the_basic_one_and_then_kept(tmp_path):
    """``hf-relpos train`` saves the model (the basic card), then writes its own card with the run's numbers over
    it (as train does, in its staged folder); a later save_pretrained into that folder keeps the train card."""
    from hf_relpos.commands.model_card import write_model_card

    model = make_model(RelPosForCausalLM, "transformer_xl")
    model.save_pretrained(tmp_path)
    assert is_own_card((tmp_path / CARD_FILE).read_text())
    summary = {"position_encoding": "transformer_xl", "seq_len": 16, "test_ppl_by_length": {"16": 9.5, "32": 11.25},
               "command": "hf-relpos train --position-encoding transformer_xl", "corpus": "embedded",
               "train_tokens": 1000, "preset": "tiny", "parameters": model.num_parameters(), "position_parameters": 10,
               "mem_len": 0, "steps": 2, "batch_size": 4, "learning_rate": 1e-3, "seed": 0, "final_train_loss": 2.5,
               "date": "2026-11-25", "torch": "2", "train_seconds": 1.0, "test_tokens": 500}
    write_model_card(tmp_path, summary)
    train_card = (tmp_path / CARD_FILE).read_bytes()
    assert b"Test perplexity (500 held-out tokens" in train_card and not is_own_card(train_card.decode())
    model.save_pretrained(tmp_path)
    assert (tmp_path / CARD_FILE).read_bytes() == train_card


def test_a_stacks_card_describes_the_stack(tmp_path):
    """An encoder-decoder's encoder or decoder saved alone: its card gives that stack's kind and layers (it said
    "encoder-decoder", "2 encoder, 3 decoder" for an encoder of 2 layers) and loads it with AutoModel."""
    model = make_model(RelPosForConditionalGeneration, "t5_bias", preset="seq2seq")
    for part, kind, layers in (("encoder", "the encoder stack (bidirectional)", model.config.num_hidden_layers),
                               ("decoder", "the decoder stack (causal", model.config.num_decoder_layers)):
        getattr(model, part).save_pretrained(tmp_path / part)
        card = (tmp_path / part / CARD_FILE).read_text()
        assert f"| attention | {kind}" in card and f"| layers | {layers} |" in card, card
        assert "AutoModel.from_pretrained(" in card


def test_a_readme_link_or_fifo_is_the_users(tmp_path):
    """A README.md that is a symbolic link (dangling, or to a card of ours elsewhere) stays the link (a dangling one was
    replaced by a card); a named pipe is not opened (reading it hung save_pretrained)."""
    import os
    import threading

    elsewhere = tmp_path / "shared"
    make_model(RelPosForCausalLM, "t5_bias").save_pretrained(elsewhere)
    shared_card = (elsewhere / CARD_FILE).read_text()
    for name, target in (("dangling", tmp_path / "nowhere.md"), ("linked", elsewhere / CARD_FILE)):
        folder = tmp_path / name
        folder.mkdir()
        (folder / CARD_FILE).symlink_to(target)
        make_model(RelPosForCausalLM, "shaw").save_pretrained(folder)
        assert (folder / CARD_FILE).is_symlink() and os.readlink(folder / CARD_FILE) == str(target), name
    assert (elsewhere / CARD_FILE).read_text() == shared_card and not (tmp_path / "nowhere.md").exists()

    folder = tmp_path / "fifo"
    folder.mkdir()
    os.mkfifo(folder / CARD_FILE)
    saving = threading.Thread(target=make_model(RelPosForCausalLM, "shaw").save_pretrained, args=(folder,), daemon=True)
    saving.start()
    saving.join(timeout=60)
    if saving.is_alive():  # unblock the reader so the thread ends, then fail
        with open(folder / CARD_FILE, "w"):
            pass
        pytest.fail("save_pretrained hung reading a named pipe README.md")
    assert (folder / "model.safetensors").is_file()


def test_every_scheme_has_a_card_template():
    """`hf-relpos train` writes each scheme's card from model_cards/<scheme>.md: a scheme without one trained to the
    end and then failed (fox, caught by compare --corpus stdlib). Each template names its own scheme."""
    from hf_relpos.commands.model_card import read_template
    from hf_relpos.configuration_relpos import POSITION_ENCODINGS

    for scheme in POSITION_ENCODINGS:
        text = read_template(scheme)
        assert f'position_encoding="{scheme}"' in text and "{{training}}" in text, scheme
