"""The package's layout promises: imports only go down (no cycle, lazy imports included), no
module reaches into another module's private names, and the written maps (docs/architecture.md,
backticked paths in docs, README and docstrings) name only what exists."""
import ast
import pathlib

from support import doc_map

PKG = pathlib.Path(__file__).resolve().parent.parent / "gagar_jax"


def _modules() -> dict:
    mods = {}
    for p in PKG.rglob("*.py"):
        name = ".".join(p.relative_to(PKG.parent).with_suffix("").parts)
        mods[name[: -len(".__init__")] if name.endswith(".__init__") else name] = p
    return mods


def _imports(mods: dict) -> dict:
    """module -> {(imported module, imported name or None)} for every import, lazy ones too."""
    out = {}
    for m, p in mods.items():
        pkg = m if p.name == "__init__.py" else m.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                edges |= {(a.name, None) for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    edges.add((sub, None) if sub in mods else (base, a.name))
        out[m] = {(t, n) for t, n in edges if t in mods and t != m}
    return out


def test_no_import_cycles():
    mods = _modules()
    graph = {m: {t for t, _ in e if t != "gagar_jax"} for m, e in _imports(mods).items()}
    state, cycles = {}, []

    def visit(u, stack):
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                cycles.append(" -> ".join(stack[stack.index(v):] + [v]))
            elif not state.get(v):
                visit(v, stack)
        stack.pop()
        state[u] = 2

    for m in sorted(graph):
        if not state.get(m):
            visit(m, [])
    assert not cycles, cycles


def test_no_private_names_across_modules():
    mods = _modules()
    edges = _imports(mods)
    bad = [f"{m} imports {t}.{n}" for m, e in edges.items() for t, n in e
           if n is not None and n.startswith("_") and not n.startswith("__")]
    for m, p in mods.items():   # `module._private` attribute use through an imported module
        imported = {t.rpartition(".")[2]: t for t, n in edges[m] if n is None}
        for node in ast.walk(ast.parse(p.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in imported and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                bad.append(f"{m} uses {imported[node.value.id]}.{node.attr}")
    assert not bad, bad


# The layers, lowest first (docs/architecture.md): a module may import its own layer and the ones
# before it, never a later one. `gagar_jax/__init__.py` (the lazy public API) and `__main__` are
# above every layer; `rollout` imports no JAX and only the JAX-free ground and feed modules, so it
# sits right above them: the JAX packages that implement its engine interface (`sample`) or run
# its tasks and graders in process (`run`'s colocated loop) import it downwards.
LAYERS = [
    ("ground", ["gagar_jax.config", "gagar_jax.batch", "gagar_jax.sharding",
                "gagar_jax.mesh_layout", "gagar_jax.distributed", "gagar_jax.audit_file",
                "gagar_jax.grading", "gagar_jax.publish_format"]),
    ("algo", ["gagar_jax.algo"]),
    ("feed", ["gagar_jax.feed"]),
    ("rollout", ["gagar_jax.rollout"]),
    ("kernels", ["gagar_jax.kernels"]),
    ("model", ["gagar_jax.model"]),
    ("hf", ["gagar_jax.hf"]),
    ("sample", ["gagar_jax.sample"]),
    ("run", ["gagar_jax.run"]),
    ("aot", ["gagar_jax.aot"]),
    ("sim", ["gagar_jax.sim"]),
]
TOP = {"gagar_jax", "gagar_jax.__main__"}


def _layer(module: str) -> int:
    for i, (_, prefixes) in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return i
    raise AssertionError(f"{module} is in no layer of tests/test_layout.py's LAYERS")


def test_imports_go_down_the_layers():
    mods = _modules()
    upward = []
    for m, edges in _imports(mods).items():
        if m in TOP:
            continue
        for t, _ in edges:
            if t in TOP:
                upward.append(f"{m} imports the top-level package {t}")
            elif _layer(t) > _layer(m):
                upward.append(f"{m} ({LAYERS[_layer(m)][0]}) imports {t} "
                              f"({LAYERS[_layer(t)][0]})")
    assert not upward, upward


# Within the order, the arrows docs/architecture.md allows (a layer always imports itself).
MAY_IMPORT = {
    "ground": set(), "algo": {"ground"}, "feed": {"ground"}, "kernels": {"ground"},
    "model": {"ground", "kernels"}, "hf": {"ground", "model"},
    "rollout": {"ground", "feed"},
    "sample": {"ground", "kernels", "model", "hf", "rollout"},
    "run": {"ground", "algo", "feed", "rollout", "kernels", "model", "hf", "sample"},
    "aot": {"ground", "algo", "feed", "kernels", "model", "hf", "sample", "run"},
    "sim": {"ground", "algo", "feed", "kernels", "model", "hf", "sample", "run"},
}


def test_each_layer_imports_only_what_the_architecture_allows():
    mods = _modules()
    bad = []
    for m, edges in _imports(mods).items():
        if m in TOP:
            continue
        own = LAYERS[_layer(m)][0]
        for t, _ in edges:
            other = LAYERS[_layer(t)][0] if t not in TOP else "top"
            if other != own and other not in MAY_IMPORT[own]:
                bad.append(f"{m} ({own}) imports {t} ({other})")
    assert not bad, bad


# What the JAX-free side may load: the rollout package runs where no JAX is installed.
JAX_STACK = {"jax", "jaxlib", "flax", "optax", "orbax", "chex", "etils", "ml_collections"}


def test_rollout_reaches_only_jax_free_modules_of_ours():
    """Every module of ours that `rollout/` imports, directly or through another, imports nothing
    of the JAX stack (tests/test_rollout_imports.py runs the same promise with JAX absent)."""
    mods = _modules()
    edges = {m: {t for t, _ in e} for m, e in _imports(mods).items()}
    seen, todo = set(), [m for m in mods if m.startswith("gagar_jax.rollout")]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += sorted(edges[m] - {"gagar_jax"})
    bad = []
    for m in sorted(seen):
        for node in ast.walk(ast.parse(mods[m].read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                     else [])
            bad += [f"{m} imports {n}" for n in names if n.split(".")[0] in JAX_STACK]
    assert not bad, bad


# ------------------------------------------------------------ maps that cannot go stale (item 4)
REPO = PKG.parent


def test_every_module_is_in_the_architecture_map():
    missing = doc_map.unmapped_modules(PKG, REPO / "docs" / "architecture.md")
    assert not missing, "\n".join(missing)


def test_every_backticked_path_and_name_exists():
    stale = doc_map.stale_references(doc_map.Repo(REPO), doc_map.repo_texts(REPO))
    assert not stale, "\n".join(stale)


def test_map_check_reports_a_planted_module(tmp_path):
    """A module the map does not name is reported with the row to add it to; a map that names it
    passes. Both on a copy of the package, so the planted names touch nothing real."""
    pkg = tmp_path / "gagar_jax"
    (pkg / "feed").mkdir(parents=True)
    for f in ("__init__.py", "config.py", "feed/__init__.py", "feed/schema.py",
              "feed/new_source.py"):
        (pkg / f).write_text('"""x"""\n')
    doc = tmp_path / "architecture.md"
    doc.write_text("# map\n\n```\ngagar_jax/\n  __init__.py config.py   ground\n"
                   "  feed/      schema                records in\n```\n")
    assert doc_map.unmapped_modules(pkg, doc) == [
        "architecture.md: module gagar_jax.feed.new_source is not in the package map: add "
        "`new_source` to the `feed/` row of the first ``` block"]
    doc.write_text(doc.read_text().replace("schema ", "schema new_source "))
    assert doc_map.unmapped_modules(pkg, doc) == []


def test_path_check_reports_planted_stale_names():
    """Pre-move names planted in a doc and in a docstring are each reported with file and line;
    current names, external paths and what a run writes pass."""
    repo = doc_map.Repo(REPO)
    doc = ("intro\n"
           "Code: `gagar_jax/algo/grading.py` and `attention_context.py`,\n"
           "`gagar_jax.algo.grading.FactorTable`, `experts_ep.py::test_x`, `hf_families.NO_SUCH`\n"
           "fine: `gagar_jax/grading.py`, `run/step.py`, `kernels/attention/`, `run/loop`,\n"
           "`gagar_jax.grading.FactorTable`, `gagar_jax.feed.local_row_slice`,\n"
           "`hf_families.FAMILIES`,\n"
           "`tests/test_layout.py::test_x`, `metrics.jsonl`, `verl/trainer/ppo/core_algos.py`,\n"
           "`runs/tiny_cpu/summary.json`, `jax.jit`, `tier/rank`, `model.attention`\n"
           "```\n`inside_a_fence.py`\n```\n"
           "[old](aot/flash_310b_3e90e06_v5p_8x8x8.json), [new](aot/flash_310b_v5p_8x8x8.json)\n")
    stale = doc_map.stale_references(repo, [("docs/x.md", 1, doc, True),
                                            ("gagar_jax/y.py", 40, "see `train_step.py`", False)])
    refs = [line.split(" names no ")[0] for line in stale]
    assert refs == ["docs/x.md:12: link `aot/flash_310b_3e90e06_v5p_8x8x8.json`",
                    "docs/x.md:2: `gagar_jax/algo/grading.py`",
                    "docs/x.md:2: `attention_context.py`",
                    "docs/x.md:3: `gagar_jax.algo.grading.FactorTable`",
                    "docs/x.md:3: `experts_ep.py`", "docs/x.md:3: `hf_families.NO_SUCH`",
                    "gagar_jax/y.py:40: `train_step.py`"], stale
    assert all("current name" in line for line in stale)


def test_aot_reports_are_one_per_config_and_variant():
    """docs/aot/ keeps the current proof: names carry no commit hash (a rerun replaces its report
    and git keeps the old one), and every report says which commit it compiled."""
    import json
    import re
    bad = []
    for p in sorted((REPO / "docs" / "aot").glob("*.json")):
        if any(re.fullmatch(r"[0-9a-f]{7,}", part) for part in p.stem.split("_")):
            bad.append(f"{p.name}: a commit hash in the name: rename it without the hash (the "
                       f"commit goes inside the report) and update the docs that link it")
        if not json.loads(p.read_text()).get("commit"):
            bad.append(f"{p.name}: no `commit` inside: add the commit it was compiled at")
    assert not bad, "\n".join(bad)
