"""Hypothesis settings, strategies and drawing helpers shared by the fuzz tests.

Used by test_functional_fuzz.py, test_configuration_relpos.py and test_modeling_fuzz.py. The run is
deterministic (``derandomize=True``) so that CI is stable. ``HF_RELPOS_FUZZ_SCALE=10`` multiplies every example
budget; ``HF_RELPOS_FUZZ_RANDOM=1`` draws fresh random examples; ``HF_RELPOS_FUZZ_SHRINK=1`` shrinks failures.
``COUNTS`` holds how many examples each property ran in this session (``test_zz_report_example_counts``).
"""

from __future__ import annotations

import collections
import os

import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st

from hf_relpos import POSITION_ENCODINGS
from hf_relpos.configuration_relpos import HIDDEN_ACTS

SCALE = float(os.environ.get("HF_RELPOS_FUZZ_SCALE", "1"))
RANDOM = os.environ.get("HF_RELPOS_FUZZ_RANDOM", "") not in ("", "0")
SHRINK = os.environ.get("HF_RELPOS_FUZZ_SHRINK", "") not in ("", "0")
COUNTS: collections.Counter = collections.Counter()


def fuzz_settings(examples: int):
    return settings(
        max_examples=max(1, int(examples * SCALE)),
        deadline=None,
        derandomize=not RANDOM,
        database=None,
        print_blob=True,
        # Shrinking a failure can take minutes; the test_regression_* tests hold minimal repros instead.
        phases=[p for p in Phase if p != Phase.shrink or SHRINK],
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
    )


DTYPES = (torch.float32, torch.float64, torch.bfloat16)
MASK_FLOAT_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
NON_FLOAT_DTYPES = (torch.int64, torch.int32, torch.uint8, torch.bool, torch.complex64)

CAUSAL_ONLY = ("fire", "nope", "fox")  # the README: defined for causal attention only


def chance(data, p_true: float = 0.12) -> bool:
    """A biased coin: True with probability about ``p_true`` (hypothesis still shrinks it to False)."""
    # hypothesis favours small integers (and shrinks toward 0): small means "no"
    return data.draw(st.integers(0, 99)) >= 100 - int(p_true * 100)


def bad_int(data, minimum: int = 0):
    """An invalid value for an ``int >= minimum`` argument."""
    return data.draw(
        st.sampled_from(
            [minimum - 1, minimum - 7, 2.0, float("nan"), True, "3", None, torch.tensor(2.5), torch.tensor([1, 2])]
        )
    )


def draw_int_arg(data, name: str, faults: set, lo: int, hi: int, minimum: int = 0):
    if chance(data, 0.06):
        faults.add(name)
        return bad_int(data, minimum)
    value = data.draw(st.integers(lo, hi))
    if chance(data, 0.05):
        return torch.tensor(value)  # a 0-d integer tensor counts as an int (documented in _check_int)
    return value


def draw_qkv_values(data, shape, dtype):
    scale = data.draw(st.sampled_from([0.1, 1.0, 4.0]))
    seed = data.draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype)


def draw_mask(data, B, H, Q, K, faults: set):
    """None, or a bool / additive float mask broadcastable to [B, H, Q, K] (sometimes not: a fault)."""
    kind = data.draw(st.sampled_from(["none", "bool", "float", "float", "bad_dtype"]))
    if kind == "none":
        return None
    full = [B, H, Q, K]
    shape = [data.draw(st.sampled_from([1, n])) for n in full]
    drop = data.draw(st.integers(0, 4))
    if all(s == 1 for s in shape[:drop]):
        shape = shape[drop:]
    if chance(data, 0.08):
        faults.add("attention_mask")
        if chance(data, 0.3):
            shape = [1] * (5 - len(shape)) + list(shape)  # 5-D: does not broadcast to a 4-D shape
        else:
            dim = data.draw(st.integers(0, len(full) - 1))
            true = full[dim]
            wrong = data.draw(st.integers(2, 14).filter(lambda n: n not in (1, true)))
            shape = [1] * (4 - len(shape)) + list(shape)
            shape[dim] = wrong
    seed = data.draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    if kind == "bool":
        p = data.draw(st.sampled_from([0.0, 0.3, 0.8, 1.0]))
        return torch.rand(shape, generator=g) < p
    if kind == "bad_dtype":
        faults.add("attention_mask")
        return torch.ones(shape, dtype=data.draw(st.sampled_from([torch.long, torch.int32, torch.uint8])))
    mdtype = data.draw(st.sampled_from(MASK_FLOAT_DTYPES))
    choice = torch.randint(0, 4, shape, generator=g)
    values = torch.rand(shape, generator=g, dtype=torch.float64) * 10 - 5
    out = torch.where(choice == 0, torch.zeros_like(values), values)
    out = torch.where(choice == 1, torch.full_like(values, float("-inf")), out)
    out = torch.where(choice == 2, torch.full_like(values, float(torch.finfo(mdtype).min)), out).to(mdtype)
    return out


# ---------------------------------------------------------------------------------------------------
# models
# ---------------------------------------------------------------------------------------------------


@st.composite
def model_configs(draw):
    # Transformer-XL is drawn more often: its memory adds a path (mems) the other schemes do not have.
    scheme = draw(st.sampled_from(POSITION_ENCODINGS + ("transformer_xl",) * 3))
    is_decoder = True if scheme in CAUSAL_ONLY else draw(st.booleans())
    heads = draw(st.sampled_from([1, 2, 4]))
    head_dim = draw(st.sampled_from([2, 4]))
    kw = dict(
        position_encoding=scheme,
        is_decoder=is_decoder,
        vocab_size=draw(st.integers(8, 24)),
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_hidden_layers=draw(st.integers(1, 2)),
        intermediate_size=draw(st.sampled_from([8, 16])),
        hidden_act=draw(st.sampled_from(HIDDEN_ACTS)),
        attention_bias=draw(st.booleans()),
        initializer_range=draw(st.sampled_from([0.02, 0.5])),
        pad_token_id=0,
        bos_token_id=None,
        eos_token_id=None,
    )
    if scheme == "t5_bias":
        nb = draw(st.integers(2 if is_decoder else 4, 12))
        one_side = nb if is_decoder else nb // 2
        kw.update(relative_attention_num_buckets=nb, relative_attention_max_distance=draw(
            st.integers(one_side // 2 + 1, 24)))
    elif scheme == "shaw":
        kw.update(max_relative_position=draw(st.integers(0, 4)), shaw_value_embeddings=draw(st.booleans()))
    elif scheme == "transformer_xl":
        kw.update(mem_len=draw(st.sampled_from([3, 0, 1, 2, 6])), clamp_len=draw(st.sampled_from([-1, 1, 3, 8])))
    elif scheme == "log_decay":
        kw.update(log_decay_scale=draw(st.sampled_from([0.1, 1.0, 3.0])))
    elif scheme == "rope":
        kw.update(rope_theta=draw(st.sampled_from([10.0, 10000.0])))
    elif scheme == "fire":
        kw.update(fire_mlp_width=draw(st.sampled_from([1, 4])), fire_threshold=draw(st.sampled_from([2.0, 512.0])))
    elif scheme in ("kerple_log", "nope", "fox"):
        pass
    else:
        kw.update(max_position_embeddings=draw(st.integers(4, 24)))
    return kw


def draw_padding(data, batch: int, length: int):
    kind = data.draw(st.sampled_from(["none", "ones", "left", "right", "holes", "full_row"]))
    if kind == "none":
        return None
    mask = torch.ones(batch, length, dtype=torch.long)
    seed = data.draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    for b in range(batch):
        n = int(torch.randint(0, length + 1, (1,), generator=g)) if length else 0
        if kind == "left":
            mask[b, :n] = 0
        elif kind == "right":
            mask[b, length - n :] = 0
        elif kind == "holes":
            mask[b] = (torch.rand(length, generator=g) < 0.6).long()
        elif kind == "full_row" and (b == 0 or torch.rand(1, generator=g) < 0.5):
            mask[b] = 0
    if data.draw(st.booleans()):
        mask = mask.bool()
    return mask



MEMS_KINDS = ("batch", "too_long", "hidden", "layers", "ragged", "not_tensor", "none_entry", "2d", "float64", "tensor")


def invalid_mems(data, mems_like: list, batch: int, config, kind: str):
    H, L, M = config.hidden_size, config.num_hidden_layers, config.mem_len
    m = mems_like[0].shape[1] if mems_like else 1
    make = lambda b, n, h, dtype=torch.float32: torch.randn(b, n, h, dtype=dtype)  # noqa: E731
    if kind == "batch":
        return [make(batch + 1, m, H) for _ in range(L)]
    if kind == "too_long":
        return [make(batch, M + 1, H) for _ in range(L)]
    if kind == "hidden":
        return [make(batch, m, H + 2) for _ in range(L)]
    if kind == "layers":
        return [make(batch, m, H) for _ in range(L + 1)]
    if kind == "ragged":
        return [make(batch, (m + i) % (M + 1), H) for i in range(L)] if L > 1 else [make(batch, m, H + 1)]
    if kind == "not_tensor":
        return [[0.0] * H for _ in range(L)]
    if kind == "none_entry":
        return [None] * L
    if kind == "2d":
        return [make(batch, H, 1)[..., 0] for _ in range(L)]
    if kind == "float64":
        return [make(batch, m, H, torch.float64) for _ in range(L)]
    return torch.randn(L, batch, m, H)
