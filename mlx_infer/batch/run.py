"""What the Engine's batched entry points share: a batch run to its end, a lone request's speculative tokens,
the checks of a model for batched decoding."""

from typing import Callable, Iterator, List, Optional

from ..errors import MlxInferError
from ..rmm.options import Retention
from ..speculative import SpecState
from .request import BatchRequest
from .scheduler import BatchScheduler


def check_batchable(rmm: Optional[Retention]) -> None:
    """Raise MlxInferError for a model whose attention products are reduced (RMM qk / pv): batched decoding
    does not reduce them."""
    if rmm is not None and rmm.products() != {"qk": 1.0, "pv": 1.0}:
        raise MlxInferError("batched decoding does not reduce the attention products: load the model with "
                            "rmm= without qk / pv for batched requests")


def solo_tokens(spec: SpecState) -> Callable[[BatchRequest], Optional[Iterator[int]]]:
    """BatchScheduler's `solo`: the speculative iterator of a batched request running alone (its cache holds
    its prompt and its tokens but the last; SpecState.tokens), None where speculation cannot pay."""

    def tokens(req: BatchRequest) -> Optional[Iterator[int]]:
        if req.speculative is None or req.spec is None or req.cache is None:
            return None
        history = req.prompt_ids + req.generated
        return spec.tokens(history, req.params, req.max_tokens - req.assembler.n, req.speculative, req.spec,
                           req.cache, start=len(history) - 1)

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
