"""Shared-prefix (cascade) attention: exact against SDPA over the joined keys, and the caches it reads."""

import pytest
import torch

from toolcollapse.attention import (Groups, SplitKV, causal_mask, cascade_attention, flash_split_attention,
                                    joined_attention, prefix_causal_attention, split_attention)
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


@pytest.mark.parametrize("b, h, hkv, t, p, s", [(3, 4, 4, 5, 8, 9), (2, 9, 3, 6, 5, 6), (2, 4, 4, 7, 6, 7)])
def test_flash_split_attention_of_a_chunk_equals_attention_over_the_joined_keys(b, h, hkv, t, p, s):
    """Rollout chunks (no gradient): every query against the one prefix, then the rests under the mask;
    a query that sees none of its rest (row 1's first) attends to the prefix alone."""
    torch.manual_seed(b * 10 + s)
    q, kp, vp = torch.randn(b, h, t, 8), torch.randn(1, hkv, p, 8), torch.randn(1, hkv, p, 8)
    kr, vr = torch.randn(b, hkv, s, 8), torch.randn(b, hkv, s, 8)
    mask = causal_mask(t, s).expand(b, 1, t, s).clone()
    mask[0, :, :, 0] = False
    mask[1, :, 0, :] = False
    expected = joined_reference(q, kp, vp, kr, vr, mask)
    got = flash_split_attention(q, SplitKV(kp, kr), SplitKV(vp, vr), mask, 8 ** -0.5)
    torch.testing.assert_close(got, expected, atol=2e-6, rtol=0)

    class Module:
        num_key_value_groups, is_causal, training = h // hkv, True, False

    with torch.no_grad():  # the path cascade_attention takes for a chunk without gradient
        out, _ = cascade_attention(Module(), q, SplitKV(kp, kr), SplitKV(vp, vr), mask, scaling=8 ** -0.5)
    torch.testing.assert_close(out.transpose(1, 2), expected, atol=2e-6, rtol=0)


@pytest.mark.parametrize("h, hkv, t", [(4, 4, 1), (6, 2, 1), (4, 4, 3), (4, 4, 6), (9, 3, 7)])
def test_group_parts_equal_attention_over_each_rows_copy(h, hkv, t):
    """Rows that share their group's part (a task's G rollouts, its prompt's rest) attend to it as to a
    copy of their own: groups of 3, 1 and 3 rows in mixed order (rows leave and come back), group parts
    left-padded to one width, a row that sees none of its rest; decoding (t <= 4) and chunk paths, and
    the one-kernel copy (`cascade_attention` under autograd)."""
    torch.manual_seed(h * 10 + t)
    b, p, q_len, s, d = 7, 9, 8, 5, 8
    of = torch.tensor([0, 0, 2, 2, 2, 0, 1])  # group 3: no row reads it (its rollouts ended)
    group_mask = torch.ones(4, q_len, dtype=torch.bool)
    group_mask[1, :5], group_mask[2, :2] = False, False  # shorter prompts: left padding
    q, kp, vp = torch.randn(b, h, t, d), torch.randn(1, hkv, p, d), torch.randn(1, hkv, p, d)
    kg, vg = torch.randn(4, hkv, q_len, d), torch.randn(4, hkv, q_len, d)
    kr, vr = torch.randn(b, hkv, s, d), torch.randn(b, hkv, s, d)
    mask = causal_mask(t, s).expand(b, 1, t, s).clone()
    mask[0] = False
    rows = torch.cat([group_mask[of][:, None, None, :].expand(b, 1, t, q_len), mask], dim=-1)
    expected = joined_reference(q, kp, vp, torch.cat([kg[of], kr], dim=2), torch.cat([vg[of], vr], dim=2), rows)
    groups = Groups.of_rows(of, group_mask)
    assert groups.slot.tolist() == [0, 1, 0, 1, 2, 2, 0] and groups.size == 3
    keys, values = SplitKV(kp, kr, group=kg, groups=groups), SplitKV(vp, vr, group=vg, groups=groups)

    class Module:
        num_key_value_groups, is_causal, training = h // hkv, True, False

    with torch.no_grad():  # split products (t <= 4) or the flash kernels (a chunk)
        out, _ = cascade_attention(Module(), q, keys, values, mask, scaling=d ** -0.5)
    torch.testing.assert_close(out.transpose(1, 2), expected, atol=2e-6, rtol=0)
    torch.testing.assert_close(split_attention(q, keys, values, mask, d ** -0.5), expected, atol=2e-6, rtol=0)
    out, _ = joined_attention(Module(), q, keys, values, mask, d ** -0.5)
    torch.testing.assert_close(out.transpose(1, 2), expected, atol=2e-6, rtol=0)
    if t > 4:
        torch.testing.assert_close(flash_split_attention(q, keys, values, mask, d ** -0.5), expected, atol=2e-6,
                                   rtol=0)
        out, _ = cascade_attention(Module(), q.requires_grad_(), keys, values, mask, scaling=d ** -0.5)
        torch.testing.assert_close(out.transpose(1, 2), expected, atol=2e-6, rtol=0)  # a copy a row


@pytest.mark.parametrize("hkv, dtype, tol", [(4, torch.float32, 2e-6), (2, torch.float32, 2e-6),
                                             (2, torch.bfloat16, 3e-2)])
def test_prefix_causal_attention_and_its_gradients_equal_attention_over_the_joined_keys(hkv, dtype, tol):
    """A teacher-forced forward's attention (rests causal, right-padded) and every input's gradient."""
    torch.manual_seed(hkv)
    b, h, t, p = 3, 4, 7, 5
    inputs = [torch.randn(b, h, t, 8), torch.randn(1, hkv, p, 8), torch.randn(1, hkv, p, 8),
              torch.randn(b, hkv, t, 8), torch.randn(b, hkv, t, 8)]
    grad = torch.randn(b, h, t, 8)
    results = []
    for path in ("reference", "flash"):
        xs = [x.to(dtype).requires_grad_() for x in inputs]
        if path == "reference":
            out = joined_reference(*[x.float() for x in xs], causal_mask(t, t).expand(b, 1, t, t))
        else:
            out = prefix_causal_attention(xs[0], SplitKV(xs[1], xs[3], causal=True),
                                          SplitKV(xs[2], xs[4], causal=True), 8 ** -0.5)
            assert out.dtype == dtype
        out.float().backward(grad)
        results.append([out.detach().float(), *(x.grad.float() for x in xs)])
    for got, expected in zip(results[1], results[0]):
        torch.testing.assert_close(got, expected, atol=tol, rtol=0)


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


def test_a_cascade_cache_shares_each_prompts_rest_among_its_rows():
    """`set_groups`: two prompts' rests become group parts of 3 rows each, whose own rests start empty;
    rows dropped, taken out and added back keep their groups; a part no row reads is let go."""
    from toolcollapse.kvcache import CascadeLayer

    layer = CascadeLayer(torch.zeros(1, 1, 4, 2), torch.zeros(1, 1, 4, 2))
    rests = torch.arange(12.0).view(2, 1, 3, 2)
    layer.set_groups(rests, rests, torch.tensor([[0, 1, 1], [1, 1, 1]]), torch.tensor([0, 0, 0, 1, 1, 1]))
    assert layer.get_seq_length() == 4 + 3 and layer.keys.shape == (6, 1, 0, 2)
    keys, _ = layer.update(torch.ones(6, 1, 1, 2), torch.ones(6, 1, 1, 2))
    torch.testing.assert_close(keys.group, rests)
    assert keys.groups.of.tolist() == [0, 0, 0, 1, 1, 1] and keys.groups.mask.tolist() == [[False, True, True]] + [[True] * 3]
    taken = layer.take_rows(torch.tensor([1, 3]))
    layer.batch_select_indices(torch.tensor([0, 2, 4, 5]))
    layer.add_rows(*taken)
    assert layer.groups.of.tolist() == [0, 0, 1, 1, 0, 1] and layer.groups.slot.tolist() == [0, 1, 0, 1, 2, 2]
    with pytest.raises(RuntimeError, match="share group parts"):
        layer.batch_repeat_interleave(2)
    layer.batch_select_indices(torch.tensor([2, 3, 5]))  # group 0's rows all ended
    layer.drop_unread_groups()
    torch.testing.assert_close(layer.group_keys, rests[1:])
    assert layer.groups.of.tolist() == [0, 0, 0] and layer.groups.mask.tolist() == [[True] * 3]


def test_attention_dropout_still_applies_to_rows_after_a_shared_prefix():
    """With dropout in training the prefix path takes the one-kernel copy, which applies it (the flash
    kernels here are called without dropout)."""
    from toolcollapse.model import build_model, rest_hidden_states, run_prefix

    model = build_model("tiny", vocab_size=64, max_seq_len=128, pad_token_id=0, eos_token_id=1, seed=0)
    ids = torch.randint(2, 64, (2, 30))
    prefix = run_prefix(model.eval(), ids[:1, :20])  # the same prefix keys and values for every call
    model.train()
    torch.testing.assert_close(rest_hidden_states(model, prefix, ids[:, 20:]),
                               rest_hidden_states(model, prefix, ids[:, 20:]))  # no dropout: deterministic
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = 0.5
    rest = ids[:, 20:]
    assert not torch.equal(rest_hidden_states(model, prefix, rest), rest_hidden_states(model, prefix, rest))
