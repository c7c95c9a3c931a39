"""Structured generation: constraints (JSON schema, any JSON object, regex, Lark grammar) compiled by
llguidance, applied to the logits as an allowed-token bitmask per step."""

from .constraint import Constraint, json_object, json_schema, lark, regex, response_format
from .grammar import Grammars, GrammarState
from .mask import apply_masks

__all__ = ["Constraint", "Grammars", "GrammarState", "apply_masks", "json_object", "json_schema", "lark", "regex",
           "response_format"]
