"""Print what each position scheme adds to attention for a small example.

Shows, for 6 queries following 2 cached tokens against 8 keys, the T5 buckets and bias,
Shaw's clipped distance indices, the log-decay and ALiBi biases, and runs Shaw and
Transformer-XL attention once.

    python scripts/demo_biases.py     # or make demo-biases; a few seconds (mostly importing torch)
"""

import torch

from hf_relpos import functional as F

torch.set_printoptions(precision=2, linewidth=140, sci_mode=False)
Q, K, PAST, HEADS, DIM = 6, 8, 2, 4, 16


def show(title, tensor):
    print(f"\n== {title}  shape={list(tensor.shape)}")
    print(tensor)


def main():
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


if __name__ == "__main__":
    main()
