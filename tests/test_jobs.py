"""System tests of `--jobs N` (concurrent runs, each in its own process; on CPU one thread each): `altgrad-sweep --jobs 2`
trains every run once and writes what a one-thread `--jobs 1` sweep writes; `altgrad-study --jobs 2` trains every run
of a tiny study once (two shards sharing the folder) and writes the answer; the process pool forwards Ctrl-C as SIGTERM.
All runs use the `smoke` preset on the small shared data (`small_data`), with eager kernels (ALTGRAD_COMPILE=never)."""
import json, os, re, shutil, signal, subprocess, sys, threading, time
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = 4


def _cmd(name: str, module: str, fn: str) -> list:
    "The console script, or (before `pip install -e .` knows it) the same entry point through python."
    exe = shutil.which(name)
    return [exe] if exe else [sys.executable, "-c", f"import sys; from altgrad.{module} import {fn}; sys.exit({fn}(sys.argv[1:]))"]


def _run(cmd, *args):
    # one thread, as each --jobs process has on CPU: a CPU run's numbers depend on the thread count
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "ALTGRAD_COMPILE": "never"}
    r = subprocess.run(cmd + [str(a) for a in args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r


def _runs(out: Path) -> dict:
    "{run folder relative to `out`: its summary.json} for every trained run (reference and formats)."
    return {str(p.parent.relative_to(out)): json.loads(p.read_text()) for p in out.rglob("summary.json")
            if (p.parent / "config.yaml").exists() and "_previous" not in p.parts}


def _timeless(text: str) -> str:
    "A summary with its one measured figure, the speed, blanked: '1,234.5 tokens/s' and '987 tokens/s' alike (any machine)."
    return re.sub(r"\d[\d,]*(\.\d+)? tokens/s", "N tokens/s", text)


def test_timeless():
    "The speed is blanked whatever its size (thousands separator or not), and nothing else is touched."
    fast, slow = "ran at 1,234.5 tokens/s (median step); loss 3.21", "ran at 987 tokens/s (median step); loss 3.21"
    assert _timeless(fast) == _timeless(slow) == "ran at N tokens/s (median step); loss 3.21"
    assert _timeless(fast.replace("3.21", "3.22")) != _timeless(slow)


def test_sweep_jobs_equals_sequential(tmp_path, small_data):
    "Two formats with --jobs 2: every run trained once, in the pool; the same table and final losses as --jobs 1."
    sweep = lambda out, jobs: _run(_cmd("altgrad-sweep", "sweep_cli", "sweep_cli"), "--preset", "smoke", "--out", out, "--steps", STEPS,
                                   "--data-dir", small_data, "--formats", "E5M2,E3M4", "--wandb-mode", "disabled", "--jobs", jobs)
    seq, par = tmp_path / "seq", tmp_path / "par"
    sweep(seq, 1)
    r = sweep(par, 2)
    assert "[altgrad-sweep] --jobs 2: 5 processes to start, at most 2 at a time (one thread each)" in r.stdout, r.stdout[-2000:]
    for line in ("reference: done", "E5M2 (training): done", "E5M2 (write-up): done", "E3M4 (training): done", "E3M4 (write-up): done",
                 "reusing reference run", "E5M2: reusing the finished run", "E3M4: reusing the finished run"):
        assert line in r.stdout, (line, r.stdout[-3000:])
    assert "failed" not in r.stdout and "Traceback" not in r.stderr, r.stdout[-2000:] + r.stderr[-2000:]
    assert sorted(p.name for p in (par / ".jobs").iterdir()) == ["E3M4.notebook.log", "E3M4.train.log", "E5M2.notebook.log",
                                                                 "E5M2.train.log", "reference.log"]
    a, b = _runs(seq), _runs(par)
    assert sorted(a) == sorted(b) and len(a) == 3, (sorted(a), sorted(b))
    for k, s in b.items():               # trained once, from step 0, never resumed or replaced
        assert (s["stopped_reason"], s["final_step"], s["steps_this_run"], s["resumed_from"]) == ("max_steps", STEPS, STEPS, None), (k, s)
        for key in ("final_train_loss", "final_val_loss", "best_val_loss"): assert s[key] == a[k][key], (k, key, s[key], a[k][key])
    assert not list(par.rglob("_previous"))
    assert _timeless((par / "summary.md").read_text()) == _timeless((seq / "summary.md").read_text())
    assert (par / "E5M2" / "report.md").exists() and (par / "E3M4" / "report.md").exists()


def test_study_jobs(tmp_path, small_data):
    "A tiny study with --jobs 2: two shards share the folder, every run is trained once, then the answer is written."
    out = tmp_path / "study"
    r = _run(_cmd("altgrad-study", "study_cli", "study_cli"), "--preset", "smoke", "--formats", "E4M3", "--regimes", "nearest",
             "--tuning-seeds", "42", "--heldout-seeds", "43,44", "--steps", STEPS, "--lr-mults", "1", "--max-extensions", "0",
             "--data-dir", small_data, "--out", out, "--jobs", 2)
    n_runs = 2 + 2 * (2 + 2)               # tuning: E4M3 x (fp32, nearest); per held-out seed: references (FP32, BF16) and the same
    assert f"[altgrad-study] --jobs 2: 2 processes share {out} (one thread each)" in r.stdout, r.stdout[-2000:]
    assert "shard 0/2: done" in r.stdout and "shard 1/2: done" in r.stdout, r.stdout[-2000:]
    assert f"[altgrad-study] study: {n_runs} reused, 0 trained" in r.stdout, r.stdout[-2000:]
    logs = [(out / ".jobs" / f"shard-{i}.log").read_text() for i in (0, 1)]
    trained = sum(int(n) for log in logs for n in re.findall(r"shard \d/2: \d+ reused, (\d+) trained", log))
    runs = _runs(out)
    assert trained == len(runs) == n_runs, (trained, sorted(runs), [log[-1500:] for log in logs])
    for k, s in runs.items():
        assert (s["stopped_reason"], s["steps_this_run"], s["resumed_from"]) == ("max_steps", STEPS, None), (k, s)
    assert not list(out.rglob("_previous"))
    st = json.loads((out / "study.json").read_text())
    assert st["complete"] and len(st["runs"]) == n_runs and (out / "answer.md").exists()


def test_pool_forwards_interrupt(tmp_path):
    """Ctrl-C to the parent of a pool: each running process gets SIGTERM (and ends as a trainer does, at a checkpoint), none
    starts any more, and `JobsInterrupted` carries the shell's exit code."""
    from altgrad.pool import Job, JobsInterrupted, run_pool
    child = ("import pathlib, signal, sys, time; p = pathlib.Path(sys.argv[1]); "
             "signal.signal(signal.SIGTERM, lambda *a: (p.write_text('SIGTERM'), sys.exit(143))); p.write_text('started'); time.sleep(60)")
    jobs = [Job(n, [sys.executable, "-c", child, tmp_path / n], tmp_path / f"{n}.log") for n in ("a", "b", "c")]
    started = lambda: all((tmp_path / n).exists() and (tmp_path / n).read_text() == "started" for n in ("a", "b"))
    def interrupt():
        t0 = time.time()
        while not started() and time.time() - t0 < 60: time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)
    threading.Thread(target=interrupt, daemon=True).start()
    t0 = time.time()
    before = signal.getsignal(signal.SIGINT)          # SIG_IGN when the suite runs in the background (`cmd &`)
    with pytest.raises(JobsInterrupted) as e: run_pool(jobs, 2, poll=0.05)
    assert e.value.exit_code == 130 and time.time() - t0 < 30
    assert e.value.rcs == {"a": 143, "b": 143}, e.value.rcs          # the stopped jobs' exit codes; "c" never ran
    assert [(tmp_path / n).read_text() for n in ("a", "b")] == ["SIGTERM", "SIGTERM"] and not (tmp_path / "c").exists()
    assert signal.getsignal(signal.SIGINT) is before      # the handlers are restored
