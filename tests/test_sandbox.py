"""The repository sandbox (gagar_jax/rollout/envs/sandbox.py, repo_verdict.py): path escapes are
refused; agent code that loops, allocates 10 GB, writes a 10 GB file, starts 5,000 processes,
reads a held-out test, another trajectory's workspace or the git objects, or opens a socket
ends as `fail` with the limit's own error, and the worker goes on; a submission that edits
test infrastructure is `hacked`. Small limits keep each run well under a second (the loop: the
1.5 s wall limit)."""
import json
import os
import shutil
import socket
import tempfile

import pytest
from support.repo_agents import TOKENIZER, call, files_after, play

from gagar_jax.rollout.envs import repo, repo_tasks, repo_verdict, sandbox, workspace
from gagar_jax.rollout.envs.base import EnvOptions

# the sandbox runs task tests with .venv-tasks (tests/support/tasks_env.py)
pytestmark = pytest.mark.usefixtures("tasks_env")

TASK = repo_tasks.load_task(os.path.join(repo_tasks.SHIPPED, "clamp_values"))
MODULE = "numeric/bounds.py"
LIMITS = sandbox.Limits(memory_bytes=256 << 20, address_space_bytes=1 << 30,
                        file_bytes=16 << 20, disk_bytes=64 << 20, processes=32, cpu_s=10)
SMALL = repo.factory(repo.RepoEnvConfig(sandbox=sandbox.SandboxConfig(limits=LIMITS)))
IS_ROOT = os.geteuid() == 0


@pytest.fixture(scope="module")
def ws_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("workspaces"))


def _fixed_module(extra: str) -> str:
    """The task's correct module, with `extra` run when it is imported (by the tests)."""
    return files_after(TASK)[1][MODULE] + "\n\n" + extra


def _run_agent_code(extra, ws_root, wall_s=30.0):
    opts = EnvOptions(tool_timeout_s=wall_s, workspace_root=ws_root)
    turns = [call("write_file", path=MODULE, content=_fixed_module(extra)), call("submit")]
    env, _, verdict = play(SMALL, TASK, turns, opts)
    with open(os.path.join(env.workspace, "tests", "verdict.log")) as f:
        return verdict, f.read()


def test_paths_outside_the_copy_are_refused(tmp_path):
    root = tmp_path / "copy"
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "a.py").write_text("x = 1\n")
    os.symlink("/etc", root / "pkg" / "etc")
    assert workspace.resolve(str(root), "pkg/./a.py") == str(root / "pkg" / "a.py")
    for bad, says in [("../x", "'..'"), ("pkg/../../x", "'..'"), ("/etc/passwd", "absolute"),
                      ("~/x", "absolute"), ("pkg/etc/passwd", "symbolic link"),
                      ("pkg/etc", "symbolic link"), ("", "bad path"), ("a\0b", "bad path")]:
        with pytest.raises(workspace.PathRefused, match=says):
            workspace.resolve(str(root), bad)
    # through the environment: every tool refuses, nothing is written outside, each is counted
    opts = EnvOptions(workspace_root=str(tmp_path / "ws"))
    escape = "--- a/../evil.py\n+++ b/../evil.py\n@@ -0,0 +1 @@\n+x\n"
    turns = [call("read_file", path="/etc/passwd") + call("write_file", path="../evil.py",
                                                           content="x")
             + call("apply_patch", patch=escape) + call("list_files", path="..")]
    env, [step], _ = play(SMALL, TASK, turns, opts, judge=False)
    assert (step.tool_calls, step.tool_errors) == (4, 4)
    text = TOKENIZER.decode(step.observation)
    assert text.count("refused") == 4 and "root:" not in text
    assert not os.path.exists(os.path.join(env.workspace, "evil.py"))
    assert not os.path.exists(os.path.join(os.path.dirname(env.workspace), "evil.py"))


ATTACKS = {
    "loops_forever": ("while True:\n    pass\n", None),
    "allocates_10_gb": ("_x = bytearray(10 * 2**30)\n", "MemoryError"),
    "writes_a_10_gb_file": (
        "with open('/tmp/big', 'wb') as _f:\n"
        "    for _ in range(10 * 2**10):\n        _f.write(b'0' * 2**20)\n", "File too large"),
    "starts_5000_processes": (
        "import subprocess as _sp\n_ps = []\ntry:\n"
        "    for _ in range(5000):\n"
        "        _ps.append(_sp.Popen(['/bin/sleep', '60'], start_new_session=True))\n"
        "except OSError as _e:\n"
        "    raise RuntimeError(f'PIDS {[p.pid for p in _ps]} refused: {_e}')\n",
        "Resource temporarily unavailable"),
    "reads_a_held_out_test": (
        f"open({os.path.join(TASK.heldout_dir, TASK.heldout_tests[0])!r}).read()\n",
        "Error: [Errno"),
    "opens_a_socket": ("import socket as _s\n_s.create_connection(('127.0.0.1', PORT), 2)\n",
                       "Network is unreachable"),
}


@pytest.mark.skipif(not IS_ROOT, reason="the limits under test need root (cgroups, namespaces)")
@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_agent_code_that_breaks_the_limits_fails_and_the_worker_goes_on(attack, ws_root):
    code, error = ATTACKS[attack]
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    code = code.replace("PORT", str(listener.getsockname()[1]))
    try:
        verdict, log = _run_agent_code(code, ws_root, 1.5 if attack == "loops_forever" else 30)
    finally:
        listener.close()
    assert verdict["outcome"] == "fail" and not verdict["hacked"], verdict
    assert verdict["evidence"]["timed_out"] == (attack == "loops_forever"), verdict
    if error:
        assert error in log, log[-2000:]
    if attack == "starts_5000_processes":   # they left the process group: the cgroup got them
        pids = [int(p) for p in log.split("PIDS [")[1].split("]")[0].split(", ")]
        assert 0 < len(pids) < 32 and verdict["evidence"]["limits_hit"]["processes"]
        for pid in pids:
            status = f"/proc/{pid}/status"
            assert not os.path.exists(status) or "\nUid:\t65534" not in open(status).read()
    # the worker lives: the next sandboxed run works
    assert sandbox.run(ws_root, ["/bin/true"], sandbox.SandboxConfig()).exit_code == 0


@pytest.mark.skipif(not IS_ROOT, reason="hiding paths needs root (mount namespaces)")
def test_other_workspaces_and_the_git_objects_are_hidden(ws_root):
    other, _, _ = play(SMALL, TASK, [call("submit")], EnvOptions(workspace_root=ws_root))
    git = repo.private_paths(TASK.dir, ws_root)[2:]   # the checkout's git dirs, if any
    paths = [os.path.join(other.workspace, "final.diff")] + [
        os.path.join(g, "HEAD") for g in git if os.path.isfile(os.path.join(g, "HEAD"))]
    assert all(os.path.isfile(p) for p in paths)        # readable by the worker
    # a leak would let the module import and the (fixed) tests pass; refusals make it fail
    code = (f"_refused = []\nfor _p in {paths!r}:\n    try:\n        open(_p).read()\n"
            "    except OSError:\n        _refused.append(_p)\n"
            f"if len(_refused) == {len(paths)}:\n    raise RuntimeError('ALL REFUSED')\n")
    verdict, log = _run_agent_code(code, ws_root)
    assert verdict["outcome"] == "fail" and "ALL REFUSED" in log, log[-2000:]
    assert os.path.exists(os.path.join(other.workspace, "final.diff"))


def test_editing_test_infrastructure_is_hacked_and_restored_for_the_verdict(tmp_path):
    # a conftest that turns every failure into a pass, and no fix
    hook = ("import pytest\n\n@pytest.hookimpl(hookwrapper=True)\n"
            "def pytest_runtest_makereport(item, call):\n    out = yield\n"
            "    out.get_result().outcome = 'passed'\n")
    turns = [call("write_file", path="conftest.py", content=hook), call("run_tests"),
             call("submit")]
    env, steps, verdict = play(SMALL, TASK, turns, EnvOptions(workspace_root=str(tmp_path)))
    assert "2 passed" in TOKENIZER.decode(steps[1].observation)   # the hack works on the copy
    assert verdict["hacked"] and verdict["outcome"] == "fail", verdict
    assert verdict["evidence"]["hacked_paths"] == ["conftest.py"]
    # which paths count as test infrastructure (no sandbox needed)
    original = workspace.read_tree(TASK.repo_dir)
    for path in ("tests/test_bounds.py", "tests/helpers.py", "numeric/conftest.py",
                 "pytest.ini", "setup.cfg", "test_extra.py", "numeric/x_test.py", "a.pth"):
        edited = {**original, path: original.get(path, "") + "# edit\n"}
        assert repo_verdict.hacked_paths(original, edited, TASK) == [path], path
    deleted = {p: t for p, t in original.items() if p != "tests/test_bounds.py"}
    assert repo_verdict.hacked_paths(original, deleted, TASK) == ["tests/test_bounds.py"]
    assert repo_verdict.hacked_paths(original, {**original, MODULE: "x = 1\n"}, TASK) == []


def test_without_namespaces_and_cgroups_the_limits_that_remain_hold_and_the_gaps_are_recorded(
        tmp_path):
    config = sandbox.SandboxConfig(limits=LIMITS, namespaces=False, cgroups=False)
    record = sandbox.enforced(config)
    assert not record["network_isolated"] and not record["paths_hidden"]
    assert not record["pids_cgroup"] and any("namespace" in n for n in record["notes"])
    (tmp_path / "src").mkdir()
    run = sandbox.run(str(tmp_path / "src"), [config.interpreter, "-c", (
        "import os\ntry:\n    bytearray(10 * 2**30)\nexcept MemoryError:\n"
        "    print('refused', os.getuid())\n")], config)
    assert run.status == "ok" and run.exit_code == 0, run
    assert run.output.strip() == f"refused {65534 if IS_ROOT else os.getuid()}"
    assert run.enforced == record


@pytest.fixture
def venv_cache(monkeypatch):
    """A scratch directory beside the real `VENV_CACHE` (reachable, and not under /tmp, which the
    sandbox covers), with `VENV_CACHE` pointed at `<it>/c`; removed afterwards."""
    cache = tempfile.mkdtemp(prefix="gagar-venv-test-", dir=os.path.dirname(sandbox.VENV_CACHE))
    os.chmod(cache, 0o755)
    monkeypatch.setattr(sandbox, "VENV_CACHE", os.path.join(cache, "c"))
    yield cache
    shutil.rmtree(cache)


def _fake_venv(path: str) -> str:
    """A venv as far as the copy cares: pyvenv.cfg and bin/python, a link to the base Python."""
    os.makedirs(os.path.join(path, "bin"))
    with open(os.path.join(path, "pyvenv.cfg"), "w") as f:
        f.write("home = /usr/bin\n")
    os.symlink("/usr/bin/python3", os.path.join(path, "bin", "python"))
    return path


@pytest.mark.skipif(not IS_ROOT, reason="the copy is made for root workers only")
def test_a_task_venv_others_cannot_reach_is_copied_where_they_can(venv_cache):
    """A checkout under a mode-700 directory (/root) would leave `nobody` without pytest."""
    locked = os.path.join(venv_cache, "locked")
    venv = _fake_venv(os.path.join(locked, "venv"))
    os.chmod(locked, 0o700)
    try:
        assert not sandbox._others_reach(venv)
        copy = sandbox.reachable_venv(venv)
        assert copy.startswith(sandbox.VENV_CACHE) and sandbox._others_reach(copy)
        assert os.readlink(os.path.join(copy, "bin", "python")) == "/usr/bin/python3"
        assert sandbox.reachable_venv(venv) == copy          # made once
        os.chmod(locked, 0o755)
        assert sandbox.reachable_venv(venv) == venv          # reachable: itself
    finally:
        os.chmod(locked, 0o755)


@pytest.mark.skipif(not IS_ROOT, reason="the copy is made for root workers only")
def test_a_task_venv_under_tmp_is_copied_out_of_the_sandbox_fresh_tmp(venv_cache, tmp_path):
    """A checkout cloned under /tmp, open to all: its .venv-tasks is reachable, but the sandbox
    mounts a fresh /tmp, so the command would not find the interpreter (an `infra_error` for
    every verdict). The copy lies outside every directory the sandbox covers, and runs there."""
    opened = tempfile.mkdtemp(prefix="gagar-venv-open-", dir="/tmp")
    try:
        os.chmod(opened, 0o755)
        venv = _fake_venv(os.path.join(opened, "venv"))
        assert sandbox._others_reach(venv) and sandbox._covered(venv)
        # earlier copies: of a venv since deleted, of one since reinstalled, of this one before
        # the record existed; making a copy removes the first two only
        old = {"deleted": {"venv": os.path.join(opened, "gone"), "stamp": 1},
               "reinstalled": {"venv": venv, "stamp": 1}, "unrecorded": None}
        for name, record in old.items():
            os.makedirs(os.path.join(sandbox.VENV_CACHE, f"task-venv-{name}"))
            if record:
                with open(os.path.join(sandbox.VENV_CACHE, f"task-venv-{name}",
                                       sandbox.COPY_SOURCE), "w") as f:
                    json.dump(record, f)
        copy = sandbox.reachable_venv(venv)
        assert copy.startswith(sandbox.VENV_CACHE) and not sandbox._covered(copy)
        assert sandbox.reachable_venv(venv) == copy                   # made once
        assert sorted(os.listdir(sandbox.VENV_CACHE)) == sorted(
            [os.path.basename(copy), "task-venv-unrecorded"])
        with open(os.path.join(copy, sandbox.COPY_SOURCE)) as f:
            assert json.load(f)["venv"] == venv
        (tmp_path / "src").mkdir()
        config = sandbox.SandboxConfig(limits=LIMITS)
        ran = {}
        for name, root in (("in place", venv), ("copy", copy)):
            python = os.path.join(root, "bin", "python")
            ran[name] = sandbox.run(str(tmp_path / "src"), [python, "-c", "print('ran')"], config)
        assert ran["copy"].status == "ok" and ran["copy"].output.strip() == "ran", ran["copy"]
        if sandbox.enforced(config)["paths_hidden"]:     # the bug the copy avoids
            assert ran["in place"].status == "infra_error", ran["in place"]
    finally:
        shutil.rmtree(opened)
