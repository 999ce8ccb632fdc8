"""KV caches for long multi-turn rollouts: append in place, and share the common prefix.

transformers' `DynamicLayer` grows its keys and values with `torch.cat` on every
decoded token, which copies the whole cache: O(L^2) memory traffic per turn, and on
CPU the larger part of rollout time (measured: 21 s of 35 s for 64 tool-world
episodes). `AppendOnlyLayer` keeps a buffer whose capacity doubles when full and writes
new entries in place; attention reads a view of the filled part.

`CascadeLayer` adds a prefix every row shares (the system prompt), held once, [1, Hkv, P, D]:
the cache hands attention a `SplitKV` (prefix, this row's rest) and
`attention.cascade_attention` attends to the prefix once for all rows. Batch operations
(copy a prompt's rest to its rows, drop finished rows) touch the rest only. With `set_groups` the G
rollouts of a prompt also share one copy of the prompt's rest (on BFCL each task has its own
system prompt of 2-5 k tokens: the batch shares ~200 of them). `PrefixLayer` is the
same for one training or probe forward: the prefix, and the chunk being run, stored nowhere.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from toolcollapse.attention import Groups, SplitKV


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

    def take_rows(self, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Copies of the filled part of rows `index`: [n, Hkv, length, D] keys and values."""
        return self.keys[index], self.values[index]

    def add_rows(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Rows taken earlier, shorter or as long as the others, appended after them; their missing
        positions are zeros (the caller masks them)."""
        n, length = keys.shape[0], keys.shape[-2]
        k = self._k.new_zeros((n, *self._k.shape[1:]))
        v = self._v.new_zeros((n, *self._v.shape[1:]))
        k[..., :length, :], v[..., :length, :] = keys, values
        self._k, self._v = torch.cat([self._k, k]), torch.cat([self._v, v])
        self._refresh()


def append_only_cache(config) -> DynamicCache:
    cache = DynamicCache(config=config)
    cache.layers = [AppendOnlyLayer() for _ in cache.layers]
    return cache


class CascadeLayer(AppendOnlyLayer):
    """An append-only layer whose rows also attend to one shared prefix and, after `set_groups`, to
    their group's part."""

    def __init__(self, prefix_keys: torch.Tensor, prefix_values: torch.Tensor):
        super().__init__()
        self.prefix_keys, self.prefix_values = prefix_keys, prefix_values  # [1, Hkv, P, D]
        self.group_keys = self.group_values = None  # [Gp, Hkv, Q, D]
        self.groups: Groups | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        keys, values = super().update(key_states, value_states)
        return (SplitKV(self.prefix_keys, keys, group=self.group_keys, groups=self.groups),
                SplitKV(self.prefix_values, values, group=self.group_values, groups=self.groups))

    def get_seq_length(self) -> int:
        group = 0 if self.group_keys is None else self.group_keys.shape[-2]
        return self.prefix_keys.shape[-2] + group + super().get_seq_length()

    def set_groups(self, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, of: torch.Tensor) -> None:
        """Group parts `keys`, `values` [n, Hkv, Q, D] (`mask` [n, Q]: their real positions) and the rows that
        attend to them (`of` [N]: each row's part), whose own rests start empty."""
        self.group_keys, self.group_values = keys, values
        self.groups = Groups.of_rows(of, mask.bool())
        rows = (len(of), keys.shape[1], 0, keys.shape[-1])
        if not self.is_initialized:
            self.lazy_initialization(keys, values)
        self._k, self._v, self._length = keys.new_empty(rows), values.new_empty(rows), 0
        self._refresh()

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.groups is not None:
            raise RuntimeError("rows that share group parts are not repeated (set_groups makes them)")
        super().batch_repeat_interleave(repeats)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.groups is not None:
            self.groups = Groups.of_rows(self.groups.of[indices], self.groups.mask)

    def drop_unread_groups(self) -> None:
        """Let go of the group parts no row reads any more (every rollout of the task ended): decoding
        multiplies every group's part, read or not. Not while rows are taken out (their groups would go)."""
        if self.groups is None:
            return
        read = torch.unique(self.groups.of)  # sorted
        if len(read) == len(self.groups.mask):
            return
        new_index = torch.full((len(self.groups.mask),), -1, dtype=torch.long, device=read.device)
        new_index[read] = torch.arange(len(read), device=read.device)
        self.group_keys, self.group_values = self.group_keys[read], self.group_values[read]
        self.groups = Groups.of_rows(new_index[self.groups.of], self.groups.mask[read])

    def take_rows(self, index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Rows `index`: keys and values (`AppendOnlyLayer.take_rows`) and, sharing group parts, their groups."""
        if self.groups is None:
            return super().take_rows(index)
        return (*super().take_rows(index), self.groups.of[index])

    def add_rows(self, keys: torch.Tensor, values: torch.Tensor, of: torch.Tensor | None = None) -> None:
        super().add_rows(keys, values)
        if self.groups is not None:
            self.groups = Groups.of_rows(torch.cat([self.groups.of, of]), self.groups.mask)


class PrefixLayer(DynamicLayer):
    """One forward over the rows' rests on top of a shared prefix; the rests' keys and values stay only
    as long as the cache (a rollout's prefill of long prompts reads them)."""

    def __init__(self, prefix_keys: torch.Tensor, prefix_values: torch.Tensor):
        super().__init__()
        self.prefix_keys, self.prefix_values = prefix_keys, prefix_values  # [1, Hkv, P, D]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys, self.values = key_states, value_states
        return (SplitKV(self.prefix_keys, key_states, causal=True),
                SplitKV(self.prefix_values, value_states, causal=True))

    def get_seq_length(self) -> int:
        return self.prefix_keys.shape[-2]


def prefix_kv(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) [1, Hkv, P, D] of every layer of a cache that ran the prefix alone."""
    return [(layer.keys, layer.values) for layer in cache.layers]


def cascade_cache(config, prefix: list[tuple[torch.Tensor, torch.Tensor]], store: bool = True) -> DynamicCache:
    """A cache over a shared prefix: rows append to it (`store`, rollouts) or run once (training)."""
    cache = DynamicCache(config=config)
    layer = CascadeLayer if store else PrefixLayer
    cache.layers = [layer(k, v) for k, v in prefix]
    return cache


def drop_unread_groups(cache: DynamicCache) -> None:
    """`CascadeLayer.drop_unread_groups` on every layer (a no-op for other caches)."""
    for layer in cache.layers:
        if isinstance(layer, CascadeLayer):
            layer.drop_unread_groups()


def take_rows(cache: DynamicCache, index: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Rows `index` of an append-only (or cascade) cache, every layer, copied out."""
    return [layer.take_rows(index) for layer in cache.layers]


def add_rows(cache: DynamicCache, taken: list[tuple[torch.Tensor, ...]]) -> None:
    """Rows taken by `take_rows` back in, after the cache's own rows."""
    for layer, rows in zip(cache.layers, taken):
        layer.add_rows(*rows)
