"""Eviction policies behind one interface (base.EvictionPolicy), by CLI name."""

from ...errors import MlxInferError
from .base import AttentionStats, EvictionPolicy
from .h2o import H2O
from .random_policy import RandomPolicy
from .scissorhands import Scissorhands
from .snapkv import SnapKV
from .streaming import StreamingLLM

#: CLI name -> policy class.
POLICIES = {p.name: p for p in (H2O, Scissorhands, StreamingLLM, SnapKV, RandomPolicy)}


def make_policy(name: str, **kwargs) -> EvictionPolicy:
    """A fresh policy by name (h2o, scissorhands, streaming, snapkv, random); kwargs go to its constructor.

    Raises:
        MlxInferError: an unknown name.
    """
    if name not in POLICIES:
        raise MlxInferError(f"unknown eviction policy {name!r}: use one of {', '.join(POLICIES)}")
    return POLICIES[name](**kwargs)


__all__ = ["AttentionStats", "EvictionPolicy", "H2O", "POLICIES", "RandomPolicy", "Scissorhands", "SnapKV",
           "StreamingLLM", "make_policy"]
