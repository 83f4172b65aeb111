"""Fresh starts over an earlier run's audit files (issue 36 items 2 and 5): a run killed before
its first checkpoint, and two `--start_fresh` in one second. In-process, no JAX compile."""
import json
import os

import pytest

from gagar_jax.audit_file import unused_name
from gagar_jax.run import resume

FILES = {"metrics.jsonl": '{"step": 1}\n{"step": 2}\n', "groups.jsonl": '{"group_id": "g0"}\n',
         "dead_letter.jsonl": '{"reason": "schema"}\n', "ledger.json": '{"received": 3}\n'}


def _old_run(wd, tag=""):
    for name, text in FILES.items():
        (wd / name).write_text(text + tag)


def test_a_run_killed_before_its_first_checkpoint_restarts_with_its_audit_files_aside(tmp_path,
                                                                                      caplog):
    """No checkpoint was ever written, yet metrics.jsonl / groups.jsonl hold lines: a restart
    (no --start_fresh, as a scheduler does it) trains from step 0 with those files moved aside
    and logged, so no step or group id appears twice (today: appended to)."""
    _old_run(tmp_path)
    (tmp_path / "checkpoints").mkdir()
    with caplog.at_level("WARNING", logger="gagar_jax.run.resume"):
        resume.guard_fresh_start(str(tmp_path), str(tmp_path / "checkpoints"),
                                 start_fresh=False)
    [aside] = [d for d in os.listdir(tmp_path) if d.startswith("before_fresh_start-")]
    for name, text in FILES.items():
        assert not (tmp_path / name).exists()
        assert (tmp_path / aside / name).read_text() == text
    assert any("before its first checkpoint" in r.getMessage() and aside in r.getMessage()
               for r in caplog.records)
    # A workdir without audit lines is left alone (the first launch).
    resume.guard_fresh_start(str(tmp_path), str(tmp_path / "checkpoints"), start_fresh=False)
    assert len([d for d in os.listdir(tmp_path) if d.startswith("before_fresh_start-")]) == 1


@pytest.mark.parametrize("clock", [[1e9, 1e9], [1e9 + 5, 1e9]])   # same second; set back
def test_two_fresh_starts_never_share_a_directory(tmp_path, monkeypatch, clock):
    now = [clock[0]]
    monkeypatch.setattr(resume.time, "time", lambda: now[0])
    if clock[0] != clock[1]:       # an earlier run already used the later name
        (tmp_path / "before_fresh_start-1000000000").mkdir()
    for i in range(2):
        now[0] = clock[i]
        _old_run(tmp_path, tag=f"run {i}\n")
        resume.guard_fresh_start(str(tmp_path), str(tmp_path / "checkpoints"),
                                 start_fresh=True)
    asides = sorted(d for d in os.listdir(tmp_path) if d.startswith("before_fresh_start-")
                    and (tmp_path / d / "metrics.jsonl").exists())
    assert len(asides) == 2
    texts = sorted((tmp_path / d / "metrics.jsonl").read_text().splitlines()[-1]
                   for d in asides)
    assert texts == ["run 0", "run 1"]      # the first's saved files were not overwritten


def test_unused_name_counts_up(tmp_path):
    assert unused_name(tmp_path, "x") == tmp_path / "x"
    (tmp_path / "x").mkdir()
    (tmp_path / "x.1").write_text(json.dumps({}))
    assert unused_name(tmp_path, "x") == tmp_path / "x.2"
