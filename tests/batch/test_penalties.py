"""A batched request's logits processors (repetition / presence / frequency penalties) see the history a lone
request's see: the prompt and every token before the one being picked, once each. A newcomer's first decode
step in the batch saw its first token twice (in the request's tokens and again as the pending one), which
shifts the repetition window and doubles that token's frequency penalty."""

from mlx_infer import SamplingParams
from mlx_infer.batch.run import run_batch


def test_each_pick_sees_the_prompt_and_the_tokens_before_it_once(default_engine):
    sched = default_engine.scheduler(prefix_cache=False)
    params = SamplingParams(max_tokens=6, frequency_penalty=1.0)
    reqs = [default_engine.batch_request(p, params, emit=lambda step: None)
            for p in ["Say yes yes yes yes.", "Repeat the word cat ten times."]]
    seen = {id(r): [] for r in reqs}
    for r in reqs:
        def record(history, logits, r=r):
            seen[id(r)].append(history.tolist())
            return logits
        r.processors = [record]
    run_batch(sched, reqs)
    window = params.repetition_context_size
    for r in reqs:
        assert len(seen[id(r)]) == len(r.generated)
        for k, history in enumerate(seen[id(r)]):
            assert history == (r.prompt_ids + r.generated[:k])[-window:], f"pick {k}"
