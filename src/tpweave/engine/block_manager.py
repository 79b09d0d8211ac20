"""Paged KV-cache blocks: a free list and reference counts."""

from __future__ import annotations

from collections import deque

from tpweave.engine.sequence import Sequence


def slot_of(block_table: list[int], position: int, block_size: int) -> int:
    """Flat index of the KV slot of token `position` in the page pool (slot = block * size + offset)."""
    return block_table[position // block_size] * block_size + position % block_size


class BlockManager:
    """Hands out the `num_blocks` KV-cache blocks of `block_size` token slots each to sequences, first freed
    first reused; a block returns to the free list when its reference count drops to 0."""

    def __init__(self, *, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))
        self.ref_counts = [0] * num_blocks

    @property
    def num_free(self) -> int:
        """Blocks on the free list."""
        return len(self.free_blocks)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens (rounded up)."""
        return -(-num_tokens // self.block_size)

    def extra_blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks to add so that the first `num_tokens` tokens of `seq` have KV slots."""
        return max(0, self.blocks_for(num_tokens) - len(seq.block_table))

    def can_grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether enough blocks are free for the first `num_tokens` tokens of `seq` to have KV slots."""
        return self.extra_blocks_needed(seq, num_tokens) <= self.num_free

    def grow(self, seq: Sequence, num_tokens: int) -> None:
        """Append to seq.block_table the free blocks its first `num_tokens` tokens need; ValueError (nothing
        taken) if there are not enough."""
        need = self.extra_blocks_needed(seq, num_tokens)
        if need > self.num_free:
            raise ValueError(f"seq {seq.seq_id} needs {need} blocks, {self.num_free} free: check can_grow first")
        for _ in range(need):
            block = self.free_blocks.popleft()
            assert self.ref_counts[block] == 0
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def free(self, seq: Sequence) -> None:
        """Drop seq's reference to each of its blocks and empty its block table; blocks no one holds become free."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0
            if self.ref_counts[block] == 0:
                self.free_blocks.append(block)
        seq.block_table = []

    def slot(self, seq: Sequence, position: int) -> int:
        """Flat KV slot of token `position` of `seq` in the page pool (see slot_of)."""
        return slot_of(seq.block_table, position, self.block_size)
