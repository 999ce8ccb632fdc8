"""A KV cache for long multi-turn rollouts: append in place instead of concatenating.

transformers' `DynamicLayer` grows its keys and values with `torch.cat` on every
decoded token, which copies the whole cache: O(L^2) memory traffic per turn, and on
CPU the larger part of rollout time (measured: 21 s of 35 s for 64 tool-world
episodes). This layer keeps a buffer whose capacity doubles when full and writes
new entries in place; attention reads a view of the filled part.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class AppendOnlyLayer(DynamicLayer):
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._length = 0
        self._k = key_states.new_empty((*key_states.shape[:-2], 0, key_states.shape[-1]))
        self._v = value_states.new_empty((*value_states.shape[:-2], 0, value_states.shape[-1]))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, m = self._length, key_states.shape[-2]
        if n + m > self._k.shape[-2]:
            self._grow(max(2 * self._k.shape[-2], n + m, 64))
        self._k[..., n:n + m, :] = key_states
        self._v[..., n:n + m, :] = value_states
        self._length = n + m
        self._refresh()
        return self.keys, self.values

    def _grow(self, capacity: int) -> None:
        k = self._k.new_zeros((*self._k.shape[:-2], capacity, self._k.shape[-1]))
        v = self._v.new_zeros((*self._v.shape[:-2], capacity, self._v.shape[-1]))
        k[..., :self._length, :] = self._k[..., :self._length, :]
        v[..., :self._length, :] = self._v[..., :self._length, :]
        self._k, self._v = k, v

    def _refresh(self) -> None:
        self.keys = self._k[..., :self._length, :]
        self.values = self._v[..., :self._length, :]

    def get_seq_length(self) -> int:
        return self._length if self.is_initialized else 0

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.get_seq_length() > 0:
            self._k = self._k.repeat_interleave(repeats, dim=0)
            self._v = self._v.repeat_interleave(repeats, dim=0)
            self._refresh()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.get_seq_length() > 0:
            self._k, self._v = self._k[indices], self._v[indices]
            self._refresh()

    def crop(self, max_length: int) -> None:
        raise NotImplementedError("rollouts never crop their cache")


def append_only_cache(config) -> DynamicCache:
    cache = DynamicCache(config=config)
    cache.layers = [AppendOnlyLayer() for _ in cache.layers]
    return cache
