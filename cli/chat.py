"""`mlx-infer chat`: an interactive multi-turn session with history.

Commands: /reset clears the history, /exit (or EOF) quits. Ctrl-C during an answer stops it and
returns to the prompt (the interrupted turn is dropped from the history); a second Ctrl-C, at the
prompt, exits. Works with stdin from a pipe: then no prompt is drawn and each answer is one block
on stdout.
"""

import sys
from typing import Callable, List, Optional, Tuple

import typer

from mlx_infer.defaults import KV_BLOCK_SIZE
from mlx_infer.errors import MlxInferError

from .errors import fail, report, user_errors
from .generate import collect_text, stream_to_stdout
from .options import (
    BlockSizeOpt, ChatKVCacheOpt, DraftModelOpt, EvictOpt, KVBitsOpt, KVBudgetOpt, KVQuantStartOpt, KVSchemeOpt, MaxDraftOpt, RepackOpt, MaxTokensOpt, MinPOpt, ModelOpt, RepetitionPenaltyOpt, SeedOpt, SpecOpt,
    StopOpt, SystemOpt, TemperatureOpt, TopKOpt, TopPOpt, VerboseOpt, Weights, WeightsOpt, fit_to_model,
    RmmOpt, check_rmm, kv_kwargs, sampling_params, spec_kwargs,
    FormatOpt, GrammarOpt, JsonSchemaOpt, NoForcedSpansOpt, RegexOpt, constraint_kwargs,
)
from .progress import (PrefillBar, defers_measurements, isatty, load_engine, measure_after_answer,
                       prepare_speculation, stderr)
from .stats import print_stats

PROMPT = ">>> "
HELP = "/reset clears the history, /exit quits; Ctrl-C stops an answer, twice exits."


def read_line(interactive: bool) -> Optional[str]:
    """The next user line without its newline, or None at EOF."""
    if interactive:
        try:
            return input(PROMPT)
        except EOFError:
            return None
    line = sys.stdin.readline()
    return line.rstrip("\r\n") if line else None


class ChatSession:
    """The history of one chat and the loop that reads turns and streams answers."""

    def __init__(self, engine, params, system: Optional[str] = None, show_stats: bool = False,
                 verbose: bool = False, interactive: bool = False, speculative: Optional[dict] = None,
                 after_answer: Optional[Callable[[], None]] = None):
        self.engine = engine
        self.after_answer = after_answer  # run once, after the first answer (deferred measurements)
        self.speculative = speculative or {}
        self.params = params
        self.system = system
        self.show_stats = show_stats
        self.verbose = verbose
        self.interactive = interactive
        self.history: List[dict] = []

    def reset(self) -> None:
        """Forget every turn (the system prompt stays) and the engine's kept KV cache."""
        self.history.clear()
        self.engine.reset()

    def answer(self, text: str) -> None:
        """Stream the model's reply to `text`; keep the turn in the history unless it failed or was cut."""
        from mlx_infer.kv.errors import KVBudgetError

        self.history.append({"role": "user", "content": text})
        reply: List[str] = []
        bar = PrefillBar()
        steps = self.engine.stream_steps(self.history, self.params, system=self.system, progress=bar,
                                         **self.speculative)
        try:
            stats = stream_to_stdout(collect_text(steps, reply))
        except MlxInferError as e:  # e.g. the history outgrew the context window
            self.history.pop()
            report(e, self.verbose)
            if "context window" in str(e) or isinstance(e, KVBudgetError):
                stderr.print("[dim]type /reset to clear the history[/dim]")
            return
        except KeyboardInterrupt:
            bar.close()
            self.history.pop()
            partial = "".join(reply)
            if not partial or partial.endswith("\n"):  # else stream_to_stdout ended its line already
                sys.stdout.write("\n")
                sys.stdout.flush()
            stderr.print("[dim](answer stopped; Ctrl-C again to exit)[/dim]")
            raise
        self.history.append({"role": "assistant", "content": "".join(reply)})
        if self.show_stats:
            print_stats(stats)
        if self.after_answer is not None:
            after, self.after_answer = self.after_answer, None
            after()  # while the user reads the answer and types the next turn

    def run(self) -> None:
        """Read turns until /exit, EOF or a second Ctrl-C in a row."""
        if self.interactive:
            stderr.print(f"[dim]{HELP}[/dim]")
        interrupted = False
        while True:
            try:
                line = read_line(self.interactive)
            except KeyboardInterrupt:
                if interrupted:
                    sys.stdout.write("\n")
                    return
                interrupted = True
                stderr.print("\n[dim](Ctrl-C again or /exit to quit)[/dim]")
                continue
            if line is None:
                if self.interactive:
                    sys.stdout.write("\n")
                return
            command = line.strip()
            if not command:
                continue
            interrupted = False
            if command in ("/exit", "/quit", "/bye"):
                return
            if command == "/reset":
                self.reset()
                stderr.print("[dim](history cleared)[/dim]")
                continue
            if command in ("/help", "/?"):
                stderr.print(HELP)
                continue
            if command.startswith("/") and " " not in command:
                stderr.print(f"[dim]unknown command {command}; {HELP}[/dim]")
                continue
            try:
                self.answer(line)
            except KeyboardInterrupt:
                interrupted = True


def chat_kv(kv_cache: Optional[str], speculative: dict, *flags) -> Tuple[dict, dict, bool]:
    """(load kwargs, request kwargs, chosen): kv_kwargs for `chat`; with kv_cache None the paged cache (its
    prefix cache keeps the turns) unless the other KV flags need the dense one (a KIVI or float-prefix
    quantization), then `chosen` is True. flags: kv_budget, evict, repack, block_size, kv_bits, kv_scheme,
    kv_quant_start as kv_kwargs takes them. Raises MlxInferError as kv_kwargs."""
    kv_budget, evict, repack, block_size, *quant = flags
    if kv_cache is not None:
        return (*kv_kwargs(kv_cache, kv_budget, evict, repack, block_size, speculative, *quant), False)
    try:
        return (*kv_kwargs("paged", kv_budget, evict, repack, block_size, speculative, *quant), True)
    except MlxInferError:
        if asks_paged(kv_budget, evict, block_size):
            raise  # paged flags given: the paged cache's own error
        return (*kv_kwargs("dense", kv_budget, evict, repack, block_size, speculative, *quant), True)


def asks_paged(kv_budget: Optional[str], evict: Optional[str], block_size: str) -> bool:
    """Whether the KV flags ask for what only the paged cache does: a budget, eviction, a block size other than
    the default (a value that does not parse counts: its own error is the one to give)."""
    from mlx_infer.kv.options import check_block_size, parse_evict

    try:
        return kv_budget is not None or parse_evict(evict) is not None or check_block_size(block_size) != KV_BLOCK_SIZE
    except MlxInferError:
        return True


def require_chat_template(engine) -> None:
    """Refuse (exit 2) to chat with a model that has no chat template."""
    if not engine.tokenizer.has_chat_template:
        raise fail(f"{engine.source.name} has no chat template, so it cannot chat; "
                   "use `mlx-infer generate --no-chat-template` with it")


def chat(
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
    weights: WeightsOpt = Weights.auto,
    spec: SpecOpt = "auto",
    draft_model: DraftModelOpt = None,
    max_draft: MaxDraftOpt = "auto",
    kv_cache: ChatKVCacheOpt = None,
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
    stats: bool = typer.Option(False, "--stats", help="Print stats of each answer to stderr."),
    verbose: VerboseOpt = False,
) -> None:
    """Chat with a model: multi-turn, with history.

    /reset clears the history, /exit (or Ctrl-D) quits. Ctrl-C stops an answer; a second Ctrl-C exits.
    """
    from mlx_infer.kv.cache import supports_paged

    with user_errors(verbose):
        params = sampling_params(max_tokens, temperature, top_p, top_k, min_p, seed, repetition_penalty, stop)
        speculative = spec_kwargs(spec, draft_model, max_draft)
        structured = constraint_kwargs(json_schema, regex, grammar, fmt, no_forced_spans)
        kv_options, kv_request, chosen = chat_kv(kv_cache, speculative, kv_budget, evict, repack, block_size,
                                                 kv_bits, kv_scheme, kv_quant_start)
        engine = load_engine(model, weights.value, verbose, check_rmm(rmm))
        if chosen and kv_options["kv_cache"] == "paged" and not supports_paged(engine.model):
            if asks_paged(kv_budget, evict, block_size):
                raise fail(f"{engine.source.name} cannot use the paged KV cache (its layers are not all KV caches), "
                           "which --kv-budget, --evict and --block-size need: drop them")
            kv_options["kv_cache"] = "dense"  # e.g. a model with recurrent layers: the last turn's cache kept
        engine.configure_kv(**kv_options)
        params = fit_to_model(params, engine)
        require_chat_template(engine)
        if structured:  # every answer follows the constraint: checked before the first turn
            engine.grammars.compile(structured["response_format"])
        # --spec auto answers the first turn plainly and measures after it; another mode measures first
        deferred = engine.defer_measurements = defers_measurements(speculative, kv_request)
        if not kv_request and not deferred:  # with eviction a speculative "auto" decodes plainly
            prepare_speculation(engine, speculative)
        ChatSession(engine, params, system, stats, verbose, interactive=isatty(),
                    speculative={**speculative, **kv_request, **structured},
                    after_answer=(lambda: measure_after_answer(engine, speculative)) if deferred else None).run()
