"""position_context_relpos.py: the cache read once (``read_cache`` -> ``Geometry``) and the mask kept as its recipe.

The geometry is checked against what each kind of Transformers cache holds, counted by the test (tokens fed,
a window's width, a static cache's size); the recipe against the rendered mask by calling its mask function
entry by entry, as any other renderer (FlexAttention's block mask) would.
"""

import ast
from pathlib import Path

import pytest
import torch

from transformers import DynamicCache, StaticCache

from hf_relpos import RelPosForCausalLM, RelPosModel
from hf_relpos.position_context_relpos import Geometry, read_cache
from tiny import build, make_model, padding_mask, rand_ids

PACKAGE = Path(__file__).resolve().parents[1] / "hf_relpos"
CACHE_QUESTIONS = {"get_seq_length", "get_query_offset", "get_mask_sizes", "get_max_length"}


def test_the_cache_is_asked_in_one_function():
    """Every call of a Cache's geometry methods in the package sits in ``position_context_relpos.read_cache``."""
    askers = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text())
        for function in ast.walk(tree):
            if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(function):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and (
                    node.func.attr in CACHE_QUESTIONS
                ):
                    askers.add((path.name, function.name))
    # read_cache's own nested calls are the only ones (the model file and the checks ask it for the record)
    assert askers == {("position_context_relpos.py", "read_cache")}


def _fill(model, cache, tokens: int):
    """Feed ``tokens`` tokens through ``model`` into ``cache``."""
    with torch.no_grad():
        model(rand_ids(1, tokens), cache=cache, use_cache=True)


def test_geometry_of_no_cache_and_of_a_dynamic_cache():
    model = build("alibi")
    assert read_cache(None, 2, 5) == Geometry(2, 5, q_offset=0, kv_length=5, kv_offset=0)
    cache = DynamicCache(config=model.config)
    _fill(model, cache, 7)
    geometry = read_cache(cache, 1, 3)
    # 7 tokens held: the 3 new ones at positions 7..9, attending over 10 keys from position 0
    assert (geometry.q_offset, geometry.kv_length, geometry.kv_offset) == (7, 10, 0)
    assert geometry.cache_layers == model.config.num_hidden_layers and geometry.room is None
    assert geometry.cache_keys == (1, model.config.num_attention_heads, model.config.head_dim)
    assert not geometry.fresh and read_cache(None, 1, 3).fresh


def test_geometry_of_a_full_sliding_window_cache():
    window = 4
    model = build("alibi", sliding_window=window)
    cache = DynamicCache(config=model.config)
    _fill(model, cache, 9)
    geometry = read_cache(cache, 1, 2)
    # A window of 4 keeps the last 3 keys (positions 6..8) before the 2 new tokens at 9..10.
    assert (geometry.q_offset, geometry.kv_length, geometry.kv_offset) == (9, 3 + 2, 9 - window + 1)


def test_geometry_of_a_static_cache_names_its_room():
    model = build("t5_bias")
    cache = StaticCache(config=model.config, max_cache_len=16)
    _fill(model, cache, 6)
    geometry = read_cache(cache, 1, 1)
    # a static cache's keys are its 16 slots from position 0, the new token at 6
    assert (geometry.q_offset, geometry.kv_length, geometry.kv_offset, geometry.room) == (6, 16, 0, 16)
    with pytest.raises(ValueError, match="max_cache_len=16 holding 6 tokens: no room for 11 more"):
        model(rand_ids(1, 11), cache=cache)


def _contexts(model, *args, **kwargs):
    """The PositionContext every layer of ``model`` received in one forward."""
    seen = []
    hooks = [
        layer.register_forward_pre_hook(lambda module, a, kw: seen.append(kw["ctx"]), with_kwargs=True)
        for layer in model.model.layers
    ]
    try:
        with torch.no_grad():
            out = model(*args, **kwargs)
    finally:
        for hook in hooks:
            hook.remove()
    return seen, out


def _render_entry_by_entry(recipe) -> torch.Tensor:
    """The recipe's mask by calling its function once per (row, query, key), and the padding by its key index."""
    mask = torch.zeros(recipe.batch, 1, recipe.q_length, recipe.kv_length, dtype=torch.bool)
    for b in range(recipe.batch):
        for i in range(recipe.q_length):
            for j in range(recipe.kv_length):
                q_idx, kv_idx = recipe.q_offset + i, recipe.kv_offset + j
                keep = bool(recipe.function(torch.tensor(b), torch.tensor(0), torch.tensor(q_idx), torch.tensor(kv_idx)))
                if recipe.padding is not None:
                    keep &= kv_idx < recipe.padding.shape[1] and bool(recipe.padding[b, kv_idx])
                mask[b, 0, i, j] = keep
    return mask


def _case(name):
    """(model, forward kwargs, what may be attended beyond causality as ``keep(b, i, j)`` from the definitions)."""
    if name == "left padding":
        mask = padding_mask(3, 7, "left")
        return build("alibi"), dict(input_ids=rand_ids(3, 7), attention_mask=mask), lambda b, i, j: bool(mask[b, j])
    if name == "bidirectional window and right padding":
        model = make_model(RelPosModel, "t5_bias", "eager", preset="modeling", is_decoder=False, sliding_window=3)
        mask = padding_mask(3, 7, "right")
        return model, dict(input_ids=rand_ids(3, 7), attention_mask=mask), (
            lambda b, i, j: bool(mask[b, j]) and abs(i - j) <= 3
        )
    if name == "packed documents":
        positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])
        document = (positions == 0).cumsum(-1)[0]
        return build("kerple_log"), dict(input_ids=rand_ids(1, 8), position_ids=positions), (
            lambda b, i, j: bool(document[i] == document[j])
        )
    if name == "causal window":
        return build("rope", sliding_window=3), dict(input_ids=rand_ids(2, 9)), lambda b, i, j: i - j < 3
    raise AssertionError(name)


@pytest.mark.parametrize(
    "name", ["left padding", "bidirectional window and right padding", "packed documents", "causal window"]
)
def test_the_mask_recipe_describes_the_rendered_mask(name):
    """The mask and its recipe's function both say what the case's definition says, entry by entry."""
    model, kwargs, keep = _case(name)
    contexts, _ = _contexts(model if isinstance(model, RelPosForCausalLM) else _Wrap(model), **kwargs)
    ctx = contexts[0]
    assert ctx.mask is not None and ctx.mask_recipe is not None
    assert all(other is ctx for other in contexts)  # built once, handed to every layer
    batch, _, length, keys = ctx.mask.shape
    rows = kwargs["input_ids"].shape[0]
    expected = torch.tensor(
        [[[[keep(b, i, j) for j in range(keys)] for i in range(length)]] for b in range(rows)]
    )
    assert torch.equal(ctx.mask.expand(rows, -1, -1, -1), expected)
    assert torch.equal(_render_entry_by_entry(ctx.mask_recipe).expand(rows, -1, -1, -1), expected)


def test_a_context_moves_its_mask_recipe():
    """``PositionContext.to`` (accelerate's hooks) moves the recipe's tensors, the packed documents included."""
    model = build("alibi")
    contexts, _ = _contexts(model, rand_ids(1, 6), seq_idx=torch.tensor([[0, 0, 0, 1, 1, 1]]))
    moved = contexts[0].to("meta")
    assert moved.mask_recipe.documents.is_meta and moved.mask.is_meta
    assert contexts[0].mask_recipe.documents.device.type == "cpu"


def test_a_cache_of_more_layers_is_refused_before_it_is_read():
    """A cache of another configuration is one line naming the layers, before its layers are asked anything (a
    cache of linear-attention layers answers no geometry question)."""
    model = build("alibi")
    cache = DynamicCache(config=build("alibi", num_hidden_layers=3).config)
    assert len(cache.layers) == 3

    def unreadable(*args, **kwargs):
        raise AssertionError("the cache was asked")

    cache.get_query_offset = cache.get_mask_sizes = cache.get_seq_length = unreadable
    with pytest.raises(ValueError, match=r"cache \(past_key_values\) has 3 layers, this model has num_hidden_layers=2"):
        model(rand_ids(1, 4), cache=cache)


def test_the_mask_recipe_of_cached_decoding_is_offset_by_the_cache():
    model = build("alibi")
    ids, mask = rand_ids(2, 6), padding_mask(2, 6, "left", pads=(0, 2))
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, attention_mask=mask, cache=cache, use_cache=True)
    step_mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
    contexts, _ = _contexts(model, rand_ids(2, 1), attention_mask=step_mask, cache=cache, use_cache=True)
    recipe = contexts[0].mask_recipe
    assert (recipe.q_offset, recipe.kv_length) == (6, 7)
    assert torch.equal(contexts[0].mask, _render_entry_by_entry(recipe))


def test_a_prepared_mask_has_no_recipe():
    model = build("alibi")
    prepared = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    contexts, _ = _contexts(model, rand_ids(1, 4), attention_mask=prepared)
    assert contexts[0].mask is not None and contexts[0].mask_recipe is None


class _Wrap(torch.nn.Module):
    """A base model seen through ``.model``, as the heads hold it (for the hooks of ``_contexts``)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **kwargs):
        return self.model(**kwargs)
