"""Per-run cgroup-v1 limits for the sandbox: memory, process count and CPU share.

One directory per sandboxed run under the worker's own cgroup of each controller
(`<mount>/<worker's path>/gagar_sandbox/<run>`), so the run also stays inside whatever limits the
worker itself lives under. Made only where the machine offers it (a cgroup-v1 hierarchy with
the controller, writable: root); otherwise each missing controller is named in `notes` and the
sandbox falls back to resource limits (docs/rollout.md, "The sandbox"). cgroup v2 is not used.
"""
from __future__ import annotations

import dataclasses
import os
import re
import signal
import time
import uuid

CONTROLLERS = ("memory", "pids", "cpu")
CPU_PERIOD_US = 100_000


def _v1_mounts() -> dict:
    """controller -> its cgroup-v1 mount point, from /proc/self/mountinfo."""
    out = {}
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, rest = left.split(), right.split()
                if len(rest) >= 3 and rest[0] == "cgroup":
                    for c in rest[2].split(","):
                        if c in CONTROLLERS:
                            out[c] = fields[4]
    except OSError:
        pass
    return out


def _own_paths() -> dict:
    """controller -> this process's cgroup path in that hierarchy, from /proc/self/cgroup."""
    out = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, ctrls, path = line.rstrip("\n").split(":", 2)
                for c in ctrls.split(","):
                    out[c] = path
    except OSError:
        pass
    return out


@dataclasses.dataclass
class RunCgroups:
    """The cgroups of one run: `dirs` (controller -> directory) and why the others are missing."""
    dirs: dict
    notes: list

    @property
    def paths(self) -> list:
        return list(self.dirs.values())

    def limits_hit(self) -> dict:
        """What the run ran into: {"memory": the limit was reached, "oom_kills": processes the
        kernel killed for it, "processes": a fork was refused} (controllers it has only)."""
        hit = {}
        if "memory" in self.dirs:
            oom = re.search(r"oom_kill (\d+)", _read(self.dirs["memory"], "memory.oom_control"))
            hit["memory"] = _read_int(self.dirs["memory"], "memory.failcnt") > 0
            hit["oom_kills"] = int(oom.group(1)) if oom else 0
        if "pids" in self.dirs:
            m = re.search(r"max (\d+)", _read(self.dirs["pids"], "pids.events"))
            hit["processes"] = bool(m) and int(m.group(1)) > 0
        return hit

    def kill_and_remove(self) -> None:
        """SIGKILL every process left in the run's cgroups, then remove them."""
        for _ in range(100):
            pids = set()
            for d in self.dirs.values():
                pids |= {int(p) for p in _read(d, "cgroup.procs").split()}
            if not pids:
                break
            for p in pids:
                try:
                    os.kill(p, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.01)
        for d in self.dirs.values():
            for _ in range(100):
                try:
                    os.rmdir(d)
                    break
                except FileNotFoundError:
                    break
                except OSError:      # busy while the last killed process exits
                    time.sleep(0.01)


def _read(d: str, name: str) -> str:
    try:
        with open(os.path.join(d, name)) as f:
            return f.read()
    except OSError:
        return ""


def _read_int(d: str, name: str) -> int:
    text = _read(d, name).strip()
    return int(text) if text.lstrip("-").isdigit() else 0


def _write(d: str, name: str, value: int) -> None:
    with open(os.path.join(d, name), "w") as f:
        f.write(str(value))


def make(memory_bytes: int, processes: int, cpus: float) -> RunCgroups:
    """One run's cgroups with these limits, or as many as the machine allows (the rest in
    `notes`). Never raises."""
    mounts, own = _v1_mounts(), _own_paths()
    name = f"run-{uuid.uuid4().hex[:12]}"
    dirs, notes = {}, []
    settings = {"memory": [("memory.limit_in_bytes", memory_bytes)],
                "pids": [("pids.max", processes)],
                "cpu": [("cpu.cfs_period_us", CPU_PERIOD_US),
                        ("cpu.cfs_quota_us", max(1000, int(cpus * CPU_PERIOD_US)))]}
    for c in CONTROLLERS:
        if c not in mounts:
            notes.append(f"no cgroup-v1 {c} controller mounted")
            continue
        d = os.path.join(mounts[c] + own.get(c, "/"), "gagar_sandbox", name)
        try:
            os.makedirs(d)
            for key, value in settings[c]:
                _write(d, key, value)
            if c == "memory" and os.path.exists(os.path.join(d, "memory.memsw.limit_in_bytes")):
                _write(d, "memory.memsw.limit_in_bytes", memory_bytes)   # swap counts too
            dirs[c] = d
        except OSError as e:
            notes.append(f"cgroup {c} not usable at {d}: {e.strerror or e}")
            RunCgroups({c: d}, []).kill_and_remove()
    return RunCgroups(dirs, notes)
