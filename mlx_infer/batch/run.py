"""What the Engine's batched entry points share: a batch run to its end (generate_batch's inputs, loop and
results), a lone request's speculative tokens, the checks of a model for batched decoding."""

from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple, Union

from ..errors import MlxInferError, RequestError
from ..generation.prompt import Prompt
from ..generation.results import GenerationResult, collect
from ..generation.sampling import SamplingParams
from ..rmm.options import Retention
from ..speculative import SpecState
from .request import BatchRequest, Emit
from .scheduler import BatchScheduler


def check_batchable(rmm: Optional[Retention]) -> None:
    """Raise MlxInferError for a model whose attention products are reduced (RMM qk / pv): batched decoding
    does not reduce them."""
    if rmm is not None and rmm.products() != {"qk": 1.0, "pv": 1.0}:
        raise MlxInferError("batched decoding does not reduce the attention products: load the model with "
                            "rmm= without qk / pv for batched requests")


def solo_tokens(spec: SpecState) -> Callable[[BatchRequest], Optional[Iterator[int]]]:
    """BatchScheduler's `solo`: the speculative iterator of a batched request running alone (its cache holds
    its prompt and its tokens but the last; SpecState.tokens), None where speculation cannot pay. Its
    grammar (which has consumed every token delivered) and logprobs go with it: the iterator consumes and
    records the tokens it yields."""

    def tokens(req: BatchRequest) -> Optional[Iterator[int]]:
        if req.speculative is None or req.spec is None or req.cache is None:
            return None
        history = req.prompt_ids + req.generated
        return spec.tokens(history, req.params, req.max_tokens - req.assembler.n, req.speculative, req.spec,
                           req.cache, start=len(history) - 1, grammar=req.grammar, logprobs=req.logprobs)

    return tokens


def run_batch(sched: BatchScheduler, requests: List[BatchRequest]) -> None:
    """Decode every request to its end on `sched` (their steps go to their emit callbacks).

    Raises:
        KVBudgetError: a request that can never fit the KV budget (before anything runs); whatever a step
            raises, after every request was failed with it.
    """
    for r in requests:
        sched.check_fits(r)
    for r in requests:
        sched.add(r)
    try:
        while sched.busy:
            sched.step()
    except BaseException:
        sched.fail_all()
        raise


def batch_inputs(prompts: Sequence[Prompt], params: Union[None, SamplingParams, Sequence[SamplingParams]],
                 sampling: Dict[str, Any], encode: Callable[[Prompt], List[int]]
                 ) -> Tuple[List[List[int]], List[SamplingParams]]:
    """generate_batch's prompts encoded (`encode`: Engine.encode_fitting) and their SamplingParams (one for
    all, one per prompt, or None: the defaults), `sampling`'s overrides applied to each.

    Raises:
        MlxInferError: a single string for prompts, params of another length than prompts, or a bad prompt
            (its message starts with "prompt i: ").
    """
    if isinstance(prompts, str):
        raise MlxInferError("generate_batch takes a list of prompts; for one prompt use generate, or pass [prompt]")
    prompts = list(prompts)
    if isinstance(params, SamplingParams) or params is None:
        params = [params or SamplingParams()] * len(prompts)
    params = list(params)
    if len(params) != len(prompts):
        raise MlxInferError(f"{len(prompts)} prompts but {len(params)} params: give one, or one per prompt")
    params = [p.with_(**sampling) if sampling else p for p in params]
    ids = []
    for i, p in enumerate(prompts):
        try:
            ids.append(encode(p))
        except MlxInferError as e:
            raise MlxInferError(f"prompt {i}: {e}") from e
    return ids, params


def prompt_request(encode: Callable[[], List[int]]) -> List[int]:
    """encode() (Engine.encode_fitting of a batched request's prompt), its MlxInferError raised as a
    RequestError of param "prompt" (a RequestError as it is)."""
    try:
        return encode()
    except RequestError:
        raise
    except MlxInferError as e:
        raise RequestError(str(e), "prompt") from None


def run_collected(sched: BatchScheduler, make: Callable[[List[int], SamplingParams, Emit], BatchRequest],
                  ids: List[List[int]], params: List[SamplingParams]) -> List[GenerationResult]:
    """Run one request per prompt (`make(prompt_ids, params, emit)`: Engine.batch_request) on `sched` to its
    end (run_batch) and collect each one's steps: one GenerationResult per prompt, in order.

    Raises:
        as run_batch.
    """
    steps: List[list] = [[] for _ in ids]
    run_batch(sched, [make(i, p, s.append) for i, p, s in zip(ids, params, steps)])
    return [collect(s) for s in steps]
