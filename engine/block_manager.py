"""Paged KV blocks with reference counts and a hash-addressed prefix cache (vLLM / nano-vllm style).

A full block is addressed by a hash chained over every token before it (and the sequence's cache
salt, so different LoRA adapters never share KV). Freed blocks keep their hash and sit in an LRU
free list: a later request with the same prefix revives them; allocation reuses the oldest first.

Where a row's KV follows its role (``kv_follows_row_role``: under int8-prompt a prompt's leading rows
take int8 activations, and a prompt's last row and its answer's rows exact ones), a block that holds any
row past its sequence's ``kv_only_prefix`` is addressed by that role too: how many of its rows lie within
the prefix. So an answer's blocks serve only a sequence that computes those positions the same way (its own
recompute after a preemption, a sibling of the same prompt), never a later prompt that holds the answer's
tokens as prompt rows: a cache hit gives the bits a cold start computes, whoever asked before. The engine
keys blocks so under --batch-invariant too: an answer's rows run through the decode attention kernel,
which rounds otherwise than the prefill a prompt holding them would take.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from engine.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 kv_follows_row_role: bool = False) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.kv_follows_row_role = kv_follows_row_role
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        self.free_blocks: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.num_prefix_hits = 0
        self.num_prefix_queries = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_blocks)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_blocks)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _block_hash(self, seq: Sequence, i: int, prev: int | None) -> int:
        """Block i's address: chained over the tokens before it, and its rows' roles where they matter."""
        bs = self.block_size
        key = (prev if prev is not None else seq.cache_salt, tuple(seq.token_ids[i * bs:(i + 1) * bs]))
        if self.kv_follows_row_role:
            kv_only_rows = seq.kv_only_prefix - i * bs
            if kv_only_rows < bs:  # some row past the prefix: the block is its role's
                return hash((*key, max(0, kv_only_rows)))
        return hash(key)

    def _cached_blocks(self, seq: Sequence) -> Iterator[int]:
        """The cached blocks of the sequence's longest seen prefix, in order."""
        if not self.enable_prefix_caching:
            return
        # At least one token must be computed to produce logits, so the last token is never cached.
        num_full = (len(seq.token_ids) - 1) // self.block_size
        prev: int | None = None
        for i in range(num_full):
            h = self._block_hash(seq, i, prev)
            block = self.hash_to_block.get(h)
            if block is None:
                return
            yield block
            prev = h

    def cached_prefix_tokens(self, seq: Sequence) -> int:
        """How many of the sequence's tokens ``allocate_cached_prefix`` would find cached now; nothing taken."""
        return sum(1 for _ in self._cached_blocks(seq)) * self.block_size

    def allocate_cached_prefix(self, seq: Sequence) -> None:
        """Give a sequence with no blocks the cached blocks of its longest seen prefix."""
        assert not seq.block_table
        self.num_prefix_queries += 1
        for block in self._cached_blocks(seq):
            if self.ref_counts[block] == 0:
                del self.free_blocks[block]
            self.ref_counts[block] += 1
            seq.block_table.append(block)
        seq.num_computed_tokens = seq.num_cached_tokens = len(seq.block_table) * self.block_size
        if seq.block_table:
            self.num_prefix_hits += 1

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return need <= len(self.free_blocks)

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> None:
        """Grow the block table to cover the next ``num_new_tokens`` tokens (check can_append first)."""
        need = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(need):
            block, _ = self.free_blocks.popitem(last=False)
            old = self.block_hash[block]
            if old is not None and self.hash_to_block.get(old) == block:
                del self.hash_to_block[old]
            self.block_hash[block] = None
            self.ref_counts[block] = 1
            seq.block_table.append(block)

    def commit_full_blocks(self, seq: Sequence, old_num_computed: int) -> None:
        """Register the blocks that became full of computed tokens so later requests can reuse them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        first = old_num_computed // bs
        last = seq.num_computed_tokens // bs
        for i in range(first, last):
            block = seq.block_table[i]
            if self.block_hash[block] is not None:
                continue
            prev = self.block_hash[seq.block_table[i - 1]] if i > 0 else None
            h = self._block_hash(seq, i, prev)
            self.block_hash[block] = h
            self.hash_to_block.setdefault(h, block)

    def free(self, seq: Sequence) -> None:
        # Release in reverse so a sequence's tail blocks are evicted before its (more shareable) head.
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_blocks[block] = None
        seq.block_table = []
