"""BatchScheduler: continuous batching over one block pool (Orca, OSDI '22; vLLM, arXiv 2309.06180).

Each `step()`: drop cancelled requests, admit waiting ones while the KV budget allows (in arrival order),
prefill the newcomers together (left-padded rows of one batched forward, kv/batch.py: the weights are read
once for all of them) and sample each one's first token, then run one batched forward of one token for every
running request and sample each row with the request's own parameters; finished requests leave at once and
their blocks go back to the pool. Decode is pipelined: the next forward is built and started before the
previous one's tokens are read back (see _launch). A request that asks for speculative decoding gets it
while it runs alone (see `solo`), lossless as every speculative mode.

Admission reserves a request's worst case, ceil((prompt + max_tokens) / block_size) blocks (less the blocks
it shares from the prefix cache; idle cached blocks are freed to make room), so a running
request never runs out of KV blocks mid-decode (no preemption needed); a request whose worst case exceeds the
whole budget is refused at submit (KVBudgetError), one that fits later waits.

A request may evict tokens as it decodes (its EvictSpec: vToken, arXiv 2608.13263, as a lone request on
the paged cache): after each decode forward that includes it, its KVRequest gets its row of the forward's
queries (one QueryTap on the model for the batch) and evicts and repacks as Engine.stream_steps does, at
the same points, so its tokens equal those of the same request alone. With repacking on it reserves only
the blocks of the most tokens it keeps live (kv.session.reserved_blocks): when the pool lacks the blocks a
prefill or a decode step needs, the evicting requests are repacked at once (KVRequest.compact), which the
reservations guarantee makes the room. That is where eviction lets more requests run in the same budget.

A request may carry a grammar (structured generation, issue 48) and logprobs. Its row is picked under its
grammar's mask, applied after its logits processors; rows without one are unmasked. A constrained row's pick
needs the mask of the state after its previous token, which the pipelined step cannot know in advance: a batch
with a constrained row still launches its forward on the lazy tokens, then reads the previous tokens back (each
grammar consumes its token and starts its next mask on the mask thread, while the forward runs), then gathers
the masks [B, W] and builds the picks (`_pick_masked`). The grammar's forced tokens are emitted one per step
(a one-hot mask), so a row's tokens equal its request's decoded alone. A request whose grammar fails fails
alone; the batch goes on. Batches without a constrained row run as before.
"""

import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, Iterator, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..defaults import DEFAULT_MAX_DRAFT, MAX_BATCH, PREFILL_STEP_SIZE
from ..errors import MlxInferError
from ..generation.compiled import CompiledBatchStep
from ..kv.attention_hook import install as install_attention_hook
from ..kv.batch import BatchStep
from ..kv.errors import KVBudgetError
from ..kv.observe import QueryRows, QueryTap
from ..kv.session import KVRequest, PagedKV, over_budget, release, reserved_blocks
from ..structured.mask import apply_masks
from .request import BatchRequest


@dataclass
class _Decode:
    """A decode forward in flight: its requests, the raw logits [B, V] (kept
    while a row reports logprobs or its pick waits for a grammar's mask; else None) and the sampled tokens
    [B] (lazy; None until `_pick_masked` builds them)."""

    batch: List[BatchRequest]
    logits: Optional[mx.array]
    sampled: Optional[mx.array]


class BatchScheduler:
    """Requests decoding together on `model` over the block pool of `kv`. Not thread-safe (BatchRunner runs
    it on one thread).

    Args:
        model: an mlx-lm model whose layer caches are all KVCache-like (make_paged_cache accepts it).
        kv: the PagedKV (block pool and budget) the requests' caches live in.
        max_batch: most requests decoding at once (>= 1).
        prefix_cache: start each request from the longest cached prefix of its prompt (kv/prefix.py: whole
            blocks of earlier requests, e.g. a shared system prompt or a chat's previous turns) and cache its
            full blocks when it finishes.
        solo: speculative decoding for a request that runs alone: called with the request (its cache
            holding its prompt and all its tokens but the last), returns the iterator of its next tokens
            (Engine: SpecState.tokens, lossless) or None (it decodes plainly). Used while it is the only
            running request and nobody waits; closed (its cache rolled back to the tokens delivered) when
            another request arrives, and the request goes on in the batch.
        compiled: the model's CompiledBatchStep (generation/compiled.py; Engine.compiled_steps), whose traces
            serve every scheduler of the model; None: one of its own.

    Raises:
        MlxInferError: max_batch < 1; KVBudgetError: a budget that holds no block.
    """

    def __init__(self, model: nn.Module, kv: PagedKV, max_batch: int = MAX_BATCH, prefix_cache: bool = True,
                 solo: Optional[Callable[[BatchRequest], Optional[Iterator[int]]]] = None,
                 compiled: Optional[CompiledBatchStep] = None):
        if not isinstance(max_batch, int) or max_batch < 1:
            raise MlxInferError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        self.model, self.kv, self.max_batch, self.prefix_cache = model, kv, max_batch, prefix_cache
        self.waiting: Deque[BatchRequest] = deque()
        self.running: List[BatchRequest] = []
        self.steps = 0  # batched decode forwards run
        # the decode forward in flight: its requests and their sampled tokens [B] (lazy, being evaluated)
        self._inflight: Optional[_Decode] = None
        self.solo = solo
        self._solo: Optional[Tuple[BatchRequest, Iterator[int]]] = None  # the lone speculative request
        kv.check_budget()  # KVBudgetError for a budget that holds no block
        release(kv.new_cache())  # UnsupportedModelError now for a model the paged cache cannot hold
        self._fused = install_attention_hook(model) > 0  # batched steps may attend on the paged kernel (kv/batch.py)
        self._tap: Optional[QueryTap] = None  # the queries of a forward with evicting requests (made on first use)
        # one-token steps replayed as compiled graphs where they apply (the engine's, whose traces outlive us)
        self._compiled = compiled if compiled is not None else CompiledBatchStep(model)

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running or self._inflight or self._solo)

    def blocks_needed(self, req: BatchRequest, evicted: bool = False) -> int:
        """The request's worst case in blocks: its prompt and max_tokens (and, speculating, a verify's draft
        tokens beyond them); evicting with repacking, before its first eviction the prompt's blocks, after it
        (`evicted`) the blocks of the most tokens it keeps live (kv.session.reserved_blocks)."""
        extra = DEFAULT_MAX_DRAFT + 1 if req.speculative is not None else 0
        before, after = reserved_blocks(req.evict, req.repack, len(req.prompt_ids), req.max_tokens + extra,
                                        self.kv.block_size)
        return after if evicted else before

    def check_fits(self, req: BatchRequest) -> None:
        """Raise KVBudgetError when the request's prompt and max_tokens can never fit the KV budget (reads
        only the budget: safe from any thread)."""
        need, most = self.blocks_needed(req), self.kv.pool.max_blocks
        if most is not None and need > most:
            raise KVBudgetError(over_budget(self.kv.pool, need, len(req.prompt_ids), req.max_tokens, req.evict,
                                            req.repack, most), "raise kv_budget or lower max_tokens")

    def add(self, req: BatchRequest) -> None:
        """Queue a request. Raises KVBudgetError as check_fits."""
        self.check_fits(req)
        self.waiting.append(req)

    def _promised(self) -> int:
        """Blocks running requests may still allocate (their reservations minus what they hold)."""
        return sum(max(0, r.reserved_blocks - len(r.sequence.table.blocks)) for r in self.running)

    def _admit(self, req: BatchRequest) -> bool:
        """Give the request its cache (starting from the longest cached prefix of its prompt) and reserve its
        blocks, freeing idle cached blocks if that makes room; False (nothing changed) when it must wait."""
        # an evicting request shares no prefix: its blocks are repacked, and its cache stops matching a prefill
        cache, cached = self.kv.start(req.prompt_ids, share=self.prefix_cache and req.evict is None)
        shared = len(cache[0].sequence.table.blocks)
        need = self.blocks_needed(req) - shared
        if not self._make_room(need, promised=True):
            release(cache)
            return False
        req.cache, req.reserved_blocks, req.cached_tokens = cache, shared + need, cached
        if req.evict is not None:
            req.kv = KVRequest(self.kv, cache, req.evict, req.repack)
        return True

    def _make_room(self, blocks: int, promised: bool = False) -> bool:
        """Whether `blocks` are free in the pool (with `promised`: beyond the blocks running requests may still
        allocate, _promised), after freeing idle cached blocks and then repacking the evicting requests if
        needed (KVRequest.compact)."""
        pool = self.kv.pool
        if pool.free_blocks is None:
            return True

        def room() -> int:
            return pool.free_blocks - (self._promised() if promised else 0)

        if room() < blocks:
            self.kv.prefix.make_room(blocks + pool.free_blocks - room())
        evicting = sorted((r.kv for r in self.running if r.kv is not None), key=lambda kv: -kv.reclaimable)
        for kv in evicting:  # the sparsest first: the fewest copies for the room
            if room() >= blocks or not kv.reclaimable:
                break
            kv.compact()
        return room() >= blocks

    def step(self) -> None:
        """Admit, prefill, and decode once (see the module docstring); emits each request's steps. A request
        cancelled since the last step ends here, before any forward: its final step is emitted ("cancelled")
        and its blocks go back to the pool (a lone speculative one's iterator is closed first)."""
        for r in [r for r in self.running if r.cancelled]:
            if self._solo is not None and self._solo[0] is r:
                self._end_solo()  # its speculative iterator stops (and rolls its cache back) before the release
            r.finish(cancelled=True)
            self._leave(r)
        for r in [r for r in self.waiting if r.cancelled]:
            r.finish(cancelled=True)
            self.waiting.remove(r)
        if self._solo is not None:
            if not self.waiting:
                return self._solo_step()
            self._end_solo()  # a newcomer: the lone request goes on in the batch
        admitted = []
        while self.waiting and len(self.running) < self.max_batch and self._admit(self.waiting[0]):
            req = self.waiting.popleft()
            self.running.append(req)
            admitted.append(req)
        if admitted:
            try:
                self._make_room(sum(math.ceil((len(r.prompt_ids) - r.cached_tokens) / self.kv.block_size) + 1
                                    for r in admitted))
                firsts, rows = self._prefill(admitted)
            except Exception:
                for r in admitted:
                    self._leave(r)
                raise
            for b, (r, token) in enumerate(zip(admitted, firsts)):
                if self.prefix_cache and r.evict is None:  # its prompt's full blocks, for the requests that share them
                    self.kv.prefix.insert(r.prompt_ids, r.sequence.table.blocks)
                if r.finished or r.accept(token, rows[b:b + 1]):  # (finished: its grammar failed)
                    self._leave(r)
        previous, self._inflight = self._inflight, None
        lone = self.running[0] if len(self.running) == 1 and not self.waiting else None
        # (a lone request goes speculative between forced spans: its iterator decides them itself)
        if self.solo is not None and lone is not None and lone.speculative is not None and not lone.forcing:
            if previous is not None:
                self._deliver(previous)
                previous = None
            if lone in self.running and not lone.forcing and self._start_solo(lone):
                return self._solo_step()
        launched = self._launch(previous) if self.running else None
        if previous is not None:
            self._deliver(previous)
        if launched is not None and launched.sampled is None:
            self._pick_masked(launched)
        self._inflight = launched

    def _start_solo(self, req: BatchRequest) -> bool:
        tokens = self.solo(req)
        if tokens is None:  # speculation cannot pay for it here: plain batched decoding from now on
            req.speculative = None
            return False
        self._solo = (req, tokens)
        return True

    def _solo_step(self) -> None:
        """The lone request's next token from its speculative iterator."""
        req, tokens = self._solo
        token = next(tokens, None)
        if token is None or req.accept(token, committed=True):
            self._end_solo()
            if token is None:  # the source ended first (the context window)
                req.finish()
            self._leave(req)

    def _end_solo(self) -> None:
        """Close the lone request's speculative iterator: its cache (and grammar) is rolled back to the tokens
        delivered, all but the last one (the state batched decoding continues from); the request resumes
        (BatchRequest.resume: leaves when its grammar fails there)."""
        req, tokens = self._solo
        self._solo = None
        tokens.close()
        req.resume()
        if req.finished and req in self.running:
            self._leave(req)

    def _prefill(self, reqs: List[BatchRequest]) -> Tuple[List[int], mx.array]:
        """Prefill the newcomers' prompts together and sample each one's first token: every prompt but its last
        token in batched forwards of at most PREFILL_STEP_SIZE tokens in all (each request a left-padded row;
        their logits are never evaluated, so MLX never computes the output head for them), then one forward
        of every newcomer's last prompt token (L = 1) whose logits [B, 1, V] give the first tokens, as a lone
        request's generate_step does. Computing the head only there saves its share of the prefill (large on
        models with a big vocabulary against their width) for one forward of B rows. Returns the first tokens
        and the raw logits [B, V] they were picked from (a request whose grammar failed is finished)."""
        now = time.perf_counter()
        todo = {}
        for r in reqs:
            r.admitted_at = now
            if len(r.prompt_ids) - 1 > r.cached_tokens:
                todo[r] = r.prompt_ids[r.cached_tokens:-1]
        pool = self.kv.pool
        while todo:
            active = list(todo)
            width = max(1, PREFILL_STEP_SIZE // len(active))
            self._forward(active, [todo[r][:width] for r in active])  # (logits [B, L, V] unused)
            for r in active:
                todo[r] = todo[r][width:]
                if not todo[r]:
                    del todo[r]
            mx.eval(pool.arrays())
        logits, _ = self._forward(reqs, [[r.prompt_ids[-1]] for r in reqs])  # [B, 1, V]
        rows = logits[:, -1, :]  # [B, V]
        masks = self._masks(reqs, leave=False)
        tokens = [r.sample(rows[b:b + 1], mask=masks[b]) for b, r in enumerate(reqs)]  # [1] each
        mx.eval(tokens + pool.arrays())
        return [int(t.item()) for t in tokens], rows

    def _forward(self, reqs: List[BatchRequest], chunks: List[List[int]], inputs: Optional[mx.array] = None,
                 tapped: bool = False) -> Tuple[mx.array, Dict[int, QueryRows]]:
        """Logits [B, L, V] of one forward of chunks[b] (token ids) for each request (left-padded rows, see
        kv/batch.py), and with `tapped` the rotated queries of each evicting request's real tokens
        ({b: QueryTap.rows(b, n_b)}); `inputs` [B, L], when given, replaces the ids
        (chunks then give only the lengths). A lone
        request runs on its own paged cache (PagedKVCache: its tokens in consecutive slots attend on the
        kernel through a dense buffer's operands and are written with one slice update; no per-step row
        index is built), which is cheaper than a one-row BatchStep (docs/benchmarks.md, batched decoding)."""
        if not tapped:
            return self._run(reqs, chunks, inputs, compiled=True), {}
        if self._tap is None:
            self._tap = QueryTap(self.model)
        with self._tap as tap:  # (the tap reads the queries as the model's Python computes them: not compiled)
            logits = self._run(reqs, chunks, inputs, compiled=False)
            return logits, {b: tap.rows(b, len(c)) for b, (r, c) in enumerate(zip(reqs, chunks)) if r.kv is not None}

    def _run(self, reqs: List[BatchRequest], chunks: List[List[int]], inputs: Optional[mx.array],
             compiled: bool) -> mx.array:
        """The forward of `_forward`: logits [B, L, V]; with `compiled`, a step of one token per request
        replays a compiled graph where CompiledBatchStep applies (generation/compiled.py)."""
        if len(reqs) == 1:
            return self.model(mx.array(chunks[0])[None] if inputs is None else inputs, cache=reqs[0].cache)
        step = BatchStep([r.sequence for r in reqs], [len(c) for c in chunks])
        tokens = step.inputs(chunks) if inputs is None else inputs  # [B, L]
        if compiled and self._compiled.ready(step):
            return self._compiled(step, tokens)
        logits = self.model(tokens, cache=step.caches())
        step.done()
        return logits

    def _launch(self, previous: Optional[_Decode]) -> Optional[_Decode]:
        """Build the next decode forward and start evaluating it (mx.async_eval), before the tokens of the
        previous one are read back, so that building one step overlaps computing the other (as mlx-lm's
        generate_step). Its input is each running request's newest token: the previous forward's sampled row
        (still lazy) or, for a newcomer, its first token. A request whose pending token is its last
        (max_tokens) is left out; one that the pending token ends otherwise (EOS, a stop string) wastes one
        row, discarded when it leaves. The picks are built here too, unless a row has a grammar (its mask
        needs its previous token: `_pick_masked` builds them after the read-back). Returns the _Decode or
        None."""
        rows = {id(r): b for b, r in enumerate(previous.batch)} if previous is not None else {}
        batch, inputs, pending = [], [], []
        for r in self.running:
            b = rows.get(id(r))
            if b is None:
                batch.append(r)
                inputs.append(mx.array([r.generated[-1]], mx.uint32))
                pending.append(None)  # (already in r.generated: the processors' history has it)
            elif len(r.generated) + 1 < r.max_tokens:
                batch.append(r)
                inputs.append(previous.sampled[b:b + 1].astype(mx.uint32))
                pending.append(inputs[-1])
        if not batch:
            return None
        if any(r.kv is not None for r in self.running):
            self._make_room(len(batch))  # at most one new block each (the reservations leave that room)
        tapped = any(r.kv is not None for r in batch)
        logits, queries = self._forward(batch, [[0]] * len(batch), mx.concatenate(inputs)[:, None], tapped)
        logits = logits[:, -1, :]  # [B, V]
        for b, rows in queries.items():  # eviction after the forward, as a lone request's (Engine.stream_steps)
            batch[b].kv.step(rows)
            batch[b].reserved_blocks = self.blocks_needed(batch[b], evicted=True)
        self.steps += 1
        keep = any(r.structured for r in batch)
        if any(r.grammar is not None for r in batch):
            mx.async_eval(logits)  # the forward runs while the previous tokens are read back
            return _Decode(batch, logits, None)
        if all(r.greedy_plain for r in batch):
            sampled = mx.argmax(logits, axis=-1)  # [B]
        else:
            sampled = mx.concatenate([r.sample(logits[b:b + 1], pending[b]) for b, r in enumerate(batch)])  # [B]
        mx.async_eval(sampled)
        return _Decode(batch, logits if keep else None, sampled)

    def _pick_masked(self, step: _Decode) -> None:
        """The picks of a launched forward with constrained rows, after the previous tokens were delivered
        (each grammar has consumed its row's token): the masks gathered [B, W] (None: unmasked) and applied to
        each row after its processors; started (mx.async_eval) into step.sampled. Rows that left meanwhile
        get no mask (their pick is discarded)."""
        masks = self._masks(step.batch)
        if all(r.greedy_plain for r in step.batch):
            sampled = mx.argmax(apply_masks(step.logits, masks), axis=-1)  # [B]
        else:  # (each row's token is in its history now: no pending token)
            sampled = mx.concatenate([r.sample(step.logits[b:b + 1], None, masks[b])
                                      for b, r in enumerate(step.batch)])
        mx.async_eval(sampled)
        step.sampled = sampled

    def _masks(self, batch: List[BatchRequest], leave: bool = True) -> List[Optional[np.ndarray]]:
        """Each running request's mask for its next pick (BatchRequest.mask; None: unmasked, or a request
        no longer running). A request whose grammar fails here fails alone (its error emitted) and, with
        `leave`, leaves the batch."""
        masks: List[Optional[np.ndarray]] = []
        for r in batch:
            mask = None
            if not r.finished and (r.grammar is not None):
                try:
                    mask = r.mask()
                except Exception as e:  # llguidance's error, or a bug in a grammar: this request only
                    r.fail(e)
                    if leave:
                        self._leave(r)
            masks.append(mask)
        return masks

    def _deliver(self, step: _Decode) -> None:
        """Read back a decode forward's tokens and hand each to its request (if it is still running), with
        its raw logits row (its logprob)."""
        for b, (r, t) in enumerate(zip(step.batch, step.sampled.tolist())):
            raw = step.logits[b:b + 1] if step.logits is not None else None
            if r in self.running and r.accept(int(t), raw):
                self._leave(r)

    def _leave(self, req: BatchRequest) -> None:
        """A request ends (finished, cancelled or failed): out of the batch; a finished one's full blocks go
        to the prefix cache (a chat's next turn starts from them), the rest back to the pool."""
        if req in self.running:
            self.running.remove(req)
        if req.cache is None:
            return
        if self.prefix_cache and req.finished and not req.cancelled:
            self.kv.keep(req.cache, req.prompt_ids + req.generated)
        else:
            release(req.cache)
        req.cache = None

    def fail_all(self) -> List[BatchRequest]:
        """Drop every request (after an error inside a forward: the batch's caches are in an unknown state);
        returns them so that their callers can be told."""
        self._inflight = None
        if self._solo is not None:
            try:
                self._end_solo()
            except Exception:  # the request is dropped anyway
                self._solo = None
        dropped = self.running + list(self.waiting)
        for r in list(self.running):
            self._leave(r)
        self.waiting.clear()
        return dropped
