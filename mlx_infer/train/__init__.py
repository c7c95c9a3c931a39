"""Training block drafters (DFlash arXiv 2602.06036; DSpark, deepseek-ai/DeepSpec) for any target mlx-infer
loads: `mlx-infer train-drafter`.

    data.py      prompts from a file; the target's own greedy answers as training sequences
    features.py  one teacher-forced target pass per sequence: taps (+ top-k next-token probabilities)
    batches.py   random anchors among response positions; block batches
    forward.py   many blocks against a full context in one drafter pass (training forward)
    losses.py    DFlash weighted CE; DSpark CE + L1 + confidence BCE
    optim.py     AdamW, warmup + cosine, gradient clipping
    build.py     a fresh drafter shaped for a target
    state.py     resumable, atomically written checkpoints
    evaluate.py  teacher-forced acceptance; held-out tau through the Engine
    trainer.py   the loop and the whole pipeline (train_drafter)
    progress.py  rich progress bars
"""

from .data import TrainSequence, read_prompts, regenerate
from .trainer import Trainer, TrainReport, TrainSettings, train_drafter

__all__ = ["TrainSequence", "read_prompts", "regenerate", "Trainer", "TrainSettings", "TrainReport", "train_drafter"]
