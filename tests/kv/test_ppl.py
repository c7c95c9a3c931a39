"""bench/ppl.py's teacher-forced core: without eviction its NLL and argmax are those of one full forward of
the model over the window (dense and paged caches alike); with eviction the prefill's prediction is
unchanged, later ones move, and the cache holds what the ratio allows."""

import math
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from mlx_infer.kv.options import EvictSpec
from mlx_infer.kv.session import PagedKV

BENCH = Path(__file__).resolve().parent.parent.parent / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))
import ppl as bench_ppl  # noqa: E402

#: A fixed window of default-model token ids (no tokenizer needed).
PREFIX = 24
WINDOW = [(i * 7919 + 13) % 4000 + 100 for i in range(PREFIX + 16)]


def full_forward(model, tokens, prefix_len):
    """(nll float64 [N - P], argmax int64 [N - P]) from one forward over the window: log-softmax of the
    logits at positions P-1 .. N-2, scored against tokens[P .. N-1]."""
    logits = model(mx.array(tokens)[None])[0].astype(mx.float32)  # [N, vocab]
    logp = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True), np.float64)
    rows = np.arange(prefix_len - 1, len(tokens) - 1)
    return -logp[rows, np.array(tokens[prefix_len:])], logp[rows].argmax(-1)


def test_no_eviction_equals_one_full_forward(default_model):
    want_nll, want_top = full_forward(default_model, WINDOW, PREFIX)
    assert want_nll.shape == (len(WINDOW) - PREFIX,) and np.all(want_nll > 0)
    calls = []
    dense_nll, dense_top = bench_ppl.window_nll(default_model, WINDOW, PREFIX, lambda: make_prompt_cache(default_model),
                                                lambda cache: calls.append(cache[0].offset))
    assert calls == list(range(PREFIX, len(WINDOW) - 1))  # after every forward but the last
    kv = PagedKV(default_model, None, 16)
    paged_nll, paged_top, stats = bench_ppl.paged_nll(default_model, kv, WINDOW, PREFIX, None)
    for nll, top in ((dense_nll, dense_top), (paged_nll, paged_top)):
        np.testing.assert_allclose(nll, want_nll, rtol=1e-4, atol=2e-4)
        np.testing.assert_array_equal(top, want_top)
    assert stats["evicted_tokens"] == 0 and stats["live_tokens"] == len(WINDOW) - 1
    assert kv.pool.blocks_in_use == 0  # the request's blocks went back
    assert math.isclose(bench_ppl.ppl(paged_nll), math.exp(want_nll.mean()), rel_tol=1e-4)


def test_eviction_changes_only_what_follows_the_prefill(default_model):
    want_nll, _ = full_forward(default_model, WINDOW, PREFIX)
    kv = PagedKV(default_model, None, 16)
    nll, top, stats = bench_ppl.paged_nll(default_model, kv, WINDOW, PREFIX, EvictSpec("streaming", 0.5))
    assert nll.shape == top.shape == want_nll.shape
    np.testing.assert_allclose(nll[0], want_nll[0], rtol=1e-4, atol=2e-4)  # scored before any eviction
    assert np.abs(nll[1:] - want_nll[1:]).max() > 1e-2  # half the context gone: the predictions move
    # the last eviction left ceil(0.5 * (N - 2)) of N - 2 tokens live, then the last forward added one
    assert stats["live_tokens"] == math.ceil(0.5 * (len(WINDOW) - 2)) + 1
    assert stats["evicted_tokens"] == len(WINDOW) - 1 - stats["live_tokens"]
