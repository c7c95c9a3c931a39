"""One Engine used from several threads (issue 52, defect 2): calls are serialized, so each request gets the
tokens and text it gets alone; a second request on a thread whose stream is still open raises
EngineBusyError instead of mixing the two."""

import gc
import threading

import pytest

from mlx_infer.errors import EngineBusyError, MlxInferError

PROMPTS = ["Name three colors and say which is the most popular.", "Explain what a CPU does, step by step."]
MAX_TOKENS = 40
ROUNDS = 2


def test_two_threads_get_the_answers_of_each_alone(default_engine):
    """Two threads generate (greedy) and stream different prompts on one engine at once, several times:
    every answer equals that prompt's answer alone, tokens and text."""
    alone = [default_engine.generate(p, max_tokens=MAX_TOKENS) for p in PROMPTS]
    got = {i: [] for i in range(len(PROMPTS))}
    errors = []
    start = threading.Barrier(len(PROMPTS))

    def one(i):
        try:
            start.wait()
            for r in range(ROUNDS):
                if r % 2:
                    text = "".join(default_engine.stream(PROMPTS[i], max_tokens=MAX_TOKENS))
                    got[i].append((None, text))
                else:
                    result = default_engine.generate(PROMPTS[i], max_tokens=MAX_TOKENS)
                    got[i].append((result.token_ids, result.text))
        except BaseException as e:  # reported below, on the test's thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, want in enumerate(alone):
        assert len(got[i]) == ROUNDS
        for ids, text in got[i]:
            assert text == want.text
            assert ids is None or ids == want.token_ids


def test_a_second_request_on_a_thread_with_an_open_stream_raises(default_engine):
    """A stream left open, then generate / stream / generate_batch on the same thread: EngineBusyError (an
    MlxInferError) saying what to do; once the first stream is closed or garbage-collected the engine
    serves again, with the answer of a fresh request."""
    want = default_engine.generate(PROMPTS[1], max_tokens=8)
    steps = default_engine.stream_steps(PROMPTS[0], max_tokens=MAX_TOKENS)
    next(steps)
    with pytest.raises(EngineBusyError, match="close.*batch_runner"):
        default_engine.generate(PROMPTS[1], max_tokens=8)
    with pytest.raises(MlxInferError, match="still streaming"):
        next(default_engine.stream(PROMPTS[1], max_tokens=8))
    with pytest.raises(EngineBusyError):
        default_engine.generate_batch([PROMPTS[1]], max_tokens=8)
    steps.close()
    assert default_engine.generate(PROMPTS[1], max_tokens=8).token_ids == want.token_ids
    chunks = default_engine.stream(PROMPTS[0], max_tokens=MAX_TOKENS)
    next(chunks)
    del chunks  # dropped unfinished: collected, which closes it
    gc.collect()
    assert default_engine.generate(PROMPTS[1], max_tokens=8).token_ids == want.token_ids


def test_another_thread_waits_for_an_open_stream(default_engine):
    """A thread's request while another thread's stream is open waits for it (no error, no mixing) and runs
    once that stream is closed."""
    want = default_engine.generate(PROMPTS[1], max_tokens=8)
    steps = default_engine.stream_steps(PROMPTS[0], max_tokens=MAX_TOKENS)
    next(steps)
    out = []
    other = threading.Thread(target=lambda: out.append(default_engine.generate(PROMPTS[1], max_tokens=8)))
    other.start()
    rest = [s.token for s in steps]  # this stream goes on to its end while the other thread waits
    other.join()
    assert out[0].token_ids == want.token_ids and rest[-1] is None
