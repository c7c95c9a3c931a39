"""Speculative decoding in lockstep (mlx_infer/distributed/speculative.py) on a group of one: the round's
message, greedy identity with plain lockstep decoding whatever the drafts (right, wrong, partly right), the
cuts at EOS, a stop and max_tokens, a sampled run to max_tokens; the SPEC_REQUEST command and rank 0's front
(LeadEngine) with --spec lookup. The launched runs are test_sharded_speculative.py."""

import queue

import pytest
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from cli.distributed import check_spec
from gguf_factory import Q, tiny_gguf
from mlx_infer.distributed import commands, init_group, load_sharded, lockstep_tokens
from mlx_infer.distributed.front import LeadEngine
from mlx_infer.distributed.speculative import (SpecLockstepStats, _pack, _unpack, check_rollback, message_width,
                                               spec_lockstep_tokens)
from mlx_infer.errors import DistributedError, MlxInferError, RequestError
from mlx_infer.generation.sampling import SamplingParams
from mlx_infer.speculative.drafters.base import Draft, Drafter

PROMPT = [5, 17, 33, 8, 60, 2, 41]


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    """The tiny Q8_0 llama (the CPU kernel layers) as a group of one's shard."""
    path, _, _ = tiny_gguf(tmp_path_factory.mktemp("tiny") / "llama-q8.gguf", "llama", Q.Q8_0, seed=3, layers=4)
    return load_sharded(str(path), init_group("any"))


@pytest.fixture(scope="module")
def plain(shard):
    """Plain lockstep greedy decoding's 24 tokens (no EOS: eos_ids empty)."""
    return list(lockstep_tokens(shard, PROMPT, SamplingParams(max_tokens=24)))


class Oracle(Drafter):
    """Proposes the plain greedy continuation, with the draft token at `wrong` (round r: (r % 4) + 1; None:
    none) replaced, so that rounds accept all, some and none of their drafts."""

    def __init__(self, plain, wrong=True):
        self.plain, self.wrong, self.round = plain, wrong, 0

    def propose(self, context, gamma, worth=None):
        done = len(context) - len(PROMPT)
        draft = list(self.plain[done:done + gamma])
        self.round += 1
        k = self.round % 4 + 1 if self.wrong else None
        if k is not None and k <= len(draft):
            draft[k - 1] = (draft[k - 1] + 1) % 200
        return Draft(draft)


def test_message_round_trip():
    gamma = 4
    msg = _pack(False, 2, [7, 8, 9], [1, 2], gamma)
    assert len(msg) == message_width(gamma) == 13
    assert _unpack(msg, gamma) == (False, 2, [7, 8, 9], [1, 2])
    full = _pack(True, 4, [1, 2, 3, 4, 5], [6, 7, 8, 9], gamma)
    assert len(full) == 13 and _unpack(full, gamma) == (True, 4, [1, 2, 3, 4, 5], [6, 7, 8, 9])
    assert _unpack(_pack(True, 0, [], [], gamma), gamma) == (True, 0, [], [])
    assert message_width(100) == message_width(15) == 35  # the verify width caps the draft


@pytest.mark.parametrize("wrong", [False, True])
def test_greedy_equals_plain_lockstep(shard, plain, wrong):
    stats = SpecLockstepStats()
    got = list(spec_lockstep_tokens(shard, PROMPT, SamplingParams(max_tokens=24), stats=stats, max_draft=5,
                                    drafter=Oracle(plain, wrong)))
    assert got == plain
    assert stats.generated_tokens == 24 and stats.committed == 23  # the first token is the prefill's
    assert stats.accepted > 0 and stats.tau > 1.0 and stats.rounds < 23
    if wrong:
        assert stats.accepted < stats.drafted  # rejections trimmed the KV cache, and the tokens still agree
    else:
        assert stats.accepted == stats.drafted


def test_lookup_drafter_greedy_equals_plain(shard, plain):
    """The default drafter (prompt lookup over the history) on a prompt that repeats itself."""
    prompt = PROMPT * 3
    want = list(lockstep_tokens(shard, prompt, SamplingParams(max_tokens=24)))
    stats = SpecLockstepStats()
    assert list(spec_lockstep_tokens(shard, prompt, SamplingParams(max_tokens=24), stats=stats)) == want
    assert stats.drafted > 0


def test_cuts_at_eos_stop_and_max_tokens(shard, plain):
    eos = plain[9]
    first = plain.index(eos)
    assert list(spec_lockstep_tokens(shard, PROMPT, SamplingParams(max_tokens=24), eos_ids=[eos], max_draft=6,
                                     drafter=Oracle(plain, False))) == plain[:first]
    seen = []

    def stop(token):
        seen.append(token)
        return len(seen) == 11

    assert list(spec_lockstep_tokens(shard, PROMPT, SamplingParams(max_tokens=24), stop=stop, max_draft=6,
                                     drafter=Oracle(plain, False))) == plain[:11]
    assert seen == plain[:11]  # asked once per delivered token, in order
    assert list(spec_lockstep_tokens(shard, PROMPT, SamplingParams(max_tokens=5), max_draft=6,
                                     drafter=Oracle(plain, False))) == plain[:5]


def test_sampled_run_reaches_max_tokens(shard, plain):
    stats = SpecLockstepStats()
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=20)
    got = list(spec_lockstep_tokens(shard, PROMPT, params, stats=stats, max_draft=4, drafter=Oracle(plain, True)))
    assert len(got) == 20 and stats.drafted > 0
    assert all(0 <= t < shard.model.args.vocab_size for t in got)


def test_check_spec_refuses_other_modes():
    assert check_spec(" Lookup ", 8) == "lookup" and check_spec("off", 0) == "off"
    with pytest.raises(MlxInferError, match="--spec 'dflash' does not run over mlx.launch ranks yet; use one of "
                       "off, lookup"):
        check_spec("dflash", 8)
    with pytest.raises(MlxInferError, match="--max-draft must be an integer >= 0"):
        check_spec("lookup", -1)


def test_follow_dispatches_speculative_requests(monkeypatch):
    """SPEC_REQUEST carries max_draft to the speculative follower; a follower without one ends the job."""
    script = iter([[commands.REQUEST, 9], [commands.SPEC_REQUEST, 5], [commands.IDLE, 0], [commands.SHUTDOWN, 0]])
    monkeypatch.setattr(commands, "broadcast_ints", lambda group, values, n, what: next(script))
    plain, spec = [], []
    assert commands.follow(init_group("any"), plain.append, spec.append) == 2 and plain == [9] and spec == [5]
    monkeypatch.setattr(commands, "broadcast_ints", lambda group, values, n, what: [commands.SPEC_REQUEST, 5])
    with pytest.raises(DistributedError, match="a speculative request this rank cannot follow"):
        commands.follow(init_group("any"), plain.append)


def test_lead_sends_spec_request_with_max_draft(monkeypatch):
    sent = []
    monkeypatch.setattr(commands, "broadcast_ints", lambda group, values, n, what: sent.append(list(values)))
    inbox = queue.Queue()
    plain = commands.submit(inbox, 12, lambda: "plain")
    spec = commands.submit(inbox, 12, lambda: "spec", spec_draft=6)
    commands.finish(inbox)
    commands.lead(init_group("any"), inbox, interval=60)
    assert plain.result() == "plain" and spec.result() == "spec"
    assert sent == [[commands.REQUEST, 12], [commands.SPEC_REQUEST, 6], [commands.SHUTDOWN, 0]]


def test_lead_engine_lookup_equals_plain(tmp_path):
    """LeadEngine with speculative "lookup" (a chat's --spec lookup; the server's) over a group of one: the
    same text, tokens and finish reason as plain lockstep, stop strings cut alike, tau in the last step's
    stats; the modes that do not run sharded are a RequestError naming the field."""
    path, _, _ = tiny_gguf(tmp_path / "llama.gguf", "llama", Q.F32, seed=4)
    messages = [{"role": "user", "content": "hello there hello there hello there"}]
    inbox = queue.Queue()
    lead = commands.lead_in_thread(init_group("any"), inbox)
    shard = load_sharded(str(path), init_group("any"))
    plain, spec = LeadEngine(shard, inbox), LeadEngine(shard, inbox, speculative="lookup", max_draft=4)
    try:
        params = SamplingParams(max_tokens=16)
        want, got = list(plain.stream_steps(messages, params)), list(spec.stream_steps(messages, params))
        assert [s.token for s in got] == [s.token for s in want] and len(want) >= 10
        assert "".join(s.text for s in got) == "".join(s.text for s in want)
        assert got[-1].finish_reason == want[-1].finish_reason
        last = got[-1].stats
        assert last.spec_mode == "lookup" and last.rounds > 0 and last.tau >= 1.0
        assert want[-1].stats.spec_mode is None
        text = "".join(s.text for s in want)
        stop = text[4:6]
        cut = SamplingParams(max_tokens=16, stop=(stop,))
        assert "".join(s.text for s in spec.stream_steps(messages, cut)) == text[:text.index(stop)]
        assert plain.batch_request(messages, speculative="lookup").max_draft == 8
        assert spec.batch_request(messages, speculative="off").max_draft is None
        assert spec.batch_request(messages, speculative="lookup", logprobs=1).max_draft is None  # decodes plainly
        with pytest.raises(RequestError, match="'speculative' is not supported while the model is split") as e:
            spec.batch_request(messages, speculative="dflash")
        assert e.value.param == "speculative"
    finally:
        spec.runner.close()
        lead.join()


def test_a_cache_that_cannot_roll_back_is_refused():
    check_rollback([KVCache(), KVCache()])
    for cache in ([KVCache(), RotatingKVCache(max_size=16)], [ArraysCache(2)]):
        with pytest.raises(MlxInferError, match="needs a KV cache that can roll back .* use --spec off"):
            check_rollback(cache)


def test_stats_object_reused_across_requests(shard, plain):
    """A caller's stats object carried over requests (its counters add up) does not cut the next request: each
    request counts its own tokens against max_tokens."""
    stats = SpecLockstepStats()
    for _ in range(2):
        got = list(spec_lockstep_tokens(shard, PROMPT, SamplingParams(max_tokens=24), stats=stats, max_draft=5,
                                        drafter=Oracle(plain, True)))
        assert got == plain
    assert stats.generated_tokens == 48
