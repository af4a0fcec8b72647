"""Folders saved under one Transformers decode identically, through remote code, under another.

    python scripts/cross_version.py save DIR    # with hf_relpos: a tiny random model per scheme and the encoder-decoder,
                                                # and the tokens greedy and beam search give now (DIR/expected.json)
    python scripts/cross_version.py check DIR   # without hf_relpos (its import is blocked): each folder through
                                                # AutoModel*.from_pretrained(trust_remote_code=True); the same tokens

``make compat`` saves under the development pin and checks under each compatibility Transformers, then the
other way round. Exit status 1 when any folder decodes differently (each mismatch is printed).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

VOCAB = 61
DECODE = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)


def _inputs(torch):
    ids = torch.randint(1, VOCAB, (2, 7), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    ids[1, :3], mask[1, :3] = 0, 0  # left padding
    return ids, mask


def _decode(model, torch) -> dict:
    ids, mask = _inputs(torch)
    out = {}
    with torch.no_grad():
        for name, extra in (("greedy", dict(use_cache=True)), ("greedy_uncached", dict(use_cache=False)),
                            ("beam", dict(num_beams=3, use_cache=True))):
            out[name] = model.generate(input_ids=ids, attention_mask=mask, **DECODE, **extra).tolist()
    return out


def save(folder: Path) -> None:
    import torch
    import transformers

    import hf_relpos
    from hf_relpos import POSITION_ENCODINGS, RelPosConfig

    small = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_hidden_layers=2, intermediate_size=64,
                 max_position_embeddings=64, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                 max_relative_position=3, initializer_range=0.3, pad_token_id=0, bos_token_id=None, eos_token_id=None)
    models = {scheme: (hf_relpos.RelPosForCausalLM, dict(position_encoding=scheme)) for scheme in POSITION_ENCODINGS}
    models["transformer_xl-memory"] = (hf_relpos.RelPosForCausalLM, dict(position_encoding="transformer_xl", mem_len=4))
    models["seq2seq-t5_bias"] = (hf_relpos.RelPosForConditionalGeneration,
                                 dict(position_encoding="t5_bias", is_encoder_decoder=True, decoder_start_token_id=0))
    expected = {"transformers": transformers.__version__, "models": {}}
    for name, (cls, fields) in models.items():
        torch.manual_seed(0)
        model = cls(RelPosConfig(**small, **fields)).eval()
        model.save_pretrained(folder / name)
        decoded = _decode(model, torch)
        if decoded["greedy"] != decoded["greedy_uncached"]:
            sys.exit(f"{name}: cached greedy differs from uncached under transformers {transformers.__version__}")
        expected["models"][name] = {"class": "seq2seq" if cls is hf_relpos.RelPosForConditionalGeneration else "causal",
                                    **decoded}
    (folder / "expected.json").write_text(json.dumps(expected))
    print(f"saved {len(models)} folders under transformers {transformers.__version__} to {folder}")


class _BlockHfRelpos:
    """A ``sys.meta_path`` finder that makes ``import hf_relpos`` fail, as on a machine without it."""

    def find_spec(self, name, path=None, target=None):
        if name == "hf_relpos" or name.startswith(("hf_relpos.", "hf_relpos_cli")):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked: remote code only)")
        return None


def check(folder: Path) -> int:
    sys.meta_path.insert(0, _BlockHfRelpos())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ["HF_MODULES_CACHE"] = tempfile.mkdtemp(prefix="hf-modules-")
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    expected = json.loads((folder / "expected.json").read_text())
    failures = 0
    for name, want in expected["models"].items():
        auto = AutoModelForSeq2SeqLM if want["class"] == "seq2seq" else AutoModelForCausalLM
        model = auto.from_pretrained(folder / name, trust_remote_code=True).eval()
        if not type(model).__module__.startswith("transformers_modules."):
            print(f"{name}: loaded {type(model).__module__}, not the folder's remote code")
            failures += 1
            continue
        got = _decode(model, torch)
        for kind in ("greedy", "greedy_uncached", "beam"):
            if got[kind] != want[kind]:
                failures += 1
                print(f"{name}: {kind} tokens differ (saved under transformers {expected['transformers']}, "
                      f"decoded under {transformers.__version__}): {got[kind]} != {want[kind]}")
    print(f"{len(expected['models'])} folders saved under transformers {expected['transformers']}, decoded through "
          f"remote code under {transformers.__version__}: {'identical' if not failures else f'{failures} mismatches'}")
    return 1 if failures else 0


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("save", "check"):
        sys.exit(__doc__)
    target = Path(sys.argv[2])
    if sys.argv[1] == "save":
        target.mkdir(parents=True, exist_ok=True)
        save(target)
    else:
        sys.exit(check(target))
