"""`gagar-train`: parse flags, start JAX's distributed runtime if asked, run the loop.

    gagar-train --config configs/tiny_cpu.py --workdir runs/tiny [--config.train.steps=20 ...]

Multi-process: `--coordinator_address HOST:PORT --num_processes N --process_id I` (or the
environment variables JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID), or
`--distributed` to let `jax.distributed.initialize()` detect a TPU pod / SLURM cluster.
Exit codes (docs/reliability.md): 0 done (or preempted and checkpointed); 2 configuration
error or workdir locked by another learner (one line naming the holder); 1 fatal runtime error
(one line naming the failing path; background writers are stopped first, with a bounded wait).

Process 0 takes the workdir lock (`--lock_wait_s`) before JAX is imported and before any workdir
file is touched. With no accelerator visible and JAX_PLATFORMS unset, JAX_PLATFORMS=cpu is set
so that an installed libtpu is never probed (it prints E0000 lines on CPU-only machines).
"""
from __future__ import annotations

import glob
import logging
import os
import sys
import traceback
from collections.abc import Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from absl import flags

# `--help`'s header: what a user runs and what comes out (the docstring above is for developers).
USAGE = """gagar-train: the RL learner (docs: README.md).

    gagar-train --config configs/tiny_cpu.py --workdir runs/tiny [--config.KEY=VALUE ...]

An existing --workdir resumes from its last checkpoint. SIGTERM or Ctrl-C checkpoints and
writes the summary (a second Ctrl-C exits at once). Exit codes: 0 done or stopped by SIGTERM
and checkpointed, 130 stopped by Ctrl-C and checkpointed, 2 configuration error or workdir
held by another learner, 1 fatal runtime error (docs/reliability.md)."""
# The persistent compilation cache a direct run uses unless JAX_COMPILATION_CACHE_DIR is set
# or --nocompile_cache is given (a rerun then skips ~30 s of compiles on the tiny config).
DEFAULT_COMPILE_CACHE = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.join(
    os.path.expanduser("~"), ".cache"), "gagar_jax", "jax")

_REPO_CONFIG = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir,
                                             os.pardir, "configs", "tiny_cpu.py"))


def _define_flags(argv: list[str]):
    from absl import flags
    from ml_collections import config_flags

    fv = flags.FlagValues()
    config_flags.DEFINE_config_file(
        "config", None, "Config file (get_config() -> ConfigDict); default: configs/tiny_cpu.py.",
        flag_values=fv, lock_config=True, sys_argv=argv)  # overrides are found in argv
    flags.DEFINE_string("workdir", None, "Run directory (checkpoints, metrics, ledger).",
                        flag_values=fv)
    flags.DEFINE_string("coordinator_address", None, "jax.distributed coordinator HOST:PORT.",
                        flag_values=fv)
    flags.DEFINE_integer("num_processes", None, "Number of processes.", flag_values=fv)
    flags.DEFINE_integer("process_id", None, "This process's index.", flag_values=fv)
    flags.DEFINE_bool("distributed", False,
                      "Call jax.distributed.initialize() with auto-detection (TPU pods, SLURM).",
                      flag_values=fv)
    flags.DEFINE_float("lock_wait_s", 0.0,
                       "Wait this long for another learner to release the workdir (e.g. its "
                       "SIGTERM grace period) before exiting 2.", flag_values=fv)
    flags.DEFINE_bool("start_fresh", False,
                      "When no readable checkpoint is left (all moved aside as corrupt), train "
                      "from step 0 and move the old audit files aside instead of exiting 1.",
                      flag_values=fv)
    flags.DEFINE_bool("verbose", False, "Show other libraries' INFO logs (orbax, JAX).",
                      flag_values=fv)
    flags.DEFINE_bool("compile_cache", True, "Use the persistent compilation cache "
                      f"(JAX_COMPILATION_CACHE_DIR, default {DEFAULT_COMPILE_CACHE}).",
                      flag_values=fv)
    return fv


def _load_failure(path: str | None, err: BaseException) -> str:
    """One line for a config file whose own code fails: the file, the line, the error."""
    if isinstance(err, SyntaxError):
        where = f"{err.filename or path}, line {err.lineno}"
        return f"could not load config {path}: syntax error ({where}): {err.msg}"
    tb = err.__traceback__
    line = None
    while tb is not None:         # the innermost frame of the config file itself
        if path and os.path.abspath(tb.tb_frame.f_code.co_filename) == os.path.abspath(path):
            line = tb.tb_lineno
        tb = tb.tb_next
    where = f" (line {line})" if line else ""
    msg = str(err).splitlines()[0] if str(err) else ""
    return f"could not load config {path}{where}: {type(err).__name__}: {msg}"


def _resolve_feed_path(cfg: Any, config_path: str | None) -> None:
    """A relative `feed.path` that names nothing from the current directory is resolved against
    the config file's repository (the parent of its directory, then the directory itself), so
    the README command works from anywhere; the start-up check names the cwd otherwise."""
    feed_path = str(cfg.feed.get("path", "") or "") if "feed" in cfg else ""
    if not feed_path or os.path.isabs(feed_path) or "://" in feed_path or not config_path:
        return
    if glob.glob(feed_path):
        return
    here = os.path.dirname(os.path.abspath(config_path))
    for base in (os.path.dirname(here), here):
        candidate = os.path.join(base, feed_path)
        if glob.glob(candidate):
            logging.getLogger(__name__).info("feed.path %s: not found from %s; using %s",
                                             feed_path, os.getcwd(), candidate)
            cfg.feed.path = candidate
            return


def _error(msg: str) -> int:
    print(f"gagar-train: error: {msg}", file=sys.stderr)
    return 2


def _unknown_key(argv: list[str], exc: AttributeError) -> str:
    """One plain line: the override that names a missing key, and ConfigDict's suggestion."""
    inner = exc.args[0] if exc.args else exc   # ConfigDict wraps a KeyError in the AttributeError
    while isinstance(inner, BaseException) and inner.args:
        inner = inner.args[0]
    msg = inner if isinstance(inner, str) else str(exc)
    lines = [ln.strip() for ln in msg.splitlines() if ln.strip()]
    key = lines[0].strip("'\"") if lines else ""
    hint = next((ln for ln in lines[1:] if ln.lower().startswith("did you mean")), "")
    for arg in argv:
        name = arg.split("=", 1)[0][len("--config."):]
        if arg.startswith("--config.") and key and name.split(".")[-1] == key:
            key = name
            break
    return f"unknown config key: {key}" + (f" ({hint[0].lower()}{hint[1:]})" if hint else "")


def _usage(argv: list[str], path: str | None) -> str:
    """`gagar-train --help`: usage, flags, every config key with its default, docs pointer."""
    from gagar_jax.config import load_config_file
    from gagar_jax.run.config_help import key_comments, key_lines

    lines = [USAGE, "", "Flags:",
             "  --config FILE            config file (default: configs/tiny_cpu.py)",
             "  --config.KEY=VALUE       override any config key (listed below)",
             "  --workdir DIR            run directory; an existing one resumes",
             "  --coordinator_address HOST:PORT, --num_processes N, --process_id I",
             "                           join a multi-process run (jax.distributed)",
             "  --distributed            jax.distributed.initialize() with auto-detection",
             "  --lock_wait_s S          wait up to S s for another learner to free the workdir",
             "  --start_fresh            no readable checkpoint left: train from step 0, old",
             "                           audit files moved aside (default: exit 1)",
             "  --verbose                show other libraries' INFO logs (orbax, JAX)",
             "  --nocompile_cache        no persistent compilation cache (default: on, in",
             f"                           JAX_COMPILATION_CACHE_DIR or {DEFAULT_COMPILE_CACHE})",
             "  -h, --help               this text", ""]
    if path is not None and os.path.isfile(path):
        lines += [f"Config keys of {path} (value, and the file's comment):",
                  *key_lines(load_config_file(path).to_dict(), key_comments(path)), ""]
    lines.append("Docs: README.md, docs/ (feed.md for graders, loss.md, scaling.md, "
                 "checkpoints.md, reliability.md: exit codes).")
    return "\n".join(lines)


# Device nodes of accelerators JAX can use (TPU VMs: /dev/accel* or /dev/vfio; NVIDIA; AMD).
_ACCELERATOR_NODES = ("/dev/accel*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*", "/dev/kfd")


def _default_platform(env: MutableMapping[str, str] = os.environ) -> None:
    """JAX_PLATFORMS=cpu when it is unset and no accelerator device node exists."""
    if "JAX_PLATFORMS" not in env and not any(glob.glob(p) for p in _ACCELERATOR_NODES):
        env["JAX_PLATFORMS"] = "cpu"


def _process_index_hint(fv: flags.FlagValues, env: Mapping[str, str] = os.environ):
    """This process's index before JAX starts (flags, JAX's or the scheduler's variables), or
    None when only JAX's auto-detection will know."""
    if fv.process_id is not None:
        return fv.process_id
    for var in ("JAX_PROCESS_ID", "SLURM_PROCID", "CLOUD_TPU_TASK_ID", "TPU_WORKER_ID"):
        if env.get(var, "").isdigit():
            return int(env[var])
    return None


def _take_lock(workdir: str, wait_s: float):
    """The error line if another learner holds the workdir, else None (the lock is held).

    An unusable workdir (read-only, missing permissions) raises OSError: a fatal error.
    """
    from gagar_jax.run import workdir_lock  # no JAX: a refused learner exits before importing it
    try:
        workdir_lock.acquire(workdir, wait_s=wait_s)
    except workdir_lock.LockHeld as e:
        return str(e)
    return None


def _fatal(err: BaseException, workdir: str) -> None:
    """One line naming the failing path, the traceback into the workdir if possible, exit 1.

    `os._exit`: a background thread (a stuck checkpoint write) must not keep the process alive.
    """
    cause, seen = err, set()
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if isinstance(cause, OSError) and cause.filename:
            break
        cause = cause.__cause__ or cause.__context__
    if cause is not None:
        reason = f"{cause.strerror or cause}: {cause.filename}"
    else:
        reason = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    where = ""
    try:
        from etils import epath  # local or object-store workdir alike
        path = epath.Path(workdir) / "fatal_error.txt"
        path.write_text("".join(traceback.format_exception(err)))
        where = f" (traceback: {path})"
    except Exception:  # the workdir itself may be what failed
        pass
    print(f"gagar-train: fatal: {reason}{where}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)


def _init_distributed(fv: flags.FlagValues) -> None:
    import jax

    env = os.environ
    addr = fv.coordinator_address or env.get("JAX_COORDINATOR_ADDRESS")
    nproc = fv.num_processes or (
        int(env["JAX_NUM_PROCESSES"]) if "JAX_NUM_PROCESSES" in env else None
    )
    pid = fv.process_id if fv.process_id is not None else (
        int(env["JAX_PROCESS_ID"]) if "JAX_PROCESS_ID" in env else None)
    if not (addr or fv.distributed):
        return
    if jax.config.jax_platforms in ("cpu",) or env.get("JAX_PLATFORMS") == "cpu":
        # CPU devices of several processes talk through gloo (tests, laptops).
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=addr, num_processes=nproc, process_id=pid)


def _config_path(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--config="):
            return arg.split("=", 1)[1]
    return None


def _configure_logging(verbose: bool) -> None:
    """The one place that configures logging: gagar_jax's own loggers at INFO, every other
    library's (orbax logs each checkpoint's steps through absl) at WARNING unless `verbose`.
    Library modules only log (stderr); stdout keeps the end-of-run summary block."""
    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING, format="%(message)s")
    logging.getLogger("gagar_jax").setLevel(logging.INFO)


def _compile_cache(enabled: bool, env: MutableMapping[str, str] = os.environ) -> None:
    """The persistent compilation cache on (JAX_COMPILATION_CACHE_DIR, else the default
    directory), or off; read by JAX when it starts, so set before it is imported."""
    if not enabled:
        env.pop("JAX_COMPILATION_CACHE_DIR", None)
        return
    env.setdefault("JAX_COMPILATION_CACHE_DIR", DEFAULT_COMPILE_CACHE)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    from absl import flags

    _configure_logging("--verbose" in argv[1:])

    path = _config_path(argv)
    if path is None and os.path.isfile(_REPO_CONFIG):  # the embedded default
        path = _REPO_CONFIG
        argv[1:1] = ["--config", path]
    if path is not None and not os.path.isfile(path):
        return _error(f"config file not found: {path}")
    if any(a in ("-h", "--help", "--helpfull", "-help") for a in argv[1:]):
        from gagar_jax.config import ConfigError
        try:
            print(_usage(argv, path))
        except ConfigError as e:
            return _error(str(e))
        except Exception as e:  # the config file's own code failed
            return _error(_load_failure(path, e))
        return 0

    from gagar_jax.config import ConfigError
    from gagar_jax.run import recipes
    try:
        argv = recipes.alias_overrides(argv)     # verl's key names
    except ConfigError as e:
        return _error(str(e))
    fv = _define_flags(argv)
    try:
        fv(argv)
        cfg = fv.config
        if cfg is not None:
            cfg.to_dict()  # a config file that failed to load raises only when first read
    except AttributeError as e:  # ConfigDict: an override names a key that does not exist
        return _error(_unknown_key(argv, e))
    except flags.Error as e:
        return _error(str(e).splitlines()[0])
    except OSError as e:
        lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
        return _error("could not load config: " + (lines[-1] if lines else str(e)))
    except Exception as e:  # the config file's own code failed (syntax, names)
        return _error(_load_failure(path, e))
    if cfg is None:
        return _error("--config is required")
    if not fv.workdir:
        return _error("--workdir is required")
    _resolve_feed_path(cfg, path)

    distributed = bool(fv.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS")
                       or fv.distributed)
    hint = _process_index_hint(fv) if distributed else 0
    try:
        lock_error = _take_lock(fv.workdir, fv.lock_wait_s) if hint == 0 else None
    except OSError as e:        # e.g. a read-only workdir: fatal (exit 1), nothing to stop yet
        print(f"gagar-train: fatal: {e.strerror or e}: {e.filename}", file=sys.stderr)
        return 1
    if lock_error and not distributed:
        return _error(lock_error)
    _default_platform()
    _compile_cache(fv.compile_cache)

    from gagar_jax.config import ConfigError
    from gagar_jax.run import train, workdir_lock

    try:
        _init_distributed(fv)
        if distributed:   # every process exits 2 when process 0 could not take the lock
            import jax
            if hint is None and jax.process_index() == 0:   # known only now
                lock_error = _take_lock(fv.workdir, fv.lock_wait_s)
            lock_error = workdir_lock.agree(lock_error, jax.process_index())
        if lock_error:
            return _error(lock_error)
        summary = train.run(cfg, fv.workdir, start_fresh=fv.start_fresh,
                            explicit=recipes.explicit_keys(argv))
    except ConfigError as e:
        return _error(str(e))
    except FileNotFoundError as e:
        return _error(f"file not found: {e.filename or e}")
    except Exception as e:  # fatal at run time: one line, exit 1
        _fatal(e, fv.workdir)
    if summary is None:
        return 0
    from gagar_jax.distributed import is_primary
    from gagar_jax.run.preemption import SIGINT_EXIT
    from gagar_jax.run.summary import summary_block
    if is_primary():
        print(summary_block(summary, fv.workdir))     # the JSON record: summary.json
    return SIGINT_EXIT if summary.get("signal") == "SIGINT" else 0


if __name__ == "__main__":
    sys.exit(main())
