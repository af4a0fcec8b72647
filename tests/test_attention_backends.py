"""attention_backends_relpos.py: the one seam between what a scheme's position term is and how it is computed.

The layout facts a new backend relies on (the fast-path choice made here only, the model file naming no scheme),
and the compact forms against the dense bias they stand for: the same attention output from the fused path of a
compact form as from the bias merged with the mask, values and gradients.
"""

import ast
import re
from pathlib import Path

import pytest
import torch

from hf_relpos import POSITION_ENCODINGS, RelPosForCausalLM
from hf_relpos import attention_backends_relpos
from hf_relpos.attention_backends_relpos import COMPACT_PATHS, attend_bias, bias_term
from hf_relpos.position_schemes_relpos import POSITION_SCHEMES, AdditiveBiasScheme, PositionScheme
from tiny import make_model, padding_mask, rand_ids

PACKAGE = Path(__file__).resolve().parents[1] / "hf_relpos"
# The functions that choose or run a fused CPU path on the model's behalf.
FAST_PATH_NAMES = {"cpu_fast_path", "saturating_bias_attention", "causal_key_bias_attention", "attention_with_bias"}
MODEL_FILES = ("modeling_relpos.py", "position_schemes_relpos.py", "position_context_relpos.py", "inputs_relpos.py",
               "generation_relpos.py", "loading_relpos.py")


def _names_used(path: Path) -> set:
    tree = ast.parse(path.read_text())
    names = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    names |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) for alias in node.names}
    return names


@pytest.mark.parametrize("module", MODEL_FILES)
def test_the_fast_path_choice_is_made_in_the_backends_module_only(module):
    assert not FAST_PATH_NAMES & _names_used(PACKAGE / module)


def test_the_model_file_names_no_scheme():
    source = (PACKAGE / "modeling_relpos.py").read_text()
    names = set(POSITION_ENCODINGS) | {cls.__name__ for cls in POSITION_SCHEMES.values()}
    found = sorted({name for name in names if re.search(rf"\b{re.escape(name)}\b", source)})
    assert not found, f"modeling_relpos.py names {found}"


def test_every_compact_form_has_a_path():
    forms = {name: cls.compact_form for name, cls in POSITION_SCHEMES.items()}
    assert {form for form in forms.values() if form is not None} <= set(COMPACT_PATHS)
    for name, cls in POSITION_SCHEMES.items():
        # a bias scheme that builds a compact form says which, so that the backend can run it
        if issubclass(cls, AdditiveBiasScheme) and cls.compact is not AdditiveBiasScheme.compact:
            assert forms[name] is not None, name
    assert PositionScheme.compact_form is None


def _captured_context(model, ids, mask):
    seen = []
    hook = model.model.layers[0].register_forward_pre_hook(
        lambda module, a, kw: seen.append(kw["ctx"]), with_kwargs=True
    )
    try:
        with torch.no_grad():
            model(ids, attention_mask=mask)
    finally:
        hook.remove()
    return seen[0]


@pytest.mark.parametrize("scheme", ["t5_bias", "alibi"])
def test_a_compact_form_computes_what_its_dense_bias_does(scheme):
    """``bias_term`` on CPU's SDPA path hands a compact form; ``attend_bias`` runs it in its fused path and gives
    the output (and the gradients) of the scheme's dense bias merged with the mask."""
    torch.manual_seed(0)
    model = make_model(RelPosForCausalLM, scheme, "sdpa", preset="modeling").double()
    ids, mask = rand_ids(2, 40), padding_mask(2, 40, "left", pads=(0, 4))
    ctx = _captured_context(model, ids, mask)
    position, attn = model.model.position, model.model.layers[0].self_attn
    compact = bias_term(ctx, torch.device("cpu"), torch.float64, 0.0, position.compact_form,
                        lambda: position.compact(ctx, "cpu", torch.float64), lambda: position.bias(ctx, "cpu", torch.float64),
                        lambda: position.bias_by_distance(ctx, "cpu"))
    assert compact.dim() < 4  # the compact form was taken
    dense = position.bias(ctx, "cpu", torch.float64).to(torch.float64)
    dense = torch.where(ctx.full_mask("cpu"), dense, torch.finfo(torch.float64).min)
    q, k, v = (torch.randn(2, 4, 40, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    fast, _ = attend_bias(attn, q, k, v, compact, ctx, position.compact_form)
    exact, _ = attend_bias(attn, q, k, v, dense, ctx, position.compact_form)
    keep = ctx.key_mask.transpose(1, 3)  # padded queries' rows are not compared ([B, Q, 1, 1])
    torch.testing.assert_close(fast * keep, exact * keep, rtol=1e-10, atol=1e-10)
    weights = torch.randn_like(fast) * keep
    grads_fast = torch.autograd.grad((fast * weights).sum(), (q, k, v))
    grads_exact = torch.autograd.grad((exact * weights).sum(), (q, k, v))
    for a, b in zip(grads_fast, grads_exact):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize(
    "scheme, dtype, compact",
    [
        ("t5_bias", torch.float32, True), ("t5_bias", torch.bfloat16, True),  # both paths take half precision
        ("alibi", torch.float32, True), ("alibi", torch.bfloat16, True), ("alibi", torch.float16, True),
        ("fox", torch.float64, True), ("fox", torch.bfloat16, True), ("fox", torch.float16, True),
        ("kerple_log", torch.float32, False),  # no compact form
    ],
)
def test_which_path_a_bias_takes(monkeypatch, scheme, dtype, compact):
    """A fresh padded forward on CPU's SDPA: the compact form's fused path in every dtype (the per-key path adds
    its bias in float32 at least), the merged bias where a scheme has none. FoX decides per layer."""
    calls = []
    for form, path in COMPACT_PATHS.items():
        monkeypatch.setitem(attention_backends_relpos.COMPACT_PATHS, form,
                            lambda *a, _path=path, _form=form: calls.append(_form) or _path(*a))
    model = make_model(RelPosForCausalLM, scheme, "sdpa", preset="modeling").to(dtype)
    with torch.no_grad():
        logits = model(rand_ids(2, 24), attention_mask=padding_mask(2, 24, "left", pads=(0, 3))).logits
    assert torch.isfinite(logits[:, 3:]).all()
    form = POSITION_SCHEMES[scheme].compact_form
    assert calls == ([form] * model.config.num_hidden_layers if compact else [])


@pytest.mark.parametrize("scheme, per_key", [("alibi", True), ("fox", True)])
def test_a_trained_per_key_bias_in_half_precision_takes_the_per_key_path(monkeypatch, scheme, per_key):
    """A bf16 training forward: ALiBi's fixed bias and FoX's trained one take the per-key path (FoX's in float32
    there: the kernel's half-precision sum per key would be its gradient, test_fox.py), not a merged bias."""
    calls = []
    monkeypatch.setitem(attention_backends_relpos.COMPACT_PATHS, "key",
                        lambda *a, _path=COMPACT_PATHS["key"]: calls.append("key") or _path(*a))
    model = make_model(RelPosForCausalLM, scheme, "sdpa", preset="modeling").to(torch.bfloat16)
    ids = rand_ids(2, 24)
    model(ids, labels=ids).loss.backward()
    assert calls == (["key"] * model.config.num_hidden_layers if per_key else [])
