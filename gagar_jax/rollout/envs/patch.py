"""Unified diffs: applied to a set of files (the `apply_patch` tool), made from two trees (a
trajectory's final diff, the tasks' reference fixes).

The format is `diff -u` / `git diff`: per file a `--- a/path` and a `+++ b/path` line
(`/dev/null` for a new or deleted file; a/ and b/ prefixes optional, and so are two differing
tree names, as `diff -ru old new` writes them; `diff --git`, `index` and mode lines ignored),
then hunks `@@ -start,len +start,len @@` of ` ` context, `-` removed
and `+` added lines, `\\ No newline at end of file` after a line that has none. A hunk applies
where its context and removed lines match exactly, at its stated line or the nearest offset
(like `patch` without fuzz); an empty line inside a hunk is read as an empty context line (what
editors and models make of one). Everything is checked before anything is written: a patch
applies whole or not at all, with a `PatchError` naming the file and the hunk.
"""
from __future__ import annotations

import dataclasses
import difflib
import re

_HUNK = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))? @@")
NO_NEWLINE = "\\ No newline at end of file"


class PatchError(ValueError):
    """A patch that cannot be read or applied; the message is shown to the agent."""


@dataclasses.dataclass
class FilePatch:
    """One file's part of a patch: paths (None for /dev/null) and hunks [(old_start, lines)],
    lines as (tag, text with its line ending) with tag in " -+"."""
    old: str | None
    new: str | None
    hunks: list


def _path(header: str) -> str | None:
    path = header[4:].split("\t")[0].strip()
    if path == "/dev/null":
        return None
    if path.startswith(('"', "'")):
        path = path.strip("\"'")
    return path[2:] if path.startswith(("a/", "b/")) else path


def parse(text: str) -> list:
    """The `FilePatch`es of a unified diff, in order."""
    lines = text.splitlines()
    out, i = [], 0
    while i < len(lines):
        if not lines[i].startswith("--- "):
            i += 1
            continue
        if i + 1 >= len(lines) or not lines[i + 1].startswith("+++ "):
            raise PatchError(f"line {i + 1}: a '---' line must be followed by a '+++' line")
        fp = FilePatch(_path(lines[i]), _path(lines[i + 1]), [])
        if fp.old and fp.new and fp.old != fp.new and "/" in fp.old and \
                fp.old.split("/", 1)[1] == fp.new.split("/", 1)[1]:
            fp.old = fp.new = fp.new.split("/", 1)[1]    # `diff -ru old_tree new_tree`
        if fp.old is None and fp.new is None:
            raise PatchError(f"line {i + 1}: both sides are /dev/null")
        i += 2
        while i < len(lines) and lines[i].startswith("@@"):
            m = _HUNK.match(lines[i])
            if not m:
                raise PatchError(f"line {i + 1}: bad hunk header {lines[i]!r}")
            old_left = 1 if m.group(2) is None else int(m.group(2))
            new_left = 1 if m.group(4) is None else int(m.group(4))
            start, body = int(m.group(1)), []
            i += 1
            while old_left > 0 or new_left > 0:
                if i >= len(lines):
                    raise PatchError(f"hunk at {fp.new or fp.old} line {start} ends early: "
                                     f"{old_left} old and {new_left} new lines missing")
                ln = lines[i]
                tag, body_text = (ln[0], ln[1:]) if ln else (" ", "")
                if tag not in " -+":
                    raise PatchError(f"line {i + 1}: a hunk line must start with ' ', '-' or "
                                     f"'+', got {ln[:40]!r}")
                old_left -= tag in " -"
                new_left -= tag in " +"
                if old_left < 0 or new_left < 0:
                    raise PatchError(f"hunk at {fp.new or fp.old} line {start}: more lines "
                                     "than its header counts")
                body.append((tag, body_text + "\n"))
                i += 1
                if i < len(lines) and lines[i].startswith(NO_NEWLINE[:12]):
                    body[-1] = (tag, body_text)
                    i += 1
            fp.hunks.append((start, body))
        out.append(fp)
    if not out:
        raise PatchError("no file patch found (expected '--- a/path' and '+++ b/path' lines)")
    return out


def _apply_hunks(old_text: str, hunks: list, name: str) -> str:
    lines = old_text.splitlines(keepends=True)
    offset, pos = 0, 0
    for k, (start, body) in enumerate(hunks, 1):
        old = [t for tag, t in body if tag in " -"]
        new = [t for tag, t in body if tag in " +"]
        want = max(start - 1, 0) + offset if old else max(start, 0) + offset
        key = [t.rstrip("\n") for t in old]
        at = None
        for d in range(len(lines) + 1):
            for cand in (want - d, want + d) if d else (want,):
                if pos <= cand <= len(lines) - len(old) and [
                        t.rstrip("\n") for t in lines[cand:cand + len(old)]] == key:
                    at = cand
                    break
            if at is not None:
                break
        if at is None:
            first = key[0] if key else ""
            raise PatchError(f"hunk {k} of {name} does not apply: its lines (from line {start}: "
                             f"{first[:60]!r}) are not in the file as written")
        lines[at:at + len(old)] = new
        offset += len(new) - len(old) + (at - want)
        pos = at + len(new)
    return "".join(lines)


def apply(files: dict, patch_text: str) -> dict:
    """Applies a unified diff to `files` (path -> text, the paths it touches).

    Args:
      files: current contents of the files the patch names (absent = does not exist).
      patch_text: the diff.
    Returns:
      path -> new text, or None for a deleted file, for every file the patch touches.
    Raises:
      PatchError: unreadable, or a hunk that does not apply; nothing is applied then.
    """
    out = dict()
    for fp in parse(patch_text):
        if fp.old is not None and fp.new is not None and fp.old != fp.new:
            raise PatchError(f"renames are not supported ({fp.old} -> {fp.new})")
        name = fp.new or fp.old
        cur = out[name] if name in out else files.get(name)
        if fp.old is None:
            if cur is not None:
                raise PatchError(f"{name} already exists (the patch creates it)")
            cur = ""
        elif cur is None:
            raise PatchError(f"{name} does not exist")
        text = _apply_hunks(cur, fp.hunks, name)
        out[name] = None if fp.new is None else text
    return out


def _diff_lines(a: str, b: str, name: str, a_name: str, b_name: str) -> list:
    out = []
    for ln in difflib.unified_diff(a.splitlines(keepends=True), b.splitlines(keepends=True),
                                   a_name, b_name, n=3):
        out.append(ln if ln.endswith("\n") else ln + "\n" + NO_NEWLINE + "\n")
    return out


def diff(old: dict, new: dict) -> str:
    """The unified diff from `old` to `new` (path -> text; None or absent = no file), files in
    path order, a/ and b/ prefixes (what `apply` reads back)."""
    out = []
    for path in sorted(set(old) | set(new)):
        a, b = old.get(path), new.get(path)
        if a == b:
            continue
        names = (f"a/{path}" if a is not None else "/dev/null",
                 f"b/{path}" if b is not None else "/dev/null")
        # an empty file created or deleted has no lines: its header alone says it
        out += _diff_lines(a or "", b or "", path, *names) or [f"--- {names[0]}\n",
                                                               f"+++ {names[1]}\n"]
    return "".join(out)
