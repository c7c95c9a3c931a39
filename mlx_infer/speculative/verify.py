"""Pure accept/reject for speculative decoding: greedy and exact speculative sampling.

Terms (as in vLLM's rejection sampler):
    draft tokens     x_1..x_g, proposed by a drafter; g = gamma >= 0.
    target dists     p_1..p_{g+1}: the target's *processed* next-token distributions at the g+1 positions
                     of one verify forward over [pending token] + draft (p_i predicts the token x_i would be).
    accepted         the longest prefix x_1..x_n the rule keeps (0 <= n <= g).
    recovered token  at the first rejection (n < g), a token sampled from the residual norm(max(0, p_{n+1} - q_{n+1})),
                     or in greedy mode the target's argmax at that position.
    bonus token      when every draft token is accepted (n == g), a token from p_{g+1}.
Each round commits n + 1 tokens: x_1..x_n and then the recovered or bonus token.

"Processed" means exactly what plain decoding picks from (see `process_logits`): mlx-lm's logits
processors (repetition penalty) with the history each position would have in plain decoding; greedy, their
argmax (as generation/sampling.pick_token); sampling, then mlx-lm's top-p, min-p and top-k masks in the
order `mlx_lm.sample_utils.make_sampler` applies them, then temperature. Speculative sampling: arXiv
2211.17192 (Leviathan et al.), 2302.01318 (Chen et al.).

Every function here returns MLX arrays and never synchronizes with the host; the caller evaluates the
accepted count and the next token together (one host sync per round).
"""

from typing import Callable, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from ..generation.sampling import SamplingParams, sampler_input
from ..kernels.prefill_attention import causal_softmax
from ..structured.mask import apply_masks

LogitsProcessor = Callable[[mx.array, mx.array], mx.array]


def process_logits(
    logits: mx.array,
    history: Sequence[int],
    draft: Sequence[int],
    params: SamplingParams,
    processors: Optional[List[LogitsProcessor]] = None,
    masks: Optional[Sequence] = None,
) -> mx.array:
    """The target's processed log-probabilities at every verified position, as plain decoding computes them.

    Args:
        logits: [g+1, V] float, the target's raw logits for the block [history[-1]] + draft.
        history: every token before the block plus the pending token history[-1] (prompt + committed), ints.
        draft: the g draft tokens, ints.
        params: sampling parameters (validated).
        processors: mlx-lm logits processors (tokens [T], logits [1, V]) -> logits [1, V], looking back at most
            params.repetition_context_size tokens; position i sees the tail of history + draft[:i], as plain
            decoding would after accepting draft[:i].
        masks: the grammar's allowed-token bitmasks, one per row (structured.mask: int32 [ceil(V / 32)] or
            None), applied after the processors and before the top-p / min-p / top-k chain and temperature,
            where plain constrained decoding applies its mask; None: unconstrained.

    Returns:
        [g+1, V] float32 log-weights: for greedy (temperature 0) the processed logits themselves (argmax gives
        the token, as in plain decoding: no log-softmax, whose exp over the vocabulary MLX's CPU backend
        computes one element at a time); for sampling the masked, temperature-scaled logits, i.e. the
        categorical distribution plain decoding samples from, up to a constant per row (normalized first
        only for top-p, whose mask compares cumulative probabilities; the other masks, the softmax and
        `mx.random.categorical` do not depend on that constant).
    """
    if processors:
        # The processors (mlx-lm's repetition penalty) look back repetition_context_size tokens at most: one
        # array of that tail of the history plus the draft serves every position as a prefix of it.
        tail = list(history[-params.repetition_context_size:])
        context = mx.array(tail + list(draft), dtype=mx.uint32)  # [R + g]
        rows = []
        for i in range(logits.shape[0]):
            row = logits[i : i + 1]
            for proc in processors:
                row = proc(context[: len(tail) + i], row)
            rows.append(row)
        logits = mx.concatenate(rows, axis=0)
    if masks is not None:
        logits = apply_masks(logits, masks)  # refused tokens -inf
    if params.greedy:
        return logits
    logprobs = sampler_input(logits, params)  # [g+1, V], what plain decoding's sampler is given
    # Same chain and order as mlx_lm.sample_utils.make_sampler.
    if 0 < params.top_p < 1.0:
        logprobs = apply_top_p(logprobs, params.top_p)
    if params.min_p != 0.0:
        logprobs = apply_min_p(logprobs, params.min_p, 1)
    if params.top_k > 0:
        logprobs = apply_top_k(logprobs, params.top_k)
    return logprobs * (1.0 / params.temperature)  # as categorical_sampling


def probabilities(scaled_logits: mx.array) -> mx.array:
    """softmax over the last axis in float32: [N, V] -> [N, V] probabilities (masked entries exactly 0).

    On MLX's CPU device with the CPU kernels, the kernel's softmax with its vectorized e^x
    (kernels/prefill_attention.causal_softmax, every column seen), far faster than mx.softmax, whose exp runs
    one element at a time there; each probability within 6e-5 of mx.softmax's relative to it (the rows sum
    to 1 within 5e-5). Elsewhere mx.softmax."""
    x = scaled_logits.astype(mx.float32)  # [N, V]
    return causal_softmax(x, 1.0, 1, x.shape[-1] - 1)


def _accepted_count(accept: mx.array) -> mx.array:
    """[g] bool -> scalar int32: length of the leading run of True (0 for g == 0)."""
    if accept.size == 0:
        return mx.array(0, dtype=mx.int32)
    return mx.sum(mx.cumprod(accept.astype(mx.int32))).astype(mx.int32)


def verify_greedy(draft: mx.array, target_logprobs: mx.array) -> Tuple[mx.array, mx.array]:
    """Greedy accept/reject.

    Args:
        draft: [g] int draft tokens.
        target_logprobs: [g+1, V] processed target log-probabilities (see `process_logits`).

    Returns:
        (n, next_token): scalar int32 arrays. n = number of leading draft tokens equal to the target's argmax;
        next_token = the target's argmax at position n (the recovered token, or the bonus token when n == g).
        The committed tokens are draft[:n] + [next_token] (== argmax[:n + 1]).
    """
    targets = mx.argmax(target_logprobs, axis=-1).astype(mx.int32)  # [g+1]
    g = draft.shape[0]
    n = _accepted_count(draft.astype(mx.int32) == targets[:g])
    return n, targets[n]


def sample_plain(scaled_logits: mx.array) -> Tuple[mx.array, mx.array]:
    """A sampling round that verifies no draft: (n = 0, a token drawn from the last row) as plain decoding
    draws it, mx.random.categorical on the processed logits (`process_logits`: [1, V] float32), with no
    softmax and log over V between: verify_sampling's g = 0 draws the same token from log(softmax(row)), up
    to float rounding, and on MLX's CPU backend, whose exp runs one element at a time, a request that never
    drafts (max_draft 0) then ran slower than plain decoding; drawn this way it runs as fast."""
    return mx.array(0, dtype=mx.int32), mx.random.categorical(scaled_logits[-1]).astype(mx.int32)


def _residual(p: mx.array, q: mx.array) -> mx.array:
    """[N, V] rows of max(0, p - q) (unnormalized; categorical normalizes). Where p == q leaves no residual
    a rejection is impossible, but the row is kept well defined (p itself)."""
    residual = mx.maximum(p - q, 0.0)
    mass = residual.sum(axis=-1, keepdims=True)
    return mx.where(mass > 0, residual, p)


def verify_sampling(
    draft: mx.array,
    target_probs: mx.array,
    draft_probs: Optional[mx.array] = None,
    uniforms: Optional[mx.array] = None,
    key: Optional[mx.array] = None,
    rejected_q: Optional[mx.array] = None,
) -> Tuple[mx.array, mx.array]:
    """Exact speculative sampling (arXiv 2211.17192, 2302.01318).

    Accept x_i with probability min(1, p_i(x_i) / q_i(x_i)), stop at the first rejection and sample the
    recovered token from norm(max(0, p_i - q_i)); when all g are accepted, sample the bonus token from
    p_{g+1}. A deterministic drafter (draft_probs None) has one-hot q: accept with probability p_i(x_i),
    residual = p_i with x_i removed. The committed tokens are distributed exactly as g+1 plain samples
    from p (given that q is what the drafter really sampled from).

    Args:
        draft: [g] int draft tokens.
        target_probs: [g+1, V] float32 processed target probabilities (rows sum to 1).
        draft_probs: [g, V] float32 drafter probabilities, or None for a deterministic drafter.
        uniforms: [g] float32 in [0, 1) for the accept tests (drawn from MLX's generator when None).
        key: optional PRNG key for the draws (MLX's global generator when None).
        rejected_q: [V] float32 drafter probabilities of a draft token x_{g+1} that lies outside the
            target's vocabulary (p_{g+1}(x_{g+1}) = 0, so it is rejected for certain; the verify forward stops
            before it): when x_1..x_g are all accepted, the next token is the recovered token of that
            rejection, from norm(max(0, p_{g+1} - rejected_q)), instead of a bonus token from p_{g+1}.

    Returns:
        (n, next_token): scalar int32 arrays, the accepted count and the recovered / bonus token.
    """
    g = draft.shape[0]
    draft = draft.astype(mx.int32)
    k1 = k2 = None
    if key is not None:
        k1, k2 = mx.random.split(key)
    last = target_probs[g:]  # [1, V]: the bonus row, or the residual of a certain rejection
    if rejected_q is not None:
        last = _residual(last, rejected_q[None].astype(target_probs.dtype))
    if g == 0:  # nothing to verify: the bonus (or recovered) token from the last row
        return mx.array(0, dtype=mx.int32), mx.random.categorical(mx.log(last[0]), key=k2).astype(mx.int32)
    p_draft = target_probs[:g]  # [g, V]
    px = mx.take_along_axis(p_draft, draft[:, None], axis=-1)[:, 0]  # [g]
    if draft_probs is None:
        qx = mx.ones_like(px)
        onehot = (mx.arange(target_probs.shape[-1])[None, :] == draft[:, None]).astype(target_probs.dtype)
        q = onehot  # [g, V]
    else:
        q = draft_probs.astype(target_probs.dtype)
        qx = mx.take_along_axis(q, draft[:, None], axis=-1)[:, 0]
    if uniforms is None:
        uniforms = mx.random.uniform(shape=(g,), key=k1)
    accept = uniforms * qx < px  # u < p/q without dividing (q(x) > 0 since x was drawn from q)
    n = _accepted_count(accept)
    rows = mx.concatenate([_residual(p_draft, q), last], axis=0)  # [g+1, V]: residuals then the last row
    row = rows[n]
    token = mx.random.categorical(mx.log(row), key=k2).astype(mx.int32)
    return n, token


def verify_round(logits: mx.array, history, tokens: List[int], params: SamplingParams, processors, q,
                 rejected_q: Optional[mx.array] = None, masks: Optional[list] = None):
    """Lazy (accepted count, next token) of one round: logits [g+1, V] of [pending] + tokens (g ints),
    q the draft's [g, V] probabilities or None (deterministic drafter); rejected_q: [V] q row of a next
    draft token outside the target's vocabulary or refused by the grammar (verify_sampling); masks:
    the grammar's g+1 bitmasks, one per row (process_logits), None without a grammar. Greedy: the
    longest prefix equal to the target's argmax; sampling: the accept / residual rule of arXiv 2211.17192 /
    2302.01318."""
    processed = process_logits(logits, history, tokens, params, processors, masks=masks)  # [g+1, V]
    draft_arr = mx.array(tokens, dtype=mx.int32)  # [g]
    if params.greedy:
        return verify_greedy(draft_arr, processed)
    if not tokens and rejected_q is None:
        return sample_plain(processed)
    return verify_sampling(draft_arr, probabilities(processed), q, rejected_q=rejected_q)
