"""QuantKVCache: one layer's quantized KV cache, satisfying mlx-lm's duck-typed cache protocol (`offset`,
`update_and_fetch`, `make_mask`, `state`, `is_trimmable`, `trim`, `nbytes`), so unmodified mlx-lm models
run on it.

Tokens [0, n_quantized) are packed (MLX's affine quantization, float16 scales and biases; the affine scheme
stores 4-bit rows Hadamard-rotated by default: quant.rotate_k / rotate_v, kv/rotation.py); the most recent
ones stay in a float mlx-lm KVCache: before the quantization threshold all of them, with KIVI its
residual window (arXiv 2402.02750), with the affine scheme none. `update_and_fetch` returns float K/V
as any cache does (the packed part dequantized lazily, so code that touches keys keeps working; mlx-vlm
#2060); attention reads the packed K/V directly instead when the attention hook (kv/attention_hook.py)
finds the fused kernel applies, and then the float copies are never computed (MLX is lazy).
"""

from typing import List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, RotatingKVCache, create_attention_mask, make_prompt_cache

from ..errors import MlxInferError
from ..kernels.attention import channel_keys_attention, merge_attention, quant_attention
from .cache import PagedKVCache
from .defaults import KV_SCALE_DTYPE as SCALE_DTYPE
from .defaults import QUANT_STEP
from .quant_options import KVQuant, check_head_dims
from .rotation import keys_basis, values_basis


def _grow(a: Optional[mx.array], shape: Tuple[int, ...], axis: int, used: int, need: int,
          dtype: mx.Dtype, step: int = QUANT_STEP) -> mx.array:
    """`a` with room for `need` entries along `axis` (grown `step` at a time, the first `used` kept)."""
    if a is not None and a.shape[axis] >= need:
        return a
    size = -(-need // step) * step
    fresh = mx.zeros(shape[:axis] + (size,) + shape[axis + 1:], dtype)
    if a is None or used == 0:
        return fresh
    kept = a[(slice(None),) * axis + (slice(0, used),)]
    return mx.concatenate([kept, fresh[(slice(None),) * axis + (slice(used, size),)]], axis=axis)


class PackedRows:
    """Per-token quantized rows of one head layout: w [H, C, dim * bits / 32] uint32, scales / biases
    [H, C, dim / group_size] float16, the first `n` rows valid (C grows in QUANT_STEP steps)."""

    def __init__(self, bits: int, group_size: int):
        self.bits, self.group_size, self.n = bits, group_size, 0
        self.w = self.scales = self.biases = None

    def append(self, x: mx.array) -> None:
        """Quantize x [H, L, dim] and append it."""
        H, L, dim = x.shape
        w, s, b = mx.quantize(x.astype(SCALE_DTYPE), group_size=self.group_size, bits=self.bits)
        need = self.n + L
        self.w = _grow(self.w, (H, 0, w.shape[-1]), 1, self.n, need, mx.uint32)
        self.scales = _grow(self.scales, (H, 0, s.shape[-1]), 1, self.n, need, SCALE_DTYPE)
        self.biases = _grow(self.biases, (H, 0, s.shape[-1]), 1, self.n, need, SCALE_DTYPE)
        self.w[:, self.n:need] = w
        self.scales[:, self.n:need] = s
        self.biases[:, self.n:need] = b
        self.n = need

    def packed(self) -> Tuple[mx.array, mx.array, mx.array]:
        """(w, scales, biases) with capacity rows (the first n valid)."""
        return self.w, self.scales, self.biases

    def dequantize(self, start: int = 0, dtype: mx.Dtype = mx.float32) -> mx.array:
        """Rows [start, n) as float [H, n - start, dim]."""
        rows = slice(start, self.n)
        return mx.dequantize(self.w[:, rows], self.scales[:, rows].astype(dtype), self.biases[:, rows].astype(dtype),
                             group_size=self.group_size, bits=self.bits)

    def trim(self, n: int) -> None:
        self.n -= n

    def arrays(self) -> list:
        return [a for a in (self.w, self.scales, self.biases) if a is not None]


class ChannelChunks:
    """KIVI's keys: chunks of `group_size` tokens quantized per channel (groups along tokens): w [H, dim,
    chunks, group_size * bits / 32] uint32, scales / biases [H, dim, chunks, 1] float16, `n` chunks valid."""

    def __init__(self, bits: int, group_size: int):
        self.bits, self.group_size, self.n = bits, group_size, 0
        self.w = self.scales = self.biases = None

    def append(self, x: mx.array) -> None:
        """Quantize x [H, k * group_size, dim] (k whole chunks) per channel and append its chunks."""
        H, L, dim = x.shape
        k = L // self.group_size
        xt = x.reshape(H, k, self.group_size, dim).transpose(0, 3, 1, 2)  # [H, dim, k, G]
        w, s, b = mx.quantize(xt.astype(SCALE_DTYPE), group_size=self.group_size, bits=self.bits)
        need, step = self.n + k, max(1, QUANT_STEP // self.group_size)  # chunks
        self.w = _grow(self.w, (H, dim, 0, w.shape[-1]), 2, self.n, need, mx.uint32, step)
        self.scales = _grow(self.scales, (H, dim, 0, 1), 2, self.n, need, SCALE_DTYPE, step)
        self.biases = _grow(self.biases, (H, dim, 0, 1), 2, self.n, need, SCALE_DTYPE, step)
        self.w[:, :, self.n:need] = w
        self.scales[:, :, self.n:need] = s
        self.biases[:, :, self.n:need] = b
        self.n = need

    def packed(self) -> Tuple[mx.array, mx.array, mx.array]:
        """(w [H, dim, C * bits / 32], scales, biases [H, dim, C / group_size]) over the capacity C tokens
        (the first n * group_size valid): each channel's codes along tokens, as the kernel reads them."""
        H, dim = self.w.shape[:2]
        return self.w.reshape(H, dim, -1), self.scales.reshape(H, dim, -1), self.biases.reshape(H, dim, -1)

    def dequantize(self, start: int = 0, dtype: mx.Dtype = mx.float32) -> mx.array:
        """Chunks [start, n) as float [H, (n - start) * group_size, dim]."""
        c = slice(start, self.n)
        x = mx.dequantize(self.w[:, :, c], self.scales[:, :, c].astype(dtype), self.biases[:, :, c].astype(dtype),
                          group_size=self.group_size, bits=self.bits)  # [H, dim, k, G]
        H, dim = x.shape[:2]
        return x.reshape(H, dim, -1).transpose(0, 2, 1)

    def trim(self, n: int) -> None:
        self.n -= n

    def arrays(self) -> list:
        return [a for a in (self.w, self.scales, self.biases) if a is not None]


class QuantKVCache:
    """One layer's quantized KV cache (batch 1).

    Args:
        quant: KVQuant (bits of K and V, scheme, group size, threshold, KIVI residual).

    Raises (from update_and_fetch):
        MlxInferError: a batch other than 1, or a head dim the kernels cannot take (not a multiple of 32
            and of the group size).
    """

    def __init__(self, quant: KVQuant):
        self.quant = quant
        self.offset = 0
        self.recent = KVCache()  # float K/V of tokens [n_quantized, offset)
        kivi = quant.scheme == "kivi"
        self.k_store = (ChannelChunks if kivi else PackedRows)(quant.k_bits, quant.group_size)
        self.v_store = PackedRows(quant.v_bits, quant.group_size)
        self.dtype: Optional[mx.Dtype] = None  # the model's K/V dtype
        self.layout: Optional[Tuple[int, int, int]] = None  # (n_kv, D, Dv), from the first update

    @property
    def n_quantized(self) -> int:
        """Tokens held packed (the first ones)."""
        return self.offset - self.recent.offset

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    def is_trimmable(self) -> bool:
        return True

    def _check(self, keys: mx.array, values: mx.array) -> None:
        if keys.shape[0] != 1:
            raise MlxInferError(f"a quantized KV cache holds one request (batch 1), got a batch of {keys.shape[0]}")
        check_head_dims(self.quant, keys.shape[3], values.shape[3])
        self.dtype = keys.dtype
        self.layout = (keys.shape[1], keys.shape[3], values.shape[3])

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> Tuple[mx.array, mx.array]:
        """Append keys [1, n_kv, L, D] and values [1, n_kv, L, Dv] (RoPE applied) and return every token's
        K [1, n_kv, S, D] and V [1, n_kv, S, Dv] in the model's dtype (packed tokens dequantized)."""
        if self.dtype is None:
            self._check(keys, values)
        L = keys.shape[2]
        quantizing = self.offset + L > self.quant.start
        self.offset += L
        if quantizing and self.recent.offset == 0 and self.quant.scheme == "affine":
            self._pack(keys[0], values[0])  # [n_kv, L, D]
        else:
            self.recent.update_and_fetch(keys, values)
            if quantizing:
                self._flush()
        return self._fetch()

    def _flush(self) -> None:
        """Move the oldest float tokens into the packed stores, keeping the scheme's residual window
        (KIVI: whole chunks of group_size tokens only)."""
        r = self.recent.offset
        n = r - self.quant.residual
        if self.quant.scheme == "kivi":
            n = max(0, n) // self.quant.group_size * self.quant.group_size
        if n <= 0:
            return
        keys, values = self.recent.keys_and_values()  # [1, n_kv, r, D]
        self._pack(keys[0, :, :n], values[0, :, :n])
        self._set_recent(keys[..., n:r, :], values[..., n:r, :])

    def _pack(self, keys: mx.array, values: mx.array) -> None:
        """Append keys [n_kv, n, D] and values [n_kv, n, Dv] to the packed stores (Hadamard-rotated first
        where quant.rotate_k / rotate_v say so: kv/rotation.py)."""
        self.k_store.append(keys_basis(keys, self.quant))
        self.v_store.append(values_basis(values, self.quant))

    def _set_recent(self, keys: mx.array, values: mx.array) -> None:
        """The float window becomes keys [1, n_kv, r, D] and values [1, n_kv, r, Dv] (r may be 0)."""
        self.recent = KVCache()
        if keys.shape[2] > 0:
            self.recent.update_and_fetch(keys, values)

    def _fetch(self) -> Tuple[mx.array, mx.array]:
        tail = self.recent.keys_and_values() if self.recent.offset else None
        if self.n_quantized == 0:
            return tail
        keys = keys_basis(self.k_store.dequantize(dtype=self.dtype), self.quant)[None]  # [1, n_kv, n_quantized, D]
        values = values_basis(self.v_store.dequantize(dtype=self.dtype), self.quant)[None]
        if tail is not None:
            keys = mx.concatenate([keys, tail[0]], axis=2)
            values = mx.concatenate([values, tail[1]], axis=2)
        return keys, values

    def fused_attention(self, queries: mx.array, scale: float, mask) -> Optional[mx.array]:
        """Attention of queries [1, n_q, L, D] over the packed K/V without dequantizing them, or None when
        it does not apply (a mask other than None for L == 1 / "causal"; affine: float tokens held; KIVI:
        no packed token yet, or the new tokens not all in the float window). Affine: the kernel layer's
        quant_attention over every token. KIVI: channel_keys_attention over the packed tokens merged with
        plain attention over the float window (the new tokens, causal)."""
        B, n_q, L, D = queries.shape
        if self.n_quantized == 0 or not ((isinstance(mask, str) and mask == "causal") or (mask is None and L == 1)):
            return None
        n_kv = self.k_store.w.shape[0]
        q = queries.reshape(n_kv, (n_q // n_kv) * L, D)  # [n_kv, n_rep * L, D]: row r is position r % L
        if self.quant.scheme == "kivi":
            if self.recent.offset < L:
                return None
            out = self._kivi_attention(q, scale, L)
        elif self.recent.offset:
            return None
        else:  # in the stored basis (scores are invariant under the rotation), the output moved back
            out = quant_attention(keys_basis(q, self.quant), self.k_store.packed(), self.v_store.packed(),
                                  self.offset, scale, L, self.quant.group_size)  # [n_kv, n_rep * L, Dv]
            out = values_basis(out, self.quant)
        return out.astype(queries.dtype).reshape(1, n_q, L, out.shape[-1])

    def _kivi_attention(self, q: mx.array, scale: float, L: int) -> mx.array:
        """q [n_kv, R, D] -> [n_kv, R, Dv] float32 over the packed tokens and the float window."""
        packed = channel_keys_attention(q, self.k_store.packed(), self.v_store.packed(), self.n_quantized, scale,
                                        self.quant.group_size)
        keys, values = self.recent.keys_and_values()  # [1, n_kv, r, D]
        r = keys.shape[2]
        scores = (q.astype(mx.float32) * scale) @ keys[0].astype(mx.float32).swapaxes(-1, -2)  # [n_kv, R, r]
        if L > 1:
            last = mx.arange(q.shape[1]) % L + (r - L)  # the last window index each row sees
            scores = mx.where(mx.arange(r)[None, None, :] <= last[None, :, None], scores, -float("inf"))
        lse = mx.logsumexp(scores, axis=-1)  # [n_kv, R]
        window = (mx.exp(scores - lse[..., None]) @ values[0].astype(mx.float32), lse)
        return merge_attention([packed, window])

    def make_mask(self, *args, **kwargs):
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    def exact_prefix(self, n: int, length: int) -> int:
        """The most of the first n tokens this layer can be trimmed back to such that prefilling the rest of
        a request's first `length` tokens (length >= n) leaves it as a fresh prefill of them would (up to float
        rounding): the packed tokens must be the ones a fresh prefill packs (the affine scheme: all or, up to
        quant.start, none; KIVI: the whole chunks of group_size tokens before the last kv_residual), and a
        packed KIVI chunk cannot give back the float values a fresh prefill keeps in its window."""
        packed_fresh = self._packed_after(length)
        if self.quant.scheme != "kivi":  # one row per token: only whether rows are packed at all matters
            return n if self.n_quantized == 0 or packed_fresh > 0 else 0
        if n >= self.n_quantized and self.n_quantized <= packed_fresh:
            return n  # the trim drops float tokens only, and what is packed stays packed
        return min(n // self.quant.group_size * self.quant.group_size, packed_fresh)

    def _packed_after(self, length: int) -> int:
        """Tokens packed after a fresh prefill of `length` tokens (in any chunks)."""
        if length <= self.quant.start:
            return 0
        if self.quant.scheme != "kivi":
            return length
        g = self.quant.group_size
        return max(0, length - self.quant.residual) // g * g

    def trim(self, n: int) -> int:
        """Drop the last n tokens (at most all); packed KIVI key chunks reached by the trim are dequantized
        back into the float window first (lossy: a kept cache is trimmed to `exact_prefix` instead).
        Returns the tokens dropped."""
        n = min(self.offset, n)
        if n > self.recent.offset and self.quant.scheme == "kivi":
            g = self.quant.group_size
            chunks = -(-(n - self.recent.offset) // g)
            first = self.k_store.n - chunks
            keys = self.k_store.dequantize(first, self.dtype)[None]  # [1, n_kv, chunks * g, D]
            values = self.v_store.dequantize(first * g, self.dtype)[None]
            self.k_store.trim(chunks)
            self.v_store.trim(chunks * g)
            if self.recent.offset:
                tail_k, tail_v = self.recent.keys_and_values()
                keys, values = mx.concatenate([keys, tail_k], 2), mx.concatenate([values, tail_v], 2)
            self._set_recent(keys, values)
        from_recent = min(n, self.recent.offset)
        self.recent.trim(from_recent)
        self.k_store.trim(n - from_recent)
        self.v_store.trim(n - from_recent)
        self.offset -= n
        return n

    @property
    def state(self):
        """The arrays to evaluate (mlx-lm evaluates `state` between prefill chunks)."""
        return self.k_store.arrays() + self.v_store.arrays() + ([*self.recent.state[:2]] if self.recent.keys is not None else [])

    @property
    def nbytes(self) -> int:
        """Bytes this layer holds now: the allocated packed arrays and the float window."""
        return sum(a.nbytes for a in self.k_store.arrays() + self.v_store.arrays()) + self.recent.nbytes

    def bytes_per_token(self) -> float:
        """Bytes a token held now costs in this layer on average (K and V, scales and biases included): packed
        tokens at their packed size, tokens still in float (before the threshold, KIVI's window) at the
        model's dtype; 0 before the first update."""
        if self.layout is None:
            return 0.0
        (n_kv, k_dim, v_dim), q, sb = self.layout, self.quant, 2 * SCALE_DTYPE.size
        packed = n_kv * (k_dim * q.k_bits / 8 + v_dim * q.v_bits / 8 + (k_dim + v_dim) * sb / q.group_size)
        dense = n_kv * (k_dim + v_dim) * self.dtype.size
        return (packed * self.n_quantized + dense * self.recent.offset) / max(1, self.offset)


def exact_prefix(cache: list, n: int, length: int) -> int:
    """The most of the first n tokens a request's per-layer caches can be trimmed back to so that prefilling
    the rest of its first `length` tokens leaves them as a fresh prefill would (QuantKVCache.exact_prefix;
    every other cache: n)."""
    return min([n] + [c.exact_prefix(n, length) for c in cache if isinstance(c, QuantKVCache)])


def kv_bytes_per_token(cache: list) -> float:
    """KV bytes one token costs over a request's dense, quantized or paged per-layer caches (packed tokens
    for a QuantKVCache, the float dtype for mlx-lm's KVCache / RotatingKVCache, a token slot of the block
    pool for a PagedKVCache: packed codes, scales and biases with quantized blocks); 0 for layers not
    written yet and for other caches."""
    total = 0.0
    for c in cache:
        if isinstance(c, QuantKVCache):
            total += c.bytes_per_token()
        elif isinstance(c, PagedKVCache):
            total += c.sequence.pool.token_bytes
        elif isinstance(c, (KVCache, RotatingKVCache)) and c.keys is not None:
            k, v = c.keys, c.values  # [B, n_kv, S, D]
            total += k.shape[1] * (k.shape[3] * k.dtype.size + v.shape[3] * v.dtype.size)
    return total


def make_quant_cache(model: nn.Module, quant: KVQuant) -> List:
    """The model's per-layer caches with every full-attention layer (mlx-lm's KVCache) quantized; other
    layers (sliding windows: RotatingKVCache, at most a window of float tokens; recurrent state) keep
    mlx-lm's own cache."""
    return [QuantKVCache(quant) if type(c) is KVCache else c for c in make_prompt_cache(model)]
