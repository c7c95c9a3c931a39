"""A request's structured-generation options, checked before any decoding: the output constraint
(`response_format`), the tools, logprobs and jump-forward decoding (`forced_spans`), turned into what the
token source takes (a GrammarState, a LogprobQueue) and what the final step needs (the ToolPlan).

    structured = structured_options(response_format={"type": "json_object"}, logprobs=5)
    grammar = structured.grammar(engine.grammars)   # None when unconstrained; one per request
    queue = structured.queue()                      # None without logprobs

Engine.stream_steps and Engine.batch_request both build theirs here.
"""

from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..errors import RequestError
from ..structured.constraint import Constraint, ConstraintError, response_format as parse_response_format
from ..structured.grammar import Grammars, GrammarState
from .logprobs import MAX_TOP_LOGPROBS, LogprobQueue


@dataclass(frozen=True)
class Structured:
    """A request's checked structured-generation options.

    Attributes:
        grammar_text: llguidance's grammar, compiled and validated (None: unconstrained).
        forced_spans: whether the grammar's forced tokens are committed without sampling (jump-forward).
        top_logprobs: alternatives per token's logprobs, 0..MAX_TOP_LOGPROBS; None: no logprobs.
        tools: the request's ToolPlan (None: no tools).
    """

    grammar_text: Optional[str] = None
    forced_spans: bool = True
    top_logprobs: Optional[int] = None
    tools: Any = None

    def grammar(self, grammars: Grammars) -> Optional[GrammarState]:
        """A fresh GrammarState for one request (None when unconstrained)."""
        return grammars.state(self.grammar_text, self.forced_spans) if self.grammar_text is not None else None

    def queue(self) -> Optional[LogprobQueue]:
        """A fresh LogprobQueue for one request (None without logprobs)."""
        return LogprobQueue(self.top_logprobs) if self.top_logprobs is not None else None


def check_logprobs(logprobs: Any) -> Optional[int]:
    """logprobs as given: None (off) or an int 0..MAX_TOP_LOGPROBS (the alternatives per token).

    Raises:
        RequestError: anything else (param "logprobs").
    """
    if logprobs is None:
        return None
    if not isinstance(logprobs, int) or isinstance(logprobs, bool) or not 0 <= logprobs <= MAX_TOP_LOGPROBS:
        raise RequestError(f"logprobs must be None (off) or an integer in 0..{MAX_TOP_LOGPROBS} (the alternatives "
                           f"per token), got {logprobs!r}", "logprobs")
    return logprobs


def structured_options(grammars: Callable[[], Grammars], response_format: Any = None, logprobs: Any = None,
                       forced_spans: Any = True, tools: Any = None) -> Structured:
    """The request's Structured options, checked (the grammar compiled against the model's tokenizer).

    Args:
        grammars: gives the model's Grammars (called only when there is a constraint).
        response_format: OpenAI's response_format dict, a Constraint, or None.
        logprobs: None or 0..MAX_TOP_LOGPROBS (check_logprobs).
        forced_spans: True or False.
        tools: the request's ToolPlan (None: none); its constraint merges with the response_format's.

    Raises:
        ConstraintError: a bad response_format, an invalid schema / regex / grammar, an unsupported keyword
            (named); RequestError: a bad logprobs or forced_spans.
    """
    top = check_logprobs(logprobs)
    if not isinstance(forced_spans, bool):
        raise RequestError(f"forced_spans must be True or False, got {forced_spans!r}", "forced_spans")
    constraint: Optional[Constraint] = parse_response_format(response_format)
    if tools is not None:
        constraint = tools.merge(constraint)
    text = grammars().compile(constraint) if constraint is not None else None
    return Structured(text, forced_spans, top, tools)


__all__ = ["ConstraintError", "Structured", "check_logprobs", "structured_options"]
