"""Named defaults of `mlx-infer serve` (mlx_infer/defaults.py style)."""

# where the server listens, the most tokens a request may ask for, the most requests waiting (defined there)
from ..defaults import SERVE_HOST as HOST, SERVE_PORT as PORT  # noqa: F401
from ..defaults import SERVE_MAX_QUEUE as MAX_QUEUE, SERVE_MAX_TOKENS_LIMIT as MAX_TOKENS_LIMIT  # noqa: F401

#: Largest request body accepted, bytes (a 1 MiB JSON holds a prompt far beyond any context window here).
MAX_BODY_BYTES = 1 << 20
#: Tokens of a request that asks for none (MAX_TOKENS_LIMIT: the most one may ask for).
DEFAULT_MAX_TOKENS = 512
#: Most prompt tokens (after the chat template) per request; the model's context window also applies.
MAX_PROMPT_TOKENS = 32768
#: Stop strings per request (OpenAI allows 4).
MAX_STOP = 16
#: Most choices one request may ask for (`n`): each is a request of the batch.
MAX_N = 8
#: Most alternatives per token of the legacy completions' `logprobs` (OpenAI's limit; chat takes up to 20).
MAX_COMPLETION_LOGPROBS = 5
#: Seconds between two checks that a non-streaming client is still connected.
DISCONNECT_POLL_S = 0.5
#: Bucket bounds of /metrics' time-to-first-token histogram, seconds (CPU prefill of long prompts takes tens).
TTFT_BUCKETS_S = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0, 120.0)
#: Bucket bounds of /metrics' inter-token latency histogram, seconds.
ITL_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
#: Bucket bounds of /metrics' speculative tau histogram (tokens committed per target forward).
TAU_BUCKETS = (1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0)
#: Bucket bounds of /metrics' model load time histogram, seconds.
LOAD_BUCKETS_S = (0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
#: glibc malloc arenas a server process uses (backend.limit_malloc_arenas; measured in docs/benchmarks.md
#: "Serving soak": idle memory after model swaps).
MALLOC_ARENAS = 2
#: Responses kept for /v1/responses' previous_response_id (the least recently used dropped first).
RESPONSES_STORE_SIZE = 1024
#: Characters of text those stored conversations hold at most, all together (16 to 64 MiB of Python str).
RESPONSES_STORE_CHARS = 16 * 1024 * 1024
