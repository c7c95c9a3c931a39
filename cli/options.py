"""Flags shared by `generate`, `chat`, `bench` and `serve`, and the SamplingParams built from them.

Declaring the flags imports nothing heavy (their choices and defaults come from mlx_infer.defaults), so that
`--help` and a usage error answer at once; the checks that need the library's modules (which import MLX)
import them when they run.
"""

import warnings
from enum import Enum
from typing import TYPE_CHECKING, Annotated, List, Optional

import typer

from mlx_infer.defaults import (
    KV_BLOCK_SIZE, KV_CACHES, KV_SCHEMES, MAX_TOKENS, MAX_VERIFY_WIDTH, SPEC_MODEL_MODES, SPEC_MODES,
)
from mlx_infer.errors import MlxInferError
from mlx_infer.rmm.defaults import RMM_PRESETS
from mlx_infer.rmm.options import PRODUCT_COMPONENTS, parse_rmm

from .errors import as_flag

if TYPE_CHECKING:
    from mlx_infer.generation.sampling import SamplingParams

SAMPLING = "Sampling"
MODEL = "Model"
SPEC = "Speculative decoding"
KV = "KV cache"
RMM = "Reduced matmul"
STRUCTURED = "Structured output"


class Weights(str, Enum):
    """How weights are kept in memory (see `mlx_infer.load`)."""

    auto = "auto"
    native = "native"
    float32 = "float32"


ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", "-m", metavar="MODEL", rich_help_panel=MODEL,
    help="A .gguf file, an MLX / Hugging Face model directory or a Hugging Face repo id (org/name). "
         "Default: the embedded SmolLM2-135M-Instruct (Q4_1).")]
WeightsOpt = Annotated[Weights, typer.Option(
    "--weights", case_sensitive=False, rich_help_panel=MODEL,
    help="auto: quantized weights stay quantized on mlx-infer's CPU kernels when they are available, else float32 "
         "on the CPU backend with an optimized BLAS when memory allows; elsewhere as stored; "
         "native: as stored (often quantized); float32: dequantize.")]
MaxTokensOpt = Annotated[int, typer.Option(
    "--max-tokens", "-n", rich_help_panel=SAMPLING, help="Most tokens to generate.")]
TemperatureOpt = Annotated[float, typer.Option(
    "--temperature", "--temp", rich_help_panel=SAMPLING, help="Sampling temperature; 0 is greedy.")]
TopPOpt = Annotated[float, typer.Option(
    "--top-p", rich_help_panel=SAMPLING, help="Nucleus sampling mass, in (0, 1]; 1 is off.")]
TopKOpt = Annotated[int, typer.Option(
    "--top-k", rich_help_panel=SAMPLING, help="Keep the k most likely tokens; 0 is off.")]
MinPOpt = Annotated[float, typer.Option(
    "--min-p", rich_help_panel=SAMPLING, help="Drop tokens below min-p x p(best), in [0, 1); 0 is off.")]
SeedOpt = Annotated[Optional[int], typer.Option(
    "--seed", rich_help_panel=SAMPLING,
    help="Random seed, for reproducible sampling (with --spec off or a fixed --max-draft N: under --max-draft "
         "auto the draft length follows measured timings, and so does which random numbers a sample uses; the "
         "distribution is the same).")]
RepetitionPenaltyOpt = Annotated[float, typer.Option(
    "--repetition-penalty", rich_help_panel=SAMPLING, help="Penalty > 0 for recently generated tokens; 1 is off.")]
StopOpt = Annotated[Optional[List[str]], typer.Option(
    "--stop", rich_help_panel=SAMPLING,
    help="Stop when this string appears (not printed); \\n and \\t are newline and tab. Repeatable.")]
SystemOpt = Annotated[Optional[str], typer.Option(
    "--system", "-s", help="System prompt (needs the model's chat template).")]
JsonSchemaOpt = Annotated[Optional[str], typer.Option(
    "--json-schema", metavar="FILE|JSON", rich_help_panel=STRUCTURED, show_default=False,
    help="The answer is JSON valid under this JSON schema (a file, or the schema's JSON text).")]
RegexOpt = Annotated[Optional[str], typer.Option(
    "--regex", metavar="RE", rich_help_panel=STRUCTURED, show_default=False,
    help="The whole answer matches this regular expression.")]
GrammarOpt = Annotated[Optional[str], typer.Option(
    "--grammar", metavar="FILE", rich_help_panel=STRUCTURED, show_default=False,
    help="The answer is a sentence of this Lark grammar (llguidance's Lark; `start` is the start rule).")]
FormatOpt = Annotated[Optional[str], typer.Option(
    "--format", metavar="json", rich_help_panel=STRUCTURED, show_default=False,
    help="json: the answer is a JSON object, any (Ollama's `format: json`).")]
NoForcedSpansOpt = Annotated[bool, typer.Option(
    "--no-forced-spans", rich_help_panel=STRUCTURED,
    help="Decode the text a constraint forces token by token, instead of committing it several tokens per "
         "forward.")]
#: --spec is a plain string checked by spec_kwargs against SPEC_MODES (mlx_infer.speculative.MODES), so that a bad
#: value gets the one-line error rather than typer's usage box.
SpecOpt = Annotated[str, typer.Option(
    "--spec", "--speculative", metavar="|".join(SPEC_MODES), rich_help_panel=SPEC,
    help="Drafter for lossless speculative decoding (greedy: the same output as plain decoding; sampling: "
         "the same distribution; faster when drafts are accepted): auto picks the best available and falls "
         "back to plain decoding where verifying several tokens costs as much as decoding them; off is plain "
         "decoding.")]
DraftModelOpt = Annotated[Optional[str], typer.Option(
    "--draft-model", metavar="MODEL", rich_help_panel=SPEC,
    help="For --spec draft (or auto): a smaller model with the same tokenizer; for --spec dflash / dspark: "
         "a drafter directory or repo id.")]
MaxDraftOpt = Annotated[str, typer.Option(
    "--max-draft", metavar="auto|N", rich_help_panel=SPEC,
    help="Draft tokens per round: auto (chosen each round from measured costs and acceptance) or a fixed N "
         f"(0: plain decoding; at most {MAX_VERIFY_WIDTH - 1} are verified per round).")]
#: The KV flags are plain strings checked by kv_kwargs (one `error:` line for a bad value, not typer's box).
KVCacheOpt = Annotated[str, typer.Option(
    "--kv-cache", metavar="|".join(KV_CACHES), rich_help_panel=KV,
    help="dense: mlx-lm's contiguous cache (default: the fastest without eviction); paged: a block pool with a "
         "token table per request (vToken), needed for --evict with blocks really freed.")]
#: chat's --kv-cache: unset, a chat keeps its turns in the paged cache's prefix cache where it can (chat.chat_kv).
ChatKVCacheOpt = Annotated[Optional[str], typer.Option(
    "--kv-cache", metavar="|".join(KV_CACHES), rich_help_panel=KV, show_default=False,
    help="paged (default where the model's layers are KV caches and the KV quantization fits blocks: not "
         "with --kv-scheme kivi or --kv-quant-start): each turn starts from the earlier turns' full KV blocks "
         "in the prefix cache, as `mlx-infer serve`; dense: mlx-lm's contiguous cache, the last turn's kept "
         "(decoding slightly faster, docs/kv.md).")]
KVBudgetOpt = Annotated[Optional[str], typer.Option(
    "--kv-budget", metavar="BYTES|FRACTION", rich_help_panel=KV,
    help="Most KV memory of the paged cache: 512MB, 2GiB, ... (a bare integer is bytes) or a fraction of free "
         "memory with a decimal point (0.5, 1.0). Default: no limit.")]
EvictOpt = Annotated[Optional[str], typer.Option(
    "--evict", metavar="POLICY:RATIO", rich_help_panel=KV,
    help="Evict this fraction of the KV tokens with a policy: h2o, scissorhands, streaming, snapkv, random "
         "(e.g. h2o:0.5; lossy; needs the paged cache: --kv-cache paged, chat's default; with --spec auto it "
         "decodes plainly).")]
RepackOpt = Annotated[str, typer.Option(
    "--repack", metavar="on|off", rich_help_panel=KV,
    help="With --evict: pack live tokens into fewer blocks (on) or free blocks only when empty (off: Naive-Evict).")]
BlockSizeOpt = Annotated[str, typer.Option(
    "--block-size", metavar="N", rich_help_panel=KV, help="Tokens per KV block of the paged cache.")]
KVBitsOpt = Annotated[Optional[str], typer.Option(
    "--kv-bits", metavar="8|4|kXvY", rich_help_panel=KV,
    help="Quantize the KV cache: 8 or 4 bits, or K and V apart (k8v4); lossy (see docs/kv_quant.md for the measured "
         "quality); dense or paged cache (paged: quantized blocks, affine scheme), batched decoding too. Default: float KV "
         "(also what 16, float, off or none ask for).")]
KVSchemeOpt = Annotated[str, typer.Option(
    "--kv-scheme", metavar="|".join(KV_SCHEMES), rich_help_panel=KV,
    help="With --kv-bits: affine (per token, groups along head_dim) or kivi (keys per channel, values per "
         "token, the most recent tokens kept in float; arXiv 2402.02750).")]
KVQuantStartOpt = Annotated[str, typer.Option(
    "--kv-quant-start", metavar="N", rich_help_panel=KV,
    help="With --kv-bits: keep the first N tokens' KV in float; past N the whole cache is quantized.")]
RmmOpt = Annotated[Optional[str], typer.Option(
    "--rmm", metavar="SPEC|PRESET", rich_help_panel=RMM,
    help="Reduced matrix multiplication (arXiv 2608.13426; lossy): keep this fraction of each product's "
         "contraction per component, e.g. attn=0.5,mlp=0.9,qk=0.75 (components q k v o gate up down qk pv, "
         "groups attn mlp linear all; per layer: mlp@0-3=0.5) or a preset: " + ", ".join(RMM_PRESETS) + ".")]
#: --rmm of the batched commands (serve): the linear components only.
LinearRmmOpt = Annotated[Optional[str], typer.Option(
    "--rmm", metavar="SPEC|PRESET", rich_help_panel=RMM,
    help="Reduced matrix multiplication (arXiv 2608.13426; lossy) of the linear layers: keep this fraction of "
         "each product's contraction per component, e.g. attn=0.5,mlp=0.9 (components q k v o gate up down, "
         "groups attn mlp linear; per layer: mlp@0-3=0.5). qk / pv need single requests (generate, chat).")]
VerboseOpt = Annotated[bool, typer.Option(
    "--verbose", "-v", help="Say more on stderr, and show tracebacks of errors.")]


def check_rmm(rmm: Optional[str], batched: Optional[str] = None, instead: str = "generate/chat") -> Optional[str]:
    """The --rmm value, checked before the model loads (raises MlxInferError with the one-line reason).
    batched: the command that decodes batched ("serve"), which reduces no attention product (qk, pv): their
    items are refused, pointing at `instead`."""
    try:
        retention = parse_rmm(rmm)
    except MlxInferError as e:
        raise as_flag(e, "rmm") from e
    if batched and retention is not None and any(v < 1.0 for v in retention.products().values()):
        raise MlxInferError(f"--rmm {rmm.strip()!r}: {batched} decodes batched; {'/'.join(PRODUCT_COMPONENTS)} "
                            f"reduction runs only for single requests: use {instead}, or only linear components "
                            "(q k v o gate up down, attn, mlp, linear)")
    return rmm


def sampling_params(
    max_tokens: int = MAX_TOKENS,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: Optional[int] = None,
    repetition_penalty: float = 1.0,
    stop: Optional[List[str]] = None,
) -> "SamplingParams":
    """Validated SamplingParams from the flags; raises MlxInferError naming the first bad one.

    Built before the model loads, so a bad flag fails before the model's seconds of loading.
    """
    from mlx_infer.generation.sampling import SamplingParams

    try:
        return SamplingParams(
            temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=seed,
            repetition_penalty=repetition_penalty, max_tokens=max_tokens,
            stop=tuple(unescape(s) for s in stop or ()),
        )
    except MlxInferError as e:
        raise MlxInferError(_as_flag(str(e))) from e


def fit_to_model(params: "SamplingParams", engine) -> "SamplingParams":
    """`params` checked against the loaded model (top-k against its vocabulary), before any measuring;
    raises MlxInferError naming the flag."""
    try:
        return params.for_vocab(engine.vocab_size)
    except MlxInferError as e:
        raise MlxInferError(_as_flag(str(e))) from e


def unescape(text: str) -> str:
    r"""Turn the escapes a shell passes through literally (\n, \t, \\) into the characters, as llama.cpp
    does for its stop strings: `--stop "\n\n"` stops at a blank line."""
    out, i = [], 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text) and text[i + 1] in "nt\\":
            out.append({"n": "\n", "t": "\t", "\\": "\\"}[text[i + 1]])
            i += 2
        else:
            out.append(text[i])
            i += 1
    return "".join(out)


#: The flags of SamplingParams fields that have more than one name.
_SAMPLING_FLAGS = {"temperature": TemperatureOpt, "max_tokens": MaxTokensOpt}


def flag_names(option) -> str:
    """Every name of a flag declared as Annotated[..., typer.Option(NAME, ALIAS, ...)], shortest first:
    TemperatureOpt -> '--temp/--temperature'."""
    info = option.__metadata__[0]
    names = [n for n in (info.default, *info.param_decls) if isinstance(n, str) and n.startswith("-")]
    return "/".join(sorted(names, key=len))


def _as_flag(message: str) -> str:
    """'top_p must be ...' -> '--top-p must be ...': name the flag the user typed (every name of one that
    has several: '--temp/--temperature must be ...')."""
    from mlx_infer.generation.sampling import SamplingParams

    field = message.split(" ", 1)[0]
    if field.isidentifier() and field in SamplingParams.__dataclass_fields__:
        flag = flag_names(_SAMPLING_FLAGS[field]) if field in _SAMPLING_FLAGS else "--" + field.replace("_", "-")
        return flag + message[len(field):]
    return message


def spec_kwargs(spec: str, draft_model: Optional[str], max_draft: str) -> dict:
    """Engine.stream_steps keyword arguments from the speculative flags; raises MlxInferError when bad."""
    from mlx_infer.speculative.modes import check_max_draft

    value = max_draft.strip().lower()
    if value != "auto":
        try:
            value = int(value)
        except ValueError:
            raise MlxInferError(f"--max-draft must be 'auto' or an integer >= 0, got {max_draft!r}") from None
        if value < 0:
            raise MlxInferError(f"--max-draft must be 'auto' or an integer >= 0, got {max_draft!r}")
        if value > MAX_VERIFY_WIDTH - 1:
            warnings.warn(f"--max-draft {value}: at most {MAX_VERIFY_WIDTH - 1} draft tokens are verified per round; "
                          f"drafting {MAX_VERIFY_WIDTH - 1}")
    check_max_draft(value)
    mode = spec.strip().lower()
    if mode not in SPEC_MODES:
        raise MlxInferError(f"--spec must be one of {', '.join(SPEC_MODES)}, got {spec!r}")
    if mode == "draft" and not draft_model:
        raise MlxInferError("--spec draft needs --draft-model MODEL (a smaller model with the same tokenizer)")
    if draft_model and mode not in SPEC_MODEL_MODES:
        raise MlxInferError(f"--spec {mode} uses no --draft-model; drop it, or pick --spec "
                            f"{', '.join(SPEC_MODEL_MODES)}")
    return {"speculative": mode, "draft_model": draft_model, "max_draft": value}


def kv_kwargs(kv_cache: str, kv_budget: Optional[str], evict: Optional[str], repack: str, block_size: str,
              speculative: dict, kv_bits: Optional[str] = None, kv_scheme: str = "affine",
              kv_quant_start: str = "0") -> tuple:
    """(load kwargs, request kwargs) from the KV flags: kv_cache / kv_budget / block_size / kv_bits /
    kv_scheme / kv_quant_start for Engine.configure_kv, evict / repack for each request. Raises
    MlxInferError naming the bad flag (before the model loads; the library's checks name their keyword,
    which errors.report words as the flag)."""
    from mlx_infer.kv.options import check_block_size, check_kv_cache, parse_budget, parse_evict
    from mlx_infer.kv.quant_options import check_paged_quant, kv_quant

    try:
        kind = check_kv_cache(kv_cache)
    except MlxInferError:
        raise MlxInferError(f"--kv-cache must be one of {', '.join(KV_CACHES)}, got {kv_cache!r}") from None
    try:
        size = check_block_size(block_size)
    except MlxInferError:
        raise MlxInferError(f"--block-size must be an integer >= 1 (tokens per KV block), got {block_size!r}") from None
    budget = parse_budget(kv_budget)  # its messages name kv_budget: the CLI reports them as --kv-budget
    if evict is not None and not evict.strip():
        raise MlxInferError("--evict needs POLICY:RATIO (e.g. h2o:0.5), or none for no eviction; it was empty")
    try:
        spec = parse_evict(evict)
    except MlxInferError as e:
        raise MlxInferError(f"--evict: {e}") from None
    value = repack.strip().lower()
    if value not in ("on", "off"):
        raise MlxInferError(f"--repack must be on or off, got {repack!r}")
    if spec is None and value == "off":
        warnings.warn("--repack off has no effect without --evict POLICY:RATIO (it picks Naive-Evict: the same "
                      "evictions, blocks freed only when empty)")
    if kind == "dense" and (budget is not None or size != KV_BLOCK_SIZE or spec is not None):
        flag = "--evict" if spec is not None else "--kv-budget" if budget is not None else "--block-size"
        raise MlxInferError(f"{flag} needs --kv-cache paged")
    mode = speculative.get("speculative", "off")
    if spec is not None and mode not in ("off", "auto"):
        raise MlxInferError(f"--evict with --spec {mode} is not supported yet: use --spec off or auto "
                            "(which then decodes plainly)")
    quant = kv_quant(kv_bits, kv_scheme, kv_quant_start)  # (errors in the library's names: see errors.flag_words)
    if quant is not None and kind == "paged":
        check_paged_quant(quant)
    request = {"evict": str(spec), "repack": value == "on"} if spec is not None else {}
    options = {"kv_cache": kind, "kv_budget": budget, "block_size": size}
    if quant is not None:
        options.update(kv_bits=kv_bits, kv_scheme=quant.scheme, kv_quant_start=quant.start)
    return options, request


def _source_text(value: str, flag: str, what: str) -> str:
    """A flag's value: the file it names when one exists, else the text itself (`what` says which is
    expected). Raises MlxInferError naming the flag for an unreadable file."""
    from pathlib import Path

    path = Path(value).expanduser()
    if len(value) < 4096 and path.is_file():
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise MlxInferError(f"{flag}: cannot read {value}: {e}") from None
    if what == "file":
        raise MlxInferError(f"{flag}: no file {value!r}; give the path of a Lark grammar file")
    if what == "json" and not value.lstrip().startswith("{"):
        raise MlxInferError(f"{flag}: no file {value!r}, and it is not a JSON schema either; give a schema "
                            "file's path or the schema itself as JSON text")
    return value


def constraint_kwargs(json_schema: Optional[str], regex: Optional[str], grammar: Optional[str],
                      fmt: Optional[str], no_forced_spans: bool) -> dict:
    """Engine.stream_steps keyword arguments (response_format, forced_spans) from the structured-output flags,
    at most one of --json-schema, --regex, --grammar, --format. Raises MlxInferError (exit 2) for several of
    them, an unreadable file, a schema that is not JSON, --format other than json; the constraint itself is
    checked against the model's tokenizer before decoding (ConstraintError)."""
    from mlx_infer.structured import constraint

    given = [flag for flag, value in (("--json-schema", json_schema), ("--regex", regex), ("--grammar", grammar),
                                      ("--format", fmt)) if value is not None]
    if len(given) > 1:
        raise MlxInferError(f"{' and '.join(given)} cannot be used together; give one constraint")
    if no_forced_spans and not given:
        warnings.warn("--no-forced-spans changes nothing without --json-schema, --regex, --grammar or --format")
    try:
        if json_schema is not None:
            rule = constraint.json_schema(_source_text(json_schema, "--json-schema", "json"), "json_schema")
        elif regex is not None:
            rule = constraint.regex(regex, "regex")
        elif grammar is not None:
            rule = constraint.lark(_source_text(grammar, "--grammar", "file"), "grammar")
        elif fmt is not None:
            if fmt.strip().lower() != "json":
                raise MlxInferError(f"--format takes json (any JSON object), got {fmt!r}; for a schema use "
                                    "--json-schema")
            rule = constraint.json_object("format")
        else:
            return {}
    except constraint.ConstraintError as e:
        raise MlxInferError(f"{given[0]}: {e}") from None
    return {"response_format": rule, "forced_spans": not no_forced_spans}
