"""Errors of the paged KV cache."""

from ..errors import MlxInferError


class KVBudgetError(MlxInferError):
    """The block pool's budget cannot hold the blocks asked for (one line: how many, and what to do)."""
