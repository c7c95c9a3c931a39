"""BatchRequest: one request of batched decoding, from its prompt to its last GenerationStep."""

import time
from collections import deque
from typing import Any, Callable, Deque, List, Optional, Union

import mlx.core as mx
import numpy as np
from mlx_lm.tokenizer_utils import StreamingDetokenizer

from ..generation.assemble import StepAssembler, with_tool_calls
from ..generation.logprobs import LogprobQueue
from ..generation.results import GenerationStats, GenerationStep
from ..generation.sampling import (SamplingParams, build_keyed_sampler, build_logits_processors, build_sampler,
                                   pick_token, sampler_input)
from ..kv.options import EvictSpec
from ..kv.session import KVRequest
from ..speculative import SpecOptions, SpecStats
from ..structured.grammar import GrammarState
from ..structured.mask import apply_masks, one_hot_mask

Emit = Callable[[Union[GenerationStep, BaseException]], None]


class BatchRequest:
    """A validated request waiting for, or in, the batch.

    Args:
        prompt_ids: the prompt, token ids (non-empty, shorter than the context window).
        params: its sampling parameters (validated, `for_vocab` applied).
        max_tokens: most tokens to generate (params.max_tokens capped by the context window).
        detokenizer: its own streaming detokenizer (not shared with another live request).
        eos: end-of-sequence token ids.
        emit: called with each GenerationStep, the last one with finish_reason and stats, or with an
            exception when the request failed (on the scheduler's thread); None until `deliver_to` gives it
            (BatchRunner.submit does).
        speculative: SpecOptions of speculative decoding while the request runs alone (None or mode "off":
            never); its SpecStats are in `spec`.
        rmm: the model's RMM retention in canonical form (str(Retention)), reported in the stats; None when exact.
        evict: token eviction while it decodes in the batch (EvictSpec; None: none), with vToken repacking
            (`repack`) or Naive-Evict; the scheduler gives it a KVRequest (`kv`) when admitted, whose
            stats become GenerationStats.kv. An evicting request never speculates and shares no prefix.
        grammar: the output's GrammarState (None: unconstrained). Each sampled token is picked under its mask
            (after the logits processors); every delivered token is consumed by it; the tokens it forces
            (GrammarState.forced, after each delivered token) are emitted one per decode step without
            sampling, so the tokens equal those of the same request decoded alone.
        logprobs: the LogprobQueue of its tokens' logprobs (None: none): each delivered step carries its
            token's TokenLogprob from the raw logits row it was picked from (`accept`'s `raw`).
        tools: its ToolPlan (None: no tools): the final step carries the calls parsed from the whole text
            (generation.assemble.with_tool_calls).

    With a seed, the request draws from its own MLX random key (mx.random.key(seed)), so its samples do not
    depend on what else is in the batch, and equal a single request's with the same seed.
    """

    def __init__(self, prompt_ids: List[int], params: SamplingParams, max_tokens: int,
                 detokenizer: StreamingDetokenizer, eos, emit: Optional[Emit], speculative: Optional[SpecOptions] = None,
                 rmm: Optional[str] = None, evict: Optional[EvictSpec] = None, repack: bool = True, *,
                 grammar: Optional[GrammarState] = None, logprobs: Optional[LogprobQueue] = None, tools: Any = None):
        self.prompt_ids = list(prompt_ids)
        self.evict, self.repack = evict, repack
        self.kv: Optional[KVRequest] = None  # its eviction and block record, once admitted (evicting only)
        self.rmm = rmm
        self.params = params
        self.max_tokens = max_tokens
        self.assembler = StepAssembler(detokenizer, params.stop, eos, max_tokens, tools)
        self._emit = emit
        self.sampler = build_sampler(params)
        self.keyed_sampler = build_keyed_sampler(params)
        self.processors = build_logits_processors(params)
        self.key: Optional[mx.array] = mx.random.key(params.seed) if params.seed is not None else None
        self.generated: List[int] = []  # every sampled token (EOS included)
        self.cache: Optional[list] = None  # per-layer PagedKVCache, once admitted
        self.reserved_blocks = 0
        self.cached_tokens = 0  # prompt tokens whose KV came from a prefix cache
        self.cancelled = False
        self.finished = False
        self.submitted_at = time.perf_counter()
        self.admitted_at: Optional[float] = None  # when its prefill began
        self.first_at: Optional[float] = None
        self.speculative = speculative if speculative is not None and speculative.on else None
        self.spec: Optional[SpecStats] = SpecStats() if self.speculative is not None else None
        self.grammar, self.logprobs, self.tools = grammar, logprobs, tools
        self.forcing: Deque[int] = deque()  # the grammar's forced tokens still to emit (consumed as emitted)
        self._texts: List[str] = []  # the text delivered so far (a ToolPlan parses it at the end)
        if grammar is not None:
            grammar.prefetch()  # the first token's mask, computed while the request waits and prefills

    def deliver_to(self, emit: Emit) -> None:
        """Hand this request's steps (and the error that may end it) to `emit` from now on (BatchRunner.submit
        points them at the request's handle, or at its caller's own consumer)."""
        self._emit = emit

    def emit(self, item) -> None:
        """Hand a step (or the error that ended the request) to its consumer. A consumer that fails to take
        it (e.g. the server's event loop has closed), or a request without one, is cancelled: the batch goes on
        without it."""
        try:
            if self._emit is None:
                raise LookupError("the request has no consumer")
            self._emit(item)
        except Exception:
            self.cancelled = True

    @property
    def greedy_plain(self) -> bool:
        """Greedy with no logits processor: its token is the argmax of its logits row."""
        return self.params.greedy and not self.processors

    @property
    def sequence(self):
        return self.cache[0].sequence

    @property
    def structured(self) -> bool:
        """Whether its rows need the host between steps: a grammar (its mask needs the token before) or
        logprobs (read from the raw logits row of each token)."""
        return self.grammar is not None or self.logprobs is not None

    def mask(self) -> Optional[np.ndarray]:
        """The bitmask int32 [W] its next token is picked under: one-hot on the next forced token, the
        grammar's mask (the one prefetched at `accept`), or None (unconstrained).

        Raises:
            whatever the grammar raises computing the mask (the request then fails alone)."""
        if self.forcing:
            return one_hot_mask(self.forcing[0], self.grammar.vocab)
        return self.grammar.mask() if self.grammar is not None else None

    def sample(self, logits: mx.array, pending: Optional[mx.array] = None,
               mask: Optional[np.ndarray] = None) -> mx.array:
        """The next token from this request's logits [1, V] (as plain decoding: processors, then the
        grammar's `mask` (int32 [W], None: unconstrained), then sampling.pick_token, with this request's own
        random key when seeded): [1], lazy. pending: the token [1] sampled but not yet accepted (a pipelined
        step), part of the history the logits processors see. A forced token is taken as it is (no draw:
        the random key moves only where plain decoding samples)."""
        if self.forcing:
            return mx.array([self.forcing[0]], dtype=mx.uint32)
        logits = logits.astype(mx.float32)  # as plain decoding and the speculative loop pick from
        if self.processors:
            history = mx.array((self.prompt_ids + self.generated)[-self.params.repetition_context_size:], mx.uint32)
            if pending is not None:
                history = mx.concatenate([history, pending.astype(mx.uint32)])[-self.params.repetition_context_size:]
            for p in self.processors:
                logits = p(history, logits)
        if mask is not None:
            logits = apply_masks(logits, [mask])
        if self.key is None or self.params.greedy:
            return pick_token(logits, self.params, self.sampler)
        token, self.key = self.keyed_sampler(sampler_input(logits, self.params), self.key)
        return token

    def accept(self, token: int, raw: Optional[mx.array] = None, committed: bool = False) -> bool:
        """Deliver a token; True when the request has ended (its final step emitted, or failed).

        Args:
            token: the token picked from its row (or the next forced one).
            raw: the raw logits row [1, V] it was picked from (its logprob; needed with logprobs).
            committed: its source already consumed it into the grammar and recorded its logprob (a lone
                request's speculative iterator); only its logprob is taken.

        A grammar that refuses it or fails fails this request alone (`fail`: the error is emitted)."""
        self.first_at = self.first_at or time.perf_counter()
        self.generated.append(token)
        text = self.assembler.add(token)
        if not committed:
            try:
                self._advance(token, ended=text is None)
            except Exception as e:  # ConstraintError, or llguidance's own error: this request only
                self.fail(e)
                return True
            if self.logprobs is not None:
                self.logprobs.add(raw, [token])
        if text is not None:
            self._texts.append(text)
            logprob = self.logprobs.take() if self.logprobs is not None else None
            self.emit(GenerationStep(text, token, logprob=logprob))
            return False
        self.finish()
        return True

    def _advance(self, token: int, ended: bool) -> None:
        """The grammar consumes the token; unless the request ended, it plans the next: the tokens it forces
        (after a forced span's last token, asked again, as plain decoding does) or the mask, started on the
        mask thread (GrammarState.prefetch) while the next forward runs."""
        if self.grammar is None:
            return
        if self.forcing:
            self.forcing.popleft()
        self.grammar.consume([token])
        if not ended and not self.forcing:
            self._plan()

    def _plan(self) -> None:
        if not self.grammar.stopped:
            self.forcing.extend(self.grammar.forced())
        if not self.forcing:
            self.grammar.prefetch()

    def resume(self) -> None:
        """Back in the batch after its speculative iterator closed (which rolled its cache and grammar back
        to the tokens delivered): the logprobs it recorded for tokens not delivered are dropped, and the
        grammar plans the next token (`_advance`)."""
        if self.logprobs is not None:
            self.logprobs.clear()
        if self.grammar is not None and not self.finished:
            self.forcing.clear()
            self._plan()

    def finish(self, cancelled: bool = False) -> None:
        """Emit the final step: finish_reason "stop" / "length" (or "cancelled": the text so far, nothing
        held back), and stats."""
        if self.finished:
            return
        self.finished = True
        if self.grammar is not None:
            self.grammar.close()  # a mask prefetched for a token that will not come
        end = time.perf_counter()
        text, token, reason = self.assembler.final()
        reason = "cancelled" if cancelled else reason
        first = self.first_at or end
        n = self.assembler.n
        began = self.admitted_at or self.submitted_at
        pool = self.sequence.pool if self.cache is not None else None  # its KV blocks' pool (None: never admitted)
        stats = GenerationStats(
            prompt_tokens=len(self.prompt_ids),
            generated_tokens=n,
            ttft_s=first - self.submitted_at,
            prefill_tps=(len(self.prompt_ids) - self.cached_tokens) / (first - began) if first > began else 0.0,
            decode_tps=(n - 1) / (end - first) if n > 1 and end > first else 0.0,
            total_s=end - self.submitted_at,
            peak_memory_bytes=int(mx.get_peak_memory()),
            cached_prompt_tokens=self.cached_tokens,
            kv_bits=str(pool.quant) if pool is not None and pool.quant is not None else None,
            kv_bytes_per_token=float(pool.num_layers * pool.token_bytes) if pool is not None else 0.0,
            rmm=self.rmm,
            kv=self.kv.stats() if self.kv is not None else None,
        )
        if self.spec is not None:
            stats.spec_mode, stats.tau, stats.rounds = self.spec.mode or "off", self.spec.tau, self.spec.rounds
            stats.draft_s, stats.verify_s, stats.acceptance = self.spec.draft_s, self.spec.verify_s, self.spec.acceptance
        logprob = self.logprobs.take() if self.logprobs is not None and token is not None else None
        final = GenerationStep(text, token, finish_reason=reason, stats=stats, logprob=logprob)
        if self.tools is not None and not cancelled:
            final = with_tool_calls(final, self.tools, "".join(self._texts) + text)
        self.emit(final)

    def fail(self, error: BaseException) -> None:
        """End the request with an error (emitted in the place of its final step)."""
        if not self.finished:
            self.finished = True
            if self.grammar is not None:
                self.grammar.close()
            self.emit(error)
