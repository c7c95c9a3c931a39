"""The training forward (many blocks against a full context) equals the inference forward of each block
(Backbone.hidden with the context rows < anchor), so what is trained is what drafts."""

import mlx.core as mx
import pytest
from block_drafters import random_dflash, random_dspark

from mlx_infer.speculative.target import embedding
from mlx_infer.train.batches import anchor_range, make_batch, sample_anchors
from mlx_infer.train.data import TrainSequence
from mlx_infer.train.features import sequence_features
from mlx_infer.train.forward import block_masks, blocks_hidden
from mlx_infer.train.losses import block_inputs


@pytest.mark.parametrize("make,windows", [(random_dflash, None), (random_dflash, [3, None]), (random_dspark, None)])
def test_blocks_equal_inference_forward(target, make, windows):
    model = make(seed=3, block=4, **({"windows": windows} if windows else {}))
    seqs = [TrainSequence(list(range(5, 25)), 5), TrainSequence(list(range(30, 45)), 3)]
    feats = [sequence_features(target, model.target_layer_ids, s) for s in seqs]
    assert feats[0].feats.shape == (20, 2 * 32) and feats[0].feats.dtype == mx.float16
    anchors = [[5, 9, 16], [3, 7, 11]]
    batch = make_batch(feats, anchors, 4)
    emb = embedding(target)(block_inputs(batch, model.mask_token_id, 4))
    h = blocks_hidden(model, batch.feats, emb, batch.anchors)
    assert h.shape == (2, 3, 4, 32)
    for s in range(2):
        for a, anchor in enumerate(anchors[s]):
            ctx = feats[s].feats[None, :anchor].astype(mx.float32)
            ref = model.hidden(emb[s, a][None], ctx, model.make_cache())[0]
            assert mx.allclose(ref, h[s, a], atol=1e-4).item(), (s, anchor)


def test_masks_see_only_earlier_context_and_own_block():
    m = block_masks(mx.array([[2, 5]]), context_len=8, block=3)
    assert m.shape == (2, 1, 3, 11)
    assert m[0, 0, :, :8].tolist() == [[True, True] + [False] * 6] * 3
    assert m[1, 0, :, :8].tolist() == [[True] * 5 + [False] * 3] * 3
    assert m[:, :, :, 8:].all().item()  # the own block, bidirectional (the other block is not among the keys)
    w = block_masks(mx.array([[5]]), context_len=8, block=3, window=3)
    assert w[0, 0, 0, :8].tolist() == [False, False, False, True, True, False, False, False]


def test_anchors_stay_in_the_response():
    import random

    seq = TrainSequence(list(range(20)), 6)
    f = sequence_features.__globals__["SequenceFeatures"](mx.array(seq.tokens), 6, mx.zeros((20, 4)))
    assert list(anchor_range(f, 4, all_slots=False)) == list(range(6, 17))  # slot 3 predicts x_{a+3} <= x_19
    assert list(anchor_range(f, 4, all_slots=True)) == list(range(6, 16))  # DSpark's slot 3 predicts x_{a+4}
    picks = sample_anchors(random.Random(0), f, 30, 4, False)
    assert len(picks) == 30 and min(picks) >= 6 and max(picks) <= 16
