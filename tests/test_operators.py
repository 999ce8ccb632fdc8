"""Runs that survive their operators (issue 20), each case through the CLI in a subprocess: two jobs on one
directory, a full disk or a read-only directory, an edited config on resume, SIGTERM and SIGINT, the tool
process dying with its parent, and a study stopped by SIGTERM. (Torn log lines, config files, garbage for
`diagnose` and a missing tokenizer: tests/test_runtime.py, tests/test_config.py, the SIGKILL test in
tests/test_rl.py.)"""

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml
from test_rl import _metrics, _rl_config

CLI = [sys.executable, "-m", "toolcollapse.cli"]
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def _rl(config, out, *extra, **popen):
    return subprocess.Popen([*CLI, "rl", "--config", str(config), "--out", str(out), "--set", "threads=1", *extra],
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def _wait_for(predicate, proc=None, timeout=120.0):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, "timed out"
        assert proc is None or proc.poll() is None, proc.communicate() if proc else ""
        time.sleep(0.05)


def _steps_logged(run):
    path = run / "metrics.jsonl"
    return sum(1 for line in path.read_text().splitlines() if line.endswith("}")) if path.is_file() else 0


@pytest.mark.slow
def test_a_second_job_on_the_same_directory_stops_at_once_naming_the_holder(tmp_path, answering_checkpoint):
    config = _rl_config(tmp_path, answering_checkpoint, steps=6)
    run = tmp_path / "run"
    first = _rl(config, run, "--set", "grpo.steps=10000")  # still running when the second one asks (CI once
    # saw a 6-step first job end before the second's interpreter started, and the second rightly ran)
    lock = tmp_path / ".run.lock"
    _wait_for(lambda: lock.is_file() and lock.read_text().strip() == str(first.pid), first)
    t0 = time.time()
    second = _rl(config, run, "--overwrite")
    out, err = second.communicate(timeout=120)
    assert second.returncode == 2 and f"in use by another rl run (pid {first.pid}" in err, err
    assert time.time() - t0 < 30  # before loading anything
    first.send_signal(signal.SIGKILL)  # a crashed run leaves no stale lock: the next one starts
    first.wait()
    third = _rl(config, run, "--overwrite")
    assert third.wait(timeout=300) == 0, third.communicate()[1][-2000:]
    assert [r["step"] for r in _metrics(run)] == list(range(6))


def _inject(tmp_path, after_saves: int, err: int):
    """A sitecustomize that makes the `after_saves`-th checkpoint save fail with OSError(err): the case on a
    machine without tmpfs or chattr."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import errno, toolcollapse.checkpoint as c\n"
        "_save, _n = c._sync, [0]\n"
        "def _sync(d):\n"
        "    _n[0] += 1\n"
        f"    if _n[0] == {after_saves}:\n"
        f"        raise OSError({err}, 'No space left on device', str(d))\n"
        "    _save(d)\n"
        "c._sync = _sync\n")
    return dict(ENV, PYTHONPATH=f"{hook}{os.pathsep}{ENV.get('PYTHONPATH', '')}")


def _mount_tmpfs(path, size="1m"):
    path.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    return proc.returncode == 0


@pytest.mark.slow
def test_a_full_disk_stops_with_one_message_and_keeps_the_last_good_checkpoint(tmp_path, answering_checkpoint):
    config = _rl_config(tmp_path, answering_checkpoint, steps=6, checkpoint_every=1)
    disk = tmp_path / "disk"
    if _mount_tmpfs(disk, "20m"):  # room for one checkpoint (~13 MB: the weights, AdamW's two moments), not two
        try:
            proc = _rl(config, disk / "run")
            out, err = proc.communicate(timeout=300)
            run = disk / "run"
            assert proc.returncode == 2 and "No space left on device" in err and "the run stopped" in err, err[-2000:]
            assert "Traceback" not in err
            checkpoints = sorted(p.name for p in (run / "checkpoints").iterdir())
            assert checkpoints and not [c for c in checkpoints if c.startswith(".")]  # no partial directory left
            assert f"the last good checkpoint is {run / 'checkpoints' / checkpoints[-1]}" in err
        finally:
            subprocess.run(["umount", str(disk)])
        return
    run = tmp_path / "run"  # no tmpfs here: the third save fails as a full disk would
    proc = subprocess.run([*CLI, "rl", "--config", str(config), "--out", str(run), "--set", "threads=1"],
                          env=_inject(tmp_path, 3, errno.ENOSPC), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "the last good checkpoint is" in proc.stderr and "step_000002" in proc.stderr
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000001", "step_000002"]
    pytest.skip("no tmpfs could be mounted: the full disk was injected as an OSError(ENOSPC) in the third save")


@pytest.mark.slow
def test_a_directory_that_cannot_be_written_is_refused_before_the_model_loads(tmp_path, answering_checkpoint):
    config = _rl_config(tmp_path, answering_checkpoint, steps=2)
    parent = tmp_path / "frozen"
    parent.mkdir()
    if subprocess.run(["chattr", "+i", str(parent)], capture_output=True).returncode != 0:
        pytest.skip("chattr +i is not available here (as root, mode bits do not stop writes)")
    try:
        proc = _rl(config, parent / "run")
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 2 and "cannot write in" in err and "Traceback" not in err, err[-2000:]
        assert "Loading weights" not in err
    finally:
        subprocess.run(["chattr", "-i", str(parent)])


@pytest.mark.slow
def test_a_run_directory_made_read_only_mid_run_stops_with_one_message_and_resumes(tmp_path, answering_checkpoint):
    config = _rl_config(tmp_path, answering_checkpoint, steps=30, checkpoint_every=2)
    run = tmp_path / "run"
    proc = _rl(config, run)
    _wait_for(lambda: (run / "checkpoints" / "step_000002" / "COMPLETE").is_file(), proc)
    if subprocess.run(["chattr", "-R", "+i", str(run)], capture_output=True).returncode != 0:
        proc.kill()
        pytest.skip("chattr +i is not available here")
    try:
        out, err = proc.communicate(timeout=300)
    finally:
        subprocess.run(["chattr", "-R", "-i", str(run)])
    assert proc.returncode == 2 and "the run stopped; the last good checkpoint is" in err, err[-2000:]
    assert "Traceback" not in err and f"toolcollapse rl --resume {run}" in err
    resumed = subprocess.run([*CLI, "rl", "--resume", str(run)], env=ENV, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert [r["step"] for r in _metrics(run)] == list(range(30))


@pytest.mark.slow
def test_resume_refuses_a_config_edited_since_the_checkpoint_unless_the_key_is_named(tmp_path, answering_checkpoint):
    config = _rl_config(tmp_path, answering_checkpoint, steps=4, checkpoint_every=2)
    run = tmp_path / "run"
    assert _rl(config, run).wait(timeout=300) == 0
    saved = yaml.safe_load((run / "config.yaml").read_text())
    saved["grpo"]["lr"] = 5e-4
    saved["grpo"]["steps"] = 6
    (run / "config.yaml").write_text(yaml.safe_dump(saved))
    refused = subprocess.run([*CLI, "rl", "--resume", str(run)], env=ENV, capture_output=True, text=True)
    assert refused.returncode == 2 and "grpo.lr: 0.001 -> 0.0005" in refused.stderr
    assert "--allow-change grpo.lr,grpo.steps" in refused.stderr
    partly = subprocess.run([*CLI, "rl", "--resume", str(run), "--allow-change", "grpo.steps"], env=ENV,
                            capture_output=True, text=True)
    assert partly.returncode == 2 and "grpo.lr" in partly.stderr and "grpo.steps:" not in partly.stderr
    allowed = subprocess.run([*CLI, "rl", "--resume", str(run), "--allow-change", "grpo.lr,grpo.steps"], env=ENV,
                             capture_output=True, text=True, timeout=300)
    assert allowed.returncode == 0, allowed.stderr[-2000:]
    rows = _metrics(run)
    assert [r["step"] for r in rows] == list(range(6)) and rows[-1]["lr"] == 5e-4 and rows[0]["lr"] == 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_ends_the_step_saves_a_checkpoint_and_the_run_resumes_exactly(tmp_path, answering_checkpoint,
                                                                                sig, code):
    config = _rl_config(tmp_path, answering_checkpoint, temperature=2.0, format_reward=1.0, group_size=4,
                        checkpoint_every=10)
    full = tmp_path / "full"
    assert _rl(config, full).wait(timeout=300) == 0
    run = tmp_path / "run"
    proc = _rl(config, run)
    _wait_for(lambda: _steps_logged(run) >= 2, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err[-2000:]
    assert f"continue with: toolcollapse rl --resume {run}" in out + err and "Traceback" not in err
    stopped = len(_metrics(run))
    assert 2 <= stopped < 5 and (run / "checkpoints" / f"step_{stopped:06d}" / "COMPLETE").is_file()
    resumed = subprocess.run([*CLI, "rl", "--resume", str(run)], env=ENV, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert _metrics(run) == _metrics(full)


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_without_a_traceback(tmp_path, answering_checkpoint):
    config = _rl_config(tmp_path, answering_checkpoint, steps=50)
    run = tmp_path / "run"
    proc = _rl(config, run)
    _wait_for(lambda: _steps_logged(run) >= 1, proc)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    # the second Ctrl-C stops the step at once, or, when the step had already ended and its checkpoint was
    # written, it is ignored while the process ends: exit 130 either way, never a traceback or a kill (-2)
    assert proc.returncode == 130 and "Traceback" not in err, err[-2000:]
    assert "interrupted" in err or "with a checkpoint; continue with" in out + err, (out + err)[-2000:]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_the_tool_process_dies_with_its_parent(tmp_path, sig):
    """Even in the middle of a call (a model's call can run for its whole time limit): the socket's EOF is not
    read until the call returns."""
    script = tmp_path / "parent.py"
    script.write_text(
        "import threading, time\n"
        "from sandbox_helpers import new_list, sleep\n"
        "from toolcollapse.sandbox import Sandbox\n"
        "box = Sandbox(60.0, 512, True)\n"
        "sid = box.open(new_list)\n"
        "threading.Thread(target=box.call, args=(sid, sleep, 30), daemon=True).start()\n"
        "time.sleep(1.0)\n"
        "print(box._proc.pid, flush=True)\n"
        "time.sleep(60)\n")
    env = dict(ENV, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), ENV.get("PYTHONPATH", "")]))
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    child = int(parent.stdout.readline())
    assert _alive(child)
    parent.send_signal(sig)
    parent.wait()
    deadline = time.time() + 1.0
    while time.time() < deadline:
        if not _alive(child):
            return
        time.sleep(0.02)
    pytest.fail(f"the tool process {child} outlived its parent by a second")


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper that never comes, as PID 1 of some containers, is dead)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_a_study_stopped_by_sigterm_finishes_on_the_same_command_with_the_same_results(tmp_path):
    from test_study import _study

    path = _study(tmp_path)
    raw = yaml.safe_load(path.read_text())
    raw["overrides"]["grpo.steps"] = 4
    raw["settings"]["sft_only_lr1e-3"]["supervision.sft_only.match"] = "@ets_lr1e-3"  # in each study's own out_dir
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    reference = tmp_path / "reference.yaml"
    raw["out_dir"] = str(tmp_path / "reference")
    reference.write_text(yaml.safe_dump(raw, sort_keys=False))
    assert subprocess.run([*CLI, "study", str(reference)], env=ENV, capture_output=True).returncode == 0

    proc = subprocess.Popen([*CLI, "study", str(path)], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    out_dir = tmp_path / "study"
    _wait_for(lambda: any(_steps_logged(p.parent) >= 1 for p in out_dir.glob("*/seed0/metrics.jsonl")), proc,
              timeout=600)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 143 and "Run the same command to continue" in out + err, err[-3000:]
    again = subprocess.run([*CLI, "study", str(path)], env=ENV, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-3000:]
    for run in (tmp_path / "reference").glob("*/seed0"):
        assert _metrics(out_dir / run.parent.name / "seed0") == _metrics(run) if (run / "metrics.jsonl").is_file() \
            else True
        for summary in (run / "checkpoints").glob("step_*/eval/*.summary.json"):
            mine = out_dir / summary.relative_to(tmp_path / "reference")
            assert json.loads(mine.read_text())["success_rate"] == json.loads(summary.read_text())["success_rate"]
    tables = [(d / "report" / "report.md").read_text().split("## Arms and columns", 1)[1] for d in (out_dir,
                                                                                                  tmp_path / "reference")]
    assert tables[0].replace(str(out_dir), "X") == tables[1].replace(str(tmp_path / "reference"), "X")
    shutil.rmtree(tmp_path / "reference")
