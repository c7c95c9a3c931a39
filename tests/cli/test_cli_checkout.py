"""Running the tests from the checkout: `python -m pytest` imports `mlx_infer` from the source tree (the
checkout comes first on sys.path), where the CLI is cli/, not mlx_infer/cli/; the root conftest.py maps it
(issue 52: with a regular install, the CLI tests failed at collection with "No module named 'mlx_infer.cli'")."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: `python -m pytest --co` of a CLI test module from the checkout, as with a regular (not editable) install:
#: the editable install's import hook, which maps mlx_infer.cli to cli/ by name, is taken out first.
COLLECT = """
import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in (getattr(f, "__module__", "") + repr(f))]
sys.path.insert(0, {repo!r})
import pytest
sys.exit(pytest.main(["-q", "--co", "-p", "no:cacheprovider", "tests/cli/test_cli_bugs.py"]))
"""


def test_python_m_pytest_from_the_checkout_collects_the_cli_tests():
    done = subprocess.run([sys.executable, "-c", COLLECT.format(repo=str(REPO))], cwd=REPO, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "No module named" not in done.stdout
    assert "test_cli_bugs.py::test_user_errors_still_exit_2" in done.stdout
