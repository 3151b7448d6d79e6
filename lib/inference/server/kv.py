"""The builtin engine's KV cache: per layer, buffers with room for the tokens still to come."""

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from lib.models.load import Blocks

# Tokens a block holds (BlockLayer). A 64-row SmolLM2 decode step's attention over blocks of 16, 32 and 64
# tokens took 26, 23 and 22 ms at 60 tokens of context, one thread; 64 wastes the most on a half-full block.
BLOCK = 32


class GrowingLayer(DynamicLayer):
    """A layer's cached keys and values, in buffers with room at the end: a decode step writes its token
    there, where transformers' DynamicLayer concatenates the whole history again. `dtype` is what they are
    kept in (None: the model's)."""

    def __init__(self, dtype: torch.dtype | None = None):
        super().__init__()
        self.store = dtype
        self.room: tuple[torch.Tensor, torch.Tensor] | None = None  # (B, heads, capacity, D) each

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = 0 if self.room is None else self.keys.shape[-2]
        end = length + key_states.shape[-2]
        if self.room is None or end > self.room[0].shape[-2]:
            capacity = end + max(64, end // 4)  # a resize every ~end/4 steps keeps the copying small
            old = self.room or (None, None)
            self.room = tuple(
                self.grown(new, kept, length, capacity) for new, kept in zip((key_states, value_states), old)
            )
        self.room[0][..., length:end, :] = key_states
        self.room[1][..., length:end, :] = value_states
        self.keys, self.values = self.room[0][..., :end, :], self.room[1][..., :end, :]
        return self.keys, self.values

    def grown(
        self, states: torch.Tensor, old: torch.Tensor | None, length: int, capacity: int
    ) -> torch.Tensor:
        buffer = states.new_empty(
            (*states.shape[:-2], capacity, states.shape[-1]), dtype=self.store or states.dtype
        )
        if old is not None:
            buffer[..., :length, :] = old[..., :length, :]
        return buffer

    def states(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(keys, values), each (B, heads, T, head_dim)."""
        return self.keys, self.values

    def selected(self, index: torch.Tensor, start: int) -> tuple["GrowingLayer", int]:
        """A layer of the rows `index` from token `start` on, and the token it starts at (`start`)."""
        layer = type(self)(self.store)
        layer.update(self.keys[index, :, start:], self.values[index, :, start:])
        return layer, start


class BlockLayer(GrowingLayer):
    """A layer's keys and values in blocks of BLOCK tokens, each block one contiguous (B, heads, BLOCK, D) run
    and room for more blocks at the end. A decode step's attention reads them block by block as two long
    runs of memory: the (B, heads, capacity, D) buffers of GrowingLayer leave a gap after each row's tokens,
    over which the CPU's batched matmuls ran at half the speed (docs/benchmarks.md, serving). Kept in
    float32 for lib/models/load.py's grouped_sdpa, which reads them uncast; a decode step gets Blocks, a prefill
    the states it gave."""

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
        needed = -(-end // BLOCK)
        if self.room is None or needed > self.room[0].shape[0]:
            capacity = needed + max(2, needed // 4)  # blocks; a resize every ~needed/4 blocks
            self.room = tuple(
                self.grown(states, old, capacity)
                for states, old in zip((key_states, value_states), self.room or (None, None))
            )
        for room, states in zip(self.room, (key_states, value_states)):
            for first in range(start - start % BLOCK, end, BLOCK):  # each block the new tokens reach
                lo, hi = max(start, first), min(end, first + BLOCK)
                room[first // BLOCK, :, :, lo - first : hi - first] = states[:, :, lo - start : hi - start]
        self.length = end
        if start == 0:
            return key_states, value_states  # a prefill attends over its own states
        if key_states.shape[-2] == 1:
            return tuple(Blocks(room[:needed], end) for room in self.room)
        return self.states()

    def grown(self, states: torch.Tensor, old: torch.Tensor | None, capacity: int) -> torch.Tensor:
        batch, heads, _, dim = states.shape
        # Zeros past the last token: block_attention masks them, and 0 x a masked weight stays 0.
        buffer = states.new_zeros((capacity, batch, heads, BLOCK, dim), dtype=self.store or states.dtype)
        if old is not None:
            buffer[: old.shape[0]] = old
        return buffer

    def get_seq_length(self) -> int:
        return getattr(self, "length", 0)

    def selected(self, index: torch.Tensor, start: int) -> tuple["BlockLayer", int]:
        """The rows `index` from the block holding token `start` on (whole blocks, no re-blocking): the layer,
        and the token it starts at."""
        drop = start // BLOCK
        layer = type(self)(self.store)
        layer.dtype, layer.device, layer.is_initialized = self.dtype, self.device, True
        layer.room = tuple(room[drop:, index] for room in self.room)
        layer.length = self.length - drop * BLOCK
        return layer, drop * BLOCK

    def states(self) -> tuple[torch.Tensor, torch.Tensor]:
        blocks = -(-self.length // BLOCK)
        return tuple(
            room[:blocks].permute(1, 2, 0, 3, 4).flatten(2, 3)[:, :, : self.length] for room in self.room
        )


def kv_cache(config, layers=(), dtype: torch.dtype | None = None, blocks: bool = False) -> DynamicCache:
    """A cache for `config`'s model whose full-attention layers are GrowingLayers kept in `dtype` (BlockLayers
    with `blocks`), filled with `layers`' (keys, values) when given (sliding-window layers stay
    transformers' own)."""
    cache = DynamicCache(config=config)
    kind = BlockLayer if blocks else GrowingLayer
    cache.layers = [kind(dtype) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    for layer, (keys, values) in zip(cache.layers, layers):
        layer.update(keys, values)
    return cache


def layer_states(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's (keys, values), (B, heads, T, head_dim) (the engine serves full-attention models only)."""
    return [layer.states() for layer in cache.layers]


def selected(cache: DynamicCache, index: torch.Tensor, start: int = 0) -> tuple[DynamicCache, int]:
    """A cache of the rows `index` from about token `start` on, and the token it starts at (<= `start`)."""
    layers = [layer.selected(index, start) for layer in cache.layers]
    new = DynamicCache(config=None)
    new.layers = [layer for layer, _ in layers]
    return new, layers[0][1]


def stacked(config, parts: list[tuple[DynamicCache, torch.Tensor]], dtype=None, blocks: bool = False):
    """One cache (kv_cache's kind) and attention mask of several (cache, mask (B, T)), their rows in order:
    the shorter histories left-padded, masked, to the longest."""
    if len(parts) == 1:
        return parts[0]
    width = max(mask.shape[1] for _, mask in parts)

    def pad(tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """Left-padded along dim 2 (keys, values) or 1 (a mask)."""
        missing = width - tensor.shape[dim]
        return torch.nn.functional.pad(tensor, (0, 0, missing, 0) if dim == 2 else (missing, 0))

    layers = [
        (torch.cat([pad(keys, 2) for keys, _ in states]), torch.cat([pad(values, 2) for _, values in states]))
        for states in zip(*(layer_states(cache) for cache, _ in parts))
    ]
    return kv_cache(config, layers, dtype, blocks), torch.cat([pad(mask, 1) for _, mask in parts])
