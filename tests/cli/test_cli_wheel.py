"""A real wheel: only `mlx_infer/...` inside, the `mlx-infer` script declared, and the CLI runs
from an install of just that wheel (its dependencies taken from the running environment)."""

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path


REPO = Path(__file__).resolve().parents[2]
#: What a build needs from the source tree (copied, so the shared checkout gets no build/ dir).
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "mlx_infer", "cli", "models", "cpu_kernels", "metal_kernels",
           "cuda_kernels")


def build_wheel(tmp_path: Path) -> Path:
    """`pip wheel --no-deps` of a copy of the repo; offline when setuptools is installed here."""
    src = tmp_path / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=ignore)
        elif path.exists():
            shutil.copy2(path, src / name)
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", "-w",
           str(tmp_path / "dist"), str(src)]
    if importlib.util.find_spec("setuptools") and importlib.util.find_spec("wheel"):
        cmd.insert(4, "--no-build-isolation")
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    wheels = list((tmp_path / "dist").glob("mlx_infer-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_contents_and_entry_point(tmp_path):
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        dist_info = next(n.split("/")[0] for n in names if n.split("/")[0].endswith(".dist-info"))
        entry_points = zf.read(f"{dist_info}/entry_points.txt").decode()
    top_level = {n.split("/")[0] for n in names}
    assert top_level == {"mlx_infer", dist_info}, top_level  # no top-level cli/ or models/
    for module in ("app", "generate", "chat", "doctor", "convert", "errors", "progress", "options"):
        assert f"mlx_infer/cli/{module}.py" in names, module
    assert "mlx_infer/__main__.py" in names
    # Every module of the source tree made it in (a package missing from pyproject's list would not).
    sources = {f"mlx_infer/{p.relative_to(REPO / 'mlx_infer').as_posix()}" for p in (REPO / "mlx_infer").rglob("*.py")}
    sources |= {f"mlx_infer/cli/{p.relative_to(REPO / 'cli').as_posix()}" for p in (REPO / "cli").rglob("*.py")}
    assert sorted(sources - set(names)) == []
    # The drafter registry and the shipped drafters, as mlx_infer/models (registry.py reads them there).
    assert "mlx_infer/models/registry.json" in names
    for drafter in (p.parent for p in (REPO / "models").glob("*/config.json")):
        for part in ("config.json", "model.safetensors"):
            assert f"mlx_infer/models/{drafter.name}/{part}" in names, (drafter.name, part)
    # The kernel sources: the CPU extension is built from them on first use, the GPU bodies read at import.
    for source in ("cpu_kernels/CMakeLists.txt", "cpu_kernels/qmm.cpp", "cpu_kernels/rmm.cpp", "cpu_kernels/rmm.h",
                   "metal_kernels/qmm.metal", "metal_kernels/rmm_qmm.metal", "cuda_kernels/metal_prelude.cuh"):
        assert f"mlx_infer/{source}" in names, source
    assert "[console_scripts]" in entry_points
    assert "mlx-infer = mlx_infer.cli.app:main" in entry_points

    # Install just the wheel into a directory and run `mlx-infer --help` from it.
    target = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check",
                           "--target", str(target), str(wheel)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    script = (
        "import sys; sys.path.insert(0, sys.argv[1]); sys.argv = ['mlx-infer', '--help']\n"
        "import mlx_infer, mlx_infer.cli.app as app\n"
        "assert mlx_infer.__file__.startswith(sys.path[0]), mlx_infer.__file__\n"
        "assert app.__file__.startswith(sys.path[0]), app.__file__\n"
        "app.main()\n"
    )
    run = subprocess.run([sys.executable, "-c", script, str(target)], capture_output=True, text=True,
                         timeout=120, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    for command in ("generate", "chat", "doctor", "convert"):
        assert command in run.stdout
