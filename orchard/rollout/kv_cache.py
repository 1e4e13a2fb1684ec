"""KV-cache bookkeeping of `HFEngine`: the cache of the rows decoding together, which rows join and leave between
decode steps, and the prefix store through which a new turn reuses the cache of the turn before.

Layout: per layer, keys and values live in buffers ``[B, H, C, D]`` of which the first ``length`` columns are in
use and the rest is spare room (`BatchCache`); ``mask`` ``[B, C]`` marks the columns that hold a real token (1) and
the padding (0). A decode step writes one column in place, whether the model's own forward runs (through a
``DynamicCache`` whose layers are views of the buffers) or `orchard.rollout.fast_decode`'s. Keys are cached after
the rotary embedding, at each token's true position, so the real columns of a row, read in order, are exactly the
cache of its token sequence whatever padding lies around them. That is what lets rows of different lengths share
one cache (padded on the left), join a running batch, leave it, and be stored for a later prompt that starts with
the same tokens. Only full-attention layers (``DynamicLayer``) have this property; a sliding window or a
linear-attention state does not, so `check_cache_layers` refuses such models.
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from orchard._extras import requires_extra

LayerKV = list[tuple[torch.Tensor, torch.Tensor]]
"""One tensor pair per layer: keys and values ``[H, T, D]`` of one sequence (no batch axis, no padding)."""


def new_cache(config: Any) -> Any:
    """An empty transformers ``DynamicCache`` for ``config``."""
    with requires_extra("rollout"):
        from transformers import DynamicCache

    return DynamicCache(config=config)


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


_SPARE = 64
"""Free columns a cache is given beyond what it holds when it is laid out (prefill, rows joining or leaving), and
what it grows by when full. A fixed chunk rather than a fraction of the length: on a GPU, spare room is memory
held per row (Qwen3-8B in bf16: 64 columns are 9 MiB a row), while the copy of a growth every 64 steps costs
about 1/64 of what attention reads from the cache at each step."""


class BatchCache:
    """The KV cache of the rows that decode together, right-aligned: column ``length - 1`` is every row's latest
    token.

    Per layer, keys and values live in buffers ``[B, H, C, D]`` with ``C >= length`` columns: the first ``length``
    hold the rows' caches, the rest is spare room that a decode step writes in place (no concatenation, no copy of
    what is cached). A full buffer grows by a chunk (`reserve`). A layer's buffers are allocated by its first write
    unless a stored prefix laid them out first.

    Args:
        mask: ``[B, C]`` long, 1 where a column holds (or is about to hold) a real token of the row; 0 for padding
            and for the spare columns.
        length: columns in use.
        keys: per layer ``[B, H, C, D]``, or None until the layer's first write.
        values: as ``keys``.
    """

    def __init__(
        self,
        mask: torch.Tensor,
        length: int,
        keys: list[torch.Tensor | None],
        values: list[torch.Tensor | None],
    ) -> None:
        self.mask = mask
        self.length = length
        self.keys = keys
        self.values = values

    @property
    def rows(self) -> int:
        return self.mask.shape[0]

    @property
    def capacity(self) -> int:
        return self.mask.shape[1]

    def reserve(self, columns: int) -> None:
        """Make room for ``columns`` more columns, growing every buffer by a chunk if they do not fit."""
        need = self.length + columns
        if need <= self.capacity:
            return
        capacity = need + _SPARE
        self.mask = _widen(self.mask, self.length, capacity, dim=1)
        for layer in (self.keys, self.values):
            for i, buffer in enumerate(layer):
                if buffer is not None:
                    layer[i] = _widen(buffer, self.length, capacity, dim=2)

    def write(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[B, H, S, D]`` keys and values of ``S`` new tokens into columns ``length .. length + S - 1`` of
        layer ``layer`` (room must be reserved) and return the layer's cache up to them (views, no copy). The
        columns count as in use once `advance` is called, after every layer wrote."""
        end = self.length + keys.shape[2]
        if end > self.capacity:
            raise ValueError(f"keys has {keys.shape[2]} columns; only {self.capacity - self.length} are reserved")
        if self.keys[layer] is None:
            shape = (self.rows, keys.shape[1], self.capacity, keys.shape[3])
            self.keys[layer] = keys.new_zeros(shape)
            self.values[layer] = values.new_zeros((*shape[:3], values.shape[3]))
        k_buffer, v_buffer = self.keys[layer], self.values[layer]
        assert k_buffer is not None and v_buffer is not None
        k_buffer[:, :, self.length : end] = keys
        v_buffer[:, :, self.length : end] = values
        return k_buffer[:, :, :end], v_buffer[:, :, :end]

    def advance(self, columns: int) -> None:
        """Count the ``columns`` columns every layer has written as in use."""
        self.length += columns

    def hf_cache(self, config: Any) -> Any:
        """A transformers ``DynamicCache`` over these buffers: the model's forward reads the cached columns and
        writes its new tokens' keys and values in place (`write`); call `advance` after it."""
        cache = new_cache(config)
        layer_class = _buffer_layer_class()
        cache.layers = [layer_class(self, i) for i in range(len(self.keys))]
        return cache

    def select(self, keep: Sequence[int]) -> None:
        """Keep only the rows ``keep`` (in that order), then drop the columns that became padding in every row."""
        index = torch.tensor(list(keep), dtype=torch.long, device=self.mask.device)
        mask = self.mask[:, : self.length].index_select(0, index)
        real_columns = mask.any(dim=0).nonzero()
        start = int(real_columns[0]) if len(real_columns) else self.length
        length = self.length - start
        self.mask = _widen(mask[:, start:], length, length + _SPARE, dim=1)
        for layer in (self.keys, self.values):
            for i, buffer in enumerate(layer):
                assert buffer is not None
                kept = buffer[:, :, start : self.length].index_select(0, index)
                layer[i] = _widen(kept, length, length + _SPARE, dim=2)
        self.length = length

    def extend(self, other: BatchCache) -> None:
        """Append the rows of ``other``; the shorter of the two is padded on the left to the longer's length."""
        width = max(self.length, other.length)
        capacity = width + _SPARE

        def stack(mine: torch.Tensor, theirs: torch.Tensor, mine_len: int, theirs_len: int, dim: int) -> torch.Tensor:
            shape = list(mine.shape)
            shape[0], shape[dim] = mine.shape[0] + theirs.shape[0], capacity
            out = mine.new_zeros(shape)
            out[: mine.shape[0]].narrow(dim, width - mine_len, mine_len).copy_(mine.narrow(dim, 0, mine_len))
            out[mine.shape[0] :].narrow(dim, width - theirs_len, theirs_len).copy_(
                theirs.narrow(dim, 0, theirs_len)
            )
            return out

        self.mask = stack(self.mask, other.mask, self.length, other.length, dim=1)
        for mine, theirs in ((self.keys, other.keys), (self.values, other.values)):
            for i, (a, b) in enumerate(zip(mine, theirs, strict=True)):
                assert a is not None and b is not None
                mine[i] = stack(a, b, self.length, other.length, dim=2)
        self.length = width

    def row_kv(self, row: int) -> LayerKV:
        """The cache of row ``row``'s token sequence: its real columns, copied out of the batch."""
        real = self.mask[row, : self.length].bool()
        pairs = []
        for k, v in zip(self.keys, self.values, strict=True):
            assert k is not None and v is not None
            pairs.append((k[row, :, : self.length][:, real], v[row, :, : self.length][:, real]))
        return pairs


def _widen(t: torch.Tensor, used: int, capacity: int, dim: int) -> torch.Tensor:
    """A zero tensor with ``capacity`` entries along ``dim`` whose first ``used`` are those of ``t``."""
    shape = list(t.shape)
    shape[dim] = capacity
    out = t.new_zeros(shape)
    out.narrow(dim, 0, used).copy_(t.narrow(dim, 0, used))
    return out


@functools.cache
def _buffer_layer_class() -> type:
    """``BufferLayer``, defined once transformers is imported (an extra)."""
    with requires_extra("rollout"):
        from transformers.cache_utils import DynamicLayer

    class BufferLayer(DynamicLayer):
        """A ``DynamicLayer`` whose keys and values are views of a `BatchCache`'s buffers: ``update`` writes the new
        tokens in place instead of concatenating."""

        _layer_type = None  # never registered as transformers' layer of any attention type

        def __init__(self, batch: BatchCache, index: int) -> None:
            super().__init__()
            self.batch, self.index = batch, index
            keys, values = batch.keys[index], batch.values[index]
            if keys is not None and values is not None and batch.length > 0:
                self.keys, self.values = keys[:, :, : batch.length], values[:, :, : batch.length]
                self.device = keys.device
                self.is_initialized = True

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
        ) -> tuple[torch.Tensor, torch.Tensor]:
            self.keys, self.values = self.batch.write(self.index, key_states, value_states)
            self.device = key_states.device
            self.is_initialized = True
            return self.keys, self.values

    return BufferLayer


@dataclass
class PrefillInputs:
    """One forward's inputs that prefill a group of new rows, some continuing a stored prefix."""

    cache: BatchCache
    """The rows' cache: the reused prefixes in its first ``P`` columns (``length = P``), room for the new tokens."""
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
    capacity = width_p + width_s + _SPARE
    input_ids = torch.full((batch, width_s), pad_token_id, dtype=torch.long)
    mask = torch.zeros((batch, capacity), dtype=torch.long)
    position_ids = torch.zeros((batch, width_s), dtype=torch.long)
    for b, (n, suffix) in enumerate(zip(lengths, suffixes, strict=True)):
        input_ids[b, width_s - len(suffix) :] = torch.tensor(suffix, dtype=torch.long)
        mask[b, width_p - n : width_p] = 1
        mask[b, width_p + width_s - len(suffix) : width_p + width_s] = 1
        position_ids[b, width_s - len(suffix) :] = torch.arange(n, n + len(suffix))
    layers = len(new_cache(config).layers)
    keys: list[torch.Tensor | None] = [None] * layers
    values: list[torch.Tensor | None] = [None] * layers
    if width_p > 0:
        template = next(kv for kv in prefixes if kv is not None)
        for i, (k0, v0) in enumerate(template):
            k_buffer = k0.new_zeros((batch, k0.shape[0], capacity, k0.shape[2]), device=device)
            v_buffer = v0.new_zeros((batch, v0.shape[0], capacity, v0.shape[2]), device=device)
            for b, kv in enumerate(prefixes):
                if kv is not None:
                    k_buffer[b, :, width_p - lengths[b] : width_p] = kv[i][0]
                    v_buffer[b, :, width_p - lengths[b] : width_p] = kv[i][1]
            keys[i], values[i] = k_buffer, v_buffer
    mask = mask.to(device)
    cache = BatchCache(mask, width_p, keys, values)
    return PrefillInputs(cache, input_ids.to(device), mask[:, : width_p + width_s], position_ids.to(device))


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
