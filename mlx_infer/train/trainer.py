"""The drafter training loop (DFlash arXiv 2602.06036; DSpark, deepseek-ai/DeepSpec recipe) and the whole
`train-drafter` pipeline: prompts -> the target's own answers -> features -> steps -> published checkpoint
-> held-out acceptance.

One step: `seqs_per_step` random training sequences, `anchors` random anchors each (response positions),
the loss of losses.py, AdamW with warmup + cosine (optim.py), global-norm clipping. Every
`checkpoint_every` steps (and at the end) a resumable checkpoint is written atomically (state.py).
Runs wherever MLX runs: the CPU backend for small targets, Metal / CUDA when present.
"""

import json
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn

from ..errors import MlxInferError
from ..speculative import target as target_parts
from ..speculative.drafters.dflash import save_dflash_model
from ..speculative.drafters.dspark import save_dspark_model
from .batches import make_batch, sample_anchors, usable
from .build import DEFAULT_BLOCK, check_taps, new_drafter
from .data import TrainSequence, load_sequences, read_prompts, regenerate, save_sequences
from .evaluate import heldout_tau, teacher_forced_acceptance
from .features import all_features
from .losses import default_decay, dflash_loss, dspark_loss
from .optim import clip, make_optimizer
from .state import latest_checkpoint, load_training_state, save_training_state


@dataclass
class TrainSettings:
    """Training settings (CLI flags).

    Attributes:
        kind: "dflash" or "dspark".
        steps: optimizer steps.
        lr: peak learning rate.
        block_size: B (None: 16 for DFlash, 7 for DSpark).
        layers: drafter decoder layers.
        taps: tapped target layers (None: evenly spaced, one per drafter layer).
        seqs_per_step: sequences per step; anchors: blocks per sequence per step.
        warmup: warmup fraction of the steps; clip: max global gradient norm.
        decay: DFlash loss decay (None: the published value for B).
        markov_rank: DSpark Markov head rank; top_k: target probabilities kept for DSpark's L1.
        checkpoint_every: steps between resumable checkpoints (0: only at the end).
        seed: drafter init and anchor sampling.
        mask_token_id: block filler (None: the last vocabulary id).
    """

    kind: str = "dflash"
    steps: int = 200
    lr: float = 6e-4
    block_size: Optional[int] = None
    layers: int = 1
    taps: Optional[List[int]] = None
    seqs_per_step: int = 4
    anchors: int = 16
    warmup: float = 0.04
    clip: float = 1.0
    decay: Optional[float] = None
    markov_rank: int = 64
    top_k: int = 64
    checkpoint_every: int = 50
    seed: int = 0
    mask_token_id: Optional[int] = None

    def __post_init__(self):
        if self.block_size is None:
            self.block_size = DEFAULT_BLOCK.get(self.kind, 16)
        for name in ("steps", "seqs_per_step", "anchors"):
            if int(getattr(self, name)) < 1:
                raise MlxInferError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if not self.lr > 0:
            raise MlxInferError(f"--lr must be > 0, got {self.lr}")

    def identity(self) -> dict:
        """The settings a resumed run must share with the checkpoint."""
        return {k: getattr(self, k) for k in ("kind", "block_size", "layers", "taps", "markov_rank", "mask_token_id")}


class Trainer:
    """Trains a drafter on sequences of a target.

    Args:
        target: the target mlx-lm model (frozen; its embedding and lm_head are shared).
        sequences: TrainSequence list (the target's own answers).
        settings: TrainSettings.
        out_dir: where checkpoints go (None: no checkpoints).
        config: the target's HF config (drafter geometry; default its mlx-lm args).
        model: a drafter to continue training (default: a fresh one from `settings`).
        progress: progress(done, total) while computing features.

    Raises:
        MlxInferError: no sequence long enough for one block, bad settings.
    """

    def __init__(self, target: nn.Module, sequences: Sequence[TrainSequence], settings: TrainSettings,
                 out_dir=None, config: Optional[dict] = None, model=None,
                 progress: Optional[Callable[[int, int], None]] = None):
        s = self.settings = settings
        self.target = target
        self.model = model or new_drafter(s.kind, target, layers=s.layers, block_size=s.block_size, taps=s.taps,
                                          mask_token_id=s.mask_token_id, markov_rank=s.markov_rank,
                                          config=config, seed=s.seed)
        self.dspark = s.kind == "dspark"
        self.block = self.model.block_size
        self.embed = target_parts.embedding(target)
        self.head = target_parts.output_head(target)
        self.decay = s.decay or default_decay(self.block)
        feats = all_features(target, self.model.target_layer_ids, sequences, s.top_k if self.dspark else 0, progress)
        self.features = usable(feats, self.block, self.dspark)
        if not self.features:
            raise MlxInferError(
                f"no training sequence has a response long enough for one block of {self.block} "
                "(raise --max-response-tokens or lower --block-size)")
        self.out_dir = Path(out_dir) if out_dir is not None else None
        self.optimizer = make_optimizer(s.lr, s.steps, s.warmup)
        self.rng = random.Random(s.seed)
        self.step = 0
        self.log: List[Dict] = []
        self._value_and_grad = nn.value_and_grad(self.model, self._loss)

    @property
    def slots(self) -> int:
        """Predicted tokens per block (DFlash B - 1, DSpark B)."""
        return self.block if self.dspark else self.block - 1

    def _loss(self, batch):
        if self.dspark:
            return dspark_loss(self.model, batch)[0]
        return dflash_loss(self.model, batch, self.embed, self.head, self.decay)[0]

    def sample_batch(self):
        """A random batch (advances the anchor sampler's RNG)."""
        s = self.settings
        n = min(s.seqs_per_step, len(self.features))
        items = self.rng.sample(self.features, n)
        anchors = [sample_anchors(self.rng, f, s.anchors, self.block, self.dspark) for f in items]
        return make_batch(items, anchors, self.block)

    def train_step(self) -> float:
        """One optimizer step; returns the loss (float, before the update)."""
        batch = self.sample_batch()
        loss, grads = self._value_and_grad(batch)
        grads, _ = clip(grads, self.settings.clip)
        self.optimizer.update(self.model, grads)
        mx.eval(loss, self.model.parameters(), self.optimizer.state)
        self.step += 1
        return float(loss.item())

    def checkpoint(self) -> Optional[Path]:
        """Write a resumable checkpoint of the current step (no-op without out_dir)."""
        if self.out_dir is None:
            return None
        info = {"settings": self.settings.identity(), "log": self.log}
        return save_training_state(self.out_dir, self.step, self.model, self.optimizer, self.rng.getstate(), info)

    def resume(self) -> bool:
        """Continue from the latest checkpoint in out_dir; False when there is none.

        Raises:
            MlxInferError: a checkpoint made with other settings (kind, block, layers, taps, ...).
        """
        path = latest_checkpoint(self.out_dir) if self.out_dir is not None else None
        if path is None:
            return False
        saved = json.loads((path / "state.json").read_text()).get("settings", {})
        mine = json.loads(json.dumps(self.settings.identity()))
        diff = sorted(k for k in mine if saved.get(k) != mine[k])
        if diff:
            raise MlxInferError(f"the checkpoint in {self.out_dir} was made with other settings ({', '.join(diff)}); "
                                "use the same flags or another --out")
        self.step, rng_state, info = load_training_state(path, self.model, self.optimizer)
        self.rng.setstate(rng_state)
        self.log = list(info.get("log", []))
        return True

    def run(self, on_step: Optional[Callable[[int, int, float, float], None]] = None) -> List[Dict]:
        """Train up to settings.steps (from the current step), checkpointing on the way.

        Args:
            on_step: called after each step with (step, total steps, loss, predicted tokens per second).

        Returns:
            The loss log: [{"step", "loss", "tokens_per_s"}] (every step).
        """
        s = self.settings
        tokens = min(s.seqs_per_step, len(self.features)) * s.anchors * self.slots
        while self.step < s.steps:
            t0 = time.perf_counter()
            loss = self.train_step()
            tps = tokens / max(time.perf_counter() - t0, 1e-9)
            self.log.append({"step": self.step, "loss": round(loss, 5), "tokens_per_s": round(tps, 1)})
            if on_step:
                on_step(self.step, s.steps, loss, tps)
            if s.checkpoint_every and self.step % s.checkpoint_every == 0 and self.step < s.steps:
                self.checkpoint()
        if self.out_dir is not None and _ckpt_step(self.out_dir) != self.step:
            self.checkpoint()
        return self.log

    def evaluate(self, features) -> Dict:
        """teacher_forced_acceptance of the current drafter on features (of the same target)."""
        if self.dspark:
            return teacher_forced_acceptance(self.model, features)
        return teacher_forced_acceptance(self.model, features, self.embed, self.head)

    def save(self, path, dtype: Optional[mx.Dtype] = None) -> Path:
        """The drafter in its published format (DFlash: z-lab layout; DSpark: DeepSpec layout).

        Args:
            dtype: cast the drafter's floating-point weights first (e.g. mx.bfloat16 for a smaller file);
                the trainer's model is cast in place (train no further after that).
        """
        if dtype is not None:
            self.model.set_dtype(dtype)
            mx.eval(self.model.parameters())
        if self.dspark:
            return save_dspark_model(self.model, path)
        return save_dflash_model(self.model, path)


def _ckpt_step(out_dir) -> int:
    path = latest_checkpoint(out_dir)
    return json.loads((path / "state.json").read_text())["step"] if path else -1


@dataclass
class TrainReport:
    """What a `train_drafter` run did (also written to OUT/train_report.json).

    Attributes:
        out_dir: the drafter directory (published format).
        steps: steps trained in total; resumed_from: the checkpoint step it continued from (0: fresh).
        train_sequences, heldout_sequences: counts.
        first_loss, last_loss: mean loss of the first / last 10 steps of the log.
        before, after: teacher_forced_acceptance on the held-out sequences (before: at step 0 only).
        heldout: heldout_tau of the saved drafter (None when skipped).
        seconds: wall time of the whole run.
    """

    out_dir: str
    steps: int
    resumed_from: int
    train_sequences: int
    heldout_sequences: int
    first_loss: float
    last_loss: float
    before: Optional[Dict]
    after: Dict
    heldout: Optional[Dict]
    seconds: float


def _mean(xs) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def train_drafter(engine, data, out_dir, settings: TrainSettings, max_response_tokens: int = 128,
                  heldout: int = 4, resume: bool = False, max_prompts: Optional[int] = None,
                  tau_tokens: int = 64, save_dtype: Optional[mx.Dtype] = None, status: Optional[Callable[[str], None]] = None,
                  phase: Optional[Callable[[str, int, int], None]] = None,
                  on_step: Optional[Callable[[int, int, float, float], None]] = None) -> TrainReport:
    """The whole pipeline of `mlx-infer train-drafter`.

    Args:
        engine: the target Engine.
        data: prompt file (text or JSONL, see data.py).
        out_dir: output directory: the drafter (config.json + model.safetensors), checkpoints/,
            sequences.jsonl (the regenerated data, reused on resume), train_log.jsonl, train_report.json.
        settings: TrainSettings.
        max_response_tokens: most tokens of each regenerated answer.
        heldout: prompts kept out of training (the last ones of the file) for the acceptance estimate.
        resume: continue from the checkpoint in out_dir.
        max_prompts: use only the first N prompts.
        tau_tokens: answer length of the held-out speculative runs (0: skip them).
        save_dtype: dtype of the saved drafter (None: float32, as trained); the held-out estimates use it.
        status: called with one-line messages; phase(name, done, total) for data / feature progress;
            on_step as Trainer.run.

    Raises:
        MlxInferError: bad data, an out_dir with a checkpoint but no --resume (or the reverse), bad settings.
    """
    t_start = time.perf_counter()
    say = status or (lambda msg: None)
    out = Path(out_dir).expanduser()
    if max_response_tokens < 1:
        raise MlxInferError(f"--max-response-tokens must be >= 1, got {max_response_tokens}")
    check_taps(settings.taps or [], len(target_parts.decoder_layers(engine.model)))  # before regenerating
    prompts = read_prompts(data)
    if max_prompts:
        prompts = prompts[:max_prompts]
    has_ckpt = latest_checkpoint(out) is not None if out.is_dir() else False
    if has_ckpt and not resume:
        raise MlxInferError(f"{out} holds a training checkpoint; pass --resume to continue it, or choose another --out")
    if out.exists() and not out.is_dir():
        raise MlxInferError(f"--out {out} is a file, not a directory")
    out.mkdir(parents=True, exist_ok=True)
    n_held = min(heldout, len(prompts) // 5) if len(prompts) > 1 else 0
    seq_file = out / "sequences.jsonl"
    meta_file = out / "sequences.meta.json"
    meta = {"data": str(Path(data).resolve()), "prompts": len(prompts), "max_response_tokens": max_response_tokens,
            "model": getattr(engine.source, "name", "")}
    if resume and seq_file.is_file() and meta_file.is_file() and json.loads(meta_file.read_text()) == meta:
        sequences = load_sequences(seq_file)
        say(f"reusing {len(sequences)} regenerated sequences from {seq_file}")
    else:
        say(f"regenerating answers to {len(prompts)} prompts with the target (greedy, <= {max_response_tokens} tokens)")
        sequences = regenerate(engine, prompts, max_response_tokens,
                               progress=(lambda d, t: phase("answers", d, t)) if phase else None)
        save_sequences(seq_file, sequences)
        meta_file.write_text(json.dumps(meta))
    # held-out: the answers of the last n_held prompts (regenerate drops empty answers, so count from the end)
    n_held = min(n_held, max(0, len(sequences) - 1))
    train_seqs, held_seqs = (sequences[:-n_held], sequences[-n_held:]) if n_held else (sequences, [])
    if not train_seqs:
        raise MlxInferError(f"the target gave no answer to the prompts of {data}")
    trainer = Trainer(engine.model, train_seqs, settings, out_dir=out, config=engine.config,
                      progress=(lambda d, t: phase("features", d, t)) if phase else None)
    resumed_from = trainer.step if resume and trainer.resume() else 0
    if resume and resumed_from:
        say(f"resuming at step {resumed_from} of {settings.steps}")
    held_feats = all_features(engine.model, trainer.model.target_layer_ids, held_seqs,
                              settings.top_k if trainer.dspark else 0)
    before = trainer.evaluate(held_feats) if held_feats and trainer.step == 0 else None
    say(f"training a {settings.kind} drafter: {trainer.model.cfg.num_hidden_layers} layer(s), block {trainer.block}, "
        f"taps {trainer.model.target_layer_ids}, {len(trainer.features)} sequences, {settings.steps} steps")
    log = trainer.run(on_step)
    (out / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    trainer.save(out, save_dtype)
    after = trainer.evaluate(held_feats) if held_feats else {}
    tau = None
    held_prompts = prompts[len(prompts) - n_held:] if n_held else []
    if tau_tokens and held_prompts:
        say(f"measuring tau on {len(held_prompts)} held-out prompts")
        tau = heldout_tau(engine, settings.kind, out, held_prompts, tau_tokens)
    losses = [r["loss"] for r in log]
    report = TrainReport(str(out), trainer.step, resumed_from, len(trainer.features), len(held_seqs),
                         _mean(losses[:10]), _mean(losses[-10:]), before, after, tau,
                         time.perf_counter() - t_start)
    (out / "train_report.json").write_text(json.dumps(asdict(report), indent=2))
    return report
