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
