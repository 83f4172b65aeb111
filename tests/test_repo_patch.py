"""Unified diffs (gagar_jax/rollout/envs/patch.py): what `diff` writes `apply` reads back, hunks
apply at an offset, and a patch applies whole or not at all."""
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gagar_jax.rollout.envs import patch

LINES = st.lists(st.sampled_from(["a", "b", "c", "", "def f():", "    return 1"]), max_size=12)


@st.composite
def trees(draw):
    """Two versions of a few files: edited, created, deleted, with or without a final
    newline."""
    old, new = {}, {}
    for name in ("x.py", "pkg/y.py", "z.txt"):
        a, b = draw(st.none() | LINES), draw(st.none() | LINES)
        if a is not None:
            old[name] = "\n".join(a) + draw(st.sampled_from(["\n", ""]))
        if b is not None:
            new[name] = "\n".join(b) + draw(st.sampled_from(["\n", ""]))
    return old, new


@given(trees())
def test_apply_reads_back_what_diff_writes(pair):
    old, new = pair
    text = patch.diff(old, new)
    if not text:
        assert old == new
        return
    out = patch.apply(old, text)
    result = {**old, **out}
    assert {p: t for p, t in result.items() if t is not None} == new


def test_a_hunk_applies_at_the_nearest_offset_and_names_its_file_when_it_cannot():
    old = {"m.py": "a\nb\nc\nd\n"}
    diff = patch.diff(old, {"m.py": "a\nb\nC\nd\n"})
    moved = {"m.py": "new\nlines\non top\na\nb\nc\nd\n"}
    assert patch.apply(moved, diff) == {"m.py": "new\nlines\non top\na\nb\nC\nd\n"}
    with pytest.raises(patch.PatchError, match=r"hunk 1 of m.py does not apply"):
        patch.apply({"m.py": "a\nb\nX\nd\n"}, diff)


def test_a_patch_is_checked_whole_before_anything_is_applied():
    two = patch.diff({"a.py": "1\n", "b.py": "2\n"}, {"a.py": "one\n", "b.py": "two\n"})
    with pytest.raises(patch.PatchError, match="b.py"):
        patch.apply({"a.py": "1\n", "b.py": "changed\n"}, two)
    for bad, says in [("hello", "no file patch"), ("--- a/x\nnope", "'+++' line"),
                      ("--- a/x\n+++ b/y\n@@ -1 +1 @@\n-a\n+b\n", "renames"),
                      ("--- a/x\n+++ b/x\n@@ -1,2 +1,2 @@\n-a\n", "ends early"),
                      ("--- a/x\n+++ b/x\n@@ -1 +1 @@\n*a\n+b\n", "must start with"),
                      ("--- /dev/null\n+++ b/x\n@@ -0,0 +1 @@\n+a\n", "already exists")]:
        with pytest.raises(patch.PatchError, match=re.escape(says)):
            patch.apply({"x": "a\n"}, bad)


def test_diffs_written_by_hand_without_prefixes_and_with_blank_context_lines():
    text = "--- m.py\n+++ m.py\n@@ -1,3 +1,3 @@\n x = 1\n\n-y = 2\n+y = 3\n"
    assert patch.apply({"m.py": "x = 1\n\ny = 2\n"}, text) == {"m.py": "x = 1\n\ny = 3\n"}
    ru = ("diff -ru repo/pkg/m.py fixed/pkg/m.py\n--- repo/pkg/m.py\t2026-12-05 01:00:00\n"
          "+++ fixed/pkg/m.py\t2026-12-05 01:00:01\n@@ -1 +1 @@\n-a\n+b\n")
    assert patch.apply({"pkg/m.py": "a\n"}, ru) == {"pkg/m.py": "b\n"}
