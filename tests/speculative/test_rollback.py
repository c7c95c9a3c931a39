"""Rollback edge cases. Convention (see mlx_infer/speculative/loop.py): when the token generator stops,
the target cache holds prompt + yielded tokens except the last yielded one: offset == P + yielded - 1."""

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

from mlx_infer import MlxInferError
from mlx_infer.generation.decode import plain_tokens
from mlx_infer.generation.sampling import SamplingParams
from mlx_infer.speculative import DraftModelDrafter, LookupDrafter, SpecStats, speculative_tokens

PROMPT = [3, 9, 27, 17, 51, 25, 11, 33, 35, 41]
GREEDY = SamplingParams()


def offset(cache):
    offs = {c.offset for c in cache}
    assert len(offs) == 1
    return offs.pop()


@pytest.mark.parametrize("drafter, max_draft", [("draft", 8), ("lookup", 0)], ids=["accepted-block", "launched-ahead"])
def test_stop_inside_accepted_block_and_close_mid_round(target, drafter, max_draft):
    """A consumer that stops at token k (as the Engine does at EOS or a stop string) leaves the cache at
    P + k - 1, and decoding resumed from it continues exactly as plain: inside an 8-token accepted block,
    and with max_draft 0, where every round is plain and the next one is already launched (as mlx-lm's
    generate_step) when the consumer stops."""
    base = list(plain_tokens(target, PROMPT, GREEDY, 12))
    for k in (1, 2, 5):
        cache = make_prompt_cache(target)
        d = DraftModelDrafter(target) if drafter == "draft" else LookupDrafter()
        stats = SpecStats()
        gen = speculative_tokens(target, PROMPT, GREEDY, 12, d, max_draft, stats=stats, cache=cache)
        got = [next(gen) for _ in range(k)]
        gen.close()
        assert got == base[:k]
        assert offset(cache) == len(PROMPT) + k - 1
        assert stats.committed == k  # tau counts the tokens delivered, not those past the stop
        # resume: the pending token is got[-1]; the cache must hold exactly PROMPT + got[:-1]
        logits = target(mx.array([got[-1]])[None], cache=cache)
        assert int(mx.argmax(logits[0, -1]).item()) == base[k]


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 9])
def test_max_tokens_mid_block(target, max_tokens):
    cache = make_prompt_cache(target)
    out = list(speculative_tokens(target, PROMPT, GREEDY, max_tokens, DraftModelDrafter(target), 8, cache=cache))
    assert out == list(plain_tokens(target, PROMPT, GREEDY, max_tokens))
    assert offset(cache) == len(PROMPT) + max_tokens - 1


def test_plain_rounds_launched_ahead(target):
    """With max_draft 0 every round is plain and launched before the previous one is read back: the
    tokens are plain decoding's, one width-1 forward each (none wasted), and the cache ends at P + n - 1."""
    base = list(plain_tokens(target, PROMPT, GREEDY, 10))
    spy = WidthSpy(target)
    cache = make_prompt_cache(target)
    assert list(speculative_tokens(spy, PROMPT, GREEDY, 10, LookupDrafter(), 0, cache=cache)) == base
    assert offset(cache) == len(PROMPT) + 9
    assert spy.widths.count(1) == 10


class WidthSpy(nn.Module):
    """Wraps a model and records the width of every forward (its lm_head shows the output vocabulary)."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.lm_head = model, model.lm_head
        self.layers = model.layers
        self._widths = []

    @property
    def widths(self):
        return self._widths

    def __call__(self, x, cache=None):
        self._widths.append(x.shape[1])
        return self.inner(x, cache=cache)


def test_gamma_larger_than_remaining(target):
    spy = WidthSpy(target)
    cache = make_prompt_cache(target)
    out = list(speculative_tokens(spy, PROMPT, GREEDY, 3, DraftModelDrafter(target), 8, cache=cache))
    assert out == list(plain_tokens(target, PROMPT, GREEDY, 3))
    decode_widths = spy.widths[1:]  # after the prefill
    assert max(decode_widths) <= 3, "a round never verifies past max_tokens"
    assert offset(cache) == len(PROMPT) + 2


def test_lookup_rollback_after_rejections(target):
    """Lookup drafts on a copy-heavy prompt get partly rejected; the cache still ends at the convention."""
    prompt = PROMPT * 3
    cache = make_prompt_cache(target)
    out = list(speculative_tokens(target, prompt, GREEDY, 15, LookupDrafter(), 6, cache=cache))
    assert out == list(plain_tokens(target, prompt, GREEDY, 15))
    assert offset(cache) == len(prompt) + 14


class FrozenCache:
    """A cache that cannot roll back (as recurrent / SSM state)."""

    offset = 0

    def is_trimmable(self):
        return False


def test_untrimmable_cache_is_a_clear_error(target):
    gen = speculative_tokens(target, PROMPT, GREEDY, 4, LookupDrafter(), 4, cache=[FrozenCache()])
    with pytest.raises(MlxInferError, match="roll back"):
        next(gen)


def test_rotating_window_too_small_is_a_clear_error(target):
    cache = [RotatingKVCache(max_size=16) for _ in target.layers]
    gen = speculative_tokens(target, PROMPT, GREEDY, 32, LookupDrafter(), 4, cache=cache)
    with pytest.raises(MlxInferError, match="sliding-window"):
        next(gen)


def test_draft_model_vocab_mismatch_is_a_clear_error():
    from mlx_infer.speculative.drafters.draft_model import check_same_vocab

    class Tok:
        def __init__(self, v):
            self.v = v

        def get_vocab(self):
            return self.v

    with pytest.raises(MlxInferError, match="tokenizer"):
        check_same_vocab(Tok({"a": 0, "b": 1}), Tok({"a": 0, "c": 1}))
