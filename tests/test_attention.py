"""Shared-prefix (cascade) attention: exact against SDPA over the joined keys, and the caches it reads."""

import pytest
import torch

from toolcollapse.attention import SplitKV, causal_mask, cascade_attention, split_attention
from toolcollapse.kvcache import AppendOnlyLayer


def joined_reference(q, kp, vp, kr, vr, mask):
    """SDPA over [prefix copied per row ; rest], key-value heads repeated for the query heads."""
    b, h = q.shape[:2]
    g = h // kr.shape[1]
    keys = torch.cat([kp.expand(b, -1, -1, -1), kr], dim=2).repeat_interleave(g, dim=1)
    values = torch.cat([vp.expand(b, -1, -1, -1), vr], dim=2).repeat_interleave(g, dim=1)
    full = torch.cat([torch.ones(b, 1, q.shape[2], kp.shape[2], dtype=torch.bool), mask], dim=-1)
    return torch.nn.functional.scaled_dot_product_attention(q, keys, values, attn_mask=full)


@pytest.mark.parametrize("b, h, hkv, t, p, s", [
    (3, 4, 4, 1, 9, 6),  # decoding: one query a row
    (2, 6, 2, 1, 7, 5),  # grouped-query attention (SmolLM2, Qwen2.5)
    (3, 4, 4, 5, 8, 9),  # a chunk of 5 new tokens, causal among themselves
    (2, 9, 3, 6, 5, 6),
    (2, 4, 4, 1, 6, 0),  # nothing of its own yet
])
def test_split_attention_equals_attention_over_the_joined_keys(b, h, hkv, t, p, s):
    torch.manual_seed(b * 100 + t)
    q, kp, vp = torch.randn(b, h, t, 8), torch.randn(1, hkv, p, 8), torch.randn(1, hkv, p, 8)
    kr, vr = torch.randn(b, hkv, s, 8), torch.randn(b, hkv, s, 8)
    mask = causal_mask(t, s).expand(b, 1, t, s).clone()
    if s:
        mask[0, :, :, 0] = False  # a padding hole in row 0
    expected = joined_reference(q, kp, vp, kr, vr, mask)
    got = split_attention(q, SplitKV(kp, kr), SplitKV(vp, vr), mask, 8 ** -0.5)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=0)

    class Module:  # what Hugging Face passes as `module`
        num_key_value_groups, is_causal, training = h // hkv, True, False

    out, _ = cascade_attention(Module(), q, SplitKV(kp, kr), SplitKV(vp, vr), mask, scaling=8 ** -0.5)
    torch.testing.assert_close(out.transpose(1, 2), expected, atol=2e-6, rtol=0)  # both paths (t <= 4, t > 4)


def test_rows_taken_out_of_an_append_only_cache_come_back_masked_to_the_new_length():
    layer = AppendOnlyLayer()
    layer.update(torch.arange(24.0).view(3, 1, 2, 4), torch.zeros(3, 1, 2, 4))
    taken = layer.take_rows(torch.tensor([1]))
    layer.batch_select_indices(torch.tensor([0, 2]))
    layer.update(torch.ones(2, 1, 3, 4), torch.ones(2, 1, 3, 4))  # the others go on for 3 tokens
    layer.add_rows(*taken)
    assert layer.keys.shape == (3, 1, 5, 4)
    torch.testing.assert_close(layer.keys[2, 0, :2], torch.arange(8.0, 16.0).view(2, 4))  # row 1, after the others
    assert layer.keys[2, 0, 2:].abs().sum() == 0  # positions it never had: zeros, masked by the caller
