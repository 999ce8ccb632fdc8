"""Shared-prefix ("cascade") attention: one copy of the prefix every row shares.

Every rollout, training row and probe conversation of a batch starts with the same
~650-token system prompt. Attending to it through B per-row copies of its keys and values
reads them B times per step (on CPU, memory-bound: 62 % of decoding, docs/BENCHMARKS.md).
Here the prefix's keys and values are kept once, [1, Hkv, P, D], and every query of the
batch attends to them in one matrix product; the rest of each row (its own tokens) is
attended per row, under a mask; the two softmax parts are merged exactly by their
maxima and sums (the log-sum-exp merge of cascade attention, as in FlashInfer):

    softmax over [prefix ; rest] = (e_p @ V_p + e_r @ V_r) / (sum e_p + sum e_r),
    e_x = exp(q K_x^T * scale - m),  m = the max over both parts.

The split products pay where attention is memory-bound: decoding, one query a row (2.6-5.7x
faster than SDPA over per-row copies at 32 rows, 650 + 50..400 keys, 1 thread). Chunks of many
queries a row are compute-bound; on the CPU they run two fused flash kernels that also return
their log-sum-exp -- every query of the batch against the one prefix, unmasked, then each row's
rest -- merged the same way: rollout chunks (a prompt's rest, an observation; no gradient) with
the rest under the mask (`flash_split_attention`), teacher-forced forwards (training, the
reference pass, the probe: right-padded rows, the rest causal) under `is_causal`, with an exact
backward (`prefix_causal_attention`). Elsewhere (CUDA, a chunk under autograd that is not
teacher-forced) a chunk runs one fused SDPA kernel over a per-row copy of the prefix.

It plugs into any Hugging Face model that routes attention through `AttentionInterface`
(Llama, Qwen2, SmolLM2, ...): a cache layer hands the attention function a `SplitKV`
(prefix, rest) instead of one tensor, and the model runs with
`config._attn_implementation = CASCADE` (`cascade(model)`). The mask passed as
`attention_mask` is 4-D, [B, 1, T, S] bool over the rest only (True: attend), and goes
through the model untouched. Plain tensors (no prefix) fall back to SDPA. Scores and the
merge are computed in float32 whatever the model's dtype.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from torch.autograd.function import once_differentiable
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

CASCADE = "toolcollapse_cascade"
DECODE_MAX_QUERIES = 4  # up to this many queries a row, the split products (decoding); above, one fused kernel


@dataclass(frozen=True)
class Groups:
    """Which rows share which group part: the G rollouts of a task attend to one copy of the keys and
    values of their prompt's rest (past the batch's prefix) instead of G copies."""

    of: torch.Tensor  # [B] long: each row's group
    slot: torch.Tensor  # [B] long: the row's rank among its group's rows in the batch
    size: int  # the most rows a group has in the batch (R)
    mask: torch.Tensor  # [Gp, Q] bool: the group part's real keys (prompts are left-padded to Q)

    @staticmethod
    def of_rows(of: torch.Tensor, mask: torch.Tensor) -> Groups:
        """Groups for rows `of` [B] (any order; a group may have any number of rows, or none)."""
        if not len(of):
            return Groups(of, of, 0, mask)
        one_hot = torch.nn.functional.one_hot(of, len(mask))  # [B, Gp]
        slot = (one_hot.cumsum(dim=0) - 1).gather(1, of[:, None]).squeeze(1)
        return Groups(of, slot, int(one_hot.sum(dim=0).max()), mask)

    def to_groups(self, x: torch.Tensor) -> torch.Tensor:
        """Rows' [B, ...] -> [Gp, R, ...], zeros where a group has fewer rows."""
        out = x.new_zeros((len(self.mask), self.size, *x.shape[1:]))
        out[self.of, self.slot] = x
        return out

    def to_rows(self, x: torch.Tensor) -> torch.Tensor:
        """[Gp, R, ...] -> the rows' [B, ...]."""
        return x[self.of, self.slot]


@dataclass(frozen=True)
class SplitKV:
    """Keys (or values) of one layer: the batch's shared prefix, each row's own rest and, for rollouts of
    several rows a task, the part each group of rows shares (their prompt's rest), attended between the two."""

    prefix: torch.Tensor  # [1, Hkv, P, D]
    rest: torch.Tensor  # [B, Hkv, S, D]
    causal: bool = False  # the rest is the queries' own tokens, attended causally (a teacher-forced forward)
    group: torch.Tensor | None = None  # [Gp, Hkv, Q, D]
    groups: Groups | None = None  # which rows attend to which group part


def cascade_attention(module: Any, query: torch.Tensor, key: SplitKV | torch.Tensor, value: SplitKV | torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query [B, H, T, D]; key, value SplitKV; attention_mask [B, 1, T, S] bool over the rest.
    Returns [B, T, H, D] (the layout Hugging Face's attention functions return) and no weights."""
    if not isinstance(key, SplitKV):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if dropout:  # (training with attention dropout) one fused kernel over a copy, which applies it
        return joined_attention(module, query, key, value, attention_mask, scaling, dropout=dropout, **kwargs)
    if key.causal and query.device.type == "cpu":
        out = prefix_causal_attention(query, key, value, scaling or query.shape[-1] ** -0.5)
        return out.transpose(1, 2), None
    if query.shape[2] > DECODE_MAX_QUERIES:  # a chunk (prompt rest, observation)
        if query.device.type == "cpu" and not torch.is_grad_enabled():
            out = flash_split_attention(query, key, value, attention_mask, scaling or query.shape[-1] ** -0.5)
            return out.transpose(1, 2), None
        return joined_attention(module, query, key, value, attention_mask, scaling, **kwargs)  # one kernel, a copy
    out = split_attention(query, key, value, attention_mask, scaling or query.shape[-1] ** -0.5)
    return out.transpose(1, 2).to(query.dtype), None


def joined_attention(module: Any, query: torch.Tensor, key: SplitKV, value: SplitKV,
                     attention_mask: torch.Tensor | None, scaling: float | None, dropout: float = 0.0,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """SDPA over [prefix copied per row ; rest]: for many queries a row the fused kernel beats the
    split products (compute-bound; measured: 0.35-0.67x at 30 queries), and the copy is paid once a chunk."""
    b, t = query.shape[0], query.shape[2]
    groups = key.groups
    keys = [key.prefix.expand(b, -1, -1, -1), key.rest]
    values = [value.prefix.expand(b, -1, -1, -1), value.rest]
    if groups is not None:
        keys.insert(1, key.group[groups.of])
        values.insert(1, value.group[groups.of])
    keys, values = torch.cat(keys, dim=2), torch.cat(values, dim=2)
    mask = None
    if attention_mask is not None or groups is not None:
        parts = [torch.ones((b, 1, t, key.prefix.shape[2]), dtype=torch.bool, device=query.device)]
        if groups is not None:
            parts.append(groups.mask[groups.of][:, None, None, :].expand(b, 1, t, -1))
        rest = key.rest.shape[2]
        parts.append(attention_mask.expand(b, 1, t, rest) if attention_mask is not None else
                     torch.ones((b, 1, t, rest), dtype=torch.bool, device=query.device))
        mask = torch.cat(parts, dim=-1)
    return sdpa_attention_forward(module, query, keys, values, mask, dropout=dropout, scaling=scaling, **kwargs)


def split_attention(query: torch.Tensor, key: SplitKV, value: SplitKV, mask: torch.Tensor | None,
                    scale: float) -> torch.Tensor:
    """Softmax attention of `query` [B, H, T, D] over prefix and rest, merged exactly; [B, H, T, D] float32.
    Heads are grouped over key-value heads (GQA): H = g * Hkv."""
    b, h, t, d = query.shape
    hkv, s = key.rest.shape[1], key.rest.shape[2]
    g = h // hkv
    q = query.float().view(b, hkv, g * t, d)  # [B, Hkv, gT, D]
    # prefix: every query of the batch in one product per key-value head
    q_flat = q.transpose(0, 1).reshape(hkv, b * g * t, d)  # [Hkv, BgT, D]
    s_p = torch.bmm(q_flat, key.prefix[0].float().transpose(1, 2)) * scale  # [Hkv, BgT, P]
    # rest: per row
    s_r = torch.matmul(q, key.rest.float().transpose(2, 3)) * scale  # [B, Hkv, gT, S]
    if mask is not None:  # [B, 1, T, S] -> [B, 1, gT, S]: the same mask for every head of a group
        m = mask.expand(b, 1, t, s).repeat(1, 1, g, 1) if g > 1 else mask.expand(b, 1, t, s)
        s_r = s_r.masked_fill(~m, float("-inf"))
    m_p = s_p.amax(dim=-1).view(hkv, b, g * t).transpose(0, 1)  # [B, Hkv, gT]
    m_r = s_r.amax(dim=-1) if s else torch.full_like(m_p, float("-inf"))
    top = torch.maximum(m_p, m_r)  # finite: the prefix is never masked
    groups = key.groups
    if groups is not None:  # each group's rows' queries against its one copy, [Gp, Hkv, R gT, Q]
        q_g = groups.to_groups(q).transpose(1, 2).reshape(len(groups.mask), hkv, -1, d)
        s_g = torch.matmul(q_g, key.group.float().transpose(2, 3)) * scale
        s_g = s_g.masked_fill(~groups.mask[:, None, None, :], float("-inf"))
        top = torch.maximum(top, _rows(groups, s_g.amax(dim=-1), hkv))
    e_p = torch.exp(s_p - top.transpose(0, 1).reshape(hkv, b * g * t, 1))  # [Hkv, BgT, P]
    e_r = torch.exp(s_r - top[..., None])  # [B, Hkv, gT, S]
    num_p = torch.bmm(e_p, value.prefix[0].float()).view(hkv, b, g * t, d).transpose(0, 1)  # [B, Hkv, gT, D]
    num = num_p + torch.matmul(e_r, value.rest.float())
    den = e_p.sum(dim=-1).view(hkv, b, g * t).transpose(0, 1) + e_r.sum(dim=-1)  # [B, Hkv, gT]
    if groups is not None:
        top_g = groups.to_groups(top).transpose(1, 2).reshape(len(groups.mask), hkv, -1, 1)
        e_g = torch.exp(s_g - top_g)
        num = num + _rows(groups, torch.matmul(e_g, value.group.float()), hkv)
        den = den + _rows(groups, e_g.sum(dim=-1), hkv)
    return (num / den[..., None]).reshape(b, h, t, d)


def _rows(groups: Groups, x: torch.Tensor, heads: int) -> torch.Tensor:
    """A group-layout result [Gp, heads, R * T, ...] back to the rows': [B, heads, T, ...]."""
    x = x.view(x.shape[0], heads, groups.size, -1, *x.shape[3:])
    return groups.to_rows(x.transpose(1, 2))


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


class _PrefixCausal(torch.autograd.Function):
    """Attention of q [B, H, T, D] over [prefix kp, vp [1, H, P, D] ; each row's own k, v [B, H, T, D] causal].

    Two flash kernels, each returning its log-sum-exp l: o_p (all B*T queries against the prefix,
    one batch) and o_r (the rows, is_causal). Merged: out = w o_p + (1 - w) o_r, w = sigmoid(l_p - l_r).
    Backward: the merged output is the softmax over both parts, whose score gradient in part x is
    P_x (dO V_x^T - rowsum(dO * out)) scaled by its weight; the flash backward computes exactly that
    when handed the gradient w_x dO, the *merged* output and the part's own log-sum-exp."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, kp: torch.Tensor, vp: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                scale: float) -> torch.Tensor:
        b, h, t, d = q.shape
        o_p, l_p = _flash(_rows_as_one(q), kp, vp, 0.0, False, scale=scale)  # [1, H, BT, D], [1, H, BT]
        o_r, l_r = _flash(q, k, v, 0.0, True, scale=scale)  # [B, H, T, D], [B, H, T]
        w = torch.sigmoid(l_p.view(h, b, t).transpose(0, 1).float() - l_r.float())[..., None]  # [B, H, T, 1]
        out = torch.lerp(o_r.float(), o_p.view(h, b, t, d).transpose(0, 1).float(), w).to(q.dtype)
        ctx.save_for_backward(q, kp, vp, k, v, out, l_p, l_r, w)
        ctx.scale = scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, kp, vp, k, v, out, l_p, l_r, w = ctx.saved_tensors
        b, h, t, d = q.shape
        g_p = (w * grad.float()).to(q.dtype)  # both weights in float32: 1 - w subtracted in bfloat16 cancels
        g_r = ((1 - w) * grad.float()).to(q.dtype)
        dq_p, dkp, dvp = _flash_backward(_rows_as_one(g_p), _rows_as_one(q), kp, vp, _rows_as_one(out), l_p, 0.0,
                                         False, scale=ctx.scale)
        dq, dk, dv = _flash_backward(g_r, q, k, v, out, l_r, 0.0, True, scale=ctx.scale)
        return dq + dq_p.view(h, b, t, d).transpose(0, 1), dkp, dvp, dk, dv, None


def _rows_as_one(x: torch.Tensor) -> torch.Tensor:
    """[B, H, T, D] -> [1, H, B*T, D]: every row's queries in one batch (they attend to the same prefix)."""
    b, h, t, d = x.shape
    return x.transpose(0, 1).reshape(1, h, b * t, d)


def flash_split_attention(query: torch.Tensor, key: SplitKV, value: SplitKV, mask: torch.Tensor | None,
                          scale: float) -> torch.Tensor:
    """Softmax attention of a chunk `query` [B, H, T, D] over the prefix and the rows' rests under `mask`
    ([B, 1, T, S] bool, True: attend; None: all), no gradient; [B, H, T, D] in the query's dtype.
    Two CPU flash kernels merged by their log-sum-exp: every query of the batch against the one prefix
    (3x faster than one kernel over per-row copies for observation chunks: 32 rows x 30 queries, 650 + 300
    keys, 1 thread), then the rests."""
    b, h, t, d = query.shape
    g = h // key.rest.shape[1]
    dtype = query.dtype
    kp, vp, k, v = (x.to(dtype) if g == 1 else x.to(dtype).repeat_interleave(g, dim=1)
                    for x in (key.prefix, value.prefix, key.rest, value.rest))
    o_p, l_p = _flash(_rows_as_one(query), kp, vp, 0.0, False, scale=scale)
    o_p, l_p = o_p.view(h, b, t, d).transpose(0, 1), l_p.view(h, b, t).transpose(0, 1)
    bias = None if mask is None else torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, float("-inf"))
    o_r, l_r = _flash(query, k, v, 0.0, False, attn_mask=bias, scale=scale)
    if mask is not None:  # a query that sees none of its rest: the kernel returns 0 and log-sum-exp 0
        l_r = l_r.float().masked_fill(~mask.any(dim=-1), float("-inf"))
    if key.groups is None:
        w = torch.sigmoid(l_p.float() - l_r.float())[..., None]
        return torch.lerp(o_r.float(), o_p.float(), w).to(dtype)
    groups = key.groups  # each group's rows' queries against its one copy, as one sequence a group
    kg, vg = (x.to(dtype) if g == 1 else x.to(dtype).repeat_interleave(g, dim=1) for x in (key.group, value.group))
    q_g = groups.to_groups(query).transpose(1, 2).reshape(len(groups.mask), h, -1, d)  # [Gp, H, R T, D]
    bias = torch.zeros(groups.mask.shape, dtype=dtype).masked_fill_(~groups.mask, float("-inf"))[:, None, None]
    o_g, l_g = _flash(q_g, kg, vg, 0.0, False, attn_mask=bias, scale=scale)
    parts = torch.stack([l_p.float(), _rows(groups, l_g, h).float(), l_r.float()])  # [3, B, H, T]
    w = torch.softmax(parts, dim=0)[..., None]  # each part's share of the softmax's mass
    return (w[0] * o_p.float() + w[1] * _rows(groups, o_g, h).float() + w[2] * o_r.float()).to(dtype)


def prefix_causal_attention(query: torch.Tensor, key: SplitKV, value: SplitKV, scale: float) -> torch.Tensor:
    """Softmax attention of `query` [B, H, T, D] over the prefix and, causally, the rows' own keys
    (key.rest is [B, Hkv, T, D]: right-padded rows, whose pads only later pads see); [B, H, T, D] in
    the query's dtype. CPU flash kernels; heads grouped over key-value heads (GQA) are repeated."""
    g = query.shape[1] // key.rest.shape[1]
    dtype = query.dtype
    kp, vp, k, v = (x.to(dtype) if g == 1 else x.to(dtype).repeat_interleave(g, dim=1)
                    for x in (key.prefix, value.prefix, key.rest, value.rest))
    return _PrefixCausal.apply(query, kp, vp, k, v, scale)


def causal_mask(t: int, s: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[1, 1, t, s] bool: query i (the last t of s positions) attends to rest positions <= s - t + i."""
    return torch.ones(t, s, dtype=torch.bool, device=device).tril(diagonal=s - t)[None, None]


@contextlib.contextmanager
def cascade(model: Any) -> Iterator[None]:
    """Within the block the model's attention is `cascade_attention` (restored after, also on error)."""
    config = model.config
    before = config._attn_implementation
    config._attn_implementation = CASCADE
    try:
        yield
    finally:
        config._attn_implementation = before


AttentionInterface.register(CASCADE, cascade_attention)
AttentionMaskInterface.register(CASCADE, sdpa_mask)  # only reached with a 2-D mask (not used here)
