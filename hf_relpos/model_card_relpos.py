"""The model card (``README.md``) that ``save_pretrained`` writes beside the weights, and the schemes' citations.

Copied into every saved folder with ``modeling_relpos.py`` (remote code), so it imports nothing of hf_relpos. The
card says what the model is (class, scheme, sizes), how to load it and what to cite; it measures nothing. Its last
line is a marker holding the SHA-256 of the text above it: ``save_pretrained`` replaces a ``README.md`` only when
it is such a card, unedited. A user's README, an edited card, and the cards ``hf-relpos train`` and
``convert-t5`` write (they carry the run's numbers and no marker) are kept as they are.
"""

from __future__ import annotations

import hashlib
import os
import re
import secrets

CARD_FILE = "README.md"
MARKER = (
    "<!-- hf_relpos save_pretrained card, sha256 of the text above: {digest}. save_pretrained replaces this card "
    "while that text is unchanged; edit it, or delete this line, to keep it. -->"
)
_MARKER = re.compile(
    re.escape(MARKER).replace(re.escape("{digest}"), "([0-9a-f]{64})") + r"\n?\Z"
)

BIBTEX = {
    "t5_bias": """@article{raffel2020t5,
  title={Exploring the Limits of Transfer Learning with a Unified Text-to-Text Transformer},
  author={Raffel, Colin and Shazeer, Noam and Roberts, Adam and Lee, Katherine and Narang, Sharan and Matena, Michael and Zhou, Yanqi and Li, Wei and Liu, Peter J.},
  journal={Journal of Machine Learning Research}, volume={21}, number={140}, pages={1--67}, year={2020}
}""",
    "shaw": """@inproceedings{shaw2018relative,
  title={Self-Attention with Relative Position Representations},
  author={Shaw, Peter and Uszkoreit, Jakob and Vaswani, Ashish},
  booktitle={Proceedings of NAACL-HLT}, pages={464--468}, year={2018}
}""",
    "transformer_xl": """@inproceedings{dai2019transformerxl,
  title={Transformer-{XL}: Attentive Language Models beyond a Fixed-Length Context},
  author={Dai, Zihang and Yang, Zhilin and Yang, Yiming and Carbonell, Jaime and Le, Quoc V. and Salakhutdinov, Ruslan},
  booktitle={Proceedings of ACL}, pages={2978--2988}, year={2019}
}""",
    "log_decay": """@inproceedings{chi2022kerple,
  title={{KERPLE}: Kernelized Relative Positional Embedding for Length Extrapolation},
  author={Chi, Ta-Chung and Fan, Ting-Han and Ramadge, Peter J. and Rudnicky, Alexander I.},
  booktitle={Advances in Neural Information Processing Systems}, year={2022},
  note={the log-decay bias is the fixed (r1 = lambda, r2 = 1) case of KERPLE's logarithmic variant}
}""",
    "alibi": """@inproceedings{press2022alibi,
  title={Train Short, Test Long: Attention with Linear Biases Enables Input Length Extrapolation},
  author={Press, Ofir and Smith, Noah A. and Lewis, Mike},
  booktitle={International Conference on Learning Representations}, year={2022}
}""",
    "rope": """@article{su2021roformer,
  title={{RoFormer}: Enhanced Transformer with Rotary Position Embedding},
  author={Su, Jianlin and Lu, Yu and Pan, Shengfeng and Murtadha, Ahmed and Wen, Bo and Liu, Yunfeng},
  journal={arXiv preprint arXiv:2104.09864}, year={2021}
}""",
}
BIBTEX["kerple_log"] = """@inproceedings{chi2022kerple,
  title={{KERPLE}: Kernelized Relative Positional Embedding for Length Extrapolation},
  author={Chi, Ta-Chung and Fan, Ting-Han and Ramadge, Peter J. and Rudnicky, Alexander I.},
  booktitle={Advances in Neural Information Processing Systems}, year={2022}
}"""
BIBTEX["fire"] = """@inproceedings{li2024fire,
  title={Functional Interpolation for Relative Positions Improves Long Context Transformers},
  author={Li, Shanda and You, Chong and Guruganesh, Guru and Ainslie, Joshua and Ontanon, Santiago and Zaheer, Manzil
          and Sanghai, Sumit and Yang, Yiming and Kumar, Sanjiv and Bhojanapalli, Srinadh},
  booktitle={International Conference on Learning Representations}, year={2024}
}"""
BIBTEX["nope"] = """@inproceedings{kazemnejad2023nope,
  title={The Impact of Positional Encoding on Length Generalization in Transformers},
  author={Kazemnejad, Amirhossein and Padhi, Inkit and Natesan Ramamurthy, Karthikeyan and Das, Payel and Reddy, Siva},
  booktitle={Advances in Neural Information Processing Systems}, year={2023}
}"""
BIBTEX["fox"] = """@inproceedings{lin2025forgetting,
  title={Forgetting Transformer: Softmax Attention with a Forget Gate},
  author={Lin, Zhixuan and Nikishin, Evgenii and He, Xu Owen and Courville, Aaron},
  booktitle={International Conference on Learning Representations}, year={2025}
}"""
BIBTEX["sinusoidal"] = BIBTEX["learned"] = """@inproceedings{vaswani2017attention,
  title={Attention Is All You Need},
  author={Vaswani, Ashish and Shazeer, Noam and Parmar, Niki and Uszkoreit, Jakob and Jones, Llion and Gomez, Aidan N. and Kaiser, {\\L}ukasz and Polosukhin, Illia},
  booktitle={Advances in Neural Information Processing Systems}, year={2017}
}"""

# Each scheme: what it is, in a few words with its paper, and the config fields that set it (docs/guides/models.md).
SCHEMES = {
    "t5_bias": ("T5's bucketed relative position bias (Raffel et al., 2020)",
                ("relative_attention_num_buckets", "relative_attention_max_distance")),
    "shaw": ("relative position representations of keys and values (Shaw et al., 2018)",
             ("max_relative_position", "shaw_value_embeddings")),
    "transformer_xl": ("Transformer-XL's relative positional encoding (Dai et al., 2019)", ("mem_len", "clamp_len")),
    "log_decay": ("a fixed bias -λ·ln(1 + |i - j|), KERPLE's logarithmic kernel with fixed parameters "
                  "(Chi et al., 2022)", ("log_decay_scale",)),
    "alibi": ("ALiBi's linear biases (Press et al., 2022)", ()),
    "kerple_log": ("KERPLE's learned logarithmic kernel bias (Chi et al., 2022)", ()),
    "fire": ("FIRE, a learned function of normalised relative distances (Li et al., 2024)",
             ("fire_mlp_width", "fire_threshold")),
    "nope": ("no position information: the causal mask alone orders tokens (Kazemnejad et al., 2023)", ()),
    "fox": ("the Forgetting Transformer: no position encoding, a learned forget gate per layer and head adding "
            "Σ log f between key and query to the logits (Lin et al., 2025)", ()),
    "rope": ("rotary position embeddings (Su et al., 2021)", ("rope_theta",)),
    "sinusoidal": ("sinusoidal absolute positions added to the embeddings (Vaswani et al., 2017)",
                   ("max_position_embeddings",)),
    "learned": ("a learned absolute position table added to the embeddings (as in Vaswani et al., 2017)",
                ("max_position_embeddings",)),
}
# The Hub's task for each class (the widget and the search filter read it from the front matter).
PIPELINE_TAG = {
    "AutoModelForCausalLM": "text-generation",
    "AutoModelForSeq2SeqLM": "text2text-generation",
    "AutoModelForSequenceClassification": "text-classification",
    "AutoModel": "feature-extraction",
}


def model_card(config, class_name: str, auto_class: str, parameters: int) -> str:
    """The card of a model of class ``class_name`` (loaded with ``auto_class``) with ``config`` and ``parameters``
    parameters, the marker line last."""
    scheme = config.position_encoding
    about, fields = SCHEMES[scheme]
    settings = ", ".join(f"`{name}={getattr(config, name)!r}`" for name in fields)
    if config.is_encoder_decoder and class_name != "RelPosForConditionalGeneration":  # model.encoder.save_pretrained
        kind = ("the decoder stack (causal, cross-attending to an encoder's states)" if config.is_decoder else
                "the encoder stack (bidirectional)") + " of an encoder-decoder in T5's layout, saved alone"
        layers = str(config.num_hidden_layers)
    elif config.is_encoder_decoder:
        kind = ("encoder-decoder in T5's layout: a bidirectional encoder and a causal decoder with the scheme in "
                "self-attention, cross-attention without a position term")
        layers = f"{config.num_hidden_layers} encoder, {config.num_decoder_layers} decoder"
    else:
        kind = "causal (decoder-only)" if config.is_decoder else "bidirectional (encoder-only)"
        layers = str(config.num_hidden_layers)
    activation, gated = config.mlp_activation
    rows = [
        ("class", f"`{class_name}` (`{auto_class}`)"),
        ("attention", kind),
        ("position scheme", f"`{scheme}`" + (f": {settings}" if settings else "")),
        ("layers", layers),
        ("width", f"hidden_size {config.hidden_size}, {config.num_attention_heads} heads × head_dim "
                  f"{config.head_dim}, intermediate_size {config.intermediate_size} "
                  f"({'gated ' if gated else ''}{activation})"),
        ("vocabulary", f"{config.vocab_size} tokens"),
        ("parameters", f"{parameters:,}"),
    ]
    if config.sliding_window is not None:
        rows.append(("sliding window", f"{config.sliding_window} positions"))
    if (config.norm_type, config.norm_position, config.final_norm) != ("rms_norm", "pre", True):
        rows.append(("norms", f"{config.norm_type}, {config.norm_position}-norm, "
                              f"{'a' if config.final_norm else 'no'} final norm"))
    if config.cutoffs is not None:
        rows.append(("vocabulary clusters", f"adaptive input and softmax cut at {config.cutoffs}, div_val "
                                            f"{config.div_val}: the causal LM's logits are log-probabilities"))
    if auto_class == "AutoModelForSequenceClassification":
        rows.append(("labels", str(config.num_labels)))
    tags = ["custom_code", "hf_relpos", "relative-position", scheme.replace("_", "-")]
    lines = [
        "---",
        "library_name: transformers",
        f"pipeline_tag: {PIPELINE_TAG[auto_class]}",
        "tags:",
        *(f"  - {tag}" for tag in tags + (["encoder-decoder"] if config.is_encoder_decoder else [])),
        "---",
        "",
        f"# {class_name} with `position_encoding=\"{scheme}\"` (hf_relpos)",
        "",
        f"A Transformer with {about}, saved by hf_relpos' `save_pretrained`. This card says what "
        "the model is; it holds no measurement of it.",
        "",
        "| | |",
        "| --- | --- |",
        *(f"| {name} | {value} |" for name, value in rows),
        "",
        "## How to load",
        "",
        "The model's code ships in this folder (`modeling_relpos.py` and the files it imports), so it loads "
        "without hf_relpos, as remote code:",
        "",
        "```python",
        f"from transformers import {auto_class}",
        "",
        f'model = {auto_class}.from_pretrained("path/to/this/folder", trust_remote_code=True)',
        "```",
        "",
        "With hf_relpos installed, its own classes load it (no code from the folder runs):",
        "",
        "```python",
        "import hf_relpos  # registers its classes with the Auto classes",
        f"from transformers import {auto_class}",
        "",
        f'model = {auto_class}.from_pretrained("path/to/this/folder")',
        "```",
        "",
        "## Citation",
        "",
        "The position scheme's paper:",
        "",
        "```bibtex",
        BIBTEX[scheme],
        "```",
        "",
    ]
    text = "\n".join(lines)
    return text + MARKER.format(digest=hashlib.sha256(text.encode("utf-8")).hexdigest()) + "\n"


def is_own_card(text: str) -> bool:
    """True for a card ``model_card`` wrote and nobody edited since: its marker's digest is that of the text above."""
    match = _MARKER.search(text)
    if match is None:
        return False
    above = text[: match.start()]
    return hashlib.sha256(above.encode("utf-8")).hexdigest() == match.group(1)


def write_card(folder, card: str) -> bool:
    """Write ``card`` as ``folder/README.md`` unless a README is there that is not an unedited card of ours (it is
    kept, byte for byte); the text goes to a temporary file beside it, then replaces it in one rename. True when
    written."""
    path = os.path.join(folder, CARD_FILE)
    if os.path.lexists(path) and (os.path.islink(path) or not os.path.isfile(path)):
        return False  # a link (dangling too), a folder, a pipe: the user's, not a file we wrote
    try:
        with open(path, encoding="utf-8") as existing:
            if not is_own_card(existing.read()):
                return False
    except FileNotFoundError:
        pass
    except (UnicodeDecodeError, OSError):  # not text we wrote, or one we cannot read: the user's
        return False
    temporary = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"  # beside it: the rename stays on one file system
    try:
        with open(temporary, "x", encoding="utf-8") as out:
            out.write(card)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise
    return True


__all__ = ["BIBTEX", "CARD_FILE", "is_own_card", "model_card", "write_card"]
