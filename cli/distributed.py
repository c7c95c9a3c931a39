"""`mlx-infer generate` under `mlx.launch`: one model over the launch's ranks (docs/distributed.md).

    mlx.launch -n 2 --backend ring -- mlx-infer generate "Hello" --parallel pipeline
    mlx.launch --hosts 10.0.0.1,10.0.0.2 --backend ring -- mlx-infer generate "Hello"

app.py registers this command as `generate` when the process was started by a launcher (MLX_RANK set), the
single-process one otherwise. Rank 0 reads the prompt and writes the answer (stdout) and every message
(stderr); the other ranks print nothing but their own failures. It takes the sampling flags of `generate` and
its structured-output flags (--json-schema, --regex, --grammar, --format, --no-forced-spans: the grammar runs on
rank 0, which picks every token) and `--spec off|lookup` (prompt lookup drafted on rank 0, verified in lockstep:
mlx_infer/distributed/speculative.py; with a structured-output flag it decodes plainly); the other drafters, the
paged / quantized KV cache and eviction do not run sharded yet.
"""

import json
import os
import sys
from typing import Annotated, List

import typer

from mlx_infer.defaults import DEFAULT_MAX_DRAFT, MAX_VERIFY_WIDTH

from .errors import fail, user_errors
from .options import (FormatOpt, GrammarOpt, JsonSchemaOpt, MaxTokensOpt, MinPOpt, ModelOpt, NoForcedSpansOpt,
                      RegexOpt, RepetitionPenaltyOpt, SeedOpt, StopOpt, SystemOpt, TemperatureOpt, TopKOpt, TopPOpt,
                      VerboseOpt, Weights, WeightsOpt, constraint_kwargs, sampling_params)

PARALLEL = "Several processes"
ParallelOpt = Annotated[str, typer.Option(
    "--parallel", help="How the model splits over the ranks: tensor (each rank a slice of every layer's heads "
    "and MLP rows, two all-reduces per layer), pipeline (each rank a range of layers) or auto (tensor when "
    "the heads divide evenly by the group size, else pipeline).", rich_help_panel=PARALLEL)]
ShardSpecOpt = Annotated[str, typer.Option(
    "--spec", "--speculative", metavar="off|lookup", rich_help_panel=PARALLEL,
    help="Speculative decoding over the ranks: lookup (prompt lookup drafted on rank 0, each draft verified by "
    "one forward on every rank; greedy: the same output as off) or off (plain lockstep decoding).")]
ShardMaxDraftOpt = Annotated[int, typer.Option(
    "--max-draft", metavar="N", rich_help_panel=PARALLEL,
    help=f"With --spec lookup: draft tokens per round (a fixed N; at most {MAX_VERIFY_WIDTH - 1} are verified per "
    "round).")]
BackendOpt = Annotated[str, typer.Option(
    "--backend", help="mx.distributed's backend: any, ring, jaccl, mpi or nccl (the one mlx.launch started).",
    rich_help_panel=PARALLEL)]


def under_launch() -> bool:
    """Whether a launcher started this process (mlx.launch sets MLX_RANK; mpirun OMPI_COMM_WORLD_RANK)."""
    return "MLX_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ


def generate(
    prompt: Annotated[str, typer.Argument(metavar="PROMPT", help="The prompt; '-' reads it from stdin (rank 0's).",
                                          show_default=False)],
    model: ModelOpt = None,
    max_tokens: MaxTokensOpt = 256,
    temperature: TemperatureOpt = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    min_p: MinPOpt = 0.0,
    seed: SeedOpt = None,
    repetition_penalty: RepetitionPenaltyOpt = 1.0,
    stop: StopOpt = None,
    system: SystemOpt = None,
    no_chat_template: Annotated[bool, typer.Option(
        "--no-chat-template", help="Send the prompt as raw text, without the model's chat template.")] = False,
    weights: WeightsOpt = Weights.auto,
    parallel: ParallelOpt = "auto",
    backend: BackendOpt = "any",
    json_schema: JsonSchemaOpt = None,
    regex: RegexOpt = None,
    grammar: GrammarOpt = None,
    fmt: FormatOpt = None,
    no_forced_spans: NoForcedSpansOpt = False,
    spec: ShardSpecOpt = "off",
    max_draft: ShardMaxDraftOpt = DEFAULT_MAX_DRAFT,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print one JSON object (text, token_ids, finish_reason, stats) instead of streaming.")] = False,
    stats: Annotated[bool, typer.Option("--stats", help="Print timing stats to stderr (rank 0).")] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Generate an answer to PROMPT with the model split over the ranks of mlx.launch, and stream it to stdout.

    Rank 0 reads the prompt and prints the answer; every rank runs each step in lockstep. A rank that fails
    ends the job with one error line on rank 0.
    """
    from mlx_infer.distributed import init_group, watchdog

    group = init_group(backend) if backend in ("any", "ring", "jaccl", "mpi", "nccl") else None
    rank = group.rank if group is not None else 0
    watchdog.on_terminate(rank)
    with user_errors(verbose if rank == 0 else False):
        if group is None:
            raise fail(f"unknown --backend {backend!r}; use one of any, ring, jaccl, mpi, nccl")
        try:
            structured = constraint_kwargs(json_schema, regex, grammar, fmt, no_forced_spans)
            _generate(group, prompt, model, sampling_params(max_tokens, temperature, top_p, top_k, min_p, seed,
                                                            repetition_penalty, stop),
                      system, no_chat_template, weights.value, parallel, as_json, stats or verbose, structured,
                      check_spec(spec, max_draft), max_draft)
        except BaseException:
            if rank != 0:  # rank 0 says what went wrong; the others leave quietly with the same status
                sys.stderr = open(os.devnull, "w")
            raise


def check_spec(spec: str, max_draft: int) -> str:
    """The sharded --spec mode (off or lookup), lower-cased; raises the one-line error for another mode or a
    negative --max-draft (every rank decides the same from the same flags)."""
    from mlx_infer.distributed.speculative import SPEC_MODES

    mode = spec.strip().lower()
    if mode not in SPEC_MODES:
        raise fail(f"--spec {spec!r} does not run over mlx.launch ranks yet; use one of {', '.join(SPEC_MODES)}")
    if max_draft < 0:
        raise fail(f"--max-draft must be an integer >= 0, got {max_draft}")
    return mode


def _generate(group, prompt: str, model, params, system, no_chat_template: bool, weights: str, parallel: str,
              as_json: bool, show_stats: bool, structured: dict, spec: str = "off",
              max_draft: int = DEFAULT_MAX_DRAFT) -> None:
    from mlx_infer.distributed import LockstepStats, broadcast_ints, load_sharded, lockstep_tokens
    from mlx_infer.distributed.speculative import SpecLockstepStats, spec_lockstep_tokens
    from mlx_infer.distributed.structured import LeadPick
    from mlx_infer.errors import MlxInferError
    from mlx_infer.generation.prompt import PromptCodec
    from mlx_infer.generation.structured_request import structured_options
    from mlx_infer.speculative.target import output_vocab
    from mlx_infer.structured.grammar import Grammars

    from .generate import read_prompt

    if structured and spec != "off":  # the sharded verify takes no grammar yet: every rank decodes plainly
        if group.is_root:
            sys.stderr.write(f"note: --spec {spec} decodes plainly with a structured-output flag under mlx.launch\n")
        spec = "off"
    shard = load_sharded(model, group, parallel, weights)
    tokenizer = shard.tokenizer
    ids, error, picker = None, None, None
    if group.is_root:
        try:
            if prompt == "-":  # mlx.launch passes stdin on but never its end: reading it would wait forever
                raise fail("under mlx.launch the prompt cannot come from stdin (the launcher never passes on its "
                           "end); give it as an argument")
            if system and no_chat_template:
                raise fail("--system needs the chat template; drop --no-chat-template or --system")
            ids = PromptCodec(tokenizer, output_vocab(shard.model)).encode(read_prompt(prompt), system,
                                                                            not no_chat_template)
            if structured:  # rank 0 picks every token: the grammar runs there only (distributed/structured.py)
                grammars = Grammars(tokenizer, output_vocab(shard.model), tokenizer.eos_token_ids)
                options = structured_options(lambda: grammars, **structured)
                picker = LeadPick(params, options.grammar(grammars))
        except MlxInferError as e:
            error = e
    (ok,) = broadcast_ints(group, [int(error is None)] if group.is_root else None, 1, "the prompt check")
    if not ok:
        raise error if error is not None else fail("rank 0 refused the prompt")
    if group.is_root and show_stats:
        sys.stderr.write(f"{group.size} ranks ({group.backend}), {shard.parallel} parallel; rank 0 holds "
                         f"{shard.detail}\n")
    text: List[str] = []
    detok = tokenizer.detokenizer
    detok.reset()
    stops = params.stop
    stream = group.is_root and not as_json and not stops
    tokens: List[int] = []

    def found_stop(token: int) -> bool:
        detok.add_token(token)
        text.append(detok.last_segment)
        if stream:
            sys.stdout.write(text[-1])
            sys.stdout.flush()
        return bool(stops) and any(s in "".join(text) for s in stops)

    run = SpecLockstepStats() if spec == "lookup" else LockstepStats()
    finish = "length"
    stop = found_stop if group.is_root else None
    steps = (spec_lockstep_tokens(shard, ids, params, tokenizer.eos_token_ids, run, stop, max_draft)
             if spec == "lookup" else
             lockstep_tokens(shard, ids, params, tokenizer.eos_token_ids, run, stop=stop, picker=picker))
    for token in steps:
        tokens.append(token)
    if picker is not None:
        picker.close()
    if len(tokens) < params.max_tokens:
        finish = "stop"
    if not group.is_root:
        return
    detok.finalize()
    text.append(detok.last_segment)
    answer = "".join(text)
    for s in stops:
        if s in answer:
            answer, finish = answer[:answer.index(s)], "stop"
    if as_json:
        out = {"model": shard.source.name, "text": answer, "token_ids": tokens, "finish_reason": finish,
               "parallel": shard.parallel, "ranks": group.size, "backend": group.backend,
               "stats": {"prompt_tokens": run.prompt_tokens, "generated_tokens": run.generated_tokens,
                         "prefill_s": run.prefill_s, "decode_s": run.decode_s, "broadcast_s": run.broadcast_s,
                         **_spec_stats(run)}}
        sys.stdout.write(json.dumps(out, ensure_ascii=False) + "\n")
    elif stream:
        sys.stdout.write(text[-1] + "\n")
    else:
        sys.stdout.write(answer + "\n")
    sys.stdout.flush()
    if show_stats and run.step_s:
        per = sum(run.step_s) / len(run.step_s)
        sys.stderr.write(f"prompt {run.prompt_tokens} tokens in {run.prefill_s:.2f} s; {run.generated_tokens} "
                         f"tokens at {(run.generated_tokens - 1) / sum(run.step_s):.1f} tokens/s; broadcast "
                         f"{1e3 * run.broadcast_s / len(run.step_s):.2f} ms per forward\n")
        spec_stats = _spec_stats(run)
        if spec_stats:
            sys.stderr.write(f"spec lookup: tau {spec_stats['tau']:.2f} tokens per forward, {run.rounds} rounds, "
                             f"{run.accepted} of {run.drafted} draft tokens accepted\n")


def _spec_stats(run) -> dict:
    """The speculative counters of a SpecLockstepStats for --json / --stats ({} for plain lockstep)."""
    if not hasattr(run, "tau"):
        return {}
    return {"spec_mode": "lookup", "tau": run.tau, "rounds": run.rounds, "drafted": run.drafted,
            "accepted": run.accepted, "committed": run.committed, "draft_s": run.draft_s, "verify_s": run.verify_s,
            "acceptance": run.acceptance}
