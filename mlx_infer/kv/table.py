"""The token table of one request (vToken, arXiv 2608.13263): logical token -> (block, slot) and a live bit.

Logical token i is the i-th token the request ever appended (prompt and generated); its original position
(the RoPE position its K was computed at) is i and stays i after eviction and repacking. Appends fill the
tail block's free slots and then new blocks (append-only, as vLLM); an evicted token leaves a hole that only
repacking (`apply_moves`) reclaims, and a block whose tokens are all evicted or trimmed returns to the pool.
This host copy is the master; the lookup copy the attention reads is `live_slots()` turned into an mx.array
by the caller (PagedSequence), rebuilt when `version` changes.
"""

from typing import Dict, List, Optional, Sequence

import numpy as np

from ..errors import MlxInferError
from .pool import BlockPool


class TokenTable:
    """Logical tokens of one request over blocks of `pool`.

    Args:
        pool: the BlockPool the blocks come from (allocation, release, block size).

    Attributes:
        run: the first flat slot when tokens 0 .. length - 1 are all live at the consecutive slots run ..
            run + length - 1 (a request that never evicted, over blocks with consecutive ids: attention then
            reads one range of the pool, no lookup), else None.
    """

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.block_size = pool.block_size
        self.length = 0  # logical tokens (== the next token's position)
        self._block = np.zeros(0, np.int64)  # [cap] block id of each logical token
        self._slot = np.zeros(0, np.int64)  # [cap] offset in its block
        self._live = np.zeros(0, bool)  # [cap]
        self.live_count: Dict[int, int] = {}  # block -> live tokens in it
        self.fill: Dict[int, int] = {}  # block -> slots handed out (append-only inside a block)
        self.blocks: List[int] = []  # the request's blocks in logical order (by their first token)
        self.tail = -1  # the block new tokens go to while it has room (-1: none)
        self.version = 0  # bumped whenever the live slots change
        self.run: Optional[int] = None  # see `run` in the class docstring

    # ---- views

    @property
    def n_live(self) -> int:
        return int(self._live[: self.length].sum())

    def live_tokens(self) -> np.ndarray:
        """Logical ids (== original positions) of the live tokens, ascending: int64 [S]."""
        return np.flatnonzero(self._live[: self.length])

    def positions(self) -> np.ndarray:
        """Original positions of the live tokens (RoPE positions), ascending: int64 [S]."""
        return self.live_tokens()

    def is_live(self, tokens: Sequence[int]) -> np.ndarray:
        return self._live[np.asarray(tokens, np.int64)]

    def slots(self, tokens: Sequence[int]) -> np.ndarray:
        """Flat slots (block * block_size + offset) of logical tokens: int64 [n]."""
        t = np.asarray(tokens, np.int64)
        return self._block[t] * self.block_size + self._slot[t]

    def location(self, token: int):
        """(block, offset) of a logical token."""
        return int(self._block[token]), int(self._slot[token])

    def live_slots(self) -> np.ndarray:
        """Flat slots of the live tokens in logical order: int64 [S] (what attention gathers)."""
        return self.slots(self.live_tokens())

    def tokens_in(self, block: int) -> np.ndarray:
        """Live logical tokens stored in `block`, ascending."""
        t = self.live_tokens()
        return t[self._block[t] == block]

    def waste(self) -> float:
        """1 - mean live fraction of the request's blocks (0.0 with no blocks): vToken's F."""
        if not self.blocks:
            return 0.0
        return 1.0 - sum(self.live_count[b] for b in self.blocks) / (len(self.blocks) * self.block_size)

    # ---- operations

    def append(self, n: int) -> np.ndarray:
        """Add n live tokens at positions length .. length + n - 1; returns their flat slots int64 [n].

        Raises:
            KVBudgetError: the pool cannot hold the new blocks (the table is then unchanged).
        """
        room = self.block_size - self.fill[self.tail] if self.tail >= 0 else 0
        new = self.pool.allocate(-(-(n - room) // self.block_size)) if n > room else []
        self._reserve(self.length + n)
        blocks, offsets = [], []
        for b in ([self.tail] if room > 0 else []) + new:
            if b not in self.fill:
                self.fill[b], self.live_count[b] = 0, 0
                self.blocks.append(b)
            k = min(self.block_size - self.fill[b], n - len(blocks))
            blocks += [b] * k
            offsets += range(self.fill[b], self.fill[b] + k)
            self.fill[b] += k
            self.live_count[b] += k
            self.tail = b
        s, e = self.length, self.length + n
        self._block[s:e], self._slot[s:e], self._live[s:e] = blocks, offsets, True
        first = blocks[0] * self.block_size + offsets[0] if n else 0
        follows = self.run is not None and first == self.run + s
        if (follows or s == 0) and n and _consecutive(blocks, offsets, self.block_size):
            self.run = first if s == 0 else self.run
        elif n:
            self.run = None
        self.length = e
        self.version += 1
        return self._block[s:e] * self.block_size + self._slot[s:e]

    def evict(self, tokens: Sequence[int]) -> List[int]:
        """Mark logical tokens evicted (their slots become holes); returns the blocks this emptied, which
        went back to the pool. Evicting a dead token is a no-op.

        Raises:
            MlxInferError: a token outside 0 .. length - 1.
        """
        t = np.unique(np.asarray(tokens, np.int64))
        if t.size and (t[0] < 0 or t[-1] >= self.length):
            raise MlxInferError(f"cannot evict tokens outside 0..{self.length - 1} (got {t[0]}..{t[-1]})")
        t = t[self._live[t]]
        self._live[t] = False
        if t.size:
            self.run = None
        freed = []
        for b, k in zip(*np.unique(self._block[t], return_counts=True)):
            b = int(b)
            self.live_count[b] -= int(k)
            if self.live_count[b] == 0:
                self._drop(b)
                freed.append(b)
        if t.size:
            self.version += 1
        return freed

    def adopt(self, blocks: Sequence[int]) -> None:
        """Start this (empty) table with full blocks another request wrote (a cached prefix): their
        len(blocks) * block_size tokens become its first logical tokens, and it takes one reference to each
        (so they stay while it holds them; repacking never moves a shared block).

        Raises:
            MlxInferError: the table is not empty, or a block is free.
        """
        if self.length or self.blocks:
            raise MlxInferError("only an empty token table can start from a cached prefix")
        for b in blocks:
            self.pool.incref(b)
        n = len(blocks) * self.block_size
        self._reserve(n)
        self._block[:n] = np.repeat(np.asarray(blocks, np.int64), self.block_size)
        self._slot[:n] = np.tile(np.arange(self.block_size), len(blocks))
        self._live[:n] = True
        for b in blocks:
            self.fill[b], self.live_count[b] = self.block_size, self.block_size
        self.blocks = list(blocks)
        self.length, self.tail = n, -1
        self.run = blocks[0] * self.block_size if n and _consecutive(blocks, [0] * len(blocks), 1) else None
        self.version += 1

    def truncate(self, length: int) -> int:
        """Forget logical tokens length .. self.length - 1 (a rollback): their slots are freed, a block
        left with no live token returns to the pool, and a block's fill is rolled back when the trimmed
        tokens were its last slots (so a re-append reuses them). Returns how many tokens were removed."""
        length = max(0, min(length, self.length))
        t = np.arange(length, self.length)
        for i in t[::-1]:  # newest first, so the tail's fill rolls back slot by slot
            b, s = int(self._block[i]), int(self._slot[i])
            if b < 0:  # a dead token whose block is gone
                continue
            if self._live[i]:
                self.live_count[b] -= 1
            if b in self.fill and self.fill[b] == s + 1:
                self.fill[b] = s
            if b in self.live_count and self.live_count[b] == 0:
                self._drop(b)
        self._live[length : self.length] = False
        n, self.length = self.length - length, length
        if not length:
            self.run = None
        elif self.run is None and n:  # a rollback past a token that broke the run may restore it
            self.run = self._find_run()
        if self.tail < 0 and self.length:
            self._retail()
        if n:
            self.version += 1
        return n

    def apply_moves(self, tokens: np.ndarray, dst_slots: np.ndarray, sources: Sequence[int],
                    destinations: Sequence[int]) -> None:
        """Commit a repack plan after its copy: live `tokens` now sit at flat `dst_slots`, the `sources`
        blocks not among `destinations` go back to the pool, the block list is rebuilt in logical order.
        All of it happens here, between two forwards (atomic for the attention)."""
        held = self._block[: self.length]
        held[~self._live[: self.length] & np.isin(held, list(sources))] = -1  # dead tokens left behind
        self._block[tokens] = dst_slots // self.block_size
        self._slot[tokens] = dst_slots % self.block_size
        dst = set(destinations)
        for b in sources:
            if b not in dst:
                self._drop(b)
        for b in destinations:
            stored = int((self._block[tokens] == b).sum())
            self.fill[b], self.live_count[b] = stored, stored
        live = self.live_tokens()
        first: Dict[int, int] = {}
        for b, t in zip(self._block[live].tolist(), live.tolist()):
            first.setdefault(b, t)
        self.blocks = sorted(first, key=first.get)
        self._retail()
        self.run = None  # (repacking follows eviction: the live tokens' positions have holes)
        self.version += 1

    def release(self) -> None:
        """Give every block back to the pool (the request ended)."""
        for b in list(self.blocks):
            self._drop(b)
        self.length, self.run = 0, None
        self.version += 1

    def check(self) -> None:
        """Assert the invariants: unique mapping of live tokens, live counts, block list = held blocks."""
        live = self.live_tokens()
        slots = self.slots(live)
        assert len(np.unique(slots)) == len(slots), "two live tokens share a slot"
        assert set(self._block[live].tolist()) <= set(self.blocks), "a live token outside the block list"
        for b in self.blocks:
            assert self.live_count[b] == int((self._block[live] == b).sum()), f"live count of block {b}"
            assert self.pool.refcount[b] >= 1, f"block {b} held but free in the pool"
        assert len(set(self.blocks)) == len(self.blocks)
        assert self.run == self._find_run(), f"run {self.run}, the table's {self._find_run()}"

    # ---- internals

    def _drop(self, b: int) -> None:
        held = self._block[: self.length]
        held[held == b] = -1  # its dead tokens point nowhere (the id may come back for other tokens)
        self.blocks.remove(b)
        del self.live_count[b], self.fill[b]
        self.pool.release(b)
        if b == self.tail:
            self.tail = -1

    def _find_run(self) -> Optional[int]:
        """`run` computed from the table (None when a token is dead or the slots do not follow one another)."""
        slots = self.slots(np.arange(self.length))
        if self.length and self._live[: self.length].all() and slots[-1] - slots[0] == self.length - 1 and (np.diff(slots) == 1).all():
            return int(slots[0])
        return None

    def _retail(self) -> None:
        """The tail becomes the block of the newest live token, if it still has room."""
        live = self.live_tokens()
        self.tail = -1
        if live.size:
            b = int(self._block[live[-1]])
            if self.fill[b] < self.block_size:
                self.tail = b

    def _reserve(self, n: int) -> None:
        if n > self._block.size:
            cap = max(n, 2 * self._block.size, 64)
            self._block, self._slot, self._live = (
                np.concatenate([a, np.zeros(cap - a.size, a.dtype)]) for a in (self._block, self._slot, self._live))


def _consecutive(blocks: Sequence[int], offsets: Sequence[int], block_size: int) -> bool:
    """Whether the flat slots block * block_size + offset of these tokens follow one another."""
    first = blocks[0] * block_size + offsets[0]
    return all(b * block_size + o == first + i for i, (b, o) in enumerate(zip(blocks, offsets)))
