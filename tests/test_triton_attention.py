"""The fused Triton kernel of ``hf_relpos/triton_attention_relpos.py`` against float64 oracles written from the papers:
plain ``softmax(scale·q kᵀ + b + mask) v`` (a query with no key left: zeros), with ``b`` T5's table read through
upstream T5's bucket of the distance (Raffel et al. 2020), KERPLE's ``-r1·ln(1 + r2|d|)`` (Chi et al. 2022),
ALiBi's ``-m|d|`` with the paper's slopes (Press et al. 2022), FoX's ``c_i - c_j``, ``c = cumsum(log f)`` (Lin et
al. 2025); outputs and every gradient (q, k, v, the table, r1 and r2, the slopes, FoX's gate through
``fox_query_key_bias``), under padding on either side, packed documents, a cache offset and lengths that are no
multiple of the tile, in float32, float16 and bfloat16; dead rows; the table's far-tile branch; determinism.

Without a GPU the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest.py before
Triton is imported), on CPU tensors with tiles of 16 (8 across the inner loop of each backward).
"""

import math

import pytest
import torch
import torch.nn.functional as nnF

pytest.importorskip("triton")

from hf_relpos import triton_attention_relpos as TA  # noqa: E402
from hf_relpos.functional import fox_query_key_bias, t5_relative_position_bucket  # noqa: E402

if TA.interpreting():
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    pytest.skip("the Triton kernel needs CUDA, or TRITON_INTERPRET=1 before Triton is imported",
                allow_module_level=True)

# The tiles of the backward over keys, which sums the table's gradient: query rows x key columns.
TILE_M, TILE_N = TA.launch("backward_kv")["BM"], TA.launch("backward_kv")["BN"]
# Relative error bounds (max abs error / max abs reference). bfloat16 keeps 8 significant bits: up to 3.9e-3 per
# rounding (of the output, and on a GPU of p and ds before their products; the interpreter computes bfloat16 in
# float32 and truncates the output instead of rounding it, up to 7.8e-3): 2e-2.
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
TERM_NAMES = ["table", "log", "linear", "query_key", None]
# T5's configuration in the main tests: the kernel's index covers distances -R .. R, R = max_distance (where
# upstream's buckets have saturated).
T5_MAX_DISTANCE = 20


def gen(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


# ---------------------------------------------------------------------------------------------
# Oracles, float64, from the papers
# ---------------------------------------------------------------------------------------------


def t5_bucket(relative_position, bidirectional, num_buckets, max_distance):
    """Upstream T5's ``_relative_position_bucket`` (Mesh TensorFlow; Transformers' ``T5Attention``) of
    ``relative_position = key position - query position``, in upstream's float32 operations (bucket edges depend
    on their rounding)."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets = buckets + (relative_position > 0).long() * num_buckets
        n = relative_position.abs()
    else:
        n = (-relative_position).clamp(min=0)
    max_exact = num_buckets // 2
    large = max_exact + (
        torch.log(n.float() / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact)
    ).long()
    large = large.clamp(max=num_buckets - 1)
    return buckets + torch.where(n < max_exact, n, large)


def alibi_paper_slopes(heads):
    """Press et al. 2022 (their ``get_slopes``): ``2^(-8h/n)`` for ``n`` a power of two, else the closest power's
    slopes then every other slope of twice that."""
    def power(n):
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start * start**i for i in range(n)]

    if math.log2(heads).is_integer():
        return power(heads)
    closest = 2 ** math.floor(math.log2(heads))
    return power(closest) + alibi_paper_slopes(2 * closest)[0::2][: heads - closest]


def allowed_pairs(B, Q, K, past, causal, key_valid, documents):
    """``[B, 1, Q, K]``: query ``i`` (position ``past + i``) may see key ``j``."""
    i = torch.arange(Q)[:, None] + past
    j = torch.arange(K)[None, :]
    allowed = torch.ones(B, 1, Q, K, dtype=torch.bool)
    if causal:
        allowed = allowed & (j <= i)
    if key_valid is not None:
        allowed = allowed & key_valid[:, None, None, :].cpu()
    if documents is not None:
        docs = documents.cpu()
        allowed = allowed & (docs[:, None, past:past + Q, None] == docs[:, None, None, :])
    return allowed


def attention64(q, k, v, scale, bias, allowed):
    """``softmax(scale·q kᵀ + bias) v`` over the allowed keys, zeros for a row with none; and which rows live."""
    scores = scale * q @ k.transpose(-1, -2) + bias
    alive = allowed.any(-1, keepdim=True)
    scores = scores.masked_fill(~allowed, float("-inf")).masked_fill(~alive, 0.0)
    return torch.where(alive, torch.softmax(scores, -1), 0.0) @ v, alive


def distances(Q, K, past):
    """``d[i, j] = j - (past + i)``, key minus query position."""
    return torch.arange(K)[None, :] - (torch.arange(Q)[:, None] + past)


# ---------------------------------------------------------------------------------------------
# Terms: the learned leaves, what the kernel takes of them, and the oracle's bias of their float64 copies
# ---------------------------------------------------------------------------------------------


def make_term(name, g, B, H, Q, K, past, causal, num_buckets=None, max_distance=T5_MAX_DISTANCE):
    """``(leaves, kernel_kwargs(*leaves), bias64(*leaves64), leaf names)`` for the term ``name``."""
    d = distances(Q, K, past)
    if name == "table":
        num_buckets = num_buckets or (8 if causal else 16)
        # [buckets, H] as the model's nn.Embedding holds it; the kernel gets its transpose, a strided view.
        weight = torch.randn(num_buckets, H, generator=g)
        radius = max_distance
        index = t5_relative_position_bucket(torch.arange(-radius, radius + 1), not causal, num_buckets, max_distance)
        bucket = t5_bucket(d, not causal, num_buckets, max_distance)

        def kernel(w):
            return dict(term="table", values=w.t(), index=index.to(DEVICE))

        def bias(w):
            return w.t()[:, bucket][None]

        return [weight], kernel, bias, ["table"]
    if name == "log":
        r1 = torch.rand(H, generator=g) * 1.5 + 0.5
        r2 = torch.rand(H, generator=g) * 0.9 + 0.1

        def kernel(a, c):
            return dict(term="log", values=torch.stack([a, c]))

        def bias(a, c):
            return (-a[:, None, None] * torch.log1p(c[:, None, None] * d.abs()))[None]

        return [r1, r2], kernel, bias, ["r1", "r2"]
    if name == "linear":
        slopes = torch.tensor(alibi_paper_slopes(H), dtype=torch.float32)

        def kernel(m):
            return dict(term="linear", values=torch.stack([m, torch.zeros_like(m)]))

        def bias(m):
            return (-m[:, None, None] * d.abs())[None]

        return [slopes], kernel, bias, ["slopes"]
    if name == "query_key":
        # FoX's gate: log f = logsigmoid(x), gates from strongly forgetting to nearly 1.
        log_forget = nnF.logsigmoid(2 * torch.randn(B, H, K, generator=g) + 2)

        def kernel(lf):
            return dict(term="query_key", values=fox_query_key_bias(lf, Q, past_length=past))

        def bias(lf):
            c = torch.cumsum(lf, -1)
            return c[..., past:past + Q, None] - c[..., None, :]

        return [log_forget], kernel, bias, ["log_forget"]
    assert name is None

    def kernel():
        return dict(term=None, values=None)

    def bias():
        return 0.0

    return [], kernel, bias, []


# ---------------------------------------------------------------------------------------------
# Masks: padding on either side, packed documents, a cache offset; no length a multiple of the tile
# ---------------------------------------------------------------------------------------------


def make_masks(scenario, B):
    """``(Q, past, key_valid, documents)`` of a scenario (B = 2: one batch row each way)."""
    if scenario == "padding":  # row 0 padded on the left, row 1 on the right
        Q, past = 23, 0
        valid = torch.ones(B, Q, dtype=torch.bool)
        valid[0, :5] = False
        valid[1, -7:] = False
        return Q, past, valid, None
    if scenario == "documents":  # packed: three documents in row 0, two in row 1, boundaries inside tiles
        Q, past = 37, 0
        docs = torch.zeros(B, Q, dtype=torch.long)
        docs[0, 9:] = 1
        docs[0, 23:] = 2
        docs[1, 20:] = 1
        return Q, past, None, docs
    assert scenario == "cache"  # 14 cached keys; row 0 left-padded prompt, row 1 a document starting in each part
    Q, past = 27, 14
    K = Q + past
    valid = torch.ones(B, K, dtype=torch.bool)
    valid[0, :4] = False
    docs = torch.zeros(B, K, dtype=torch.long)
    docs[1, 6:] = 1
    docs[1, 30:] = 2
    return Q, past, valid, docs


# ---------------------------------------------------------------------------------------------
# Running both and comparing
# ---------------------------------------------------------------------------------------------


def assert_relative(got, want, tolerance, name):
    got = got.detach().double().cpu()
    assert torch.isfinite(got).all(), f"{name}: not finite"
    scale = want.abs().max()
    if scale == 0:
        assert (got == 0).all(), f"{name}: want zeros, got max {got.abs().max():.2e}"
        return
    error = ((got - want).abs().max() / scale).item()
    assert error <= tolerance, f"{name}: relative error {error:.2e} > {tolerance:.0e}"


def run_both(term_name, dtype, *, causal, B, H, Q, D, past, key_valid, documents, seed, **term_options):
    """Kernel output and gradients (w.r.t. q, k, v and the term's leaves) and the float64 oracle's, on one
    random output gradient. Returns ``(got, want, names, alive)``, outputs first."""
    K = Q + past
    g = gen(seed)
    leaves, kernel, bias, leaf_names = make_term(term_name, g, B, H, Q, K, past, causal, **term_options)
    q, k, v = (torch.randn(B, H, n, D, generator=g).to(dtype) for n in (Q, K, K))
    grad_out = torch.randn(B, H, Q, D, generator=g).to(dtype)
    scale = D**-0.5

    inputs = [x.to(DEVICE).detach().requires_grad_() for x in (q, k, v, *leaves)]
    out = TA.relpos_attention(
        *inputs[:3], scale=scale, causal=causal, past=past, **kernel(*inputs[3:]),
        key_valid=None if key_valid is None else key_valid.to(DEVICE),
        documents=None if documents is None else documents.to(DEVICE),
    )
    assert out.dtype == dtype and out.shape == (B, H, Q, D)
    grads = torch.autograd.grad(out, inputs, grad_out.to(DEVICE))

    # The oracle sees the very values the kernel got (rounded to dtype), widened.
    wide = [x.detach().double().requires_grad_() for x in (q, k, v, *leaves)]
    allowed = allowed_pairs(B, Q, K, past, causal, key_valid, documents)
    ref, alive = attention64(*wide[:3], scale, bias(*wide[3:]), allowed)
    ref_grads = torch.autograd.grad(ref, wide, grad_out.double())
    names = ["out", "dq", "dk", "dv"] + [f"d{n}" for n in leaf_names]
    return [out, *grads], [ref.detach(), *ref_grads], names, alive


def check(got, want, names, alive, dtype):
    for a, b, name in zip(got, want, names):
        assert_relative(a, b, TOLERANCE[dtype], name)
    # A query with no key left: exactly zero, whatever the term (not a small average of masked values).
    out = got[0].detach().cpu()
    dead = (~alive).expand_as(out)
    assert (out[dead] == 0).all()


def cases(terms=TERM_NAMES):
    """(term, causal): FoX's term is causal only."""
    return [(t, c) for t in terms for c in (True, False) if c or t != "query_key"]


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scenario", ["padding", "documents", "cache"])
@pytest.mark.parametrize("term,causal", cases())
def test_float32_matches_the_oracle(term, causal, scenario):
    """Output and every gradient within 1e-5 of the float64 oracle, in float32."""
    B = 2
    Q, past, key_valid, documents = make_masks(scenario, B)
    seed = 2 * TERM_NAMES.index(term) + causal
    got, want, names, alive = run_both(term, torch.float32, causal=causal, B=B, H=2, Q=Q, D=8, past=past,
                                       key_valid=key_valid, documents=documents, seed=seed)
    check(got, want, names, alive, torch.float32)


@pytest.mark.skipif(not TA.interpreting(), reason="the GPU's tiles under the interpreter (a GPU uses them anyway)")
@pytest.mark.parametrize("term,causal", cases())
def test_the_gpus_tiles_across_several_tiles_match_the_oracle(term, causal, monkeypatch):
    """The tiles a GPU launches (GPU_LAUNCH: 64 x 64 forward, 32 x 64 and 64 x 32 backward) run under the interpreter
    on shapes spanning several of them, with ragged edges, padding, documents and a cache offset: values and
    gradients against the float64 oracle (the suite's other cases run the interpreter's own small tiles)."""
    monkeypatch.setattr(TA, "launch", lambda kernel: {k: v for k, v in TA.GPU_LAUNCH[kernel].items()
                                                      if k in ("BM", "BN")})
    B, Q, past = 2, 97, 40
    K = Q + past
    valid = torch.ones(B, K, dtype=torch.bool)
    valid[0, :11] = False
    docs = torch.zeros(B, K, dtype=torch.long)
    docs[1, 30:] = 1
    docs[1, 101:] = 2
    got, want, names, alive = run_both(term, torch.float32, causal=causal, B=B, H=1, Q=Q, D=16, past=past,
                                       key_valid=valid, documents=docs if causal else None, seed=13)
    check(got, want, names, alive, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("term,causal", [
    (t, c) for t, c in cases()
])
def test_half_precision_matches_the_oracle(term, causal, dtype):
    """float16 within 2e-3, bfloat16 within 2e-2, of the oracle on the same rounded inputs (cache offset,
    padding and documents at once)."""
    B = 2
    Q, past, key_valid, documents = make_masks("cache", B)
    got, want, names, alive = run_both(term, dtype, causal=causal, B=B, H=2, Q=Q, D=16, past=past,
                                       key_valid=key_valid, documents=documents, seed=7)
    check(got, want, names, alive, dtype)


@pytest.mark.parametrize("term,causal", cases())
def test_a_query_with_no_key_gives_zeros_and_no_nan(term, causal):
    """A batch row all padding, and a document whose keys are all padding: zero outputs, zero gradients of those
    queries and keys, finite gradients everywhere (exp of -inf minus -inf would give NaN)."""
    B, H, Q, D = 2, 3, 23, 8  # 3 heads: ALiBi's slopes for a head count not a power of two
    key_valid = torch.ones(B, Q, dtype=torch.bool)
    key_valid[0] = False
    key_valid[1, 8:13] = False
    documents = torch.zeros(B, Q, dtype=torch.long)
    documents[1, 8:] = 1
    documents[1, 13:] = 2
    got, want, names, alive = run_both(term, torch.float32, causal=causal, B=B, H=H, Q=Q, D=D, past=0,
                                       key_valid=key_valid, documents=documents, seed=3)
    assert not alive[0].any() and not alive[1, :, 8:13].any() and alive[1, :, 13:].all()
    check(got, want, names, alive, torch.float32)
    out, dq, dk, dv = (x.detach().cpu() for x in got[:4])
    for x in (out, dq, dk, dv):
        assert (x[0] == 0).all() and (x[1, :, 8:13] == 0).all()
    for x in got[4:]:
        assert torch.isfinite(x).all()


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1e-5), (torch.float16, 2e-4), (torch.bfloat16, 2e-3)],
                         ids=["float32", "float16", "bfloat16"])
def test_a_query_terms_gradient_is_zero(dtype, bound):
    """Softmax ignores a constant added to a query's row, so the gradient of query_key's per-query part is
    sum_j ds_ij = 0: zero within 1e-5 of the per-key part's gradient in float32. In half precision the backward's
    delta comes from the float32 output (before, from the rounded one: 1.6e-4 in float16, 3e-3 in bfloat16), which
    the forward forms from p rounded to the inputs' dtype for its p·v product (as FlashAttention does): 6e-5 in
    float16 is left of that."""
    g = gen(0)
    B, H, Q, D = 1, 2, 37, 16
    q, k, v = (torch.randn(B, H, Q, D, generator=g).to(dtype).to(DEVICE).requires_grad_() for _ in range(3))
    u = (2 * torch.randn(B, H, 2, 2 * Q, generator=g)).to(DEVICE).requires_grad_()
    out = TA.relpos_attention(q, k, v, scale=D**-0.5, term="query_key", values=u)
    (grad,) = torch.autograd.grad(out, u, torch.randn(out.shape, generator=g).to(dtype).to(DEVICE))
    query_part, key_part = grad[..., :Q].abs().max(), grad[..., Q:].abs().max()
    assert query_part <= bound * key_part, f"{query_part:.2e} vs {key_part:.2e}"


@pytest.mark.parametrize("causal,num_buckets,past", [(False, 16, 0), (True, 8, 0), (True, 12, 9)])
def test_t5_table_gradient_across_far_and_near_tiles(causal, num_buckets, past):
    """T5 with R = max_distance = 20 and 4 tiles of keys: tiles wholly beyond ±R (their sum goes to the edge
    entry) and tiles across the band (diagonal sums); the table's gradient as the oracle's."""
    K = 4 * TILE_N
    Q = K - past
    d = distances(Q, K, past)
    tiles = [d[m:m + TILE_M, n:n + TILE_N] for m in range(0, Q, TILE_M) for n in range(0, K, TILE_N)]
    visible = [t for t in tiles if not causal or (t <= 0).any()]
    # The geometry reaches every branch of the kernel's table gradient.
    assert any((t < -T5_MAX_DISTANCE).all() for t in visible)
    assert any((t > T5_MAX_DISTANCE).all() for t in visible) == (not causal)
    assert any((t.abs() <= T5_MAX_DISTANCE).any() for t in visible)
    key_valid = torch.ones(1, K, dtype=torch.bool)
    if not causal:  # right padding too, where bidirectional (causal rows already end on the diagonal)
        key_valid[0, -3:] = False
    got, want, names, alive = run_both("table", torch.float32, causal=causal, B=1, H=2, Q=Q, D=8, past=past,
                                       key_valid=key_valid, documents=None, seed=11, num_buckets=num_buckets)
    check(got, want, names, alive, torch.float32)


@pytest.mark.parametrize("term", ["table", "log", "query_key"])
def test_backward_is_deterministic(term):
    """Two backward passes give bitwise-equal gradients (no floating-point atomics); 4 tiles of keys, so that the
    table's gradient takes both its far-tile and its diagonal sums."""
    B, H, Q, D, past = 1, 2, 4 * TILE_N, 8, 0
    g = gen(5)
    leaves, kernel, _, _ = make_term(term, g, B, H, Q, Q, past, True)
    q, k, v = (torch.randn(B, H, Q, D, generator=g) for _ in range(3))
    inputs = [x.to(DEVICE).detach().requires_grad_() for x in (q, k, v, *leaves)]
    out = TA.relpos_attention(*inputs[:3], scale=D**-0.5, causal=True, past=past, **kernel(*inputs[3:]))
    grad_out = torch.randn(out.shape, generator=g).to(DEVICE)
    first = torch.autograd.grad(out, inputs, grad_out, retain_graph=True)
    second = torch.autograd.grad(out, inputs, grad_out)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


# Inputs whose shape does not go with q, k, v or the term, that relpos_attention does not check yet: the kernel reads
# out of bounds (on CPU, under the interpreter, it returns finite numbers; on a GPU garbage or a fault).

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_more_queries_than_keys_without_positions_matches_the_oracle(dtype):
    """Cross-attention: a target longer than its source (queries over several tiles, padded source keys), no
    position term and no causality, so no query position is read; values and gradients against float64."""
    g = gen(11)
    B, H, Q, K, D = 2, 2, 70, 9, 16
    q, k, v = (torch.randn(B, H, n, D, generator=g).to(dtype) for n in (Q, K, K))
    grad_out = torch.randn(B, H, Q, D, generator=g).to(dtype)
    key_valid = torch.ones(B, K, dtype=torch.bool)
    key_valid[1, -3:] = False
    inputs = [x.to(DEVICE).detach().requires_grad_() for x in (q, k, v)]
    out = TA.relpos_attention(*inputs, scale=D**-0.5, key_valid=key_valid.to(DEVICE))
    got = [out, *torch.autograd.grad(out, inputs, grad_out.to(DEVICE))]
    wide = [x.detach().double().requires_grad_() for x in (q, k, v)]
    ref, alive = attention64(*wide, D**-0.5, 0.0, allowed_pairs(B, Q, K, 0, False, key_valid, None))
    want = [ref.detach(), *torch.autograd.grad(ref, wide, grad_out.double())]
    check(got, want, ["out", "dq", "dk", "dv"], alive, dtype)


@pytest.mark.parametrize("kwargs", [
    pytest.param(dict(term="rope", values=torch.zeros(2, 2)), id="unknown-term"),
    pytest.param(dict(term="table", values=torch.zeros(2, 4)), id="table-without-index"),
    pytest.param(dict(term="log", values=torch.zeros(2, 2), index=torch.zeros(3, dtype=torch.long)),
                 id="log-with-index"),
    pytest.param(dict(term="log"), id="log-without-values"),
    pytest.param(dict(term=None, values=torch.zeros(2, 2)), id="values-without-term"),
    pytest.param(dict(term="table", values=torch.zeros(2, 4), index=torch.zeros(4, dtype=torch.long)),
                 id="index-of-even-length"),
    pytest.param(dict(term="table", values=torch.zeros(3, 4), index=torch.zeros(5, dtype=torch.long)),
                 id="table-of-other-heads"),
    pytest.param(dict(term="log", values=torch.ones(2, 1)), id="log-of-other-heads"),
    pytest.param(dict(term="table", values=torch.zeros(2, 4), index=torch.zeros(5, dtype=torch.bool)),
                 id="index-of-bools"),
    pytest.param(dict(past=1, causal=True), id="causal-queries-past-the-keys"),
    pytest.param(dict(past=1, term="log", values=torch.zeros(2, 2)), id="term-queries-past-the-keys"),
    pytest.param(dict(term="query_key", values=torch.zeros(1, 2, 2, 5)), id="query-key-of-other-length"),
    pytest.param(dict(key_valid=torch.ones(1, 4, dtype=torch.bool)), id="key-valid-of-other-length"),
    pytest.param(dict(documents=torch.zeros(2, 3, dtype=torch.long)), id="documents-of-other-batch"),
])
def test_argument_errors(kwargs):
    """A term name outside TERMS, or values, index and masks that do not go with the term and q [1, 2, 3, 8]:
    ValueError."""
    q = torch.zeros(1, 2, 3, 8, device=DEVICE)
    kwargs = {key: (x.to(DEVICE) if isinstance(x, torch.Tensor) else x) for key, x in kwargs.items()}
    with pytest.raises(ValueError):
        TA.relpos_attention(q, q, q, scale=1.0, **kwargs)


@pytest.mark.parametrize("past", [0, 3])
def test_an_index_past_the_table_reads_its_edge_entries_on_every_device(past):
    """An index entry outside the table [0, NB): the kernel reads the nearest edge entry, on the CPU and on a GPU
    alike (the op itself, below every host check: a check of the values on the host would stall a GPU or break a
    trace). Values and the table's gradient equal those of the index clamped by hand."""
    g = gen(11)
    k, v = (torch.randn(1, 2, 9, 16, generator=g).to(DEVICE) for _ in range(2))
    q = torch.randn(1, 2, 9 - past, 16, generator=g).to(DEVICE)  # queries at past .. 8 over 9 keys
    table = torch.randn(2, 4, generator=g).to(DEVICE)
    wild = torch.tensor([-7, -1, 0, 5, 2, 4, 9], device=DEVICE)  # R = 3; entries before 0 and past 3
    results = []
    for index in (wild, wild.clamp(0, 3)):
        values = table.clone().requires_grad_()
        out, _, _ = TA._attention_op(q, k, v, values, index, None, None, TA.TERMS["table"], 0.25, True, past, False)
        out.sum().backward()
        results.append((out.detach(), values.grad))
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert results[1][1].abs().sum() > 0


@pytest.mark.skipif(DEVICE != "cpu", reason="the host check reads the index: eager calls on CPU tensors only")
def test_an_eager_cpu_call_names_an_index_past_the_table():
    q = torch.zeros(1, 2, 3, 8)
    with pytest.raises(ValueError, match=r"index entries must lie in \[0, 4\), got 4 \.\. 4"):
        TA.relpos_attention(q, q, q, scale=1.0, term="table", values=torch.zeros(2, 4), index=torch.full((5,), 4))


@pytest.mark.parametrize("entries", [6, 32])
def test_the_ops_pass_torchs_opcheck(entries):
    """``torch.library.opcheck`` of both custom ops (schema, fake implementation against the real one, strides
    included, autograd registration): a table of 6 entries, padded to 8 in the kernel, gave a table gradient of
    another stride than the fake's (review), which a compiled graph's stride check refused."""
    g = gen(3)
    q, k, v = (torch.randn(1, 2, 9, 16, generator=g).to(DEVICE).requires_grad_() for _ in range(3))
    table = torch.randn(2, entries, generator=g).to(DEVICE).requires_grad_()
    index = torch.randint(0, entries, (9,), generator=g).to(DEVICE)
    args = (q, k, v, table, index, None, None, TA.TERMS["table"], 0.25, True, 0, False)
    torch.library.opcheck(TA._attention_op, args)
    out, lse, _ = TA._attention_op(*args)
    detached = [x.detach() for x in (q, k, v, out, lse)]
    torch.library.opcheck(TA._attention_backward_op, (*detached, torch.randn_like(detached[0]), table.detach(),
                                                      index, None, None, TA.TERMS["table"], 0.25, True, 0, True))


def test_every_launch_runs_under_the_inputs_device(monkeypatch):
    """Triton launches on the current device: the forward and both backward launches run inside ``on_device`` of the
    inputs' device (on a GPU, ``torch.cuda.device`` of it: inputs on cuda:1 under a current cuda:0 are read there;
    on a CPU, the interpreter, no context)."""
    import contextlib

    entered, launched = [], []
    real = TA.on_device

    @contextlib.contextmanager
    def recording(device):
        entered.append(device)
        with real(device):
            yield
        entered.append("exit")

    monkeypatch.setattr(TA, "on_device", recording)
    for name in ("_forward_kernel", "_backward_kv_kernel", "_backward_q_kernel"):
        kernel = getattr(TA, name)

        class Spy:
            def __getitem__(self, grid, kernel=kernel, name=name):
                launched.append((name, len(entered) % 2 == 1))  # inside an open on_device
                return kernel[grid]

        monkeypatch.setattr(TA, name, Spy())
    q = torch.randn(1, 2, 5, 8, device=DEVICE, requires_grad=True)
    TA.relpos_attention(q, q, q, scale=1.0, causal=True).sum().backward()
    assert entered == [q.device, "exit", q.device, "exit"]
    assert launched == [("_forward_kernel", True), ("_backward_kv_kernel", True), ("_backward_q_kernel", True)]
    guard = real(torch.device("cuda", 1))
    assert isinstance(guard, torch.cuda.device) and guard.idx == 1
    assert isinstance(real(torch.device("cpu")), contextlib.nullcontext)
