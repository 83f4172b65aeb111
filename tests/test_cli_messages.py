"""What a user reads when a resume is refused: one line on stderr, exit 2, nothing of orbax's.

The resume's shape check reads the saved config before anything compiles (`resume.check_launch`),
so the refusal runs in-process on a copy of the session's shared reference run's checkpoints.
"""
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
