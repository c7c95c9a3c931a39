"""Sampling losslessness of speculative decoding in lockstep (mlx_infer/distributed/speculative.py) on a group
of one: the first gamma + 1 tokens of seeded requests with prompt lookup drafts fit the exact joint of plain
sampling (temperature, top-k, top-p and a repetition penalty on) within the noise floor, as the one-process
loop's do (test_lossless_sampling.py; distribution.py builds the expectation with mlx-lm's own pieces). The
sharded loop picks the first token from the prefill's logits and verifies every later round with
verify.verify_round on rank 0 alone; this checks its history and cache bookkeeping under sampling."""

import numpy as np
import pytest
from distribution import K_MAX, cycle_scenario

from mlx_infer.distributed import Group, Shard
from mlx_infer.distributed.speculative import SpecLockstepStats, spec_lockstep_tokens

#: requests (seeds) per distribution test
N = 1000


@pytest.fixture(scope="module")
def cycle(make_tiny):
    return cycle_scenario(make_tiny)


@pytest.mark.parametrize("gamma,tokens", [(5, 6), (0, K_MAX)])
def test_sharded_lookup_sampling_matches_exact(cycle, gamma, tokens):
    """max_draft 5, 6 tokens: the prefill's token, then a round verifying a draft of 4 (what max_tokens leaves
    after the first token), accepted and rejected at every position (at least 10 rounds each way), and its bonus
    or recovered token. max_draft 0: K_MAX tokens, every round a plain draw."""
    shard = Shard(cycle.target, None, {}, None, Group(None, "none"), "none")
    stats = SpecLockstepStats()
    samples = np.array([list(spec_lockstep_tokens(shard, cycle.prompt, cycle.params.with_(seed=s, max_tokens=tokens),
                                                  stats=stats, max_draft=gamma))
                        for s in range(N)])
    fit, floor = cycle.fit(tokens, N)
    z, detail = fit.judge(samples, floor)
    assert z < floor.limit, (z, floor.limit, detail, stats.acceptance)
    if gamma:
        assert len(stats.proposed) == gamma - 1, stats.proposed
        for i in range(1, gamma - 1):
            assert stats.kept[i] >= 10 and stats.proposed[i] - stats.kept[i] >= 10, (stats.proposed, stats.kept)
