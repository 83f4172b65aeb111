"""A trajectory's workspace (what the grader reads) and the confined paths of its working copy.

One directory per trajectory, `<workspace_root>/<task_id>.<8 hex>/`, mode 700 (agent code, an
unprivileged user, cannot read it; under namespaces it is also covered). The layout is a
contract (`LAYOUT_VERSION`; docs/rollout.md, "The trajectory workspace"):

    <workspace>/meta.json          what happened: task, end reason, counts, verdict, sandbox
    <workspace>/transcript.jsonl   every event in order: the prompt, model turns, tool calls,
                                   their results, nudges, the end
    <workspace>/final.diff         unified diff from the task's repository to the final tree
    <workspace>/tests/             run_001.log ... (each run_tests), verdict.log and
                                   verdict_junit.xml (the held-out run)
    <workspace>/repo/              the working copy as the agent left it

Paths the agent names are confined to the working copy (`resolve`): relative, no `..`, no
component that is a symbolic link.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import uuid

LAYOUT_VERSION = 1
_ROOT_LOCK = threading.Lock()
_DEFAULT_ROOT: list = []


class PathRefused(ValueError):
    """A path outside the working copy (or through a link); the message is shown to the agent."""


def resolve(root: str, rel: object) -> str:
    """The absolute path of `rel` inside the tree `root`, or PathRefused.

    Refused: a non-string or empty path, an absolute one, any `..` component, a NUL byte, and a
    path through (or to) a symbolic link."""
    if not isinstance(rel, str) or not rel.strip() or "\0" in rel:
        raise PathRefused(f"bad path {rel!r}")
    if rel.startswith(("/", "\\", "~")):
        raise PathRefused(f"{rel}: absolute paths are refused; give a path inside the "
                          "repository, like src/module.py")
    parts = [p for p in rel.replace("\\", "/").split("/") if p not in ("", ".")]
    if ".." in parts:
        raise PathRefused(f"{rel}: '..' is refused; paths stay inside the repository")
    path = root
    for p in parts:
        path = os.path.join(path, p)
        if os.path.islink(path):
            raise PathRefused(f"{rel}: symbolic links are refused")
    return path


def relative_files(root: str) -> list:
    """Every regular file under `root`, as sorted relative paths (links are not followed)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            full = os.path.join(dirpath, name)
            if os.path.isfile(full) and not os.path.islink(full):
                out.append(os.path.relpath(full, root).replace(os.sep, "/"))
    return sorted(out)


def read_tree(root: str) -> dict:
    """relative path -> text of every file under `root` (undecodable bytes replaced)."""
    out = {}
    for rel in relative_files(root):
        with open(os.path.join(root, rel), "rb") as f:
            out[rel] = f.read().decode(errors="replace")
    return out


def write_tree(root: str, files: dict) -> None:
    """Writes `files` (relative path -> text) under `root` (made if missing)."""
    for rel, text in files.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)


def default_root() -> str:
    """A process-wide temporary workspace root (mode 700), made on first use."""
    with _ROOT_LOCK:
        if not _DEFAULT_ROOT:
            _DEFAULT_ROOT.append(tempfile.mkdtemp(prefix="gagar_workspaces_"))
        return _DEFAULT_ROOT[0]


class Workspace:
    """One trajectory's directory (the module docstring's layout) and its writers."""

    def __init__(self, root: str, task_id: str):
        root = root or default_root()
        os.makedirs(root, mode=0o700, exist_ok=True)
        self.root = root
        self.path = os.path.join(root, f"{task_id}.{uuid.uuid4().hex[:8]}")
        os.makedirs(os.path.join(self.path, "tests"), mode=0o700)
        os.chmod(self.path, 0o700)
        self.repo = os.path.join(self.path, "repo")
        self._runs = 0

    def start_copy(self, source: str) -> None:
        """The working copy: a fresh copy of the task's repository."""
        shutil.copytree(source, self.repo, symlinks=True)

    def event(self, event: dict) -> None:
        """Appends one event to the transcript (written at once: a crash keeps what came)."""
        with open(os.path.join(self.path, "transcript.jsonl"), "a") as f:
            f.write(json.dumps(event) + "\n")

    def write(self, rel: str, text: str) -> str:
        """Writes an artifact atomically; its path."""
        path = os.path.join(self.path, rel)
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            f.write(text)
        os.replace(tmp, path)
        return path

    def test_log(self, text: str) -> str:
        """The next <workspace>/tests/run_NNN.log; its path relative to the workspace."""
        self._runs += 1
        rel = f"tests/run_{self._runs:03d}.log"
        self.write(rel, text)
        return rel

    def write_meta(self, meta: dict) -> None:
        self.write("meta.json", json.dumps({"layout_version": LAYOUT_VERSION, **meta},
                                           indent=1, sort_keys=True))
