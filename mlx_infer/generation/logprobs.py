"""Log-probabilities of generated tokens: the model's log-softmax over its raw logits (before penalties,
temperature, masks and sampling filters), the same under plain, speculative and batched decoding, as OpenAI's
`logprobs` / `top_logprobs` report them."""

from collections import deque
from dataclasses import dataclass, field
from typing import Deque, List, Sequence, Tuple

import mlx.core as mx
import numpy as np

from ..defaults import MAX_TOP_LOGPROBS

__all__ = ["MAX_TOP_LOGPROBS", "LogprobQueue", "TokenLogprob", "token_logprobs"]


@dataclass
class TokenLogprob:
    """One generated token's log-probability.

    Attributes:
        token: the token id.
        logprob: its natural-log probability under the model (float, <= 0).
        top: the `top` most likely tokens at that position as (token id, logprob), most likely first ([] when
            top_logprobs is 0).
    """

    token: int
    logprob: float
    top: List[Tuple[int, float]] = field(default_factory=list)


def token_logprobs(logits: mx.array, tokens: Sequence[int], top: int = 0) -> List[TokenLogprob]:
    """TokenLogprob of tokens[i] at row i of the raw logits [N, V] (float; N == len(tokens)), with the `top`
    (0..MAX_TOP_LOGPROBS) most likely tokens of each row. Evaluates."""
    rows = logits.astype(mx.float32)
    logp = rows - mx.logsumexp(rows, axis=-1, keepdims=True)  # [N, V]
    ids = mx.array(list(tokens), dtype=mx.int32)[:, None]
    chosen = mx.take_along_axis(logp, ids, axis=-1)[:, 0]  # [N]
    outs = [chosen]
    if top:
        best = mx.argpartition(-logp, kth=top - 1, axis=-1)[:, :top]  # [N, top], unordered
        outs += [best, mx.take_along_axis(logp, best, axis=-1)]
    mx.eval(outs)
    values = np.array(chosen)
    result = []
    for i, token in enumerate(tokens):
        alts: List[Tuple[int, float]] = []
        if top:
            pairs = zip(np.array(outs[1][i]).tolist(), np.array(outs[2][i]).tolist())
            alts = sorted(pairs, key=lambda p: -p[1])
        result.append(TokenLogprob(int(token), float(values[i]), alts))
    return result


class LogprobQueue:
    """The logprobs of the tokens a token source yields, in yield order: the source `add`s them when it commits
    tokens (before yielding them), the request `take`s one per token it delivers.

    Args:
        top: alternatives per token (0..MAX_TOP_LOGPROBS).
    """

    def __init__(self, top: int = 0):
        self.top = top
        self._q: Deque[TokenLogprob] = deque()

    def add(self, logits: mx.array, tokens: Sequence[int]) -> None:
        """Record tokens[i] scored by raw logits row i ([N, V], N == len(tokens))."""
        if len(tokens):
            self._q.extend(token_logprobs(logits, tokens, self.top))

    def clear(self) -> None:
        """Forget the recorded logprobs not taken (a source closed before delivering their tokens)."""
        self._q.clear()

    def take(self) -> TokenLogprob:
        """The next yielded token's TokenLogprob. Raises IndexError when the source recorded none (a bug)."""
        return self._q.popleft()
