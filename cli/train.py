"""`mlx-infer train-drafter`: train a DFlash or DSpark block drafter for a target model."""

from enum import Enum
from pathlib import Path
from typing import Annotated, List, Optional

import typer

from .errors import fail, user_errors
from .options import ModelOpt, VerboseOpt, Weights, WeightsOpt
from .progress import load_engine, stderr

TRAIN = "Training"
DRAFTER = "Drafter"


class Kind(str, Enum):
    """Drafter families the trainer makes."""

    dflash = "dflash"
    dspark = "dspark"


class SaveDtype(str, Enum):
    """Dtypes the drafter can be saved in."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


def parse_taps(text: Optional[str]) -> Optional[List[int]]:
    """'1,9,17' -> [1, 9, 17]; None / '' -> None. Raises MlxInferError when malformed."""
    if not text or not text.strip():
        return None
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise fail(f"--taps must be comma-separated layer numbers (e.g. 1,9,17), got {text!r}") from None


def train_drafter(
    data: Annotated[Path, typer.Option(
        "--data", metavar="PATH", rich_help_panel=TRAIN, show_default=False,
        help="Prompts: a text file (one prompt per paragraph, or per line) or a .jsonl of "
             '{"prompt": ...} / {"messages": [...]}. The target answers them itself (greedy).')],
    out: Annotated[Path, typer.Option(
        "--out", "-o", metavar="DIR", rich_help_panel=TRAIN, show_default=False,
        help="Output directory: the drafter (config.json + model.safetensors, the published format), "
             "checkpoints/, the regenerated data and the training log.")],
    model: ModelOpt = None,
    weights: WeightsOpt = Weights.auto,
    kind: Annotated[Kind, typer.Option("--kind", case_sensitive=False, rich_help_panel=DRAFTER,
                                       help="dflash (z-lab format) or dspark (DeepSpec format).")] = Kind.dflash,
    layers: Annotated[int, typer.Option("--layers", rich_help_panel=DRAFTER,
                                        help="Drafter decoder layers (also the number of tapped target layers when --taps is not given).")] = 1,
    taps: Annotated[Optional[str], typer.Option(
        "--taps", metavar="I,J,...", rich_help_panel=DRAFTER,
        help="Target layers to tap (output of decoder layer i). Default: evenly spaced, one per drafter layer.")] = None,
    block_size: Annotated[Optional[int], typer.Option(
        "--block-size", rich_help_panel=DRAFTER, show_default=False,
        help="Block size B (default 16 for dflash: 15 drafts; 7 for dspark: 7 drafts).")] = None,
    markov_rank: Annotated[int, typer.Option("--markov-rank", rich_help_panel=DRAFTER,
                                             help="DSpark Markov head rank.")] = 64,
    steps: Annotated[int, typer.Option("--steps", rich_help_panel=TRAIN, help="Optimizer steps.")] = 200,
    lr: Annotated[float, typer.Option("--lr", rich_help_panel=TRAIN,
                                      help="Peak learning rate (AdamW, 4% warmup then cosine).")] = 6e-4,
    seqs_per_step: Annotated[int, typer.Option("--seqs-per-step", rich_help_panel=TRAIN,
                                               help="Sequences per step.")] = 4,
    anchors: Annotated[int, typer.Option("--anchors", rich_help_panel=TRAIN,
                                         help="Random blocks per sequence per step.")] = 16,
    max_response_tokens: Annotated[int, typer.Option(
        "--max-response-tokens", rich_help_panel=TRAIN, help="Longest regenerated answer, tokens.")] = 128,
    max_prompts: Annotated[Optional[int], typer.Option(
        "--prompts", rich_help_panel=TRAIN, show_default=False, help="Use only the first N prompts.")] = None,
    heldout: Annotated[int, typer.Option(
        "--heldout", rich_help_panel=TRAIN,
        help="Prompts (the last ones) kept out of training for the acceptance estimate.")] = 4,
    tau_tokens: Annotated[int, typer.Option(
        "--tau-tokens", rich_help_panel=TRAIN,
        help="Answer length of the held-out speculative runs that measure tau (0 skips them).")] = 64,
    checkpoint_every: Annotated[int, typer.Option(
        "--checkpoint-every", rich_help_panel=TRAIN, help="Steps between resumable checkpoints.")] = 50,
    save_dtype: Annotated[Optional[SaveDtype], typer.Option(
        "--save-dtype", case_sensitive=False, rich_help_panel=DRAFTER,
        help="Dtype of the saved drafter (bfloat16 / float16 halve the file).")] = None,
    resume: Annotated[bool, typer.Option("--resume", rich_help_panel=TRAIN,
                                         help="Continue the checkpoint in --out.")] = False,
    seed: Annotated[int, typer.Option("--seed", rich_help_panel=TRAIN, help="Initialisation and sampling seed.")] = 0,
    verbose: VerboseOpt = False,
) -> None:
    """Train a DFlash or DSpark block drafter for a target model.

    The target answers the prompts itself; one teacher-forced pass per answer gives its hidden states, from which the drafter learns to draft the target's next tokens. Runs on the CPU backend for small targets (like the default model), on Metal or CUDA when present.

    Use the result with: mlx-infer generate --spec dflash --draft-model DIR
    """
    import mlx.core as mx

    from mlx_infer.train import TrainSettings, train_drafter as run
    from mlx_infer.train.progress import TrainProgress

    with user_errors(verbose):
        if not data.is_file():
            raise fail(f"no data file at {data}; give a text file (one prompt per paragraph) or a .jsonl")
        for name, value, low in (("--layers", layers, 1), ("--steps", steps, 1), ("--max-response-tokens",
                                 max_response_tokens, 1), ("--seqs-per-step", seqs_per_step, 1),
                                 ("--anchors", anchors, 1), ("--heldout", heldout, 0), ("--tau-tokens", tau_tokens, 0),
                                 ("--checkpoint-every", checkpoint_every, 0), ("--markov-rank", markov_rank, 1)):
            if value < low:
                raise fail(f"{name} must be >= {low}, got {value}")
        if block_size is not None and block_size < (2 if kind == Kind.dflash else 1):
            raise fail(f"--block-size must be >= {2 if kind == Kind.dflash else 1} for {kind.value}, got {block_size}")
        if not lr > 0:
            raise fail(f"--lr must be > 0, got {lr}")
        if max_prompts is not None and max_prompts < 1:
            raise fail(f"--prompts must be >= 1, got {max_prompts}")
        settings = TrainSettings(kind=kind.value, steps=steps, lr=lr, block_size=block_size, layers=layers,
                                 taps=parse_taps(taps), seqs_per_step=seqs_per_step, anchors=anchors,
                                 markov_rank=markov_rank, checkpoint_every=checkpoint_every, seed=seed)
        engine = load_engine(model, weights.value, verbose)
        with TrainProgress(always=True) as bar:  # a long job: plain progress lines in logs too
            report = run(engine, data, out, settings, max_response_tokens=max_response_tokens, heldout=heldout,
                         resume=resume, max_prompts=max_prompts, tau_tokens=tau_tokens,
                         save_dtype=getattr(mx, save_dtype.value) if save_dtype else None, status=bar.status,
                         phase=bar.phase, on_step=bar.step)
        print(f"drafter: {report.out_dir} ({kind.value}, {report.steps} steps, {report.train_sequences} sequences, "
              f"{report.seconds:.0f} s)")
        print(f"loss: {report.first_loss:.4f} (first 10 steps) -> {report.last_loss:.4f} (last 10)")
        if report.after:
            before = f"{report.before['acceptance']:.3f} -> " if report.before else ""
            print(f"held-out greedy acceptance (teacher-forced): {before}{report.after['acceptance']:.3f}; "
                  f"tau_tf {report.after['tau_tf']:.2f}")
        if report.heldout:
            print(f"held-out tau (speculative {kind.value}, greedy): {report.heldout['tau']:.2f}")
        if verbose:
            stderr.print(f"[dim]report: {Path(report.out_dir) / 'train_report.json'}[/dim]")
