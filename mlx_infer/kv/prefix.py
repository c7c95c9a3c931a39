"""PrefixCache: full KV blocks reused across requests that share a prefix (a system prompt, a chat's history),
as vLLM's automatic prefix caching (arXiv 2309.06180, section 4.4): a block is keyed by a hash of its parent
block's key and its own tokens, so one key names one whole prefix; blocks are reference-counted in the pool
(the cache holds one reference, each request using it one more), and blocks only the cache holds sit in an
LRU, freed when the pool needs room (`make_room`) or the cache is over its own limit.

Only full blocks are shared (a block is immutable once its block_size slots are written: appends go to new
blocks), and a request always prefills at least its last prompt token itself (its first logits). Shared
blocks are never moved by repacking (BlockPool.shared).
"""

import hashlib
from collections import OrderedDict
from typing import Dict, List, Optional, Sequence

import numpy as np

from .pool import BlockPool

#: The key of the empty prefix (the parent of a sequence's first block).
ROOT = b""


def block_keys(tokens: Sequence[int], block_size: int) -> List[bytes]:
    """The chain keys of the full blocks of `tokens`: key i = blake2b(key i-1 + the block's token ids)."""
    keys, parent = [], ROOT
    ids = np.asarray(tokens, np.int64)
    for i in range(len(ids) // block_size):
        parent = hashlib.blake2b(parent + ids[i * block_size:(i + 1) * block_size].tobytes(), digest_size=16).digest()
        keys.append(parent)
    return keys


class PrefixCache:
    """Cached full blocks of one BlockPool.

    Args:
        pool: the pool whose blocks are cached.
        max_blocks: most blocks held only by the cache (the LRU); None: bounded only by the pool's budget
            (make_room frees them as needed).
    """

    def __init__(self, pool: BlockPool, max_blocks: Optional[int] = None):
        self.pool, self.max_blocks = pool, max_blocks
        self._by_key: Dict[bytes, int] = {}
        self._key_of: Dict[int, bytes] = {}
        self._idle: "OrderedDict[int, None]" = OrderedDict()  # blocks only the cache holds, oldest first
        self.hits = 0  # tokens served from the cache, over all lookups

    def __len__(self) -> int:
        return len(self._by_key)

    @property
    def idle_blocks(self) -> int:
        """Blocks only the cache holds (freeable)."""
        self._refresh()
        return len(self._idle)

    def lookup(self, tokens: Sequence[int]) -> List[int]:
        """The cached blocks of the longest cached prefix of tokens[:-1] (whole blocks), in order; the caller
        adopts them (PagedSequence.adopt) before anything else allocates."""
        found = []
        for key in block_keys(tokens[:-1], self.pool.block_size):
            b = self._by_key.get(key)
            if b is None:
                break
            found.append(b)
            self._idle.pop(b, None)
        self.hits += len(found) * self.pool.block_size
        return found

    def insert(self, tokens: Sequence[int], blocks: Sequence[int]) -> int:
        """Register a request's full blocks: blocks[i] holds tokens[i*bs:(i+1)*bs] (its table's first blocks,
        no hole). A key already cached keeps its block. Returns how many blocks were added."""
        added = 0
        for key, b in zip(block_keys(tokens, self.pool.block_size), blocks):
            if key in self._by_key or b in self._key_of:
                continue
            self.pool.incref(b)
            self._by_key[key], self._key_of[b] = b, key
            added += 1
        self._refresh()
        return added

    def make_room(self, blocks: int) -> int:
        """Free idle cached blocks, least recently used first, until `blocks` are free in the pool (or none is
        idle). Returns how many were freed."""
        self._refresh()
        freed = 0
        while self._idle and (self.pool.free_blocks is not None and self.pool.free_blocks < blocks):
            self._drop(next(iter(self._idle)))
            freed += 1
        return freed

    def clear(self) -> None:
        """Forget every cached block (those no request holds go back to the pool)."""
        for b in list(self._key_of):
            self._drop(b)

    def _refresh(self) -> None:
        """Idle = held by the cache alone (refcount 1); new idle blocks go to the LRU's young end, and the
        oldest go back to the pool beyond max_blocks."""
        for b in self._key_of:
            if self.pool.refcount[b] == 1:
                if b not in self._idle:
                    self._idle[b] = None
            else:
                self._idle.pop(b, None)
        self._trim()

    def _trim(self) -> None:
        while self.max_blocks is not None and len(self._idle) > self.max_blocks:
            self._drop(next(iter(self._idle)))

    def _drop(self, b: int) -> None:
        key = self._key_of.pop(b)
        del self._by_key[key]
        self._idle.pop(b, None)
        self.pool.release(b)
