"""Named defaults, in one place. Nothing here imports anything: the CLI reads its flags' choices and
defaults here without loading MLX (`mlx-infer --help` answers at once)."""

#: Tokens generated when the caller gives no limit.
MAX_TOKENS = 256
#: Prompt tokens per prefill step (as mlx-lm's generate_step).
PREFILL_STEP_SIZE = 2048
#: Group size of GGUF's Q4_0 / Q4_1 / Q8_0 blocks, kept as MLX affine groups.
GGML_BLOCK = 32
#: Group size used when a K-quant is re-quantized to MLX affine weights.
REQUANT_GROUP_SIZE = 32
#: Bump when the GGUF -> MLX conversion changes, so cached conversions are redone.
GGUF_CONVERTER_VERSION = 2
#: Prompt lookup (arXiv 2311.03511): longest and shortest n-gram matched against the context.
LOOKUP_MAX_NGRAM = 3
LOOKUP_MIN_NGRAM = 1
#: Largest draft length (gamma) tried by speculative decoding when max_draft is "auto".
DEFAULT_MAX_DRAFT = 8
#: Widest verify forward (pending token + drafts) a speculative round runs, whatever max_draft asks: up to
#: this many positions attention runs on the decode kernels, which compute each query row as a one-token
#: step does (kernels.paged_attention.PAGED_MAX_QUERIES); from 17 (kernels.prefill_attention's
#: PREFILL_MIN_QUERIES) the tiled prefill path rounds otherwise, and greedy output could move at a near-tie.
MAX_VERIFY_WIDTH = 16
#: Plain steps / speculative rounds between two mx.clear_cache() calls (as mlx-lm's generate_step: every 256 tokens).
CLEAR_CACHE_ROUNDS = 256
#: Top-p looks for its nucleus among this many most likely tokens first (a partial selection), sorting the whole
#: vocabulary only when their mass does not reach top_p (generation/sampling.top_p_filter).
TOP_P_CANDIDATES = 256
#: Most alternatives a token's logprobs carry (OpenAI's top_logprobs limit; generation/logprobs.py).
MAX_TOP_LOGPROBS = 20
#: Prompts of at least this many tokens get a prefill progress bar in the CLI (when stderr is a terminal).
PREFILL_PROGRESS_TOKENS = 512
#: Most requests decoded together in one batched forward (the CPU kernels' widest skinny product is 16 rows).
MAX_BATCH = 16
#: Seconds a batch runner (the server) stays idle before it gives its KV memory back: the prefix cache is
#: forgotten and the block pool shrinks to its initial size (Ollama keeps an idle model 5 minutes).
IDLE_RELEASE_S = 300.0
#: How long an idle OpenBLAS worker thread spins (sched_yield) waiting for the next product before it sleeps,
#: as OpenBLAS's OPENBLAS_THREAD_TIMEOUT: 2 ** this many cycles (its least, 4; its own default, 28, is about
#: 0.1 s). Set for the OpenBLAS that mlx_infer preloads unless the user set it (mlx_infer/blas.py). Its
#: spinning worker otherwise shares the CPUs with the kernels' threads after every float product, which
#: slows a long prefill where cores are few (measured in docs/cpu.md).
OPENBLAS_THREAD_TIMEOUT_LOG2 = 4

# The choices and defaults the CLI's help shows, kept here (importing their packages loads MLX); the modules
# that use them import them from here under their own names.
#: Speculative decoding modes (speculative/modes.py: MODES).
SPEC_MODES = ("off", "auto", "lookup", "draft", "layerskip", "rmm", "dflash", "dspark")
#: The modes that draft with a model given as draft_model (the others draft from the context or the target).
SPEC_MODEL_MODES = ("auto", "draft", "dflash", "dspark")
#: The KV cache kinds: mlx-lm's own contiguous cache, or the block pool with a token table (vToken).
KV_CACHES = ("dense", "paged")
#: KV quantization schemes: "affine" (K and V per token, groups along head_dim, as mlx-lm's
#: QuantizedKVCache) and "kivi" (arXiv 2402.02750: K per channel, groups along tokens; V per token; the
#: most recent tokens kept in float).
KV_SCHEMES = ("affine", "kivi")
#: Tokens per KV block of the paged cache (vLLM's and vToken's default, arXiv 2608.13263; kv/defaults.py:
#: BLOCK_SIZE).
KV_BLOCK_SIZE = 16
#: Where `mlx-infer serve` listens unless told otherwise (loopback only: nothing outside this machine reaches
#: it; server/defaults.py: HOST, PORT).
SERVE_HOST = "127.0.0.1"
SERVE_PORT = 8080
#: Most tokens one request to the server may ask for (max_tokens / max_completion_tokens; server/defaults.py:
#: MAX_TOKENS_LIMIT).
SERVE_MAX_TOKENS_LIMIT = 4096
#: Requests waiting for a place in the server's batch beyond the running ones; more get 429 (not a stalled
#: queue; server/defaults.py: MAX_QUEUE).
SERVE_MAX_QUEUE = 64
#: Seconds a served model stays loaded after its last request (Ollama's keep_alive default, 5 minutes;
#: `serve --keep-alive`, a request's keep_alive; negative: kept loaded).
SERVE_KEEP_ALIVE_S = 300.0
#: Most seconds a request waits for room to load its model (the other models busy); then 503 with Retry-After.
SERVE_MODEL_WAIT_S = 60.0
#: The Retry-After seconds of a 503 for a model that could not be loaded for lack of room.
SERVE_RETRY_AFTER_S = 5

# The kernel self-check (kernels/selfcheck.py, `mlx-infer doctor --kernels`).
#: Row counts of x the quantized matmul is checked at (decode and the verify widths).
SELFCHECK_QMM_WIDTHS = tuple(range(1, 17))
#: Query positions attention (quantized-KV, paged) and RMM's product are checked at.
SELFCHECK_WIDTHS = (1, 4, 16)
#: Cached tokens the attention kernels are checked over.
SELFCHECK_CONTEXT = 1024
#: Bits of the quantized KV cache the attention kernel is checked with.
SELFCHECK_KV_BITS = (8, 4)
#: RMM's retention the gathered product is checked at (kept groups: rmm.group_keep).
SELFCHECK_RMM_RETENTION = 0.5
#: Largest error allowed, relative to the reference's largest magnitude, by the result's dtype; with int8
#: activations (the CPU's opt-in lossy products) SELFCHECK_INT8_TOLERANCE.
SELFCHECK_TOLERANCE = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 3e-2}
SELFCHECK_INT8_TOLERANCE = 5e-2
#: Timed runs per case (their median counts; one untimed run first), and the seconds of timing per kernel
#: after which its remaining (costlier) cases are checked for values but not timed.
SELFCHECK_REPEATS = 3
SELFCHECK_TIME_BUDGET_S = 2.0
