"""Named defaults of running one model over several processes (mlx_infer/defaults.py style)."""

#: Seconds a rank waits for one collective step (a forward's all_sum / send / recv, a broadcast) before it
#: gives up with DistributedError: far above any step of a model that fits the group (a 70B prefill chunk
#: over a ring of Macs takes seconds), so it only ends a job whose peer hangs without closing its socket
#: (a dead peer's closed socket fails the step at once). MLX_INFER_DIST_TIMEOUT overrides it.
STEP_TIMEOUT_S = 600.0
#: The environment variable that overrides STEP_TIMEOUT_S (seconds, a positive number).
STEP_TIMEOUT_ENV = "MLX_INFER_DIST_TIMEOUT"
#: Seconds between rank 0's heartbeats while it waits for work (a chat's next line, a server's next request):
#: each is one small broadcast that every rank answers, so that the ranks waiting for rank 0's next command
#: never wait a whole step timeout while the job is merely idle, and a rank that died or hangs is found within
#: a heartbeat plus a step timeout. At most a quarter of the step timeout is used (commands.heartbeat_interval).
HEARTBEAT_S = 1.0
#: Bytes of each *.safetensors file the model digest reads at evenly spaced offsets (besides its header
#: and size): enough to tell two conversions apart without reading a 40 GB model at every start.
DIGEST_SAMPLES = 64
DIGEST_SAMPLE_BYTES = 1 << 16
#: The backends `--backend` / init take (mx.distributed.init's names).
BACKENDS = ("any", "ring", "jaccl", "mpi", "nccl")
#: The parallel modes.
PARALLEL_MODES = ("auto", "tensor", "pipeline")
