"""Print what each position scheme adds to attention for a small example.

Shows, for 6 queries following 2 cached tokens against 8 keys, the T5 buckets and bias,
Shaw's clipped distance indices, the log-decay and ALiBi biases, and runs Shaw and
Transformer-XL attention once. Then reproduces the published worked example in
worked-example.md ("The cat sat on mat": log-decay bias, lambda 0.3, d_k 4).

    python scripts/demo_biases.py     # or make demo-biases; a few seconds (mostly importing torch)
"""

import math

import torch

from hf_relpos import functional as F

Q, K, PAST, HEADS, DIM = 6, 8, 2, 4, 16

# The worked example's input, copied from worked-example.md (the shared folder beside the checkout):
# raw Q K^T scores, rows are queries, columns keys. tests/test_demo_biases.py checks this copy
# and every output against the published tables.
EXAMPLE_TOKENS = ("The", "cat", "sat", "on", "mat")
EXAMPLE_SCORES = (
    (0.0, 2.0, 1.0, 1.0, 1.5),
    (3.0, 0.0, 2.0, 1.0, 0.5),
    (1.0, 2.0, 2.0, 1.0, 1.5),
    (1.0, 1.0, 0.0, 2.0, 1.0),
    (1.0, 1.0, 1.0, 1.0, 1.5),
)
EXAMPLE_LAMBDA, EXAMPLE_D_K = 0.3, 4


def show(title, tensor):
    print(f"\n== {title}  shape={list(tensor.shape)}")
    print(tensor)


def worked_example():
    """The worked example in float64: bias per distance 0..4, weights without and with the bias."""
    n = len(EXAMPLE_TOKENS)
    scores = torch.tensor(EXAMPLE_SCORES, dtype=torch.float64) / math.sqrt(EXAMPLE_D_K)
    bias = F.log_decay_bias(n, n, scale=EXAMPLE_LAMBDA, dtype=torch.float64)
    return {
        # Row 0 of the [Q, K] bias is distance j - 0 = j, so it lists distances 0..n-1 in order.
        "bias_by_distance": bias[0],
        "weights_without_bias": torch.softmax(scores, dim=-1),
        "weights_with_bias": torch.softmax(scores + bias, dim=-1),
    }


def show_weights(title, weights):
    print(f"\n{title}")
    print("      " + "".join(f"{token:>8}" for token in EXAMPLE_TOKENS))
    for token, row in zip(EXAMPLE_TOKENS, weights.tolist()):
        print(f"{token:<6}" + "".join(f"{w:8.4f}" for w in row))


def main():
    # Set here rather than at import, so that importing the module (as the tests do) leaves torch alone.
    torch.set_printoptions(precision=2, linewidth=140, sci_mode=False)
    torch.manual_seed(0)
    rel = torch.arange(K)[None, :] - (torch.arange(Q)[:, None] + PAST)
    show(f"relative position j - (past+i), past={PAST}", rel)
    show("T5 buckets (bidirectional, 32 buckets, max_distance 128)", F.t5_relative_position_bucket(rel))
    show("T5 buckets (causal, 8 buckets, max_distance 6)", F.t5_relative_position_bucket(rel, False, 8, 6))
    table = torch.randn(32, HEADS) * 0.5
    show("T5 bias, head 0 (random table)", F.t5_position_bias(table, Q, K, past_length=PAST)[0, 0])
    show("Shaw clipped index clamp(j-i, -2, 2) + 2", rel.clamp(-2, 2) + 2)
    show("log-decay bias, scale 1.0", F.log_decay_bias(Q, K, scale=1.0, past_length=PAST))
    slopes = F.alibi_slopes(6)
    show("ALiBi slopes for 6 heads (Press et al.'s non-power-of-two rule)", slopes)
    show("ALiBi bias, head 0", F.alibi_bias(slopes, Q, K, past_length=PAST)[0, 0])
    show("sinusoidal embedding R for distances 3..0, dim 8", F.sinusoidal_embedding(torch.arange(3, -1, -1), 8))

    q, k, v = torch.randn(1, HEADS, Q, DIM), torch.randn(1, HEADS, K, DIM), torch.randn(1, HEADS, K, DIM)
    rel_k, rel_v = torch.randn(5, DIM), torch.randn(5, DIM)
    out = F.shaw_attention(q, k, v, rel_k, rel_v, max_relative_position=2, is_causal=True, past_length=PAST)
    show("Shaw attention output, head 0, first 4 dims (causal, k=2)", out[0, 0, :, :4])
    r = torch.randn(HEADS, K, DIM)
    u, w = torch.randn(HEADS, DIM), torch.randn(HEADS, DIM)
    out = F.transformer_xl_attention(q, k, v, r, u, w, is_causal=True)
    show(f"Transformer-XL attention output, head 0, first 4 dims ({K - Q} memory keys)", out[0, 0, :, :4])
    mask = torch.zeros(1, 1, Q, K, dtype=torch.bool)
    out = F.shaw_attention(q, k, v, rel_k, rel_v, max_relative_position=2, attention_mask=mask)
    print(f"\nA fully masked query row gives zeros, not NaN: max |out| = {out.abs().max().item()}")

    example = worked_example()
    print(f"\n== Worked example \"{' '.join(EXAMPLE_TOKENS)}\" (d_k={EXAMPLE_D_K}, lambda={EXAMPLE_LAMBDA}),"
          " as published in worked-example.md")
    print("bias by distance: " + ", ".join(f"{d}: {b:.4f}" for d, b in enumerate(example["bias_by_distance"].tolist())))
    show_weights("weights without bias", example["weights_without_bias"])
    show_weights("weights with the bias", example["weights_with_bias"])


if __name__ == "__main__":
    main()
