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

The split pays where attention is memory-bound: decoding, one query a row (2.6-5.7x faster
than SDPA over per-row copies at 32 rows, 650 + 50..400 keys, 1 thread). For chunks of many
queries a row (a prompt's rest, an observation) one fused SDPA kernel over a per-row copy
is faster, and is used; a training forward (hundreds of queries a row) gains nothing and
keeps its own path (`model.hidden_states`).

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
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

CASCADE = "toolcollapse_cascade"
DECODE_MAX_QUERIES = 4  # up to this many queries a row, the split products (decoding); above, one fused kernel


@dataclass(frozen=True)
class SplitKV:
    """Keys (or values) of one layer: the batch's shared prefix and each row's own rest."""

    prefix: torch.Tensor  # [1, Hkv, P, D]
    rest: torch.Tensor  # [B, Hkv, S, D]


def cascade_attention(module: Any, query: torch.Tensor, key: SplitKV | torch.Tensor, value: SplitKV | torch.Tensor,
                      attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """query [B, H, T, D]; key, value SplitKV; attention_mask [B, 1, T, S] bool over the rest.
    Returns [B, T, H, D] (the layout Hugging Face's attention functions return) and no weights."""
    if not isinstance(key, SplitKV):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if query.shape[2] > DECODE_MAX_QUERIES:  # a chunk (prompt rest, observation): one fused kernel over a copy
        return joined_attention(module, query, key, value, attention_mask, scaling, **kwargs)
    out = split_attention(query, key, value, attention_mask, scaling or query.shape[-1] ** -0.5)
    return out.transpose(1, 2).to(query.dtype), None


def joined_attention(module: Any, query: torch.Tensor, key: SplitKV, value: SplitKV,
                     attention_mask: torch.Tensor | None, scaling: float | None,
                     **kwargs: Any) -> tuple[torch.Tensor, None]:
    """SDPA over [prefix copied per row ; rest]: for many queries a row the fused kernel beats the
    split products (compute-bound; measured: 0.35-0.67x at 30 queries), and the copy is paid once a chunk."""
    b, t = query.shape[0], query.shape[2]
    keys = torch.cat([key.prefix.expand(b, -1, -1, -1), key.rest], dim=2)
    values = torch.cat([value.prefix.expand(b, -1, -1, -1), value.rest], dim=2)
    mask = None
    if attention_mask is not None:
        prefix = attention_mask.new_ones((b, 1, t, key.prefix.shape[2]))
        mask = torch.cat([prefix, attention_mask.expand(b, 1, t, key.rest.shape[2])], dim=-1)
    return sdpa_attention_forward(module, query, keys, values, mask, scaling=scaling, **kwargs)


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
    e_p = torch.exp(s_p - top.transpose(0, 1).reshape(hkv, b * g * t, 1))  # [Hkv, BgT, P]
    e_r = torch.exp(s_r - top[..., None])  # [B, Hkv, gT, S]
    num_p = torch.bmm(e_p, value.prefix[0].float()).view(hkv, b, g * t, d).transpose(0, 1)  # [B, Hkv, gT, D]
    num = num_p + torch.matmul(e_r, value.rest.float())
    den = e_p.sum(dim=-1).view(hkv, b, g * t).transpose(0, 1) + e_r.sum(dim=-1)  # [B, Hkv, gT]
    return (num / den[..., None]).reshape(b, h, t, d)


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
