"""User-facing errors.

Every error a user can cause (a missing file, a bad flag, an unsupported GGUF) is an
`MlxInferError` whose message is one line saying what was wrong and what to do. The CLI prints
that line and exits with code 2; anything else is a bug and keeps its traceback.

Each error carries what an edge needs to answer it without reading its text: `status`, the HTTP status the
server answers it with (400 for bad input, 503 for a closed runner, 500 for a failed forward), and `param`,
the request field at fault (None when it names none). The server builds OpenAI's error object from them.
"""

from typing import Optional


class MlxInferError(ValueError):
    """Bad input: the message is one line, fit to show a user as it is.

    Attributes:
        status: the HTTP status the server answers it with (400: the request was wrong).
        param: the request field at fault (a SamplingParams field, "prompt", ...), None when none is.
    """

    status: int = 400
    param: Optional[str] = None


class RequestError(MlxInferError):
    """A request's own value is wrong (a sampling parameter out of range, a prompt that does not fit the
    context window); `param` names the field at fault.

    Args:
        message: one line saying what was wrong and what to do.
        param: the field at fault ("temperature", "max_tokens", "prompt", ...), None when none is.
    """

    def __init__(self, message: str, param: Optional[str] = None):
        super().__init__(message)
        self.param = param


class RunnerClosedError(MlxInferError):
    """A request given to a BatchRunner that is closed, or one that was still running when it was closed
    (the server answers 503: retry on a server that is up)."""

    status = 503


class GenerationError(MlxInferError):
    """A forward failed while a runner decoded a request (every request of that batch gets it; the runner
    goes on with the next ones). The server answers 500."""

    status = 500


class EngineBusyError(MlxInferError):
    """A request started on an Engine while a stream of the same thread is still open on it (the engine runs
    one request at a time; calls from other threads wait instead)."""


class ModelNotFoundError(MlxInferError, FileNotFoundError):
    """A model path or repo id that does not exist or is not reachable."""


class UnsupportedModelError(MlxInferError):
    """A model whose architecture, tensor type or format mlx-infer cannot run."""


class InvalidGGUFError(MlxInferError):
    """A GGUF file that is truncated, corrupt or inconsistent."""


class DiskWriteError(MlxInferError):
    """A result that could not be written (a full disk, a quota or file size limit): the message names the
    folder, the space free there and what to do; nothing half-written is left behind."""


class DistributedError(MlxInferError):
    """A run across several processes (`mlx.launch`) that cannot go on: a model whose heads do not split over
    the group, model files that differ between ranks, a rank that stopped answering. Every rank raises it;
    rank 0 prints it."""
