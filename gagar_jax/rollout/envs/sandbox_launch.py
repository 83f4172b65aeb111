"""The sandbox's supervisor: one process per sandboxed command, started by `sandbox.run`.

Run as a script (`python -I -S sandbox_launch.py`, standard library only, so it starts in a few
milliseconds and never imports the worker's packages). It reads one JSON spec on stdin, writes
one JSON result on stdout, and in between:

1. joins the run's cgroups (memory, pids, cpu; made and limited by the worker);
2. with `namespaces`: a mount and a network namespace of its own (no network: only a loopback
   that is down); `/tmp` becomes a fresh tmpfs of `disk_bytes` (the command's whole disk),
   `/var/tmp` and `/dev/shm` small ones, and every `hide` path an empty, unreadable tmpfs;
3. copies `src` (opened before anything was covered) into `<scratch>/work`, owned by the
   command's user;
4. forks the command: its own session and process group, resource limits (`rlimits`), the
   unprivileged `uid`/`gid` when given, no new privileges, stdout and stderr to
   `<scratch>/out/output.log`, cwd `<scratch>/work`;
5. waits at most `timeout_s`, then kills the command's process group, every process left in its
   cgroups and every orphan it reaped (it is a child subreaper); reads back the output (head and
   tail within `output_limit` bytes) and the `collect` files.

Result: {"setup_error": str | None, "exit_code", "signal", "timed_out", "wall_s", "output",
"output_bytes", "files", "enforced"}. A `setup_error` is a failure of the sandbox itself (the
worker's `infra_error`), never of the command.
"""
import ctypes
import json
import os
import resource
import select
import signal
import sys
import time

CLONE_NEWNS, CLONE_NEWNET = 0x00020000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 1, 2, 4, 0x4000, 1 << 18
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
RLIMITS = {"AS": "RLIMIT_AS", "FSIZE": "RLIMIT_FSIZE", "CPU": "RLIMIT_CPU",
           "NPROC": "RLIMIT_NPROC", "NOFILE": "RLIMIT_NOFILE", "CORE": "RLIMIT_CORE"}
SMALL_TMPFS = ("/var/tmp", "/dev/shm")   # other world-writable places, kept small
SMALL_TMPFS_BYTES = 16 << 20
FRESH_TMPFS = ("/tmp",) + SMALL_TMPFS    # every directory the command sees empty and its own

_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(src: str, target: str, fstype: str, flags: int, data: str) -> None:
    _check(_libc.mount(src.encode(), target.encode(), fstype.encode() if fstype else None,
                       ctypes.c_ulong(flags), data.encode() if data else None),
           f"mount {fstype or src} on {target}")


def _namespaces(spec: dict) -> None:
    """Own mount and network namespaces; /tmp the command's disk; `hide` covered."""
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWNET), "unshare(mount, net)")
    # Mounts made from here on stay in this namespace (the host's are shared by default).
    _mount("none", "/", "", MS_REC | MS_PRIVATE, "")
    _mount("tmpfs", "/tmp", "tmpfs", MS_NOSUID | MS_NODEV,
           f"size={int(spec['disk_bytes'])},mode=1777")
    for path in SMALL_TMPFS:
        if os.path.isdir(path):
            _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV,
                   f"size={SMALL_TMPFS_BYTES},mode=1777")
    for path in spec["hide"]:
        if os.path.isdir(path):     # (one under /tmp is gone already)
            _mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,mode=000")


def _copy_tree(src_fd: int, dst: str, uid: int, gid: int) -> None:
    """`src_fd`'s tree (opened before /tmp and `hide` were covered) into `dst`, owned uid:gid;
    regular files and directories only (a tool-made working copy has nothing else)."""
    os.makedirs(dst, exist_ok=True)
    for dirpath, dirnames, filenames, dfd in os.fwalk(".", dir_fd=src_fd, follow_symlinks=False):
        out = os.path.normpath(os.path.join(dst, dirpath))
        for d in dirnames:
            os.makedirs(os.path.join(out, d), exist_ok=True)
        for name in filenames:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dfd)
            with os.fdopen(fd, "rb") as f_in, open(os.path.join(out, name), "wb") as f_out:
                while chunk := f_in.read(1 << 20):
                    f_out.write(chunk)
    if uid >= 0:
        for dirpath, dirnames, filenames in os.walk(dst):
            for name in [dirpath] + [os.path.join(dirpath, n) for n in dirnames + filenames]:
                os.chown(name, uid, gid)


def _child(spec: dict, work: str, log_path: str, err_w: int) -> None:
    """In the forked child: limits, identity, then exec. Never returns; errors go to `err_w`."""
    try:
        os.setsid()
        _libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        if spec["uid"] is not None:
            os.fchown(log, spec["uid"], spec["gid"])
        os.dup2(log, 1)
        os.dup2(log, 2)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        for key, value in spec["rlimits"].items():
            resource.setrlimit(getattr(resource, RLIMITS[key]), (int(value), int(value)))
        if spec["uid"] is not None:
            os.setgroups([])
            os.setgid(spec["gid"])
            os.setuid(spec["uid"])
        _check(_libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(no_new_privs)")
        os.chdir(work)
        os.execve(spec["argv"][0], spec["argv"], spec["env"])
    except BaseException as e:   # anything before exec is the sandbox's failure
        os.write(err_w, f"{type(e).__name__}: {e}".encode()[:2000])
    os.kill(os.getpid(), signal.SIGKILL)   # gone at once: no Python clean-up in a forked child


def _kill_leftovers(spec: dict, pgid: int) -> None:
    """SIGKILL the command's process group, whatever is left in its cgroups and every orphan
    reparented to this subreaper; reap them."""
    me = os.getpid()
    for _ in range(50):
        pids = set()
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for cg in spec["cgroups"]:
            try:
                with open(os.path.join(cg, "cgroup.procs")) as f:
                    pids |= {int(p) for p in f.read().split()}
            except OSError:
                pass
        pids |= _children(me)
        pids.discard(me)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
        if not pids:
            return
        time.sleep(0.01)


def _children(ppid: int) -> set:
    out = set()
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == ppid:
                        out.add(int(name))
            except (OSError, IndexError, ValueError):
                pass
    return out


def _read_bounded(path: str, limit: int) -> tuple:
    """(text, size): the whole file when it fits `limit`, else its head and tail."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            if size <= limit:
                return f.read().decode(errors="replace"), size
            head = f.read(limit // 4).decode(errors="replace")
            f.seek(size - (limit - limit // 4))
            tail = f.read().decode(errors="replace")
    except OSError:
        return "", 0
    return f"{head}\n[... {size - limit} bytes cut ...]\n{tail}", size


def supervise(spec: dict) -> dict:
    """Sets up, runs and cleans up one command (the module docstring); the result dict."""
    out = {"setup_error": None, "exit_code": None, "signal": None, "timed_out": False,
           "wall_s": 0.0, "output": "", "output_bytes": 0, "files": {},
           "enforced": {"namespaces": False, "uid": spec["uid"]}}
    try:
        for cg in spec["cgroups"]:
            with open(os.path.join(cg, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        src_fd = os.open(spec["src"], os.O_RDONLY | os.O_DIRECTORY)
        if spec["namespaces"]:
            _namespaces(spec)
            out["enforced"]["namespaces"] = True
            scratch = "/tmp"
        else:
            scratch = spec["scratch"]
        work, outdir = os.path.join(scratch, "work"), os.path.join(scratch, "out")
        uid = -1 if spec["uid"] is None else spec["uid"]
        gid = -1 if spec["gid"] is None else spec["gid"]
        _copy_tree(src_fd, work, uid, gid)
        os.close(src_fd)
        os.makedirs(outdir, exist_ok=True)
        if uid >= 0:
            os.chown(outdir, uid, gid)
        err_r, err_w = os.pipe2(os.O_CLOEXEC)
        t0 = time.monotonic()
        pid = os.fork()
        if pid == 0:
            os.close(err_r)
            _child(spec, work, os.path.join(outdir, "output.log"), err_w)
        os.close(err_w)
        pidfd = os.pidfd_open(pid)
        ready, _, _ = select.select([pidfd], [], [], float(spec["timeout_s"]))
        if not ready:
            out["timed_out"] = True
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _, status = os.waitpid(pid, 0)
        out["wall_s"] = round(time.monotonic() - t0, 3)
        _kill_leftovers(spec, pid)
        with os.fdopen(err_r, "rb") as f:
            err = f.read().decode(errors="replace")
        if err:
            out["setup_error"] = f"starting {spec['argv'][0]}: {err}"
            return out
        if os.WIFSIGNALED(status):
            out["signal"] = os.WTERMSIG(status)
        else:
            out["exit_code"] = os.WEXITSTATUS(status)
        out["output"], out["output_bytes"] = _read_bounded(
            os.path.join(outdir, "output.log"), int(spec["output_limit"]))
        for rel in spec["collect"]:
            text, _ = _read_bounded(os.path.join(work, rel), int(spec["output_limit"]) * 4)
            if os.path.isfile(os.path.join(work, rel)):
                out["files"][rel] = text
    except Exception as e:       # reported, never raised: the worker decides
        out["setup_error"] = f"{type(e).__name__}: {e}"
    return out


if __name__ == "__main__":
    result = supervise(json.loads(sys.stdin.read()))
    sys.stdout.write(json.dumps(result))
