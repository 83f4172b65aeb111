"""The sandbox agent code runs in: a fresh copy of a tree, limits, no network, hidden paths.

Agent code is whatever the repository's tests execute after the agent's edits. Each `run` copies
a tree into a scratch directory and runs one command there under `sandbox_launch.py` (a
supervisor process per run):

- as an unprivileged user (`SandboxConfig.user`, "nobody") when the worker runs as root, with
  no new privileges; otherwise as the worker's own user (and then it can read what the
  worker can);
- in its own process group and session, killed with everything it started on timeout (the
  cgroups find processes that left the group);
- limits: CPU (cgroup quota where offered, and RLIMIT_CPU), memory (cgroup where offered, and
  RLIMIT_AS per process, which refuses a 10 GB allocation at once), file size (RLIMIT_FSIZE),
  disk (the scratch is a tmpfs of `disk_bytes` in its own mount namespace), processes (pids
  cgroup; without one RLIMIT_NPROC of the unprivileged user), open files;
- with root and a permitted `unshare`: its own mount and network namespaces (no network), with
  `hide` paths (the task data, every trajectory's workspace, the project's git objects)
  covered by empty unreadable mounts.

What the machine did not allow is recorded per run (`RunResult.enforced`: booleans and the
reasons), and the environment copies it into the trajectory's metadata. A run's `status` is
"ok" (the command exited or was killed by a limit: its own doing), "timeout" (killed at
`wall_s`: its own doing) or "infra_error" (the sandbox failed: a supervisor error, a command
that could not start).
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile

from gagar_jax.rollout.envs import cgroups
from gagar_jax.rollout.envs.sandbox_launch import FRESH_TMPFS

LAUNCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sandbox_launch.py")
PROJECT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))
VENV_CACHE = "/var/cache/gagar_jax"   # root's copies of a task venv the sandbox would not see
COPY_SOURCE = "gagar-source.json"     # in each copy: the venv it copies and that venv's stamp
SUPERVISOR_GRACE_S = 20.0   # beyond `wall_s`: the supervisor's own set-up and clean-up


@dataclasses.dataclass(frozen=True)
class Limits:
    """Limits of one sandboxed command (all of its processes together where a cgroup exists).

    Attributes:
      wall_s: wall-clock seconds before the command and everything it started are killed.
      cpu_s: CPU seconds per process (RLIMIT_CPU).
      cpus: CPU share of the whole run (cgroup quota), in cores.
      memory_bytes: memory of the whole run (cgroup: resident memory, page cache, its tmpfs).
      address_space_bytes: virtual memory per process (RLIMIT_AS).
      file_bytes: the largest file a process may write (RLIMIT_FSIZE).
      disk_bytes: everything the run may write (the size of its tmpfs; needs namespaces).
      processes: processes and threads of the run (pids cgroup; else RLIMIT_NPROC).
      open_files: file descriptors per process.
      output_bytes: output kept (head and tail) of stdout and stderr together.
    """
    wall_s: float = 60.0
    cpu_s: int = 120
    cpus: float = 1.0
    memory_bytes: int = 1 << 30
    address_space_bytes: int = 4 << 30
    file_bytes: int = 64 << 20
    disk_bytes: int = 256 << 20
    processes: int = 128
    open_files: int = 256
    output_bytes: int = 32 << 10


def default_python() -> str:
    """The interpreter task tests run with: `$GAGAR_TASK_PYTHON`, else the project's
    `.venv-tasks` (`make tasks_env`; copied where others can reach it when the checkout is not,
    `reachable_venv`), else /usr/bin/python3."""
    env = os.environ.get("GAGAR_TASK_PYTHON")
    if env:
        return env
    venv = os.path.join(PROJECT, ".venv-tasks")
    if not os.path.exists(os.path.join(venv, "bin", "python")):
        return "/usr/bin/python3"
    return os.path.join(reachable_venv(venv), "bin", "python")


def _others_reach(path: str) -> bool:
    """Every directory from / down to `path` lets others through (the execute bit)."""
    path = os.path.abspath(path)
    while True:
        if not os.stat(path).st_mode & 0o001:
            return False
        parent = os.path.dirname(path)
        if parent == path:
            return True
        path = parent


def _covered(path: str) -> bool:
    """`path` lies under a directory the sandbox mounts a fresh tmpfs over (`FRESH_TMPFS`), so a
    sandboxed command cannot see it."""
    real = os.path.realpath(path)
    return any(real == d or real.startswith(d + os.sep) for d in FRESH_TMPFS)


def reachable_venv(venv: str) -> str:
    """`venv`, or, when the worker is root and a sandboxed command could not run it, a copy
    under `VENV_CACHE` that it can: when an unprivileged user cannot reach it (a checkout under a
    mode-700 home, /root for one) or when it lies under /tmp, /var/tmp or /dev/shm (a checkout
    cloned there), which the sandbox covers with a fresh tmpfs.

    A virtual environment may move: its interpreter is a link to the base Python and
    its pyvenv.cfg is found beside it; only its scripts' shebangs name the old path, and the
    sandbox runs `python -m pytest`. The copy is named by the venv's path and the time of its
    last install, made once per machine (atomically: processes racing to make it agree). Making
    one removes the copies of venvs since deleted or reinstalled (`_prune_copies`)."""
    if os.geteuid() != 0 or (_others_reach(venv) and not _covered(venv)):
        return venv
    stamp = _stamp(venv)
    key = hashlib.sha256(f"{os.path.abspath(venv)}:{stamp}".encode()).hexdigest()[:16]
    dest = os.path.join(VENV_CACHE, f"task-venv-{key}")
    if os.path.exists(os.path.join(dest, "bin", "python")) and _others_reach(dest):
        return dest
    os.makedirs(VENV_CACHE, mode=0o755, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f"task-venv-{key}.", dir=VENV_CACHE)
    os.chmod(tmp, 0o755)
    shutil.copytree(venv, os.path.join(tmp, "v"), symlinks=True)
    with open(os.path.join(tmp, "v", COPY_SOURCE), "w") as f:
        json.dump({"venv": os.path.abspath(venv), "stamp": stamp}, f)
    try:
        os.rename(os.path.join(tmp, "v"), dest)
    except OSError:        # another process made it first: theirs is the same copy
        pass
    shutil.rmtree(tmp, ignore_errors=True)
    _prune_copies(keep=dest)
    return dest


def _stamp(venv: str) -> int:
    """The time of `venv`'s last install: its newest top-level entry (ns)."""
    return max(os.stat(os.path.join(venv, f)).st_mtime_ns for f in os.listdir(venv))


def _prune_copies(keep: str) -> None:
    """Removes the copies in `VENV_CACHE` whose venv is gone or was reinstalled since: each
    fresh clone makes a copy (~36 MB with pytest), which would otherwise pile up. Copies without
    a `COPY_SOURCE` record and half-made ones (`task-venv-<key>.<random>`) are left alone."""
    for name in os.listdir(VENV_CACHE):
        path = os.path.join(VENV_CACHE, name)
        if path == keep or not name.startswith("task-venv-") or "." in name:
            continue
        try:
            with open(os.path.join(path, COPY_SOURCE)) as f:
                source = json.load(f)
            venv, stamp = source["venv"], source["stamp"]
        except (OSError, ValueError, KeyError, TypeError):
            continue            # no record (made before records existed) or an unreadable one
        try:
            gone = _stamp(venv) != stamp
        except (OSError, ValueError):
            gone = True         # the venv is gone (or an empty directory: no install)
        if gone:
            shutil.rmtree(path, ignore_errors=True)


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
    """How agent code is run.

    Attributes:
      python: the task interpreter ("" = `default_python()`); it must have pytest and, when the
        worker is root, be readable and executable by `user` (an interpreter under a mode-700
        /root is not).
      user: the unprivileged user commands run as when the worker is root.
      limits: the `Limits` of each command.
      namespaces: use mount and network namespaces where permitted (root and `unshare`).
      cgroups: use per-run cgroups where offered (cgroup v1, writable).
    """
    python: str = ""
    user: str = "nobody"
    limits: Limits = Limits()
    namespaces: bool = True
    cgroups: bool = True

    @property
    def interpreter(self) -> str:
        return self.python or default_python()


@dataclasses.dataclass(frozen=True)
class RunResult:
    """One sandboxed command.

    Attributes:
      status: "ok" (it exited, or a signal or limit ended it), "timeout" or "infra_error".
      exit_code: its exit status (None when a signal ended it or it never ran).
      signal: the signal that ended it, if any.
      output: stdout and stderr (head and tail within `Limits.output_bytes`).
      files: the `collect`ed files that exist afterwards (relative path -> text).
      wall_s: seconds it ran.
      limits_hit: cgroup evidence ({"memory", "oom_kills", "processes"}).
      enforced: what this run enforced (`enforced()`'s dict).
      error: what failed, when status is "infra_error".
    """
    status: str
    exit_code: int | None = None
    signal: int | None = None
    output: str = ""
    files: dict = dataclasses.field(default_factory=dict)
    wall_s: float = 0.0
    limits_hit: dict = dataclasses.field(default_factory=dict)
    enforced: dict = dataclasses.field(default_factory=dict)
    error: str = ""


@functools.cache
def _namespaces_work() -> str:
    """"" when a supervisor can make its namespaces here, else why not (tried once)."""
    if os.geteuid() != 0:
        return "the worker is not root: no mount or network namespace"
    with tempfile.TemporaryDirectory() as d:
        raw = _supervise({"src": d, "scratch": d, "argv": ["/bin/true"], "env": {}, "uid": None,
                          "gid": None, "namespaces": True, "hide": [], "disk_bytes": 1 << 20,
                          "rlimits": {}, "cgroups": [], "timeout_s": 10, "output_limit": 1024,
                          "collect": []}, 30.0)
    return "" if raw.get("setup_error") is None else f"unshare refused: {raw['setup_error']}"


def _supervise(spec: dict, wait_s: float) -> dict:
    proc = subprocess.Popen([sys.executable, "-I", "-S", LAUNCHER], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(json.dumps(spec).encode(), timeout=wait_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)
        proc.communicate()
        return {"setup_error": f"the sandbox supervisor did not finish in {wait_s:.0f} s"}
    try:
        return json.loads(out)
    except ValueError:
        return {"setup_error": f"the sandbox supervisor failed (rc {proc.returncode}): "
                               f"{err.decode(errors='replace')[-2000:]}"}


def enforced(config: SandboxConfig, run_cgroups: cgroups.RunCgroups | None = None) -> dict:
    """What a run with `config` enforces on this machine, with the reason for each gap."""
    notes = []
    root = os.geteuid() == 0
    ns_error = _namespaces_work() if config.namespaces else "namespaces off in the config"
    if ns_error:
        notes.append(f"{ns_error}: network not isolated, hidden paths readable, disk limited "
                     "per file only")
    if not root:
        notes.append("the worker is not root: agent code runs as the worker's user")
    dirs = run_cgroups.dirs if run_cgroups else {}
    notes += run_cgroups.notes if run_cgroups else (
        [] if config.cgroups and root else ["no cgroups (not root, or off in the config)"])
    return {"unprivileged_user": root, "network_isolated": not ns_error,
            "paths_hidden": not ns_error, "disk_limited": not ns_error,
            "memory_cgroup": "memory" in dirs, "pids_cgroup": "pids" in dirs,
            "cpu_cgroup": "cpu" in dirs, "notes": notes}


def run(src: str, argv: list, config: SandboxConfig, *, hide: tuple = (),
        collect: tuple = (), env: dict | None = None) -> RunResult:
    """Runs `argv` in a fresh copy of the tree `src` (the command's working directory).

    Args:
      src: the tree to copy (regular files and directories).
      argv: the command; argv[0] an absolute path (the task interpreter, usually).
      config: the sandbox configuration.
      hide: paths agent code must not read (covered where namespaces work).
      collect: files (relative to the copy) read back afterwards, e.g. a test report.
      env: extra environment variables (the command gets a minimal environment).
    Returns:
      the `RunResult`.
    """
    lim = config.limits
    root = os.geteuid() == 0
    ns_ok = config.namespaces and not _namespaces_work()
    uid = gid = None
    if root:
        try:
            user = pwd.getpwnam(config.user)
        except KeyError:
            return RunResult("infra_error", error=f"no user {config.user!r} to run agent code as")
        uid, gid = user.pw_uid, user.pw_gid
    groups = cgroups.make(lim.memory_bytes, lim.processes, lim.cpus) if (
        config.cgroups and root) else None
    rlimits = {"AS": lim.address_space_bytes, "FSIZE": lim.file_bytes, "CPU": lim.cpu_s,
               "NOFILE": lim.open_files, "CORE": 0}
    if uid is not None and not (groups and "pids" in groups.dirs):
        rlimits["NPROC"] = lim.processes   # counts all of the user's processes: a fallback
    scratch = tempfile.mkdtemp(prefix="gagar_sbx_")
    try:
        if uid is not None and not ns_ok:
            os.chown(scratch, uid, gid)
        base_env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
                    "HOME": "/tmp" if ns_ok else scratch, "TMPDIR": "/tmp" if ns_ok else scratch,
                    "PYTHONDONTWRITEBYTECODE": "1", "PYTHONHASHSEED": "0",
                    "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
        spec = {"src": os.path.abspath(src), "scratch": scratch, "argv": list(argv),
                "env": {**base_env, **(env or {})}, "uid": uid, "gid": gid,
                "namespaces": ns_ok, "hide": [os.path.abspath(h) for h in hide],
                "disk_bytes": lim.disk_bytes, "rlimits": rlimits,
                "cgroups": groups.paths if groups else [], "timeout_s": lim.wall_s,
                "output_limit": lim.output_bytes, "collect": list(collect)}
        raw = _supervise(spec, lim.wall_s + SUPERVISOR_GRACE_S)
        hit = groups.limits_hit() if groups else {}
    finally:
        if groups:
            groups.kill_and_remove()
        shutil.rmtree(scratch, ignore_errors=True)
    record = enforced(config, groups)
    if raw.get("setup_error") is not None:
        return RunResult("infra_error", error=raw["setup_error"], enforced=record)
    return RunResult("timeout" if raw["timed_out"] else "ok", exit_code=raw["exit_code"],
                     signal=raw["signal"], output=raw["output"], files=raw["files"],
                     wall_s=raw["wall_s"], limits_hit=hit, enforced=record)


def check_interpreter(config: SandboxConfig) -> str:
    """"" when `config`'s interpreter runs pytest in the sandbox (as its user), else a one-line
    reason (tried once per interpreter, user and isolation settings in a process)."""
    return _check_interpreter(config.interpreter, config.user, config.namespaces, config.cgroups)


@functools.cache
def _check_interpreter(python: str, user: str, namespaces: bool, use_cgroups: bool) -> str:
    config = SandboxConfig(python=python, user=user, namespaces=namespaces, cgroups=use_cgroups)
    with tempfile.TemporaryDirectory() as d:
        r = run(d, [python, "-c", "import pytest"], config)
    if r.status == "ok" and r.exit_code == 0:
        return ""
    lines = r.output.strip().splitlines()
    why = r.error or (lines[-1] if lines else f"exit code {r.exit_code}")
    who = user if os.geteuid() == 0 else "the worker's user"
    return (f"the task interpreter {python} cannot run pytest as {who}: {why} (build it with "
            "`make tasks_env`, or set GAGAR_TASK_PYTHON)")
