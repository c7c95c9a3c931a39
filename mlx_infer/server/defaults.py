"""Named defaults of `mlx-infer serve` (mlx_infer/defaults.py style)."""

#: Where the server listens unless told otherwise (loopback only: nothing outside this machine reaches it).
HOST = "127.0.0.1"
PORT = 8080
#: Largest request body accepted, bytes (a 1 MiB JSON holds a prompt far beyond any context window here).
MAX_BODY_BYTES = 1 << 20
#: Most tokens one request may ask for (max_tokens / max_completion_tokens), and the default when it asks none.
MAX_TOKENS_LIMIT = 4096
DEFAULT_MAX_TOKENS = 512
#: Most prompt tokens (after the chat template) per request; the model's context window also applies.
MAX_PROMPT_TOKENS = 32768
#: Requests waiting for a place in the batch beyond the running ones; more get 429 (not a stalled queue).
MAX_QUEUE = 64
#: Stop strings per request (OpenAI allows 4).
MAX_STOP = 16
