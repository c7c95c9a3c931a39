"""How good a drafter is, two ways.

- `teacher_forced_acceptance`: on held-out sequences (the target's own greedy answers), the fraction of
  draft tokens equal to the target's greedy token, per slot, and the mean greedy accepted length (leading
  hits) of each block; tau_tf = 1 + that mean is the committed tokens per round greedy verification would
  give with one full block per round. Cheap (one drafter pass), no target forward.
- `heldout_tau`: the real thing, mean committed tokens per target forward of
  `engine.generate(..., speculative=kind, draft_model=dir)` on held-out prompts (greedy).
"""

from typing import Dict, List, Sequence

import mlx.core as mx

from .batches import anchor_range, make_batch
from .features import SequenceFeatures
from .losses import accepted_lengths, dflash_loss, dspark_loss


def teacher_forced_acceptance(model, features: Sequence[SequenceFeatures], embed=None, head=None,
                              max_anchors: int = 64) -> Dict:
    """Greedy acceptance of a drafter on sequences (up to max_anchors evenly spaced anchors each).

    Args:
        model: DFlashModel (needs the target's embed / head) or DSparkModel (its own copies).
        features: SequenceFeatures (DSpark: with top-k).

    Returns:
        {"acceptance": mean hit rate over all draft slots, "per_slot": [g] hit rates,
         "accepted": mean leading hits per block, "tau_tf": 1 + accepted, "blocks": count}.
    """
    dspark = embed is None
    block = model.block_size
    hits: List[mx.array] = []
    for f in features:
        r = anchor_range(f, block, dspark)
        if not len(r):
            continue
        step = max(1, len(r) // max_anchors)
        anchors = list(r)[::step][:max_anchors]
        batch = make_batch([f], [anchors], block)
        if dspark:
            _, out = dspark_loss(model, batch)
        else:
            _, out = dflash_loss(model, batch, embed, head, 1.0)
        hit = out["hit"].reshape(-1, out["hit"].shape[-1])
        mx.eval(hit)
        hits.append(hit)
    if not hits:
        return {"acceptance": 0.0, "per_slot": [], "accepted": 0.0, "tau_tf": 1.0, "blocks": 0}
    hit = mx.concatenate(hits, axis=0)
    accepted = float(accepted_lengths(hit).mean().item())
    return {"acceptance": float(hit.mean().item()), "per_slot": [round(float(x), 4) for x in hit.mean(axis=0).tolist()],
            "accepted": accepted, "tau_tf": 1.0 + accepted, "blocks": int(hit.shape[0])}


def heldout_tau(engine, kind: str, drafter_dir, prompts: Sequence, max_tokens: int = 64) -> Dict:
    """Greedy speculative decoding with the saved drafter on held-out prompts.

    Args:
        engine: the target Engine.
        kind: "dflash" or "dspark".
        drafter_dir: the saved drafter directory (published format).
        prompts: strings or chat-message lists.
        max_tokens: answer length per prompt.

    Returns:
        {"tau": mean committed tokens per target forward over prompts, "per_prompt": [...],
         "decode_tps": mean decode tokens/s, "acceptance": per-position acceptance of the first prompt}.

    Raises:
        MlxInferError: the drafter does not load or fit the target.
    """
    taus, tps, acc = [], [], None
    for p in prompts:
        r = engine.generate(p, max_tokens=max_tokens, temperature=0.0, speculative=kind, draft_model=str(drafter_dir))
        if r.stats.rounds:
            taus.append(r.stats.tau)
            tps.append(r.stats.decode_tps)
            acc = acc or r.stats.acceptance
    mean = sum(taus) / len(taus) if taus else 0.0
    return {"tau": mean, "per_prompt": [round(t, 3) for t in taus],
            "decode_tps": sum(tps) / len(tps) if tps else 0.0, "acceptance": [round(a, 3) for a in (acc or [])]}
