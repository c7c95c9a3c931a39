"""Errors of the paged KV cache."""

from typing import Optional

from ..errors import MlxInferError


class KVBudgetError(MlxInferError):
    """The block pool's budget cannot hold the blocks asked for (one line: how many, and what to do).

    Args:
        problem: what does not fit (the whole message when `advice` is None).
        advice: what to do about it, after a colon; a caller that speaks to someone else (the server's
            client) can give its own advice after `problem`.
    """

    def __init__(self, problem: str, advice: Optional[str] = None):
        super().__init__(problem if advice is None else f"{problem}: {advice}")
        self.problem = problem
