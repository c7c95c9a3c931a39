"""The drafters' optimizer (DeepSpec recipe): AdamW, linear warmup then cosine decay, weight decay 0,
gradient clipping at global norm 1.0."""

from typing import Callable

import mlx.optimizers as optim

#: Recipe defaults.
LR = 6e-4
WARMUP = 0.04
CLIP = 1.0
WEIGHT_DECAY = 0.0


def lr_schedule(lr: float, steps: int, warmup: float = WARMUP) -> Callable:
    """step -> learning rate: 0 -> lr linearly over round(warmup * steps) steps (>= 1), then cosine to 0
    at `steps`."""
    n_warm = max(1, int(round(warmup * steps)))
    rest = max(1, steps - n_warm)
    return optim.join_schedules([optim.linear_schedule(0.0, lr, n_warm), optim.cosine_decay(lr, rest)], [n_warm])


def make_optimizer(lr: float = LR, steps: int = 1000, warmup: float = WARMUP,
                   weight_decay: float = WEIGHT_DECAY) -> optim.Optimizer:
    """AdamW on the schedule above (betas 0.9 / 0.999, eps 1e-8)."""
    return optim.AdamW(learning_rate=lr_schedule(lr, steps, warmup), weight_decay=weight_decay)


def clip(grads, max_norm: float = CLIP):
    """(clipped grads, global norm before clipping)."""
    return optim.clip_grad_norm(grads, max_norm)
