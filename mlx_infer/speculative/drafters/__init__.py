"""Drafters: one file each. `Drafter` is the interface (propose from the context, learn from what was
accepted); lookup (prompt lookup, arXiv 2311.03511) and draft_model (a smaller model) are built in."""

from .base import Draft, Drafter
from .draft_model import DraftModelDrafter, check_same_vocab, cut_draft_model
from .lookup import LookupDrafter

__all__ = ["Draft", "Drafter", "DraftModelDrafter", "LookupDrafter", "check_same_vocab", "cut_draft_model"]
