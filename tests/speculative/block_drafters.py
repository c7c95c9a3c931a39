"""Tiny random DFlash / DSpark drafters for the block-drafter tests (seeded, float32)."""

import mlx.core as mx
from mlx.utils import tree_map

from mlx_infer.speculative.drafters.backbone import BackboneConfig
from mlx_infer.speculative.drafters.dflash import DFlashModel
from mlx_infer.speculative.drafters.dspark import DSparkModel


def backbone_cfg(hidden=32, layers=2, taps=2, windows=None):
    return BackboneConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_taps=taps,
                          rms_norm_eps=1e-6, rope_theta=10000.0, max_position_embeddings=512, windows=windows or [])


def _init(model, seed, scale):
    mx.random.seed(seed)
    model.update(tree_map(lambda a: a * scale + 0.05 * mx.random.normal(a.shape), model.parameters()))
    mx.eval(model.parameters())
    return model


def random_dflash(seed=0, vocab=64, block=4, ids=(0, 1), target_layers=2, hidden=32, layers=2, windows=None,
                  scale=2.0):
    mx.random.seed(seed)
    m = DFlashModel(backbone_cfg(hidden, layers, len(ids), windows), block, vocab - 1, ids, target_layers, vocab)
    return _init(m, seed, scale)


def random_dspark(seed=0, vocab=64, block=4, ids=(0, 1), target_layers=2, hidden=32, layers=2, rank=8,
                  confidence=True, with_markov=True, scale=2.0):
    mx.random.seed(seed)
    m = DSparkModel(backbone_cfg(hidden, layers, len(ids)), block, vocab - 1, ids, target_layers, vocab,
                    markov_rank=rank, confidence=confidence, confidence_with_markov=with_markov)
    return _init(m, seed, scale)
