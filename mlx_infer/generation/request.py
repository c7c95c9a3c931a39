"""One request, from its validated prompt to its last GenerationStep: the KV from the engine's store, a token
source (plain decoding, or speculative), the text assembled as tokens come, the KV kept or released at the
end, the stats.

    request = Request(prompt_ids, params, max_tokens, SpecOptions("off"))
    for step in run_request(decoding, request):   # decoding: what the engine lends (Decoding)
        print(step.text, end="")

Engine.stream_steps checks the arguments, encodes the prompt and calls run_request; batched requests run in
batch/ instead.
"""

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Dict, Iterator, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.tokenizer_utils import StreamingDetokenizer

from ..errors import MlxInferError
from ..kv.observe import QueryTap
from ..kv.options import EvictSpec, parse_evict
from ..kv.quant_cache import kv_bytes_per_token
from ..kv.store import KVStore, Tracked
from ..rmm.attention import reduced_products
from ..speculative import SpecOptions, SpecState, SpecStats
from ..structured.grammar import GrammarState
from .assemble import StepAssembler, with_tool_calls
from .compiled import CompiledSteps
from .decode import plain_tokens
from .logprobs import LogprobQueue
from .results import GenerationStats, GenerationStep
from .sampling import SamplingParams


@dataclass
class Decoding:
    """What a request borrows from its engine, fixed while it runs.

    Attributes:
        model: the mlx-lm model.
        store: the engine's KVStore (dense or paged).
        spec: the model's SpecState (drafters, schedulers, measured costs).
        detokenizer: the engine's streaming detokenizer (reset per request).
        eos: the end-of-sequence token ids.
        compiled: the model's compiled one-token steps (Engine.compiled_steps), asked for when plain decoding
            runs.
        products: the RMM attention products to reduce (rmm.attention.reduced_products' arguments; {}: exact).
        kv_bits, rmm: reported in the stats (GenerationStats.kv_bits, .rmm).
    """

    model: nn.Module
    store: KVStore
    spec: SpecState
    detokenizer: StreamingDetokenizer
    eos: Collection[int]
    compiled: Callable[[], CompiledSteps]
    products: Dict[str, float] = field(default_factory=dict)
    kv_bits: Optional[str] = None
    rmm: Optional[str] = None


@dataclass
class Request:
    """A validated request.

    Attributes:
        prompt_ids: the prompt (non-empty, shorter than the context window).
        params: sampling parameters (`for_vocab` applied).
        max_tokens: most tokens to generate (params.max_tokens capped by the context window).
        options: speculative decoding (SpecOptions; mode "off": plain decoding).
        progress: callable(done, total) during prefill, prompt tokens.
        evict: token eviction (EvictSpec; None: none; check_evict), with vToken repacking or Naive-Evict.
        grammar: the output's GrammarState (None: unconstrained; generation/structured_request.py builds it).
        logprobs: the LogprobQueue the token source fills (None: no logprobs).
        tools: the request's ToolPlan (None: no tools): the final step carries the calls parsed from the text.
    """

    prompt_ids: List[int]
    params: SamplingParams
    max_tokens: int
    options: SpecOptions
    progress: Optional[Callable[[int, int], None]] = None
    evict: Optional[EvictSpec] = None
    repack: bool = True
    grammar: Optional[GrammarState] = None
    logprobs: Optional[LogprobQueue] = None
    tools: Any = None


def sampling_params(params: Optional[SamplingParams], overrides: Dict[str, Any], vocab_size: int) -> SamplingParams:
    """params (None: the defaults) with `overrides` applied to its fields, checked against the vocabulary.

    Raises:
        MlxInferError: a bad field (SamplingParams.with_ / for_vocab).
    """
    params = params or SamplingParams()
    return (params.with_(**overrides) if overrides else params).for_vocab(vocab_size)


def check_evict(evict: Optional[str], repack: bool, options: SpecOptions, model: nn.Module,
                evicts: bool = True) -> Optional[EvictSpec]:
    """The request's EvictSpec (None: no eviction).

    Args:
        evict: "POLICY:RATIO" or None; repack: True or False.
        options: the request's speculative decoding (eviction only with "off", or "auto" which then decodes
            plainly).
        evicts: whether the cache the request runs on evicts (KVStore.evicts; batched requests: True).

    Raises:
        MlxInferError: a bad evict or repack, or a bad pairing; UnsupportedModelError: a model whose
            attention the query tap cannot reach.
    """
    spec = parse_evict(evict)
    if not isinstance(repack, bool):
        raise MlxInferError(f"repack must be True or False, got {repack!r}")
    if spec is None:
        return None
    QueryTap(model)  # raises for a model whose attention statistics cannot be collected
    if not evicts:
        raise MlxInferError("evict needs the paged KV cache: load with kv_cache='paged' (CLI: --kv-cache paged)")
    if options.on and options.mode != "auto":
        raise MlxInferError(f"eviction with speculative decoding is not supported yet: use speculative='off' "
                            f"or 'auto' (which then decodes plainly), not {options.mode!r}")
    return spec


def _token_source(run: Decoding, req: Request, cache: list, cached: int,
                  spec: Optional[SpecStats]) -> Iterator[int]:
    """The request's tokens: speculative when asked for and it can pay (SpecState.tokens), else plain."""
    tokens = None
    if spec is not None and req.evict is not None:
        spec.mode = "off"  # speculative="auto" with eviction: plain decoding (not supported together yet)
    elif spec is not None:
        tokens = run.spec.tokens(req.prompt_ids, req.params, req.max_tokens, req.options, spec, cache, cached,
                                 req.progress, grammar=req.grammar, logprobs=req.logprobs)
    if tokens is None:
        tokens = plain_tokens(run.model, req.prompt_ids, req.params, req.max_tokens, cache, cached, req.progress,
                              compiled=run.compiled().decode, grammar=req.grammar, logprobs=req.logprobs)
    return tokens


def _open(run: Decoding, req: Request, spec: Optional[SpecStats]) -> Tuple[list, int, Tracked, Iterator[int]]:
    """(cache, cached, tracked, tokens): the request's KV from the store (a prefix of its prompt when it
    evicts nothing: an evicting request's cache stops matching a prefill of its tokens, and its blocks are
    repacked), room reserved, and its token source. On an error the KV is released.

    Raises:
        KVBudgetError: the request cannot fit the KV budget; MlxInferError: a drafter that cannot load, ...
    """
    cache, cached = run.store.start(req.prompt_ids, share=req.evict is None)
    try:
        run.store.reserve(cache, len(req.prompt_ids), req.max_tokens, req.evict, req.repack)
        tracked = run.store.track(cache, req.evict, req.repack)
        return cache, cached, tracked, _token_source(run, req, cache, cached, spec)
    except BaseException:
        run.store.release(cache)
        raise


def run_request(run: Decoding, req: Request) -> Iterator[GenerationStep]:
    """The steps of one request: a GenerationStep per token, the last one with finish_reason and stats.

    When the consumer stops (the generator is closed), the token source rolls its cache back to the tokens
    delivered and the store keeps them for the next request; an error in a forward, or eviction, leaves a cache
    that is released instead (it no longer equals a fresh prefill of its tokens).

    Raises:
        KVBudgetError: the request cannot fit the KV budget (before prefill); MlxInferError: a drafter that
            cannot load; whatever a forward raises.
    """
    asm = StepAssembler(run.detokenizer, req.params.stop, run.eos, req.max_tokens, req.tools)
    mx.reset_peak_memory()
    start = time.perf_counter()
    spec = SpecStats() if req.options.on else None
    cache, cached, tracked, tokens = _open(run, req, spec)
    first_at: Optional[float] = None
    delivered: List[int] = []  # every token the source gave, EOS included (what the cache may hold)
    texts: List[str] = []  # the text delivered (kept for a ToolPlan's parse)
    clean = False
    try:
        with tracked, reduced_products(**run.products):
            for token in tokens:
                first_at = first_at or time.perf_counter()
                delivered.append(token)
                tracked.step()
                text = asm.add(token)
                if text is None:
                    break
                logprob = req.logprobs.take() if req.logprobs is not None else None
                texts.append(text)
                yield GenerationStep(text, token, logprob=logprob)
        clean = True
    except GeneratorExit:  # the consumer stopped: the token source rolls its cache back to `delivered`
        clean = True
        raise
    finally:
        tokens.close()  # type: ignore[attr-defined]  # both token sources are generators
        token_bytes = kv_bytes_per_token(cache)
        kv_stats = tracked.stats()
        if clean and req.evict is None:
            run.store.keep(cache, list(req.prompt_ids) + delivered)
        else:
            run.store.release(cache)
    end = time.perf_counter()
    held_text, held_token, finish = asm.final()
    stats = _stats(run, req, cached, asm.n, start, first_at or end, end, kv_stats, token_bytes, spec)
    logprob = req.logprobs.take() if req.logprobs is not None and held_token is not None else None
    final = GenerationStep(held_text, held_token, finish_reason=finish, stats=stats, logprob=logprob)
    yield with_tool_calls(final, req.tools, "".join(texts) + held_text) if req.tools is not None else final


def _stats(run: Decoding, req: Request, cached: int, n: int, start: float, first_at: float, end: float,
           kv: Optional[dict], token_bytes: float, spec: Optional[SpecStats]) -> GenerationStats:
    """GenerationStats of a request that generated n tokens: times in seconds from time.perf_counter."""
    prefilled = len(req.prompt_ids) - cached
    stats = GenerationStats(
        prompt_tokens=len(req.prompt_ids),
        generated_tokens=n,
        ttft_s=first_at - start,
        prefill_tps=prefilled / (first_at - start) if first_at > start else 0.0,
        decode_tps=(n - 1) / (end - first_at) if n > 1 and end > first_at else 0.0,
        total_s=end - start,
        peak_memory_bytes=int(mx.get_peak_memory()),
        cached_prompt_tokens=cached,
        kv=kv,
        kv_bits=run.kv_bits,
        kv_bytes_per_token=round(token_bytes, 3),
        rmm=run.rmm,
    )
    if spec is not None:
        stats.spec_mode, stats.tau, stats.rounds = spec.mode, spec.tau, spec.rounds
        stats.draft_s, stats.verify_s, stats.acceptance = spec.draft_s, spec.verify_s, spec.acceptance
    return stats
