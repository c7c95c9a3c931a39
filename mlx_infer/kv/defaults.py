"""Named defaults of the paged KV cache (mlx_infer/defaults.py style)."""

import mlx.core as mx

from ..defaults import KV_BLOCK_SIZE as BLOCK_SIZE  # noqa: F401  (tokens per KV block, defined there)

#: Most slots whose pool rows BlockPool.rows computes in Python rather than NumPy (a decode or verify step's
#: writes; a prefill's go through NumPy).
FEW_SLOTS = 64
#: Blocks a fresh pool allocates on its first write; it grows geometrically up to its budget.
POOL_INITIAL_BLOCKS = 64
#: Growth factor of the pool's capacity when it runs out of allocated blocks.
POOL_GROWTH = 2.0
#: The pool shrinks (copies its used prefix into smaller arrays) when its highest used block is below
#: capacity / POOL_SHRINK_FACTOR; the new capacity is twice that prefix (hysteresis against thrashing).
POOL_SHRINK_FACTOR = 4
#: vToken's repack trigger: waste (1 - mean live fraction of a request's blocks) above this.
REPACK_WASTE = 0.25
#: ... and free blocks at or below this fraction of the pool's budget (the low watermark).
REPACK_LOW_WATERMARK = 0.10
#: Most tokens one repack copies (the sparsest blocks first); more waits for the next decode step.
REPACK_MAX_MOVES = 256
#: Decode steps between two attention observations (the queries of the last OBSERVE_WINDOW steps are
#: scored against the cached keys in one batched pass).
OBSERVE_PERIOD = 8
#: Most recent queries scored per observation (== OBSERVE_PERIOD: every query is counted once).
OBSERVE_WINDOW = 8
#: H2O (arXiv 2306.14048): fraction of the kept budget reserved for the recent window (its scripts: 0.1 heavy
#: + 0.1 recent of the context; here the kept tokens are split half heavy hitters, half recent).
H2O_RECENT_FRACTION = 0.5
#: Scissorhands (arXiv 2305.17118): observations remembered (history window), most recent tokens protected,
#: and what counts as "low attention": below this multiple of the uniform share 1 / live tokens.
SCISSORHANDS_HISTORY = 32
SCISSORHANDS_RECENT = 64
SCISSORHANDS_LOW = 1.0
#: StreamingLLM (arXiv 2309.17453): attention sinks kept at the start.
STREAMING_SINKS = 4
#: SnapKV (arXiv 2404.14469): observation window (last prompt queries) and pooling kernel (its repo: 32, 5).
SNAPKV_WINDOW = 32
SNAPKV_KERNEL = 5
#: Most bytes of KV blocks the prefix cache keeps for reuse when nothing else holds them, when the pool has
#: no budget (with a budget, cached blocks are freed as requests need the room).
PREFIX_CACHE_BYTES = 512 << 20
#: Quantized KV: values per scale / bias (along head_dim; KIVI keys: along tokens). 64 keeps 4-bit K/V
#: with float16 scales and biases at 4.5 bits per value (0.28x float16).
KV_GROUP_SIZE = 64
#: Quantized KV, affine scheme: the bit widths whose K or V store is rotated by a Hadamard matrix per group
#: before quantizing (kv/rotation.py, QuaRot arXiv 2404.00456). On the default model it cut 4-bit K/V's mean
#: KL from float KV severalfold at the same bytes; at 8 bits its effect was within the noise of perplexity and
#: recall (docs/kv_quant.md). KIVI keeps its per-channel keys unrotated.
KV_ROTATE_BITS = (4,)
#: Dtype of the scales and biases of quantized K/V (QuantKVCache and quantized pool blocks).
KV_SCALE_DTYPE = mx.float16
#: KIVI (arXiv 2402.02750): the most recent tokens kept in float (its paper: 32-128).
KIVI_RESIDUAL = 64
#: Token rows a quantized cache grows by (as mlx-lm's KVCache.step).
QUANT_STEP = 256
