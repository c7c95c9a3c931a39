"""The asyncio API (mlx_infer/aio.py): `await engine.agenerate(...)` and `async for chunk in engine.astream(...)`
on the engine's own BatchRunner. Concurrent coroutines decode together and get each its answer alone; leaving a
stream (break, a cancelled task) gives the request's KV blocks back; seeded answers repeat."""

import asyncio
import threading
import time

import pytest

import mlx_infer
from mlx_infer import GenerationResult, RequestError

PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]
LONG = "Tell me a long story about a dragon and a knight."
#: Seconds before a wait gives up: only to fail a hang (the work's length depends on the machine).
WAIT_S = 900


def wait_for(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        threading.Event().wait(0.05)


@pytest.fixture(scope="module")
def engine(default_gguf):
    """An engine of its own (float KV, dense): its async runner starts with the first async request."""
    return mlx_infer.load()


def requests_hold_no_blocks(engine) -> bool:
    """The async runner is idle and only the prefix cache's idle blocks are left in its pool."""
    runner = engine._aio.runner
    kv = runner.scheduler.kv
    return not runner.scheduler.busy and kv.pool.blocks_in_use == kv.prefix.idle_blocks


def test_coroutines_decode_together_and_each_gets_its_answer_alone(engine):
    alone = [engine.generate(p, max_tokens=16).token_ids for p in PROMPTS]

    async def both():
        return await asyncio.gather(*(engine.agenerate(p, max_tokens=16) for p in PROMPTS))

    results = asyncio.run(both())
    assert all(isinstance(r, GenerationResult) for r in results)
    assert [r.token_ids for r in results] == alone
    assert [r.text for r in results] == [engine.decode(ids) for ids in alone]  # no special tokens in 16 of them


def test_astream_gives_the_text_of_generate(engine):
    want = engine.generate(PROMPTS[1], max_tokens=20).text

    async def chunks():
        return [c async for c in engine.astream(PROMPTS[1], max_tokens=20)]

    got = asyncio.run(chunks())
    assert "".join(got) == want and all(got)


def test_breaking_out_of_astream_frees_the_request_blocks(engine):
    asyncio.run(engine.agenerate("Hi", max_tokens=2))  # the runner started
    wait_for(lambda: requests_hold_no_blocks(engine), "the runner to go idle")
    kv = engine._aio.runner.scheduler.kv
    baseline = kv.pool.blocks_in_use
    held, requests = [], []

    async def three_chunks():
        stream = engine.astream(LONG, max_tokens=2000)
        async for _ in stream:
            held.append(kv.pool.blocks_in_use)
            requests.append(stream._steps._handle.request)
            if len(held) == 3:
                break  # the stream is dropped here: its request is cancelled

    asyncio.run(three_chunks())
    assert min(held) > baseline  # the request held blocks while it decoded
    wait_for(lambda: requests_hold_no_blocks(engine), "the cancelled request to leave")
    request = requests[-1]
    assert request.finished and request.cancelled and len(request.generated) < 2000
    assert kv.pool.blocks_in_use == kv.prefix.idle_blocks  # only cached prefix blocks are left


def test_a_cancelled_task_cancels_its_request(engine):
    async def cancel_mid_way():
        task = asyncio.ensure_future(engine.agenerate(LONG, max_tokens=2000))
        while not engine._aio.runner.scheduler.busy:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel_mid_way())
    wait_for(lambda: requests_hold_no_blocks(engine), "the cancelled request to leave")


def test_seeded_answers_repeat(engine):
    async def three():
        return await asyncio.gather(engine.agenerate(PROMPTS[0], max_tokens=24, temperature=0.9, seed=7),
                                    engine.agenerate(PROMPTS[1], max_tokens=24),
                                    engine.agenerate(PROMPTS[0], max_tokens=24, temperature=0.9, seed=7))

    first, _, again = asyncio.run(three())
    alone = asyncio.run(engine.agenerate(PROMPTS[0], max_tokens=24, temperature=0.9, seed=7))
    assert first.token_ids == again.token_ids == alone.token_ids


def test_bad_arguments_raise_before_anything_runs(engine):
    with pytest.raises(RequestError, match="temperature") as err:
        engine.astream("Hi", temperature=-1)
    assert err.value.param == "temperature"

    async def empty():
        await engine.agenerate("   ")

    with pytest.raises(RequestError, match="empty") as err:
        asyncio.run(empty())
    assert err.value.param == "prompt"


def test_sync_calls_wait_for_the_async_runner(engine):
    """A sync request from another thread while async requests decode waits for them, then gives its answer
    alone (the runner's thread holds the engine while it has requests)."""
    want = engine.generate(PROMPTS[0], max_tokens=12).token_ids
    got = {}

    async def alongside():
        stream = engine.astream(LONG, max_tokens=40)
        first = await stream.__anext__()
        thread = threading.Thread(target=lambda: got.update(ids=engine.generate(PROMPTS[0], max_tokens=12).token_ids))
        thread.start()
        rest = [c async for c in stream]
        await asyncio.get_running_loop().run_in_executor(None, thread.join)
        return first, rest

    first, rest = asyncio.run(alongside())
    assert got["ids"] == want and first and rest
