"""The version model of `<workdir>/published/`: version directories, their manifests, the `latest`
pointer, and collection (docs/checkpoints.md, "Versions and collection"). No JAX: process 0
calls these; `publish.py` writes the files.

    published/
      step_00000010/          a version: complete weights after step 10 (that step's first attempt)
        gagar_publish.json    its manifest, written after every other file of the directory
      step_00000010.a1/       step 10 published again (a resumed run re-trained it): a new directory
      latest                  {"step", "policy_version", "path"}: names one version

Rules; each action below is one atomic step, so they hold under every order of kill and restart:
  1. A directory is written by one attempt only: every attempt takes a name no directory under
     `published/` has (`step_<8 digits>`, then `.a1`, `.a2`, ... for the same step), so nothing
     is ever written into a directory that was or is named by `latest`.
  2. A directory's manifest is written last; without it the directory is an unfinished attempt.
  3. `latest` moves only to a directory with a manifest (one atomic replace).
  4. Collection never deletes the version `latest` names, nor a version it needs.
  5. Collection (after each move of `latest`) keeps the `keep` newest versions that have been
     `latest` (following each manifest's `previous`: what `latest` named when it was committed),
     plus every version those need through `base` (a delta's chain); it deletes the rest: older
     versions, unfinished attempts, and versions committed but never named by `latest` (a kill
     between manifest and pointer). The manifest goes first, so a half-deleted directory reads
     as unfinished and is never listed, linked or named.

Manifest: {"step", "policy_version", "seq" (publish count, 1, 2, ...), "kind" ("full" or
"delta": only what changed since `base`, `gagar_jax/hf/delta.py`), "base" (name or null),
"previous" (name or null), "files" (names), "time", "digests" (file name -> sha256 hex of
every file of `files`, computed by the process that wrote it), "base_sha256" (a delta: sha256
of its base's manifest file, so a base swapped for another version is noticed)}. A delta is
committed only while its whole chain down to a full version is intact (`chain_error`; rule 4
then keeps the chain for as long as the delta is kept).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from typing import Optional

from etils import epath

from gagar_jax.distributed import is_remote
from gagar_jax.publish_format import MANIFEST, POINTER, PUBLISH_DIR, parse_name, step_dir_name

log = logging.getLogger(__name__)

_TMP = f"{POINTER}.tmp-"


def root_of(workdir: epath.PathLike) -> epath.Path:
    """`<workdir>/published` (absolute for a local workdir)."""
    w = os.fspath(workdir)
    return epath.Path(os.path.abspath(w) if not is_remote(w) else w) / PUBLISH_DIR


def read_manifest(directory: epath.PathLike) -> Optional[dict]:
    """A version's manifest, or None for an unfinished (or half-collected) directory."""
    try:
        m = json.loads((epath.Path(directory) / MANIFEST).read_text())
    except (FileNotFoundError, NotADirectoryError, ValueError):
        return None
    return m if isinstance(m, dict) else None


def read_pointer(root: epath.Path) -> Optional[dict]:
    try:
        return json.loads((root / POINTER).read_text())
    except FileNotFoundError:
        return None


def read_latest(workdir: epath.PathLike) -> Optional[dict]:
    """The `latest` pointer ({"step", "policy_version", "path"}), or None if nothing published."""
    return read_pointer(root_of(workdir))


def scan(root: epath.Path) -> dict:
    """Version directory name -> its manifest (None: unfinished), for every entry of `root`."""
    if not root.exists():
        return {}
    return {p.name: read_manifest(p) for p in root.iterdir() if parse_name(p.name)}


def published_steps(workdir: epath.PathLike) -> list[int]:
    """Steps with a complete published version (manifest present), oldest first."""
    return sorted({parse_name(n)[0] for n, m in scan(root_of(workdir)).items() if m is not None})


def new_name(root: epath.Path, step: int) -> str:
    """A name for a new attempt at `step` that no entry of `root` (nor `latest`) has or had."""
    names = [p.name for p in root.iterdir()] if root.exists() else []
    ptr = read_pointer(root)
    if ptr is not None:   # `latest` names it even if the directory went missing
        names.append(os.path.basename(ptr["path"]))
    taken = [s[1] for s in map(parse_name, names) if s is not None and s[0] == step]
    return step_dir_name(step, max(taken) + 1 if taken else 0)


class BrokenChain(ValueError):
    """A delta's chain (base, its base, ... down to a full version) is not intact: committing
    it would point `latest` at a version no engine can load."""


def file_sha256(path: epath.Path) -> str:
    """sha256 hex of a file, read in 16 MiB pieces."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while piece := f.read(1 << 24):
            digest.update(piece)
    return digest.hexdigest()


def chain_error(root: epath.Path, base: str) -> Optional[str]:
    """Why the chain from version `base` down to a full version is broken (a manifest gone or
    unreadable, a file it lists missing, a loop), or None when it is intact."""
    name, seen = base, set()
    while True:
        if name in seen:
            return f"the chain of {base} loops at {name}"
        seen.add(name)
        m = read_manifest(root / name)
        if m is None:
            return f"version {name} has no manifest (deleted, or unfinished)"
        missing = [f for f in m.get("files", []) if not (root / name / f).exists()]
        if missing:
            return f"version {name} lacks {missing[0]}"
        if m.get("kind", "full") == "full":
            return None
        if not m.get("base"):
            return f"delta {name} names no base"
        name = m["base"]


def write_pointer(root: epath.Path, obj: dict) -> None:
    """Replaces `latest` atomically: one whole-object write on an object store; a temp file +
    fsync + `os.replace` (and a directory fsync) on a local disk."""
    text = json.dumps(obj)
    if is_remote(root):
        (root / POINTER).write_text(text)
        return
    path = os.path.join(os.fspath(root), POINTER)
    tmp = f"{os.path.join(os.fspath(root), _TMP)}{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.fspath(root), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(root: epath.Path, name: str, step: int, keep: int, *, kind: str = "full",
           base: Optional[str] = None, digests: Optional[dict] = None) -> str:
    """Process 0, once every file of version `name` is written: manifest, then `latest`, then
    collection. Returns the version's path.

    Args:
      root: `published/`. name: the directory (from `new_name`). step: its train step.
      keep: versions that have been `latest` to keep (>= 1), the new one included.
      kind: "full", or "delta": `base` (a committed version's name) must be applied first.
      digests: file name -> sha256 hex from the processes that wrote the files; a file not
        in it (config.json, the index, serving files: process 0's) is hashed here.
    Raises:
      BrokenChain: a delta whose chain is not intact (nothing is committed).
    """
    final = root / name
    why = ("a delta names no base" if base is None else chain_error(root, base)) \
        if kind != "full" else None
    if why:   # `latest` must name an applicable version: never a delta on a broken chain
        raise BrokenChain(f"version {name}: {why}")
    versions = scan(root)
    ptr = read_pointer(root)
    previous = os.path.basename(ptr["path"]) if ptr is not None else None
    if previous not in versions or versions.get(previous) is None:
        previous = None
    seq = 1 + max((m.get("seq", 0) for m in versions.values() if m), default=0)
    files = sorted(p.name for p in final.iterdir() if p.name != MANIFEST)
    digests = digests or {}
    manifest = {"step": step, "policy_version": step, "seq": seq, "kind": kind, "base": base,
                "previous": previous, "files": files, "time": round(time.time(), 3),
                "digests": {f: digests.get(f) or file_sha256(final / f) for f in files}}
    if base is not None:
        manifest["base_sha256"] = file_sha256(root / base / MANIFEST)
    (final / MANIFEST).write_text(json.dumps(manifest))
    write_pointer(root, {"step": step, "policy_version": step, "path": os.fspath(final)})
    collect(root, keep)
    return os.fspath(final)


def kept_versions(versions: dict, latest: str, keep: int) -> set:
    """The names collection keeps: `keep` versions back along `previous` from `latest` (then, for
    directories written before manifests named their predecessor, the newest such steps), and
    every version they need through `base`."""
    kept, name = [], latest
    while name is not None and name not in kept and len(kept) < keep and versions.get(name):
        kept.append(name)
        name = versions[name].get("previous")
    legacy = sorted((n for n, m in versions.items() if m and "seq" not in m and n not in kept),
                    key=parse_name, reverse=True)
    kept += legacy[:max(0, keep - len(kept))]
    needed, todo = {latest, *kept}, list(kept)
    while todo:
        base = (versions.get(todo.pop()) or {}).get("base")
        if base is not None and base not in needed:
            needed.add(base)
            todo.append(base)
    return needed


def remove_version(directory: epath.Path) -> None:
    """Deletes a version directory, its manifest first (a kill midway leaves it unfinished)."""
    (directory / MANIFEST).unlink(missing_ok=True)
    directory.rmtree(missing_ok=True)


def collect(root: epath.Path, keep: int) -> list:
    """Deletes every version directory `kept_versions` does not keep (manifest first) and stale
    pointer temp files; returns the names deleted. Nothing is deleted while `latest` is absent."""
    ptr = read_pointer(root)
    if ptr is None:
        return []
    versions = scan(root)
    needed = kept_versions(versions, os.path.basename(ptr["path"]), keep)
    gone = []
    for name in sorted(set(versions) - needed):
        try:
            remove_version(root / name)
            gone.append(name)
        except OSError as e:   # a later collection tries again; nothing depends on it
            log.warning("could not collect published version %s: %s", root / name, e)
    if not is_remote(root):
        for p in root.iterdir():
            if p.name.startswith(_TMP):
                p.unlink(missing_ok=True)
    return gone
