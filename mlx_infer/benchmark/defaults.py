"""Named defaults of the benchmark suites (plain values: `mlx-infer bench --help` reads them before MLX loads)."""

#: The suites, in the order `all` runs them.
SUITES = ("decode", "prefill", "long", "spec", "batch", "kv")
#: Prompt lengths of the prefill suite, tokens (those that do not fit the model's context window are dropped).
PREFILL_LENGTHS = (128, 512, 2048, 8192)
#: Contexts of the long suite: TTFT and decode speed after a prompt of this many tokens.
LONG_CONTEXTS = (1024, 4096, 8192)
#: Speculative modes of the spec suite ("off" first: the others' speedup is against it).
SPEC_SUITE_MODES = ("off", "lookup", "auto")
#: Requests decoded together in the batch suite.
BATCH_SIZES = (1, 4, 8, 16)
#: KV caches of the kv suite: float (None), 8-bit and 4-bit.
KV_SUITE_BITS = (None, 8, 4)
#: Prompt tokens of the kv suite (a context whose KV the decoding reads).
KV_CONTEXT = 512
#: Prompts of each prompt set the spec suite times.
PROMPTS_PER_SET = 2
#: Widest forward of the verify cost curve the spec suite reports (1 + the default draft length).
COST_CURVE_WIDTH = 9
#: Tokens generated per run and interleaved trials per system (the median counts).
MAX_TOKENS = 64
TRIALS = 3
