"""System tests of interrupts: every entry point, interrupted mid-run and then run again with the same command, loses
nothing.

Each test starts the command in its own process group, waits until the run has logged a few steps, sends SIGINT to
the whole group (what Ctrl-C in a terminal does) or SIGTERM (a scheduler, `kill`), and checks:

- the trainer finished the step it was in and saved a checkpoint *at that step* (`summary.json`: 'interrupted');
- the same command again resumes from that checkpoint (`resumed_from`, `steps_this_run`), never retrains;
- every step appears exactly once in `metrics.jsonl` and `metrics.parquet`, and the losses are those of an
  uninterrupted run.

With resume disabled (a rerun that trains from step 0, or one that keeps the stopped process's records) each test
fails on `resumed_from` / `steps_this_run` or on the duplicate steps. All runs use the `smoke` preset on a slice of
the shared EurLex sample.
"""
import json, os, re, shutil, signal, subprocess, sys, time
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
LINE = re.compile(r"\[altgrad\] interrupted at step (\d+): checkpoint saved; rerun the same command to resume")


def _exe(name: str) -> str:
    p = BIN / name
    return str(p) if p.exists() else (shutil.which(name) or name)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    "EurLex (first 40 documents per split), prepared once for this module."
    from altgrad.data import prepare_eurlex, shared_data_dir
    sd = shared_data_dir(ROOT)
    if sd is None or not (sd / "eurlex").is_dir(): pytest.skip("no shared EurLex sample: set ALTGRAD_SHARED_DATA")
    d = tmp_path_factory.mktemp("data") / "eurlex"
    prepare_eurlex(d, source=sd / "eurlex", max_docs=40, progress=False)
    return d


def _env():
    return {**os.environ, "ALTGRAD_COMPILE": "never", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def _run(cmd, timeout=300):
    return subprocess.run([str(c) for c in cmd], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)


def _logged(run_dir: Path) -> int:
    "Lines in `run_dir/metrics.jsonl` (0 while it does not exist)."
    try: return (Path(run_dir) / "metrics.jsonl").read_text().count("\n")
    except OSError: return 0


def _terminal_sigint():
    "Ctrl-C as a terminal's process has it: a test run launched in the background (`cmd &`) inherits SIGINT ignored."
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt(cmd, find_run, sig=signal.SIGINT, after=5, timeout=240):
    """Start `cmd` in its own process group, wait until the run folder `find_run()` has logged `after` steps, send `sig`
    to the group; (exit code, stdout, stderr, run folder)."""
    p = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True, preexec_fn=_terminal_sigint)
    t0, run = time.monotonic(), None
    try:
        while time.monotonic() - t0 < timeout:
            run = run or find_run()
            if run is not None and _logged(run) >= after: break
            if p.poll() is not None:
                out, err = p.communicate()
                pytest.fail(f"{cmd[0]} ended (exit {p.returncode}) before it was interrupted:\n{out[-2000:]}\n{err[-3000:]}")
            time.sleep(0.05)
        else: pytest.fail(f"no run logged {after} steps within {timeout} s")
        os.killpg(p.pid, sig)
        out, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None: os.killpg(p.pid, signal.SIGKILL); p.communicate()
    return p.returncode, out, err, Path(run)


def _summary(run_dir) -> dict: return json.loads((Path(run_dir) / "summary.json").read_text())


def _check_interrupted(run_dir) -> int:
    "The run stopped at a step with a checkpoint of exactly that step; returns the step."
    s = _summary(run_dir)
    assert s["stopped_reason"] == "interrupted", s
    n = s["final_step"]
    assert (Path(run_dir) / "checkpoints" / f"step_{n:06d}.pt").exists(), sorted(p.name for p in (Path(run_dir) / "checkpoints").iterdir())
    return n


def _check_resumed(run_dir, n: int, max_steps: int):
    "The rerun continued from step `n`'s checkpoint to the end, and every step is recorded once."
    from altgrad.tracking import read_metrics
    s = _summary(run_dir)
    assert (s["stopped_reason"], s["final_step"]) == ("max_steps", max_steps), s
    assert s["resumed_from"] and s["resumed_from"].endswith(f"step_{n:06d}.pt"), s["resumed_from"]
    assert s["steps_this_run"] == max_steps - n, s
    files = [f for f in ("metrics.jsonl", "metrics.parquet") if (Path(run_dir) / f).exists()]
    assert "metrics.parquet" in files, files              # a finished study run keeps only the compact record
    for f in files:
        steps = [r["step"] for r in read_metrics(Path(run_dir) / f)]
        assert steps == list(range(1, max_steps + 1)), (f, steps)


def _losses(run_dir):
    from altgrad.tracking import read_metrics
    return [(r["step"], r["train/loss"], r.get("val/loss")) for r in read_metrics(Path(run_dir) / "metrics.jsonl")]


# --- altgrad-train ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_train_cli(data, tmp_path, sig):
    "Ctrl-C (to the process group, W&B offline) / SIGTERM: one line, exit 130 / 143; the same command resumes exactly."
    steps = 30
    cmd = lambda out: [_exe("altgrad-train"), "smoke", f"data_dir={data}", f"out_dir={out}", "--no-progress", f"max_steps={steps}",
                       "eval_interval=10", "checkpoint_interval=50", f"wandb_mode={'offline' if sig == signal.SIGINT else 'disabled'}"]
    out = tmp_path / "run"
    rc, _, err, _ = _interrupt(cmd(out), lambda: out, sig)
    assert rc == 128 + sig, (rc, err[-3000:])
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    lines = [l for l in err.splitlines() if "interrupted" in l]
    assert len(lines) == 1 and LINE.fullmatch(lines[0]), err[-3000:]
    n = _check_interrupted(out)
    assert int(LINE.fullmatch(lines[0]).group(1)) == n and 5 <= n < steps
    r = _run(cmd(out))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"holds an interrupted run of this config (step {n} of {steps}): resuming it" in r.stderr, r.stderr[-2000:]
    _check_resumed(out, n, steps)
    if sig == signal.SIGINT:                            # bit for bit the uninterrupted run
        ref = tmp_path / "ref"
        assert _run(cmd(ref)).returncode == 0
        assert _losses(out) == _losses(ref)


def test_train_cli_refuses_finished_run(data, tmp_path):
    "A second fresh run into a finished run's folder is refused in one line; --overwrite keeps the old run whole."
    out = tmp_path / "run"
    cmd = [_exe("altgrad-train"), "smoke", f"data_dir={data}", f"out_dir={out}", "--no-progress", "max_steps=3", "wandb_mode=disabled"]
    assert _run(cmd).returncode == 0
    before = (out / "summary.json").read_text()
    r = _run(cmd)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "holds a finished run (step 3 of 3)" in r.stderr, r.stderr
    assert (out / "summary.json").read_text() == before
    r = _run(cmd + ["--overwrite"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Warning" not in r.stderr and "[altgrad] moved the earlier run" in r.stderr, r.stderr
    prev = list((out / "_previous").iterdir())
    assert len(prev) == 1 and (prev[0] / "summary.json").read_text() == before
    assert {"config.yaml", "metrics.jsonl", "alerts.jsonl", "checkpoints"} <= {p.name for p in prev[0].iterdir()}


# --- the other entry points: each resumes the interrupted run it was training ------------------------------------------

def _newest_run(root: Path):
    "The run folder under `root` that is being trained now (its metrics.jsonl changed last)."
    def find():
        fs = [p for p in Path(root).rglob("metrics.jsonl") if "_previous" not in p.parts]
        return max(fs, key=lambda p: p.stat().st_mtime).parent if fs else None
    return find


def _interrupt_and_rerun(cmd, root: Path, steps: int, sig=signal.SIGINT):
    rc, out, err, run = _interrupt(cmd, _newest_run(root), sig)
    assert rc != 0, "the interrupted command exited 0"
    n = _check_interrupted(run)
    r = _run(cmd, timeout=600)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    _check_resumed(run, n, steps)
    return run


def test_sweep_cli(data, tmp_path):
    "Ctrl-C during the sweep's reference run, then the same `altgrad-sweep` again: the reference run resumes."
    steps = 40
    cmd = [_exe("altgrad-sweep"), "--preset", "smoke", "--out", tmp_path, "--steps", steps, "--data-dir", data, "--no-retry",
           "--formats", "E5M2", "--wandb-mode", "disabled", "--set", "checkpoint_interval=100", "--set", "eval_interval=20"]
    run = _interrupt_and_rerun(cmd, tmp_path, steps)
    assert "_reference" in run.parts


def test_papermill_main_job(data, tmp_path):
    "Ctrl-C to papermill while the main job trains, then the same papermill command: the run resumes."
    steps = 40
    nb_out = tmp_path / "out.ipynb"
    cmd = [sys.executable, "-m", "papermill", ROOT / "nbs" / "run_format.ipynb", nb_out, "-p", "fmt", "E5M2", "-p", "preset", "smoke",
           "-p", "steps", str(steps), "-p", "out_dir", str(tmp_path / "outputs"), "-p", "data_dir", str(data), "-p", "wandb_mode", "disabled",
           "--no-progress-bar", "--cwd", ROOT]
    _interrupt_and_rerun(cmd, tmp_path / "outputs", steps)


def test_study_cli(data, tmp_path):
    "Ctrl-C during a study run, then the same `altgrad-study` again: that run resumes."
    steps = 40
    cmd = [_exe("altgrad-study"), "--preset", "smoke", "--out", tmp_path / "study", "--formats", "E5M2", "--regimes", "nearest",
           "--tuning-seeds", "42", "--heldout-seeds", "43,44", "--steps", steps, "--lr-mults", "1", "--max-extensions", "0",
           "--data-dir", data]
    _interrupt_and_rerun(cmd, tmp_path / "study", steps)
