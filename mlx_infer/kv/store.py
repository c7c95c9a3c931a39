"""KVStore: the KV cache of one engine as its requests use it, one interface for the dense and the paged cache.

A request starts from the longest prefix the store still holds of its prompt, reserves room for what it will
add, is tracked while it decodes (eviction and the block record of the paged cache), and at its end keeps its
KV for the next requests or releases it:

    store = make_store("paged", model, budget_bytes=None, block_size=16, quant=None)
    cache, cached = store.start(prompt_ids)                        # per-layer caches holding prompt_ids[:cached]
    store.reserve(cache, len(prompt_ids), max_tokens, evict=None)  # KVBudgetError before prefill
    with store.track(cache, evict, repack) as tracked:
        for token in tokens:
            tracked.step()                                         # after each forward
    store.keep(cache, prompt_ids + generated)                      # or store.release(cache)

Two implementations: `DenseStore` (mlx-lm's contiguous caches, or quantized ones, and the last request's cache
kept for the next one) here, and `PagedKV` (kv/session.py: a block pool, its prefix cache, budget and
eviction).
"""

from dataclasses import dataclass
from typing import List, Optional, Protocol, Sequence, Tuple, Union

import mlx.nn as nn
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from ..errors import MlxInferError
from .defaults import BLOCK_SIZE, KIVI_RESIDUAL, KV_GROUP_SIZE
from .options import EvictSpec, check_block_size, check_kv_cache, parse_budget
from .pool import BlockPool
from .quant_cache import exact_prefix, make_quant_cache
from .quant_options import KVQuant, check_head_dims, check_paged_quant, fit_group_size, kv_quant
from .session import PagedKV, probe_kv_layout, release


class Tracked(Protocol):
    """One request while it decodes (KVRequest on the paged cache, NotTracked on the dense one)."""

    def __enter__(self) -> "Tracked": ...

    def __exit__(self, *exc) -> None: ...

    def step(self) -> None:
        """After each forward of the decode loop (each token delivered)."""

    def stats(self) -> Optional[dict]:
        """GenerationStats.kv (None: the dense cache reports none)."""


class KVStore(Protocol):
    """The KV cache of one engine (see the module docstring).

    Attributes:
        kind: "dense" or "paged".
        evicts: whether its requests may evict tokens (EvictSpec).
        pool: its BlockPool (None for the dense cache).
    """

    kind: str
    evicts: bool
    pool: Optional[BlockPool]

    def new_cache(self) -> list:
        """Fresh per-layer caches (mlx-lm's prompt_cache protocol)."""

    def start(self, prompt_ids: Sequence[int], share: bool = True) -> Tuple[list, int]:
        """(caches, cached): per-layer caches holding the longest prefix of the prompt the store holds (never
        its last token; `share` False: none), and that prefix's length."""

    def reserve(self, cache: list, prompt_tokens: int, new_tokens: int, evict: Optional[EvictSpec] = None,
                repack: bool = True) -> None:
        """Make room for a request before its prefill; KVBudgetError when it can never fit."""

    def track(self, cache: list, evict: Optional[EvictSpec], repack: bool = True) -> Tracked:
        """The request's tracker, a context manager open while it decodes."""

    def keep(self, cache: list, tokens: Sequence[int]) -> None:
        """A request ended cleanly: keep its KV for the next ones (`tokens`: the prompt and every token
        generated), releasing what is not kept."""

    def release(self, cache: Optional[list]) -> None:
        """A request ended otherwise: give its KV back."""

    def reset(self) -> int:
        """Forget every kept prefix and shrink to the initial size; returns the bytes released."""

    def batch_kv(self) -> PagedKV:
        """The paged cache batched requests run on (the paged store itself, or one of the dense store's)."""


class NotTracked:
    """A dense cache's request: nothing to evict, no block record."""

    def __enter__(self) -> "NotTracked":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def step(self) -> None:
        pass

    def stats(self) -> Optional[dict]:
        return None


@dataclass
class KeptCache:
    """The KV cache of the previous request, kept for the next one.

    Attributes:
        cache: the per-layer mlx-lm caches.
        tokens: the token ids whose KV they hold, in order (len == the caches' offset).
    """

    cache: list
    tokens: List[int]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two token sequences."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class DenseStore:
    """mlx-lm's contiguous per-layer caches (quantized ones, kv.quant_cache, when `quant`), with the last
    request's cache kept for the next: a request starts from it trimmed to their common prefix (a chat's next
    turn prefills only the new message). Batched requests run on a paged pool of its own (made on first use,
    no budget, quantized alike).

    Args:
        model: the engine's mlx-lm model.
        quant: quantized KV (any scheme; None: float).
        layout: the model's (n_kv_heads, k_dim, v_dim, dtype) when probed already (kv.session.probe_kv_layout).
    """

    kind = "dense"
    evicts = False
    pool: Optional[BlockPool] = None

    def __init__(self, model: nn.Module, quant: Optional[KVQuant] = None, layout: Optional[tuple] = None):
        self.model, self.quant, self.layout = model, quant, layout
        self._kept: Optional[KeptCache] = None
        self._batch: Optional[PagedKV] = None

    def new_cache(self) -> list:
        return make_prompt_cache(self.model) if self.quant is None else make_quant_cache(self.model, self.quant)

    def start(self, prompt_ids: Sequence[int], share: bool = True) -> Tuple[list, int]:
        """The kept cache trimmed to its common prefix with the prompt (at most all but the prompt's last
        token, and where a fresh prefill would hold the same: kv.quant_cache.exact_prefix), or fresh caches
        and 0 when nothing is shared or the kept one cannot trim. The kept cache is taken either way."""
        kept, self._kept = self._kept, None
        if kept is not None:
            start = min(common_prefix(kept.tokens, prompt_ids), len(prompt_ids) - 1)
            start = exact_prefix(kept.cache, start, len(prompt_ids) - 1)
            extra = len(kept.tokens) - start
            if start > 0 and (extra == 0 or can_trim_prompt_cache(kept.cache)):
                trim_prompt_cache(kept.cache, extra)
                return kept.cache, start
        return self.new_cache(), 0

    def reserve(self, cache: list, prompt_tokens: int, new_tokens: int, evict: Optional[EvictSpec] = None,
                repack: bool = True) -> None:
        """Nothing to reserve: a dense cache grows as it goes."""

    def track(self, cache: list, evict: Optional[EvictSpec], repack: bool = True) -> NotTracked:
        return NotTracked()

    def keep(self, cache: list, tokens: Sequence[int]) -> None:
        """Keep the cache whole when it can be trimmed (else the next request starts fresh)."""
        offset = cache[0].offset if can_trim_prompt_cache(cache) else -1
        self._kept = KeptCache(cache, list(tokens)[:offset]) if 0 < offset <= len(tokens) else None

    def release(self, cache: Optional[list]) -> None:
        """Nothing to give back: the cache is freed with its last reference."""

    def reset(self) -> int:
        """Drop the kept cache, and the batched pool's prefix cache (shrinking that pool)."""
        self._kept = None
        return self._batch.reset() if self._batch is not None else 0

    def batch_kv(self) -> PagedKV:
        """The private paged pool of batched requests (no budget; quantized blocks when `quant`); drops the
        kept cache.

        Raises:
            MlxInferError: a quantization the blocks cannot hold (KIVI or a float prefix).
        """
        if self.quant is not None:
            try:
                check_paged_quant(self.quant)
            except MlxInferError as exc:
                raise MlxInferError(f"batched decoding runs on the paged KV pool: {exc}") from None
        if self._batch is None:
            self._batch = PagedKV(self.model, None, BLOCK_SIZE, self.quant, self.layout)
        self._kept = None  # batched requests may need its memory
        return self._batch


def make_store(kind: str, model: nn.Module, budget_bytes: Optional[int], block_size: int,
               quant: Optional[KVQuant], layout: Optional[tuple]) -> KVStore:
    """The store of a checked configuration (kv.options.check_kv_cache and friends): DenseStore or PagedKV.

    Raises:
        KVBudgetError: a paged budget that cannot hold one block.
    """
    if kind == "dense":
        return DenseStore(model, quant, layout)
    kv = PagedKV(model, budget_bytes, block_size, quant, layout)
    if budget_bytes is not None:
        kv.check_budget()  # a budget under one block fails where it is given
    return kv


def configure_store(model: nn.Module, layout: Optional[tuple], kv_cache: str = "dense",
                    kv_budget: Union[None, int, float, str] = None, block_size: int = BLOCK_SIZE,
                    kv_bits: Union[None, int, str] = None, kv_scheme: str = "affine", kv_quant_start: int = 0,
                    kv_group_size: Optional[int] = None, kv_residual: int = KIVI_RESIDUAL,
                    kv_rotate: Optional[bool] = None) -> Tuple[KVStore, Optional[KVQuant], Optional[tuple]]:
    """The KV store of the user's options (Engine.configure_kv's, which documents them), checked.

    Args:
        model: the engine's mlx-lm model.
        layout: the model's (n_kv_heads, k_dim, v_dim, dtype) when probed already, else None (probed here when
            a quantization needs the head dims).

    Returns:
        (store, quant, layout): the store, its quantized-KV setting (None: float), and the layout (probed or
        as given).

    Raises:
        MlxInferError: an unknown kv_cache, a kv_budget that does not parse, a block_size < 1, a kv_budget /
            block_size other than the default with the dense cache, a bad quantized-KV option
            (quant_options.kv_quant), with the paged cache a quantization its blocks cannot hold
            (quant_options.check_paged_quant), head dims that kv_group_size does not divide
            (quant_options.check_head_dims; None: KV_GROUP_SIZE, or the largest group size that divides them,
            quant_options.fit_group_size); KVBudgetError: a kv_budget that cannot hold one block.
    """
    kind, budget, size = check_kv_cache(kv_cache), parse_budget(kv_budget), check_block_size(block_size)
    quant = kv_quant(kv_bits, kv_scheme, kv_quant_start, KV_GROUP_SIZE if kv_group_size is None else kv_group_size,
                     kv_residual, kv_rotate)
    if quant is not None:  # the model's head dims, known now: a group size that fits, or the error here
        if layout is None:
            layout = probe_kv_layout(model)
        dims = layout[1:3]
        quant = fit_group_size(quant, *dims) if kv_group_size is None else quant
        check_head_dims(quant, *dims)
    if kind == "dense" and (budget is not None or size != BLOCK_SIZE):
        raise MlxInferError("kv_budget and block_size apply to the paged KV cache: add kv_cache='paged'")
    if kind == "paged" and quant is not None:
        check_paged_quant(quant)  # KIVI or a float prefix: a one-line error
    return make_store(kind, model, budget, size, quant, layout), quant, layout
