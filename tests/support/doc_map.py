"""Checks that the written maps of the repository match its files (tests/test_layout.py).

Two checks, each returning one line per problem that says what to fix:
  - `unmapped_modules`: every module of gagar_jax is named in docs/architecture.md's package map
    (the first fenced block), in its package's row;
  - `stale_references`: every repository path (`gagar_jax/run/step.py`, `docs/aot/x.json`,
    `step.py`, `run/`) and every dotted name (`gagar_jax.grading.FactorTable`) written in
    backticks in docs/*.md, README.md or a module docstring exists.
"""
from __future__ import annotations

import ast
import os
import pathlib
import re
import subprocess

# Names the docs cite in backticks that are not files of this repository; never checked. Keep it
# short: a stale name of ours must not hide here.
EXTERNAL = {
    # other projects' files
    "mimo_v2.py",                           # vLLM's MiMo-V2 model
    "verl/trainer/ppo/core_algos.py",
    # what a run writes into its workdir (docs/checkpoints.md, "What a run writes")
    "metrics.jsonl", "groups.jsonl", "summary.json", "ledger.json", "dead_letter.jsonl",
    "fatal_error.txt", "tensorboard/", "metrics-000000.jsonl", "metrics-000001.jsonl",
    "calibration/", "results.json",
    # what a checkpoint directory or a published version holds
    "checkpoints/", "published/", "workdir/summary.json",
    "config.json", "generation_config.json", "model.safetensors.index.json", "gagar_publish.json",
    # example names in prose, and metric names written like paths
    "name.jsonl", "feed/ahead_of_learner", "rollout/kl", "rollout/masked_token_frac",
    "rollout/logp_abs_diff_mean",
    # a `vllm.LLM` held as `llm` (not gagar_jax/rollout/grading/llm.py)
    "llm.reset_prefix_cache()", "llm.collective_rpc(name)",
}
# Config sections (`model.attention`, `feed.batch_groups`): `x.y` with these is a setting.
CONFIG_SECTIONS = {"model", "train", "feed", "loss", "optim", "mesh", "sim", "rollout", "config"}
# Prefixes of what a run, a sweep or `make` creates (not in git): never checked.
GENERATED = ("runs/", "build/", "out/", "OUT/", ".venv", ".cache/", "/tmp/", "~/", "gs://",
             "s3://", "http://", "https://")
# File endings that make a bare backticked word a path (`step.py`).
EXTENSIONS = (".py", ".md", ".json", ".jsonl", ".toml", ".txt", ".yaml", ".yml", ".sh", ".cfg")

_TICKS = re.compile(r"(`+)([^`\n]+?)\1")
_FENCE = re.compile(r"^\s*```")


def modules(pkg: pathlib.Path) -> list:
    """Dotted names of every module under `pkg` (packages as their `__init__`'s package name)."""
    out = []
    for p in sorted(pkg.rglob("*.py")):
        parts = p.relative_to(pkg.parent).with_suffix("").parts
        out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def map_sections(text: str) -> dict:
    """The first fenced block of an architecture doc as {section: set of words}.

    Sections: "" for the top level (rows whose first word is a `.py` file), `algo/` for a top
    package's rows, `kernels/attention/` for a sub-package row (a continuation row whose first
    word ends in `/`). Words are the row's tokens, `.py` stripped.
    """
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if _FENCE.match(ln))
    end = next(i for i in range(start + 1, len(lines)) if _FENCE.match(lines[i]))
    out, top, sub = {}, None, None
    for ln in lines[start + 1:end]:
        words = ln.split()
        if not words or ln[:1] != " " or words[0].rstrip("/") == "gagar_jax":
            continue
        indent = len(ln) - len(ln.lstrip())
        if indent <= 2 and words[0].endswith("/"):
            top, sub = words[0], None
            out.setdefault(top, set())
            if len(words) > 1 and words[1].endswith("/"):   # `kernels/   attention/ ...`
                sub, words = top + words[1], words[1:]
        elif indent <= 2 and words[0].endswith(".py"):
            top, sub = "", None
        elif words[0].endswith("/") and top:
            sub = top + words[0]
        key = sub or top
        if key is None:
            continue
        out.setdefault(key, set()).update(w.removesuffix(".py") for w in words)
    return out


def unmapped_modules(pkg: pathlib.Path, doc: pathlib.Path) -> list:
    """Modules of `pkg` that `doc`'s package map does not name, one line each."""
    sections = map_sections(doc.read_text())
    missing = []
    for mod in modules(pkg):
        parts = mod.split(".")[1:]
        if not parts:
            continue
        *where, name = parts
        key = "".join(f"{p}/" for p in where)
        is_pkg = (pkg / pathlib.Path(*parts) / "__init__.py").exists()
        if is_pkg:   # a package is named by its own row (`algo/`, or `attention/` under kernels/)
            name = f"{name}/"
            ok = f"{key}{name}" in sections
        else:
            ok = name in sections.get(key, ())
        if not ok:
            row = f"the `{key}` row" if key else "the top-level row (with config.py ...)"
            missing.append(f"{doc.name}: module {mod} is not in the package map: add "
                           f"`{name.rstrip('/')}` to {row} of the first ``` block")
    return missing


def backticked(text: str, skip_fences: bool) -> list:
    """(line number, text) of every backticked span of `text`, fenced blocks skipped if asked."""
    out, fenced = [], False
    for i, ln in enumerate(text.splitlines(), 1):
        if skip_fences and _FENCE.match(ln):
            fenced = not fenced
            continue
        if not fenced:
            out += [(i, m.group(2).strip()) for m in _TICKS.finditer(ln)]
    return out


def _top_names(path: pathlib.Path) -> set:
    """Names a module defines or imports at its top level (what `module.NAME` may refer to)."""
    return _names_of(ast.parse(path.read_text()).body)


def _names_of(body: list) -> set:
    names = set()
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.If, ast.Try)):   # names defined under a guard
            names |= _names_of(node.body)
    if "__getattr__" in names:   # a lazy module (PEP 562): its table's string keys are names too
        names |= {k.value for node in body if isinstance(node, ast.Assign)
                  and isinstance(node.value, ast.Dict) for k in node.value.keys
                  if isinstance(k, ast.Constant) and isinstance(k.value, str)}
    return names


class Repo:
    """The files of a repository checkout, for resolving the names docs cite."""

    def __init__(self, root: pathlib.Path) -> None:
        self.root = root
        # what git tracks or would track (ignored build outputs and runs are not the repository)
        listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=root,
                                capture_output=True, text=True, check=True).stdout
        self.files = {f for f in listed.splitlines() if (root / f).exists()}
        self.basenames = {f.rsplit("/", 1)[-1] for f in self.files}
        self.dirs = {d for f in self.files for d in _parents(f)}
        self.dir_names = {d.rsplit("/", 1)[-1] for d in self.dirs}
        self.pkg = root / "gagar_jax"
        self.mods = {m: self._module_file(m) for m in modules(self.pkg)}
        # `blockwise.plain_attention`, `hf_families.REFUSALS`: a module's short name, or the
        # alias the package imports it under, then a name
        self.short = {}
        for m in self.mods:
            self.short.setdefault(m.rsplit(".", 1)[-1], set()).add(m)
        for p in self.mods.values():
            for node in ast.walk(ast.parse(p.read_text())):
                if isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    for a in node.names:
                        if a.asname and f"{node.module}.{a.name}" in self.mods:
                            self.short.setdefault(a.asname, set()).add(f"{node.module}.{a.name}")

    def _module_file(self, mod: str) -> pathlib.Path:
        p = self.root / pathlib.Path(*mod.split("."))
        return p / "__init__.py" if p.is_dir() else p.with_suffix(".py")

    def path_exists(self, ref: str) -> bool:
        """A path as a doc writes it: from the repository root, or the end of some path of it
        (`run/step.py`, `attention/blockwise.py`, `round3/A/criteria.md` under docs/miniature/;
        `run/loop` names run/loop.py), or a bare file or directory name found anywhere."""
        ref = ref.rstrip("/")
        if "/" not in ref:
            return ref in self.basenames or ref in self.dir_names
        wanted = (ref, ref + ".py")
        return any(c in wanted or c.endswith(("/" + ref, "/" + ref + ".py"))
                   for c in self.files | self.dirs)

    def dotted_exists(self, ref: str) -> bool:
        """`gagar_jax.a.b` is a module, or a module and a name it defines (`...grading.FactorTable`,
        `...Feed.close`: only the first name after the module is checked)."""
        parts = ref.split(".")
        for n in range(len(parts), 0, -1):
            mod = ".".join(parts[:n])
            if mod in self.mods:
                return n == len(parts) or parts[n] in _top_names(self.mods[mod])
        return False


    def attr_exists(self, ref: str) -> bool:
        """`short.NAME`: NAME is defined by (or is a submodule of) a module of that short name.
        A short name that is no module or alias of ours (`jax.jit`, `cfg.model`) is not ours
        to check: True."""
        short, name = ref.split(".")[:2]
        cands = self.short.get(short)
        if not cands or short in CONFIG_SECTIONS:
            return True
        return any(name in _top_names(self.mods[m]) or f"{m}.{name}" in self.mods for m in cands)


def _parents(f: str) -> list:
    parts = f.split("/")[:-1]
    return ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _is_path(ref: str) -> bool:
    if any(c in ref for c in " <>*{}$=,()[]|") or ref.startswith(("-", ".", "@", "/")):
        return False
    if ref.startswith(GENERATED) or "://" in ref:
        return False
    if "/" in ref:
        first = ref.split("/")[0]
        # a path is made of file-name-like parts; `tier/rank` and `a/b` in prose are not paths
        return bool(re.fullmatch(r"[\w.\-/]+", ref)) and (
            ref.endswith(EXTENSIONS) or ref.endswith("/") or first in _ROOTS)
    return ref.endswith(EXTENSIONS) and bool(re.fullmatch(r"[\w.\-]+", ref))


_ROOTS = {"gagar_jax", "docs", "tests", "scripts", "configs", "data", "seeds", "algo", "feed",
          "model", "kernels", "hf", "run", "aot", "sim", "rollout", "sample", "support"}


def references(text: str, skip_fences: bool) -> list:
    """(line, reference, kind) for the backticked repository paths and gagar_jax dotted names of
    `text`; kind is "path" or "name". `file.py::test` and `file.py:12` cite the file."""
    out = []
    for line, span in backticked(text, skip_fences):
        ref = re.split(r"::|:(?=\d)", span)[0].strip()
        if ref in EXTERNAL:
            continue
        if re.fullmatch(r"gagar_jax(\.\w+)+", ref):
            out.append((line, ref, "name"))
        elif _is_path(ref):
            out.append((line, ref, "path"))
        elif re.fullmatch(r"[a-z]\w*\.[A-Za-z_]\w*(\.\w+)*(\(.*\))?", ref):
            out.append((line, ref.split("(")[0], "attr"))
    return out


def docstrings(path: pathlib.Path) -> list:
    """(line, text) of a module's docstrings: the module's, its classes' and functions'."""
    tree = ast.parse(path.read_text())
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = getattr(node, "body", [])
            if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                    and isinstance(body[0].value.value, str)):
                out.append((body[0].lineno, body[0].value.value))
    return out


def stale_references(repo: Repo, texts: list) -> list:
    """One line per reference that names nothing in `repo`.

    Args:
      repo: the checkout.
      texts: (file name relative to the root, first line, text, is_markdown) to read.

    Returns:
      "FILE:LINE: `REF` ... : fix" lines (empty when every reference exists).
    """
    bad = []
    for name, first, text, markdown in texts:
        if markdown:
            bad += _broken_links(repo, name, text)
        for line, ref, kind in references(text, skip_fences=markdown):
            ok = (repo.dotted_exists(ref) if kind == "name" else
                  repo.attr_exists(ref) if kind == "attr" else repo.path_exists(ref))
            if not ok:
                what = {"name": "module or name", "attr": "name of that module"}.get(kind, "path")
                bad.append(f"{name}:{first + line - 1}: `{ref}` names no {what} of this "
                           f"repository: write its current name, or add it to EXTERNAL in "
                           f"tests/support/doc_map.py if it is another project's")
    return bad


_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def _broken_links(repo: Repo, name: str, text: str) -> list:
    """Markdown links (`[report](aot/x.json)`) to files of the repository that do not exist,
    taken relative to the linking file as a renderer does."""
    base = pathlib.PurePosixPath(name).parent
    bad = []
    for i, ln in enumerate(text.splitlines(), 1):
        for m in _LINK.finditer(ln):
            target = m.group(1)
            if "://" in target or target.startswith("mailto:"):
                continue
            path = os.path.normpath((base / target).as_posix())
            if path not in repo.files and path not in repo.dirs:
                bad.append(f"{name}:{i}: link `{target}` names no file of this repository "
                           f"({path}): link the file's current name (docs/aot: "
                           f"`<config>[_<variant>]_<topology>.json`)")
    return bad


def repo_texts(root: pathlib.Path) -> list:
    """What `stale_references` reads: README.md, docs/**/*.md and the docstrings of gagar_jax,
    configs/ and scripts/."""
    texts = [("README.md", 1, (root / "README.md").read_text(), True)]
    texts += [(p.relative_to(root).as_posix(), 1, p.read_text(), True)
              for p in sorted((root / "docs").rglob("*.md"))]
    sources = (p for d in ("gagar_jax", "configs", "scripts") for p in (root / d).rglob("*.py"))
    for p in sorted(sources):
        rel = p.relative_to(root).as_posix()
        texts += [(rel, line, doc, False) for line, doc in docstrings(p)]
    return texts
