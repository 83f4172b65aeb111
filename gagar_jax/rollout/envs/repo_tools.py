"""The repository environment's tools, on one trajectory's working copy.

`TOOLS` declares them (the names, arguments and one-line descriptions the prompt shows);
`RepoTools.call` runs one well-formed call and returns the text the agent sees. A problem the
agent caused (a path outside the copy, a file that does not exist, a patch that does not apply,
a file too large) is a `ToolFailure`: answered with its message and counted as a tool error. A
failure of the sandbox itself is a `SandboxFailure`: it ends the episode ("tool_error") and
makes the verdict `infra_error`.
"""
from __future__ import annotations

import os

from gagar_jax.rollout.envs import patch as patches
from gagar_jax.rollout.envs import repo_verdict, sandbox, workspace
from gagar_jax.rollout.envs.repo_tasks import RepoTask
from gagar_jax.rollout.envs.tools import ToolCall, ToolSpec

TOOLS = (
    ToolSpec("list_files", "list the repository's files (all, or under a directory)",
             {"path": "string"}),
    ToolSpec("read_file", "read a file, or lines start..end of it (1-based, inclusive)",
             {"path": "string", "start": "integer", "end": "integer"}, ("path",)),
    ToolSpec("write_file", "create or overwrite a file with this content",
             {"path": "string", "content": "string"}, ("path", "content")),
    ToolSpec("apply_patch", "apply a unified diff (--- a/path, +++ b/path, @@ hunks)",
             {"patch": "string"}, ("patch",)),
    ToolSpec("run_tests", "run the repository's visible tests (pytest) and show the output"),
    ToolSpec("submit", "submit the repository as it is now; this ends your work"),
)
BY_NAME = {t.name: t for t in TOOLS}


class ToolFailure(Exception):
    """A call the agent got wrong; the message is its answer."""


class SandboxFailure(Exception):
    """The sandbox could not run the tests (not the agent's doing)."""


class RepoTools:
    """The tools of one working copy.

    Args:
      task: the task (its visible tests).
      ws: the trajectory's workspace (the working copy, test logs).
      config: the sandbox the tests run in.
      hide: paths agent code must not read.
      max_file_bytes / max_files / max_read_chars: what one file, the copy and one read may hold.
    """

    def __init__(self, task: RepoTask, ws: workspace.Workspace, config: sandbox.SandboxConfig,
                 hide: tuple = (), *, max_file_bytes: int = 256 << 10, max_files: int = 500,
                 max_read_chars: int = 20_000):
        self.task, self.ws, self.config, self.hide = task, ws, config, hide
        self.max_file_bytes, self.max_files = max_file_bytes, max_files
        self.max_read_chars = max_read_chars
        self.test_runs = 0
        self.last_enforced: dict = {}

    def call(self, call: ToolCall) -> str:
        """Runs `call` (not `submit`, which the environment handles); the answer's text."""
        try:
            return getattr(self, f"_{call.name}")(**call.arguments)
        except workspace.PathRefused as e:
            raise ToolFailure(str(e)) from e
        except patches.PatchError as e:
            raise ToolFailure(f"patch not applied: {e}") from e

    def _path(self, rel: str) -> str:
        return workspace.resolve(self.ws.repo, rel)

    def _list_files(self, path: str = ".") -> str:
        root = self.ws.repo if path in (".", "") else self._path(path)
        if not os.path.isdir(root):
            raise ToolFailure(f"{path}: no such directory")
        base = os.path.relpath(root, self.ws.repo)
        files = [f if base == "." else f"{base}/{f}" for f in workspace.relative_files(root)]
        return "\n".join(files) if files else "(no files)"

    def _read_file(self, path: str, start: int = 1, end: int = 0) -> str:
        full = self._path(path)
        if not os.path.isfile(full):
            raise ToolFailure(f"{path}: no such file")
        with open(full, "rb") as f:
            text = f.read().decode(errors="replace")
        if start != 1 or end:
            lines = text.splitlines(keepends=True)
            if start < 1 or (end and end < start) or start > max(len(lines), 1):
                raise ToolFailure(f"{path}: lines {start}..{end or 'end'} are not in its "
                                  f"{len(lines)} lines")
            text = "".join(lines[start - 1:end or None])
        if len(text) > self.max_read_chars:
            text = (text[:self.max_read_chars] + f"\n[... cut at {self.max_read_chars} "
                    "characters: read a line range]")
        return text if text else "(empty file)"

    def _check_size(self, rel: str, text: str, full: str) -> None:
        if len(text.encode()) > self.max_file_bytes:
            raise ToolFailure(f"{rel}: {len(text.encode())} bytes is over the "
                              f"{self.max_file_bytes}-byte limit per file")
        if os.path.isdir(full):
            raise ToolFailure(f"{rel} is a directory")
        if not os.path.exists(full) and len(workspace.relative_files(self.ws.repo)) >= \
                self.max_files:
            raise ToolFailure(f"the repository already holds {self.max_files} files")

    def _write_file(self, path: str, content: str) -> str:
        full = self._path(path)
        self._check_size(path, content, full)
        os.makedirs(os.path.dirname(full), exist_ok=True)
        with open(full, "w") as f:
            f.write(content)
        return f"wrote {path} ({len(content.encode())} bytes)"

    def _apply_patch(self, patch: str) -> str:
        targets = patches.parse(patch)
        current, fulls = {}, {}
        for fp in targets:
            for rel in {fp.old, fp.new} - {None}:
                fulls[rel] = self._path(rel)
                if os.path.isfile(fulls[rel]):
                    with open(fulls[rel]) as f:
                        current[rel] = f.read()
        new = patches.apply(current, patch)
        for rel, text in new.items():
            if text is not None:
                self._check_size(rel, text, fulls[rel])
        for rel, text in new.items():
            if text is None:
                os.remove(fulls[rel])
            else:
                os.makedirs(os.path.dirname(fulls[rel]), exist_ok=True)
                with open(fulls[rel], "w") as f:
                    f.write(text)
        return "applied to " + ", ".join(
            f"{rel} ({'deleted' if text is None else 'written'})" for rel, text in new.items())

    def _run_tests(self) -> str:
        run = sandbox.run(self.ws.repo, repo_verdict.pytest_argv(
            self.config.interpreter, self.task.visible_tests), self.config, hide=self.hide)
        self.last_enforced = run.enforced
        if run.status == "infra_error":
            raise SandboxFailure(run.error)
        self.test_runs += 1
        if run.status == "timeout":
            head = f"the tests did not finish in {self.config.limits.wall_s:g} s and were killed"
        elif run.signal is not None:
            head = f"the test process was killed by signal {run.signal}"
        else:
            head = f"pytest exit code {run.exit_code}"
        self.ws.test_log(f"{head}\n{run.output}")
        return f"{head}\n{run.output[-6000:]}"
