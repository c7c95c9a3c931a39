"""StepAssembler: a request's token ids in, the text to stream out, with EOS, stop strings and max_tokens
deciding where it ends (the one place both the single-request loop and batched decoding do this); a request
with tools gets its final step's tool calls from `with_tool_calls`."""

import json
from typing import Any, Iterable, Optional, Tuple

from mlx_lm.tokenizer_utils import StreamingDetokenizer

from .results import GenerationStep
from .stops import StopStringMatcher


class StepAssembler:
    """Feed it each token the decoder produces; it says what text to deliver and when the request ends.

    Args:
        detokenizer: a streaming detokenizer of the model's tokenizer (reset here; one per live request).
        stops: stop strings (the text ends just before the first one).
        eos: end-of-sequence token ids (ends the request; not counted, not delivered).
        max_tokens: most tokens to deliver (>= 1).
        tools: the request's ToolPlan (None: no tools): a tool call that repeats an earlier one ends the
            request at its end marker ("stop", made "tool_calls" by with_tool_calls; tools/parse.py).

    Usage:
        text = asm.add(token)      # str: deliver it with `token`; None: the request ended (see final)
        text, token, finish = asm.final()   # the last step: its text, its token (None after EOS),
                                            # "stop" (EOS or a stop string) or "length"
    """

    def __init__(self, detokenizer: StreamingDetokenizer, stops: Iterable[str], eos: Iterable[int], max_tokens: int,
                 tools: Any = None):
        detokenizer.reset()
        self._calls = tools.stream() if tools is not None else None  # a ToolStream: is a call repeated?
        self.detokenizer = detokenizer
        self.stops = StopStringMatcher(tuple(stops))
        self.eos = frozenset(eos)
        self.max_tokens = max_tokens
        self.n = 0  # tokens delivered (EOS excluded)
        self.finish: Optional[str] = None
        self._held: Tuple[str, Optional[int]] = ("", None)  # the last token's text, delivered by final()

    def add(self, token: int) -> Optional[str]:
        """The text released by `token` (possibly "" while a stop string or a UTF-8 sequence is incomplete),
        or None when the request has ended with it (EOS, a stop string, a repeated tool call, max_tokens)."""
        if token in self.eos:
            self.finish = "stop"
            return None
        self.n += 1
        self.detokenizer.add_token(token)
        text, hit = self.stops.feed(self.detokenizer.text)
        if self._calls is not None and not hit:
            self._calls.feed(text)
            hit = self._calls.ended
        if hit or self.n >= self.max_tokens:
            self.finish = "stop" if hit else "length"
            self._held = (text, token)
            return None
        return text

    def final(self) -> Tuple[str, Optional[int], str]:
        """(text, token, finish_reason) of the last step; also when the token source ended first (the context
        window: "length")."""
        text, token = self._held
        finish = self.finish or "length"
        if not (finish == "stop" and token is not None):  # no stop string hit yet: the rest of the text
            self.detokenizer.finalize()
            rest, hit = self.stops.feed(self.detokenizer.text)
            text += rest if hit else rest + self.stops.flush(self.detokenizer.text)
            finish = "stop" if hit else finish
        return text, token, finish


def with_tool_calls(final: GenerationStep, plan: Any, text: str) -> GenerationStep:
    """The final step of a request with tools (plan: its ToolPlan; text: the request's whole generated text):
    the calls parsed from the text (ToolPlan.parse) on it, and finish_reason "tool_calls" when the model made
    any and ended by itself. A request cut off by max_tokens keeps "length" and only the calls whose arguments
    are whole JSON (the last one may be cut off). The plain path (generation/request.py) and batched decoding
    (batch/request.py) both end here."""
    _, calls = plan.parse(text)
    if final.finish_reason != "stop":
        calls = [c for c in calls if _is_json(c.arguments)]
    if calls:
        final.tool_calls = list(calls)
        if final.finish_reason == "stop":
            final.finish_reason = "tool_calls"
    return final


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
