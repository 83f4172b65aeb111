"""`gagar-train` as a user meets it: a refused resume in one line; the compilation cache on by
default.

The resume's shape check reads the saved config before anything compiles (`resume.check_launch`),
so the refusal runs in-process on a copy of the session's shared reference run's checkpoints.
"""
import importlib
import os
import shutil

from support import trainer_runs
from support.paths import TINY_CONFIG

from gagar_jax.run import cli


def test_a_resume_of_another_shape_is_refused_in_one_line(capsys, tmp_path, tmp_path_factory):
    ref, _ = trainer_runs.shared_reference(tmp_path_factory)
    wd = tmp_path / "run"
    shutil.copytree(ref / "checkpoints", wd / "checkpoints")
    before = sorted(p.name for p in (wd / "checkpoints").iterdir())
    code = cli.main(["gagar-train", "--config", TINY_CONFIG, "--workdir", str(wd),
                     "--config.model.hidden_size=32"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1, err           # was 16 lines: orbax's INFO around it
    assert "holds a train state of another shape (model.hidden_size: 64 -> 32)" in err, err
    assert "the checkpoints are untouched" in err and "Missing metrics" not in err, err
    assert sorted(p.name for p in (wd / "checkpoints").iterdir()) == before


def test_the_compilation_cache_is_on_by_default_and_a_flag_turns_it_off(monkeypatch):
    env = {}
    cli._compile_cache(True, env)                     # nothing set: the default directory
    assert env == {"JAX_COMPILATION_CACHE_DIR": cli.DEFAULT_COMPILE_CACHE}
    assert cli.DEFAULT_COMPILE_CACHE.endswith(os.path.join("gagar_jax", "jax"))
    env = {"JAX_COMPILATION_CACHE_DIR": "/mine"}      # the user's directory wins
    cli._compile_cache(True, env)
    assert env == {"JAX_COMPILATION_CACHE_DIR": "/mine"}
    cli._compile_cache(False, env)                    # --nocompile_cache
    assert env == {}
    # The default follows XDG_CACHE_HOME, read when the module is imported.
    monkeypatch.setenv("XDG_CACHE_HOME", "/xdg")
    fresh = importlib.reload(cli)
    try:
        assert fresh.DEFAULT_COMPILE_CACHE == os.path.join("/xdg", "gagar_jax", "jax")
    finally:
        monkeypatch.delenv("XDG_CACHE_HOME")
        importlib.reload(cli)
