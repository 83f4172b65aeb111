"""The repository tasks' interpreter for tests: .venv-tasks (`make tasks_env`; `make test` builds
it).

Agent code and a task's own tests run in the sandbox under `sandbox.default_python()`. Without
.venv-tasks that is /usr/bin/python3, which has no pytest: every task's tests then "fail", and a
planted passing fix reads as a failure far from the cause. The files that run task tests use the
`tasks_env` fixture, which fails them at once with the fix in its message when the interpreter
cannot import pytest (CI builds it); it never skips them, as for .venv-vllm.
"""
import subprocess

import pytest

from gagar_jax.rollout.envs import sandbox


@pytest.fixture(scope="session")
def tasks_env() -> str:
    """The interpreter the sandbox runs task tests with; fails the test when it has no pytest."""
    python = sandbox.default_python()
    probe = subprocess.run([python, "-c", "import pytest"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise AssertionError(
            f"{python} cannot import pytest, so the repository tasks' tests cannot run: run "
            "`make tasks_env` (`make test` does it), or set GAGAR_TASK_PYTHON to an interpreter "
            "with pytest")
    return python
