"""One choice of an OpenAI answer, built from its request's GenerationSteps as they come: the message (content,
tool calls, finish reason) of a whole answer, or the deltas of a streamed one (content pieces, tool-call deltas,
logprobs), in OpenAI's chat and legacy completions shapes.

A request with tools (its BatchRequest's `tools`, a ToolPlan) has its text read by the plan: not streaming,
`ToolPlan.parse` splits the whole text into content and calls (the final step's `tool_calls` when the engine
gave them); streaming, the plan's ToolStream turns each step's text into content deltas, call starts (id,
name) and argument pieces, sent as `delta.tool_calls[i]` with the call's index.
"""

from typing import Callable, Dict, List, Optional

from ..generation.logprobs import TokenLogprob
from ..generation.results import GenerationStep, ToolCall

#: Token id -> its text (Engine.decode of the one id).
TokenText = Callable[[int], str]


def chat_logprob(lp: TokenLogprob, text: TokenText) -> dict:
    """OpenAI's chat `logprobs.content[j]`: {token, logprob, bytes (UTF-8 of the token's text), top_logprobs}."""
    def entry(token: int, logprob: float) -> dict:
        t = text(token)
        return {"token": t, "logprob": logprob, "bytes": list(t.encode("utf-8", "surrogatepass"))}
    return {**entry(lp.token, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}


class LegacyLogprobs:
    """OpenAI's legacy completions `logprobs`: tokens (texts), token_logprobs, top_logprobs (one dict text ->
    logprob per token: its alternatives and the chosen token, as OpenAI gives up to logprobs + 1), and
    text_offset (each token's character offset in the completion's text)."""

    def __init__(self, text: TokenText):
        self.text, self.offset = text, 0

    def entries(self, lps: List[TokenLogprob]) -> dict:
        """The four lists for these tokens (offsets continue from the tokens given before)."""
        out: Dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for lp in lps:
            t = self.text(lp.token)
            top: Dict[str, float] = {}
            for token, value in lp.top:
                top.setdefault(self.text(token), value)
            top.setdefault(t, lp.logprob)
            out["tokens"].append(t)
            out["token_logprobs"].append(lp.logprob)
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(t)
        return out


def tool_call_object(call: ToolCall) -> dict:
    """OpenAI's `message.tool_calls[i]`."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


class Choice:
    """Choice `index` of an answer, fed its request's steps in order (`add`).

    Args:
        index: the choice's index (0..n-1).
        chat: chat completions (else legacy completions).
        plan: the request's ToolPlan (None without tools).
        text: token id -> text, for logprobs.
        logprobs: whether the request asked for logprobs.
    """

    def __init__(self, index: int, chat: bool, plan, text: TokenText, logprobs: bool):
        self.index, self.chat, self.plan, self.token_text = index, chat, plan, text
        self.logprobs: Optional[List[TokenLogprob]] = [] if logprobs else None
        self.legacy = LegacyLogprobs(text)
        self.texts: List[str] = []
        self.final: Optional[GenerationStep] = None
        self.tools = plan.stream() if plan is not None else None
        self.calls_streamed = 0  # calls started in the stream (their delta indices 0..)

    @property
    def done(self) -> bool:
        return self.final is not None

    def add(self, step: GenerationStep) -> None:
        """Record a step (not streaming)."""
        self.texts.append(step.text)
        if step.logprob is not None and self.logprobs is not None:
            self.logprobs.append(step.logprob)
        if step.finish_reason is not None:
            self.final = step

    # ---- a whole answer

    def calls_and_content(self):
        """(content, [ToolCall]) of the whole text: the plan's reading (the final step's calls when given)."""
        text = "".join(self.texts)
        if self.plan is None:
            return text, []
        content, calls = self.plan.parse(text)
        if self.final is not None and self.final.tool_calls:
            calls = list(self.final.tool_calls)
        return content, calls

    def finish_reason(self, calls: bool) -> str:
        reason = self.final.finish_reason if self.final is not None else "stop"
        return "tool_calls" if calls and reason == "stop" else reason

    def logprobs_object(self, lps: Optional[List[TokenLogprob]]) -> Optional[dict]:
        if lps is None:
            return None
        if self.chat:
            return {"content": [chat_logprob(lp, self.token_text) for lp in lps], "refusal": None}
        return self.legacy.entries(lps)

    def whole(self) -> dict:
        """The choice object of a whole (not streamed) answer."""
        content, calls = self.calls_and_content()
        logprobs = self.logprobs_object(self.logprobs)
        if not self.chat:
            return {"index": self.index, "text": content, "logprobs": logprobs, "finish_reason": self.finish_reason(False)}
        message: dict = {"role": "assistant", "content": content if content or not calls else None}
        if calls:
            message["tool_calls"] = [tool_call_object(c) for c in calls]
        return {"index": self.index, "message": message, "logprobs": logprobs,
                "finish_reason": self.finish_reason(bool(calls))}

    # ---- a streamed answer

    def first(self) -> dict:
        """The choice of the first chunk (chat: the role)."""
        return self._choice({"role": "assistant", "content": ""}) if self.chat else self._choice("")

    def deltas(self, step: GenerationStep) -> List[dict]:
        """The choices of the chunks this step sends (none while its text is held back), the last one with
        the finish reason when the step is the final one."""
        self.add(step)
        lps = [step.logprob] if step.logprob is not None and self.logprobs is not None else None
        out = [self._choice(d) for d in self._pieces(step.text, step.finish_reason is not None)]
        if lps and not out:  # a token whose text is not out yet: its logprobs go now, with an empty delta
            out.append(self._choice({"content": ""} if self.chat else ""))
        if lps:
            out[0]["logprobs"] = self.logprobs_object(lps)
        if step.finish_reason is not None:
            out.append(self._choice({} if self.chat else "", self.finish_reason(self.calls_streamed > 0)))
        return out

    def _pieces(self, text: str, last: bool) -> list:
        """Chat deltas ({"content"} or {"tool_calls": [...]}) or completion texts of a step's text."""
        if not self.chat:
            return [text] if text else []
        if self.tools is None:
            return [{"content": text}] if text else []
        events = self.tools.feed(text) if text else []
        if last:
            events = events + self.tools.finish()
        return [d for d in (self._tool_delta(e) for e in events) if d is not None]

    def _tool_delta(self, event) -> Optional[dict]:
        """The chat delta of one ToolStream event: a content piece, a call's start (index, id, type, name,
        empty arguments) or a piece of its arguments (index, arguments)."""
        if event.kind == "content":
            return {"content": event.text} if event.text else None
        if event.kind == "call":
            self.calls_streamed += 1
            return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                    "function": {"name": event.name, "arguments": ""}}]}
        if not event.text:
            return None
        return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}

    def _choice(self, delta, finish: Optional[str] = None) -> dict:
        key = "delta" if self.chat else "text"
        return {"index": self.index, key: delta, "logprobs": None, "finish_reason": finish}
