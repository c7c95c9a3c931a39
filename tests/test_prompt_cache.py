"""The Engine keeps its last request's KV cache: the next request prefills only what follows the common
prefix (a chat's next turn), with exactly the tokens a fresh prefill gives."""

import pytest

from mlx_infer.engine import Engine
from mlx_infer.kv.store import common_prefix

TURNS = ["Tell me a story about a cat and a dog who live together in a small house.", "And then?", "Why?"]


def fresh(engine: Engine) -> Engine:
    """Another engine over the same model, with no kept cache and no speculative memory."""
    return Engine(engine.model, engine.tokenizer, engine.config, engine.source)


def chat(engine, kwargs, turns=TURNS):
    """Run a chat; per turn (token ids, cached prompt tokens, prompt tokens)."""
    history, out = [], []
    for text in turns:
        history.append({"role": "user", "content": text})
        r = engine.generate(history, max_tokens=12, **kwargs)
        history.append({"role": "assistant", "content": r.text})
        out.append((r.token_ids, r.stats.cached_prompt_tokens, r.stats.prompt_tokens))
    return out


@pytest.mark.parametrize("kwargs", [
    {},
    {"speculative": "lookup", "max_draft": 3},
    {"temperature": 0.0, "repetition_penalty": 1.3},
    {"speculative": "lookup", "max_draft": 2, "repetition_penalty": 1.3},
])
def test_next_turn_reuses_the_history_and_gives_the_same_tokens(tiny_engine, kwargs):
    kept = chat(fresh(tiny_engine), kwargs)
    for i, (ids, cached, prompt) in enumerate(kept):
        one = fresh(tiny_engine)
        history = []
        for text, (prev, _, _) in zip(TURNS[:i], kept):
            history += [{"role": "user", "content": text},
                        {"role": "assistant", "content": tiny_engine.tokenizer.decode(prev)}]
        alone = one.generate(history + [{"role": "user", "content": TURNS[i]}], max_tokens=12, **kwargs)
        assert ids == alone.token_ids, (i, kwargs)
        if i == 0:
            assert cached == 0
        else:  # at least the whole previous prompt came from the cache (the previous answer too, where the
            # text of this random model's answer encodes back to the same tokens)
            assert kept[i - 1][2] <= cached < prompt


def test_a_stopped_request_leaves_a_usable_cache(tiny_engine):
    """A consumer that stops mid-answer (Ctrl-C in chat) leaves the cache holding what it received."""
    engine = fresh(tiny_engine)
    steps = engine.stream_steps(TURNS[0], max_tokens=20, speculative="lookup", max_draft=4)
    for _ in range(5):
        next(steps)
    steps.close()
    again = engine.generate(TURNS[0] + " Please.", max_tokens=10)
    assert again.stats.cached_prompt_tokens > 0
    assert again.token_ids == fresh(tiny_engine).generate(TURNS[0] + " Please.", max_tokens=10).token_ids


def test_reset_forgets_the_cache(tiny_engine):
    engine = fresh(tiny_engine)
    engine.generate(TURNS[0], max_tokens=4)
    engine.reset()
    assert engine.generate(TURNS[0], max_tokens=4).stats.cached_prompt_tokens == 0


def test_common_prefix():
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([], [1]) == 0
    assert common_prefix([1, 2], [1, 2]) == 2


def test_default_model_chat_turn_prefills_only_the_new_message(default_engine):
    engine = fresh(default_engine)
    history = [{"role": "user", "content": "Describe the city of Paris in detail. " * 20}]
    first = engine.generate(history, max_tokens=8)
    history += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "And Rome?"}]
    second = engine.generate(history, max_tokens=8)
    assert second.stats.cached_prompt_tokens >= first.stats.prompt_tokens
    assert second.stats.prompt_tokens - second.stats.cached_prompt_tokens < 30
    assert second.token_ids == fresh(default_engine).generate(history, max_tokens=8).token_ids
