"""User-facing errors.

Every error a user can cause (a missing file, a bad flag, an unsupported GGUF) is an
`MlxInferError` whose message is one line saying what was wrong and what to do. The CLI prints
that line and exits with code 2; anything else is a bug and keeps its traceback.
"""


class MlxInferError(ValueError):
    """Bad input: the message is one line, fit to show a user as it is."""


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
