"""A model's grammars (llguidance's tokenizer built once per model) and one request's grammar state: the
tokens allowed next as a bitmask, the tokens the grammar forces, and rollback for speculative drafts.

llguidance (github.com/guidance-ai/llguidance) computes the masks; jump-forward decoding over its forced tokens
follows SGLang's (arXiv 2312.07104).
"""

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Collection, List, Optional, Sequence

import llguidance
import llguidance.hf
import numpy as np
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from ..errors import UnsupportedModelError
from .constraint import Constraint, ConstraintError, _one_line

#: One CPU thread computes masks while the forward runs (llguidance releases the GIL while it computes).
_MASKS = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mlx-infer-mask")


class Grammars:
    """Compiles constraints for one model: llguidance's tokenizer of the model's tokenizer, built on first use.

    Args:
        tokenizer: the model's tokenizer (mlx-lm's TokenizerWrapper or a Hugging Face fast tokenizer).
        vocab: the model's output vocabulary V (logits width; masks cover V tokens).
        eos: the end-of-sequence token ids (the grammar allows them where the output may end).
    """

    def __init__(self, tokenizer, vocab: int, eos: Collection[int]):
        self._hf = getattr(tokenizer, "_tokenizer", tokenizer)
        self.vocab = vocab
        self._eos = sorted(eos)
        self._ll: Optional[llguidance.LLTokenizer] = None
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer (built once, ~0.4 s for a 49k vocabulary).

        Raises:
            UnsupportedModelError: a tokenizer llguidance cannot take (not a Hugging Face fast tokenizer).
        """
        with self._lock:
            if self._ll is None:
                try:
                    self._ll = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab, eos_token=self._eos)
                except Exception as e:  # llguidance raises plain exceptions for tokenizers it cannot read
                    raise UnsupportedModelError(
                        f"constrained generation cannot use this model's tokenizer ({type(self._hf).__name__}: "
                        f"{_one_line(str(e))}); generate without a schema, regex or grammar") from e
            return self._ll

    def compile(self, constraint: Constraint) -> str:
        """The constraint's grammar, checked against the tokenizer (before any decoding).

        Raises:
            ConstraintError: an invalid schema / regex / grammar, or a JSON-schema keyword llguidance does not
                implement (named in the message), param the constraint's field.
        """
        grammar = constraint.grammar
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if failed:
            what = {"json_schema": "JSON schema", "json_object": "JSON", "regex": "regex",
                    "lark": "grammar"}[constraint.kind]
            detail = _one_line("; ".join(messages))
            if detail.startswith("Unimplemented keys"):
                raise ConstraintError(f"the {what} uses keywords that are not supported: {detail.split(':', 1)[1].strip()}"
                                      f" (docs/structured.md lists the supported ones)", constraint.param)
            raise ConstraintError(f"invalid {what}: {detail}", constraint.param)
        return grammar

    def state(self, grammar: str, forced_spans: bool = True) -> "GrammarState":
        """A fresh GrammarState of a compiled grammar (`compile`)."""
        return GrammarState(llguidance.LLMatcher(self.tokenizer, grammar), self.vocab, forced_spans)


class GrammarState:
    """One request's position in its grammar.

    Args:
        matcher: llguidance's LLMatcher of the grammar.
        vocab: V, the model's output vocabulary.
        forced_spans: whether `forced` gives the grammar's forced tokens (jump-forward decoding); False: the
            forced text is decoded token by token under the mask, as the model's own tokens.

    A mask is an int32 array [W] (W = ceil(V / 32)), bit t of word t // 32 set when token t is allowed.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab: int, forced_spans: bool = True):
        self._m = matcher
        self.vocab = vocab
        self.forced_spans = forced_spans
        self._pending: Optional[Future] = None
        # per consumed token: whether the matcher recorded it for rollback (one consumed once the grammar has
        # stopped, end-of-sequence, is not: llguidance's rollback then counts one token fewer)
        self._recorded: List[bool] = []

    def _fill(self) -> np.ndarray:
        out = allocate_token_bitmask(1, self.vocab)
        fill_next_token_bitmask(self._m, out, 0)
        return out[0]

    def mask(self) -> np.ndarray:
        """The allowed next tokens, int32 [W] (the one `prefetch` started, or computed now)."""
        pending, self._pending = self._pending, None
        return pending.result() if pending is not None else self._fill()

    def prefetch(self) -> None:
        """Start computing the next mask on the mask thread (call after `consume`, before the forward's
        read-back); `mask` then waits for it. Nothing new when one is already pending (the state has not
        changed since: every change waits for it first)."""
        if self._pending is None:
            self._pending = _MASKS.submit(self._fill)

    @property
    def prefetched(self) -> bool:
        """Whether a mask started by `prefetch` is pending (not yet taken by `mask`, nor dropped by `close`)."""
        return self._pending is not None

    def close(self) -> None:
        """Drop the prefetched mask of a request that has ended: cancelled where the mask thread has not
        started it yet (the other requests' masks wait behind it on that one thread), else left to finish
        unread. The state stays usable (the next `mask` computes its own)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.cancel()

    def _settle(self) -> None:
        if self._pending is not None:  # the matcher must not change while a mask is computed from it
            self._pending.result()
            self._pending = None

    def consume(self, tokens: Sequence[int]) -> None:
        """Advance over tokens the grammar allows.

        Raises:
            ConstraintError: a token it refuses (a caller's bug: tokens are picked under the mask).
        """
        self._settle()
        for token in tokens:
            stopped = self._m.is_stopped()
            if not self._m.consume_token(int(token)):
                raise ConstraintError(f"token {token} is not allowed by the grammar here: "
                                      f"{_one_line(self._m.get_error())}", None)
            self._recorded.append(not stopped)

    def accepted(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` the grammar accepts (the state is unchanged)."""
        self._settle()
        n = recorded = 0
        for token in tokens:
            stopped = self._m.is_stopped()
            if self._m.try_consume_tokens([int(token)]) != 1:
                break
            n += 1
            recorded += not stopped
        self._m.rollback(recorded)
        return n

    def rollback(self, n: int) -> None:
        """Undo the last n consumed tokens (n <= the tokens consumed)."""
        self._settle()
        if n:
            undone, self._recorded = self._recorded[-n:], self._recorded[:-n]
            self._m.rollback(sum(undone))

    @property
    def consumed(self) -> int:
        """Tokens consumed since the start (an end-of-sequence token after the grammar stopped included)."""
        return len(self._recorded)

    def forced(self) -> List[int]:
        """The tokens the grammar forces from here, in their canonical tokenization ([] when forced_spans is
        off, or when the next token is a choice). Not consumed."""
        if not self.forced_spans:
            return []
        self._settle()
        return list(self._m.compute_ff_tokens())

    @property
    def stopped(self) -> bool:
        """Whether the grammar is complete and nothing but end-of-sequence may follow."""
        self._settle()
        return self._m.is_stopped()

    @property
    def accepting(self) -> bool:
        """Whether the output so far is a complete sentence of the grammar."""
        self._settle()
        return self._m.is_accepting()
