"""The public API an app embeds: the names in `mlx_infer.__all__` exist, are documented (docstrings and
docs/api.md), carry complete type annotations that mypy accepts, and the package ships `py.typed`.

New public names are picked up as they come: every error class of the library's error modules must be
exported, and every public method of an exported class must appear in docs/api.md."""

import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import mlx_infer
from mlx_infer import errors as errors_module
from mlx_infer.kv import errors as kv_errors_module

REPO = Path(__file__).resolve().parent.parent
API_DOC = REPO / "docs" / "api.md"


def public_objects():
    """(name, object) of every name in __all__ except data such as __version__."""
    return [(n, getattr(mlx_infer, n)) for n in mlx_infer.__all__ if not n.startswith("__")]


def public_classes():
    return [(n, o) for n, o in public_objects() if inspect.isclass(o)]


def public_members(cls):
    """(name, function) of the methods and properties a class of the library defines itself or inherits from
    another of the library's classes (not from object, Exception or a dataclass's generated methods), whose
    names do not start with an underscore."""
    out = {}
    for base in reversed(cls.__mro__):
        if not base.__module__.startswith("mlx_infer"):
            continue
        for name, value in vars(base).items():
            if name.startswith("_"):
                continue
            if isinstance(value, property):
                out[name] = value.fget
            elif isinstance(value, (staticmethod, classmethod)):
                out[name] = value.__func__
            elif inspect.isfunction(value):
                out[name] = value
    return sorted(out.items())


def error_classes(module):
    return [n for n, o in vars(module).items()
            if inspect.isclass(o) and issubclass(o, Exception) and o.__module__ == module.__name__]


def test_every_public_name_exists_and_has_a_docstring():
    missing = [n for n in mlx_infer.__all__ if not hasattr(mlx_infer, n)]
    assert missing == []
    undocumented = [n for n, o in public_objects() if not (inspect.getdoc(o) or "").strip()]
    assert undocumented == []
    assert isinstance(mlx_infer.__version__, str) and mlx_infer.__version__


def test_every_public_method_has_a_docstring():
    undocumented = [f"{c}.{m}" for c, cls in public_classes() for m, f in public_members(cls)
                    if not (inspect.getdoc(f) or "").strip()]
    assert undocumented == []


def test_every_error_class_is_public():
    """An error an app may catch is importable from mlx_infer (a new one in errors.py must join __all__)."""
    for module in (errors_module, kv_errors_module):
        assert set(error_classes(module)) - set(mlx_infer.__all__) == set(), module.__name__
    assert issubclass(mlx_infer.KVBudgetError, mlx_infer.MlxInferError)


def test_batch_runner_is_public():
    assert mlx_infer.BatchRunner is mlx_infer.batch.BatchRunner
    assert inspect.signature(mlx_infer.Engine.batch_runner).return_annotation in (mlx_infer.BatchRunner,
                                                                                 "BatchRunner")


def unannotated(func, owner=None):
    """The parameters of `func` without an annotation (self / cls of a method excepted), and "return" when
    its return type is not given."""
    sig = inspect.signature(func)
    params = list(sig.parameters.values())
    if owner is not None and params and params[0].name in ("self", "cls"):
        params = params[1:]
    out = [p.name for p in params if p.annotation is inspect.Parameter.empty]
    if sig.return_annotation is inspect.Signature.empty:
        out.append("return")
    return out


def test_public_functions_and_methods_are_fully_annotated():
    gaps = {}
    for name, obj in public_objects():
        if inspect.isfunction(obj):
            gaps[name] = unannotated(obj)
        elif inspect.isclass(obj):
            for m, f in public_members(obj):
                gaps[f"{name}.{m}"] = unannotated(f, obj)
    assert {k: v for k, v in gaps.items() if v} == {}


def test_docs_api_names_every_public_name_and_method():
    """docs/api.md documents every name in __all__ and every public method or property of its classes, as
    `name` / `name(...)` and `Class.method` / `Class.method(...)` in code spans."""
    text = API_DOC.read_text()
    absent = [n for n in mlx_infer.__all__ if not re.search(rf"`{re.escape(n)}[`(]", text)]
    absent += [f"{c}.{m}" for c, cls in public_classes() for m, _ in public_members(cls)
               if not re.search(rf"`{re.escape(c)}\.{re.escape(m)}[`(]", text)]
    assert absent == []


def test_py_typed_is_shipped():
    assert (REPO / "mlx_infer" / "py.typed").is_file()
    config = (REPO / "pyproject.toml").read_text()
    assert re.search(r'^"mlx_infer" = \[[^]]*"py\.typed"', config, re.M)
    assert re.search(r'^test = \[[^]]*"mypy', config, re.M)


def test_mypy_accepts_the_public_modules(tmp_path):
    """mypy (the `test` extra) type-checks the public modules with pyproject.toml's [tool.mypy] settings."""
    pytest.importorskip("mypy", reason="mypy is in the test extra: pip install -e '.[test]'")
    cache = os.environ.get("MLX_INFER_TEST_CACHE")
    cache_dir = Path(cache) / "mypy" if cache else tmp_path / "mypy"
    run = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"),
                          "--cache-dir", str(cache_dir)], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr
