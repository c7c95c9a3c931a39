"""Decode steps as compiled graphs, traced once per shape and replayed: plain decoding's one-token steps and
speculative decoding's verify forwards (a few tokens) over mlx-lm's dense KVCache, and a batched step's over
the block pool.

    steps = CompiledSteps(model)                    # one per model (Engine.compiled_steps): traces are kept
    model_fn = steps.decode if CompiledDecode.applies(model, cache) else model
    logits = model_fn(tokens, cache=cache)          # tokens [1, L] -> [1, L, V]; mlx-lm's KVCache list
    verify = CompiledDecode(model, MAX_VERIFY_WIDTH)  # also replays forwards of 2..16 tokens (SpecState)
    if steps.batch.ready(step):                     # a BatchStep of one new token per request
        logits = steps.batch(step, tokens)          # [B, 1] -> [B, 1, V]

On MLX's CPU backend every operation of a step is built by Python (the model's modules, a few microseconds
each), and `mx.async_eval` returns only once all but about ten of a graph's operations have run, so the
next step's graph is built while the machine has next to nothing left to run: building is on the critical
path (a sizeable share of a step on a small model). `mx.compile` traces the forward once and then replays
its recorded graph from C++: the same operations on the same inputs (bit-identical logits) without the
Python (timings: docs/benchmarks.md).

A traced graph cannot depend on Python values that change every step, so positions come as arrays
(kv/step_cache.StepCache): RoPE rotates at an int32 `offset`, the new K/V rows go in at array positions
(in a KVCache buffer [1, n_kv, capacity, D] with `mx.slice_update`, into the pool's planes with
`write_rows`; the old storage is donated, so the rows are written in place), and attention reads the
storage through the paged-attention kernel, which stops at each request's length (and, for a verify
forward of L tokens, each query at its own position). A verify forward not launched ahead of the previous
read-back has its building on the critical path whatever the machine has left to run, so replaying it
shortens every such round, with bit-identical logits and K/V (tests/generation/test_compiled_decode.py).
Shapes then stay the same
until a KVCache buffer grows (every 256 tokens, its `step`), or a batch's number of requests, its longest
request's length rounded up to BATCH_KEYS_BUCKET tokens, or the pool's size changes: mx.compile then
traces again (and keeps each trace for its shapes). A trace costs about what building a few steps' graphs
in Python does, so a batched shape is traced only once COMPILE_AFTER_STEPS steps
have asked for it (requests that come and go may hold a batch's size for one step), and the traces live as
long as the model's modules stay the same (CompiledSteps, kept by the Engine).

They run where all of that holds: every layer's attention an mlx-lm llama / qwen2 attention on the kernel
twins (kernels/rope.KernelRoPEAttention) calling the attention hook, no sliding-window layers, the
paged-attention kernel present (MLX's CPU device with the CPU kernels), no RMM products scope open; for
plain decoding one token (a verify forward up to max_width tokens) over mlx-lm's KVCache on every layer,
room in its buffer for them; for a batched step float blocks and no eviction in the batch. Anything else
runs the model as it is.
"""

from typing import Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

from ..kernels.dense_attention import buffer_tables, dense_fits
from ..kernels.paged_attention import paged_attention_backend
from ..kernels.rope import KernelRoPEAttention
from ..kv import attention_hook
from ..kv.batch import BatchStep, fused_attention_applies
from ..kv.pool import BlockPool
from ..kv.step_cache import StepCache
from ..rmm.attention import active_products

__all__ = ["BATCH_KEYS_BUCKET", "COMPILE_AFTER_STEPS", "CompiledBatchStep", "CompiledDecode", "CompiledSteps",
           "compiles", "module_fingerprint"]

#: A batched step's key axis is padded up to a multiple of this many tokens, so that one trace serves that
#: many steps.
BATCH_KEYS_BUCKET = 64
#: Batched steps of one shape that run the model's Python before that shape is traced (a trace costs about
#: 3-4 steps' graph building; a shape held for fewer steps would lose time).
COMPILE_AFTER_STEPS = 4


def module_fingerprint(model: nn.Module) -> Tuple[int, ...]:
    """The identities of `model`'s leaf modules: another value once any of them was swapped for another
    module (which a trace made before would not see)."""
    return tuple(id(m) for _, m in tree_flatten(model.leaf_modules(), is_leaf=nn.Module.is_module))


def compiles(model: nn.Module) -> bool:
    """Whether `model`'s decode steps can run as a compiled graph (see the module docstring): every layer's
    attention a KernelRoPEAttention calling the attention hook's `attention`, none on a sliding window, and the
    paged-attention kernel here."""
    if paged_attention_backend() == "reference":
        return False
    return all(type(getattr(layer, "self_attn", None)) is KernelRoPEAttention
               and layer.self_attn.attend is attention_hook.attention
               and not getattr(layer, "use_sliding", False)
               for layer in model.layers)


def _step(model: nn.Module, tokens: mx.array, offset: mx.array, operands: tuple, storage: tuple,
          rows: Optional[mx.array] = None) -> tuple:
    """The traced forward: tokens [B, 1] over each layer's (keys, values) in `storage` (StepCache's
    arguments) -> (logits [B, 1, V], the layers' new keys and values in the same order)."""
    caches = [StepCache(storage[i], storage[i + 1], offset, operands, rows) for i in range(0, len(storage), 2)]
    logits = model(tokens, cache=caches)
    return (logits,) + tuple(a for c in caches for a in (c.keys, c.values))


class CompiledDecode:
    """`model` whose forwards of 1..max_width tokens over mlx-lm's KVCache run as compiled graphs (see the
    module docstring), one trace per width (and buffer capacity). Called as the model: (inputs [1, L] int,
    cache=list of per-layer caches, input_embeddings=None) -> logits [1, L, V]; a forward it cannot replay
    (a wider one, a prefill chunk) runs `model` itself. Its traces keep the model's modules and weights as
    they were when made: keep one while they stay the same (CompiledSteps, SpecState).

    Args:
        model: an mlx-lm model that `applies` accepts.
        max_width: the widest forward replayed (1: plain decoding's steps; MAX_VERIFY_WIDTH: speculative
            decoding's verify forwards, whose widths come back round after round).
    """

    def __init__(self, model: nn.Module, max_width: int = 1):
        self.model = model
        self.max_width = max_width
        self._step = mx.compile(self._forward)

    @staticmethod
    def applies(model: nn.Module, cache: List) -> bool:
        """Whether `model`'s decode steps over `cache` (its per-layer caches) can replay a compiled graph:
        every cache an mlx-lm KVCache, and `compiles(model)`."""
        return (len(model.layers) == len(cache) and all(type(c) is KVCache for c in cache)
                and compiles(model))

    def _forward(self, tokens: mx.array, offset: mx.array, *buffers: mx.array) -> tuple:
        """tokens [1, L], offset int32 [1], each layer's KVCache buffers (keys [1, n_kv, capacity, D],
        values) -> (logits [1, L, V], the new buffers in the same order)."""
        _, n_kv, capacity, _ = buffers[0].shape
        L = tokens.shape[1]
        index, k_pos = buffer_tables(1, n_kv, capacity)  # constants of this capacity's trace
        q_pos = (offset + mx.arange(L, dtype=mx.int32)).reshape(1, L)  # each query's position
        return _step(self.model, tokens, offset, (index, offset + L, q_pos, k_pos), buffers)

    def _replays(self, inputs: mx.array, cache: List, input_embeddings) -> bool:
        L = inputs.shape[1] if inputs.ndim == 2 else 0
        if (input_embeddings is not None or inputs.shape[0] != 1 or not 1 <= L <= self.max_width
                or active_products() is not None):
            return False
        first = cache[0]
        if first.keys is None or not dense_fits(L, first.keys.shape[3], first.values.shape[3]):
            return False
        return all(c.keys is not None and c.offset == first.offset and c.offset + L <= c.keys.shape[2]
                   for c in cache)

    def __call__(self, inputs: mx.array, cache: Optional[List] = None, input_embeddings: Optional[mx.array] = None):
        if cache is None or not self._replays(inputs, cache, input_embeddings):
            if input_embeddings is not None:
                return self.model(inputs, cache=cache, input_embeddings=input_embeddings)
            return self.model(inputs, cache=cache)
        buffers = [a for c in cache for a in (c.keys, c.values)]
        out = self._step(inputs, mx.array([cache[0].offset], dtype=mx.int32), *buffers)
        del buffers  # the caches' references go below: the old buffers are then donated to the writes
        for i, c in enumerate(cache):
            c.keys, c.values = out[1 + 2 * i], out[2 + 2 * i]
            c.offset += inputs.shape[1]
        return out[0]


class CompiledBatchStep:
    """A batched decode step (one new token per request) over the block pool as a compiled graph (see the
    module docstring). Its traces keep the model's modules and weights as they were when made: keep one while
    they stay the same (CompiledSteps).

    Args:
        model: an mlx-lm model that `compiles` accepts.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self._step = mx.compile(self._forward)
        self._asked: Dict[tuple, int] = {}  # steps that asked for each shape

    def ready(self, step: BatchStep) -> bool:
        """Whether to run `step` here: `applies`, and its shape (requests, key bucket, pool rows) asked for
        by COMPILE_AFTER_STEPS steps so far (this one included)."""
        if not self.applies(self.model, step.pool, step):
            return False
        key = (step.shape[0], self._width(step), step.pool.arrays()[0].shape)
        self._asked[key] = asked = self._asked.get(key, 0) + 1
        return asked >= COMPILE_AFTER_STEPS

    @staticmethod
    def _width(step: BatchStep) -> int:
        return -(-step.shape[3] // BATCH_KEYS_BUCKET) * BATCH_KEYS_BUCKET

    @staticmethod
    def applies(model: nn.Module, pool: BlockPool, step: BatchStep) -> bool:
        """Whether `step` over `pool` can replay a compiled graph: one new token per request, float blocks
        attended on the paged-attention kernel (fused_attention_applies), no RMM products scope open, and
        `compiles(model)`, with a K and a V plane for each of its layers."""
        return (step.shape[2] == 1 and pool.quant is None and step.fused and fused_attention_applies(pool)
                and active_products() is None and len(pool.arrays()) == 2 * len(model.layers) and compiles(model))

    def _forward(self, tokens: mx.array, offset: mx.array, rows: mx.array, index: mx.array, lengths: mx.array,
                 q_pos: mx.array, k_pos: mx.array, *planes: mx.array) -> tuple:
        """tokens [B, 1], offset int32 [B], rows int32 [B * n_kv], the kernel operands (BatchStep.
        kernel_operands), each layer's planes (BlockPool.arrays) -> (logits [B, 1, V], the new planes)."""
        return _step(self.model, tokens, offset, (index, lengths, q_pos, k_pos), planes, rows)

    def __call__(self, step: BatchStep, tokens: mx.array) -> mx.array:
        """Run `step` (planned, its slots appended) for tokens [B, 1]: logits [B, 1, V]; the pool holds
        the new K/V and every request's layers stand at its table's end (step.done())."""
        pool = step.pool
        planes = pool.arrays()
        out = self._step(tokens, step.offset, step.write_rows, *step.kernel_operands(self._width(step)), *planes)
        del planes  # the pool's references go below: the old planes are then donated to the writes
        pool.rebind(out[1:])
        for s in step.sequences:
            for layer in range(pool.num_layers):
                s.advance(layer, 1)
        step.done()
        return out[0]


class CompiledSteps:
    """The compiled steps of one model, kept while its modules stay the same (`current`): `decode`
    (CompiledDecode) and `batch` (CompiledBatchStep), whose traces then serve every request.

    Args:
        model: an mlx-lm model.
    """

    def __init__(self, model: nn.Module):
        self.model = model
        self._fingerprint = module_fingerprint(model)
        self.decode, self.batch = CompiledDecode(model), CompiledBatchStep(model)

    def current(self) -> "CompiledSteps":
        """These steps, or new ones (no traces yet) when a module of the model was swapped since."""
        return self if module_fingerprint(self.model) == self._fingerprint else CompiledSteps(self.model)
