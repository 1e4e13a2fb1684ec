"""KV-cache bookkeeping of `HFEngine`: the cache of the rows decoding together, which rows join and leave between
decode steps, and the prefix store through which a new turn reuses the cache of the turn before.

Layout: every layer of a transformers ``DynamicCache`` holds keys and values ``[B, H, L, D]``; ``mask`` ``[B, L]``
marks the columns that hold a real token (1) and the padding (0). Keys are cached after the rotary embedding, at
each token's true position, so the real columns of a row, read in order, are exactly the cache of its token
sequence whatever padding lies around them. That is what lets rows of different lengths share one cache (padded on
the left), join a running batch, leave it, and be stored for a later prompt that starts with the same tokens.
Only full-attention layers (``DynamicLayer``) have this property; a sliding window or a linear-attention state
does not, so `check_cache_layers` refuses such models.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from orchard._extras import requires_extra

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]
"""One tensor pair per layer: keys and values ``[H, T, D]`` of one sequence (no batch axis, no padding)."""


def new_cache(config: Any, layers: Sequence[tuple[torch.Tensor, torch.Tensor]] | None = None) -> Any:
    """A transformers ``DynamicCache`` for ``config``, empty or holding ``layers`` (keys, values ``[B, H, L, D]``)."""
    with requires_extra("rollout"):
        from transformers import DynamicCache

    if layers is None:
        return DynamicCache(config=config)
    return DynamicCache(ddp_cache_data=list(layers), config=config)


def check_cache_layers(config: Any) -> None:
    """Raise ``ValueError`` unless every layer of the model's cache is a plain full-attention ``DynamicLayer``."""
    with requires_extra("rollout"):
        from transformers.cache_utils import DynamicLayer

    kinds = {type(layer).__name__ for layer in new_cache(config).layers if type(layer) is not DynamicLayer}
    if kinds:
        raise ValueError(
            f"model must have full-attention layers only (HFEngine moves cached rows between batches); "
            f"its cache has {sorted(kinds)}"
        )


class BatchCache:
    """The KV cache of the rows that decode together, right-aligned: column ``L - 1`` is every row's latest token.

    Args:
        cache: a ``DynamicCache`` whose layers hold ``[B, H, L, D]`` keys and values.
        mask: ``[B, L]`` long, 1 where a column holds a real token of the row.
    """

    def __init__(self, cache: Any, mask: torch.Tensor) -> None:
        self.cache = cache
        self.mask = mask

    @property
    def rows(self) -> int:
        return self.mask.shape[0]

    def select(self, keep: Sequence[int]) -> None:
        """Keep only the rows ``keep`` (in that order), then drop the columns that became padding in every row."""
        index = torch.tensor(list(keep), dtype=torch.long, device=self.mask.device)
        self.mask = self.mask.index_select(0, index)
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(0, index)
            layer.values = layer.values.index_select(0, index)
        real_columns = self.mask.any(dim=0).nonzero()
        start = int(real_columns[0]) if len(real_columns) else self.mask.shape[1]
        if start > 0:
            self.mask = self.mask[:, start:]
            for layer in self.cache.layers:
                layer.keys = layer.keys[:, :, start:]
                layer.values = layer.values[:, :, start:]

    def extend(self, other: BatchCache) -> None:
        """Append the rows of ``other``; the shorter of the two is padded on the left to the longer's length."""
        width = max(self.mask.shape[1], other.mask.shape[1])

        def pad(t: torch.Tensor, dim_from_end: int) -> torch.Tensor:
            missing = width - t.shape[-dim_from_end]
            if missing == 0:
                return t
            return F.pad(t, (0, 0) * (dim_from_end - 1) + (missing, 0))

        self.mask = torch.cat([pad(self.mask, 1), pad(other.mask, 1)], dim=0)
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys = torch.cat([pad(mine.keys, 2), pad(theirs.keys, 2)], dim=0)
            mine.values = torch.cat([pad(mine.values, 2), pad(theirs.values, 2)], dim=0)

    def row_kv(self, row: int) -> LayerKV:
        """The cache of row ``row``'s token sequence: its real columns, copied out of the batch."""
        real = self.mask[row].bool()
        return [(layer.keys[row][:, real], layer.values[row][:, real]) for layer in self.cache.layers]


@dataclass
class PrefillInputs:
    """One forward's inputs that prefill a group of new rows, some continuing a stored prefix."""

    cache: Any
    input_ids: torch.Tensor
    """``[B, S]`` each row's tokens after its reused prefix, left-padded."""
    attention_mask: torch.Tensor
    """``[B, P + S]``: the reused prefixes (``P`` columns, left-padded), then the new tokens."""
    position_ids: torch.Tensor
    """``[B, S]``: a row's new tokens continue at its own prefix length."""


def prefill_inputs(
    config: Any,
    prefixes: Sequence[LayerKV | None],
    suffixes: Sequence[Sequence[int]],
    pad_token_id: int,
    device: torch.device,
) -> PrefillInputs:
    """Lay out a group of rows for one prefill forward: the reused prefix caches right-aligned in a shared cache of
    ``P = max prefix length`` columns, the remaining prompt tokens right-aligned in ``S = max suffix length``
    columns after it. A row's padding thus sits between its prefix and its new tokens; the mask hides it."""
    lengths = [0 if kv is None else kv[0][0].shape[1] for kv in prefixes]
    width_p = max(lengths)
    width_s = max(len(s) for s in suffixes)
    batch = len(suffixes)
    input_ids = torch.full((batch, width_s), pad_token_id, dtype=torch.long)
    mask = torch.zeros((batch, width_p + width_s), dtype=torch.long)
    position_ids = torch.zeros((batch, width_s), dtype=torch.long)
    for b, (n, suffix) in enumerate(zip(lengths, suffixes, strict=True)):
        input_ids[b, width_s - len(suffix) :] = torch.tensor(suffix, dtype=torch.long)
        mask[b, width_p - n : width_p] = 1
        mask[b, width_p + width_s - len(suffix) :] = 1
        position_ids[b, width_s - len(suffix) :] = torch.arange(n, n + len(suffix))
    cache = new_cache(config)
    if width_p > 0:
        template = next(kv for kv in prefixes if kv is not None)
        layers = []
        for i, (k0, v0) in enumerate(template):
            keys = k0.new_zeros((batch, k0.shape[0], width_p, k0.shape[2]))
            values = v0.new_zeros((batch, v0.shape[0], width_p, v0.shape[2]))
            for b, kv in enumerate(prefixes):
                if kv is not None:
                    keys[b, :, width_p - lengths[b] :] = kv[i][0]
                    values[b, :, width_p - lengths[b] :] = kv[i][1]
            layers.append((keys, values))
        cache = new_cache(config, layers)
    return PrefillInputs(cache, input_ids.to(device), mask.to(device), position_ids.to(device))


_BLOCK = 32
"""Stored sequences are indexed by the hashes of their first ``k`` blocks of this many tokens."""


def _block_hashes(ids: Sequence[int]) -> list[int]:
    """Chained hashes of ``ids``' whole blocks: entry ``k`` stands for the first ``k + 1`` blocks."""
    hashes, h = [], 0
    for start in range(0, len(ids) - _BLOCK + 1, _BLOCK):
        h = hash((h, tuple(ids[start : start + _BLOCK])))
        hashes.append(h)
    return hashes


@dataclass
class _Entry:
    ids: torch.Tensor  # [T] long, on the CPU
    kv: LayerKV
    index_keys: list[int | None]


class PrefixStore:
    """Caches of finished rows keyed by their token ids, least recently used first out.

    A later prompt reuses the longest common prefix with a stored sequence (the cache of a prefix is the prefix of
    the cache: attention is causal). Lookups go through an index of block hashes, so their cost does not grow with
    the number of stored sequences: the candidates are the (at most 8 most recent) sequences sharing the most whole
    blocks with the prompt, and the exact common prefix is counted on those; the reuse found may thus fall short
    of the best by less than a block.

    Args:
        max_tokens: most tokens held over all entries; 0 disables the store.
    """

    _CANDIDATES = 8

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._index: dict[
            int | None, dict[int, None]
        ] = {}  # block-hash chain (None: no whole block) -> entries
        self._next_key = 0
        self.tokens = 0

    def clear(self) -> None:
        self._entries.clear()
        self._index.clear()
        self.tokens = 0

    @staticmethod
    def _common(a: torch.Tensor, b: torch.Tensor) -> int:
        m = min(len(a), len(b))
        return int((a[:m] == b[:m]).cumprod(0).sum())

    def lookup(self, prompt_ids: Sequence[int]) -> tuple[int, LayerKV | None, int | None]:
        """The longest stored prefix of ``prompt_ids`` that leaves at least its last token to prefill (whose
        logits start the sample): its length, its cache and the entry's key, or ``(0, None, None)``."""
        if not self._entries or len(prompt_ids) < 2:
            return 0, None, None
        head = prompt_ids[:-1]
        level: int | None = None
        for h in _block_hashes(head):
            if h not in self._index:
                break
            level = h
        candidates = list(self._index.get(level, {}))[-self._CANDIDATES :]
        prompt = torch.tensor(head, dtype=torch.long)
        best_key, best = None, 0
        for key in candidates:
            n = self._common(self._entries[key].ids, prompt)
            if n > best:
                best_key, best = key, n
        if best_key is None:
            return 0, None, None
        self._entries.move_to_end(best_key)
        kv = self._entries[best_key].kv
        return best, [(k[:, :best], v[:, :best]) for k, v in kv], best_key

    def add(self, ids: Sequence[int], kv: LayerKV, extends: int | None = None) -> None:
        """Store the cache ``kv`` of the sequence ``ids``. ``extends``: the key of the entry its prompt reused;
        dropped when ``ids`` starts with that entry's whole sequence (an episode's turns occupy one entry)."""
        if extends is not None and extends in self._entries:
            old = self._entries[extends]
            if self._common(old.ids, torch.tensor(ids[: len(old.ids)], dtype=torch.long)) == len(old.ids):
                self._remove(extends)
        if not 0 < len(ids) <= self.max_tokens:
            return
        while self.tokens + len(ids) > self.max_tokens:
            self._remove(next(iter(self._entries)))
        key = self._next_key
        self._next_key += 1
        index_keys: list[int | None] = [None, *_block_hashes(ids)]
        for h in index_keys:
            self._index.setdefault(h, {})[key] = None
        self._entries[key] = _Entry(torch.tensor(list(ids), dtype=torch.long), kv, index_keys)
        self.tokens += len(ids)

    def _remove(self, key: int) -> None:
        entry = self._entries.pop(key)
        self.tokens -= len(entry.ids)
        for h in entry.index_keys:
            bucket = self._index[h]
            del bucket[key]
            if not bucket:
                del self._index[h]
