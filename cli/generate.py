"""`mlx-infer generate`: one prompt in, the answer streamed to stdout (or one JSON object)."""

import json
import os
import sys
import warnings
from typing import Annotated, List

import typer

from .errors import fail, user_errors
from .options import (
    BlockSizeOpt, DraftModelOpt, EvictOpt, KVBitsOpt, KVBudgetOpt, KVCacheOpt, KVQuantStartOpt, KVSchemeOpt, MaxDraftOpt, RepackOpt, MaxTokensOpt, MinPOpt, ModelOpt, RepetitionPenaltyOpt, SeedOpt, SpecOpt,
    StopOpt, SystemOpt, TemperatureOpt, TopKOpt, TopPOpt, VerboseOpt, Weights, WeightsOpt, fit_to_model,
    RmmOpt, check_rmm, kv_kwargs, sampling_params, spec_kwargs,
    FormatOpt, GrammarOpt, JsonSchemaOpt, NoForcedSpansOpt, RegexOpt, constraint_kwargs,
)
from .progress import PrefillBar, defers_measurements, load_engine, measure_after_answer, prepare_speculation
from .stats import print_stats


def read_prompt(prompt: str) -> str:
    """The prompt argument, or all of stdin when it is '-'. Raises MlxInferError when empty."""
    from_stdin = prompt == "-"
    if from_stdin:
        prompt = sys.stdin.read()
        if prompt.endswith("\n"):
            prompt = prompt[:-1]
    if not prompt.strip():
        raise fail("the prompt is empty: stdin held no text; pipe some in" if from_stdin
                   else "the prompt is empty; give some text (or '-' to read it from stdin)")
    return prompt


def generate(
    prompt: Annotated[str, typer.Argument(metavar="PROMPT", help="The prompt; '-' reads it from stdin.",
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
    spec: SpecOpt = "auto",
    draft_model: DraftModelOpt = None,
    max_draft: MaxDraftOpt = "auto",
    kv_cache: KVCacheOpt = "dense",
    kv_budget: KVBudgetOpt = None,
    evict: EvictOpt = None,
    repack: RepackOpt = "on",
    block_size: BlockSizeOpt = "16",
    kv_bits: KVBitsOpt = None,
    kv_scheme: KVSchemeOpt = "affine",
    kv_quant_start: KVQuantStartOpt = "0",
    rmm: RmmOpt = None,
    json_schema: JsonSchemaOpt = None,
    regex: RegexOpt = None,
    grammar: GrammarOpt = None,
    fmt: FormatOpt = None,
    no_forced_spans: NoForcedSpansOpt = False,
    as_json: Annotated[bool, typer.Option(
        "--json", help="Print one JSON object (text, token_ids, finish_reason, stats) instead of streaming.")] = False,
    stats: Annotated[bool, typer.Option("--stats", help="Print timing and memory stats to stderr.")] = False,
    verbose: VerboseOpt = False,
) -> None:
    """Generate an answer to PROMPT and stream it to stdout.

    The model's chat template is applied when it has one. Stats and progress go to stderr.
    """
    with user_errors(verbose):
        params = sampling_params(max_tokens, temperature, top_p, top_k, min_p, seed, repetition_penalty, stop)
        speculative = spec_kwargs(spec, draft_model, max_draft)
        structured = constraint_kwargs(json_schema, regex, grammar, fmt, no_forced_spans)
        kv_options, kv_request = kv_kwargs(kv_cache, kv_budget, evict, repack, block_size, speculative,
                                           kv_bits, kv_scheme, kv_quant_start)
        if system and no_chat_template:
            raise fail("--system needs the chat template; drop --no-chat-template or --system")
        text = read_prompt(prompt)
        engine = load_engine(model, weights.value, verbose, check_rmm(rmm))
        engine.configure_kv(**kv_options)
        params = fit_to_model(params, engine)
        # tokenized once; a bad prompt fails before any measuring, a bad constraint too
        prompt_ids = engine.encode_fitting(text, system, not no_chat_template)
        if structured:
            engine.grammars.compile(structured["response_format"])
        # --spec auto answers first (plainly until this model's costs are measured, then measures them
        # after the answer); another mode measures before it
        deferred = engine.defer_measurements = defers_measurements(speculative, kv_request)
        if not kv_request and not deferred:  # with eviction a speculative "auto" decodes plainly
            prepare_speculation(engine, speculative)
        bar = PrefillBar()
        kwargs = dict(progress=bar, **speculative, **kv_request, **structured)
        if as_json:
            result = engine.generate(prompt_ids, params, **kwargs)
            out = {"model": engine.source.name, **result.to_dict()}
            sys.stdout.write(json.dumps(out, ensure_ascii=False) + "\n")
            sys.stdout.flush()
            final = result.stats
            answer = result.text
        else:
            pieces: List[str] = []
            final = stream_to_stdout(collect_text(engine.stream_steps(prompt_ids, params, **kwargs), pieces))
            answer = "".join(pieces)
        bar.close()
        if not answer:  # an empty answer (nothing streamed, "text": "" in the JSON): say why
            warn_empty(final, no_chat_template)
        held = final.prompt_tokens + final.generated_tokens  # what the context window holds at the end
        if final.generated_tokens < params.max_tokens and held >= engine.context_length:
            warnings.warn(f"stopped at the model's context window ({engine.context_length} tokens: "
                          f"{final.prompt_tokens} prompt + {final.generated_tokens} generated), before -n "
                          f"{params.max_tokens}; shorten the prompt for a longer answer")
        if stats or verbose:
            print_stats(final)
        if deferred:
            release_stdout()  # a reader of the answer is not kept waiting for the measurements
            measure_after_answer(engine, speculative)


def release_stdout() -> None:
    """Flush stdout and point its descriptor at the null device, so that a pipe's reader sees the end of the
    answer now, while the process goes on (stderr stays)."""
    sys.stdout.flush()
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, ValueError, OSError):
        return  # not a real file (captured in-process): nothing to release
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, fd)
    finally:
        os.close(null)


def warn_empty(stats, no_chat_template: bool) -> None:
    """Say on stderr why an answer has no text: the model ended it at its first token, or a stop string
    matched at its start."""
    if stats.generated_tokens == 0:
        warnings.warn("the answer is empty: the model ended it at its first token; try rephrasing the prompt"
                      + ("" if no_chat_template else ", or --no-chat-template for a base model"))
    else:
        warnings.warn("the answer is empty: a --stop string matched at its start")


def collect_text(steps, into: List[str]):
    """Pass steps through, keeping their text in `into`; closes the generator when stopped."""
    try:
        for step in steps:
            into.append(step.text)
            yield step
    finally:
        steps.close()


def stream_to_stdout(steps):
    """Write each step's text to stdout as it comes and end its last line with a newline, also when stopped
    (Ctrl-C: what is printed on stderr then starts its own line); return the final stats."""
    final, last = None, "\n"
    try:
        for step in steps:
            if step.text:
                sys.stdout.write(step.text)
                sys.stdout.flush()
                last = step.text[-1]
            if step.finish_reason is not None:
                final = step.stats
    finally:
        steps.close()
        if last != "\n":
            sys.stdout.write("\n")
            sys.stdout.flush()
    return final
