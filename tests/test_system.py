"""System tests of the training stack across processes: the CLIs, kill -9 and resume, offline W&B files.

All runs use the `smoke` preset on a small slice of the shared EurLex sample, prepared once per session with the
`altgrad-prepare` CLI into a temporary folder (never into the repository).
"""
import json, math, os, shutil, signal, subprocess, sys, time
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _exe(name: str) -> str:
    "The console script `name` of this environment (falls back to PATH)."
    p = BIN / name
    return str(p) if p.exists() else (shutil.which(name) or name)


def _shared() -> Path:
    from altgrad.data import shared_data_dir
    sd = shared_data_dir(ROOT)
    if sd is None or not (sd / "eurlex").is_dir():
        pytest.skip("no shared EurLex sample: set ALTGRAD_SHARED_DATA to the folder holding eurlex/")
    return sd


def _run(*args, timeout=300, **kw):
    return subprocess.run([str(a) for a in args], cwd=ROOT, capture_output=True, text=True, timeout=timeout, **kw)


def _train_args(data, out, *extra):
    return [_exe("altgrad-train"), "smoke", f"data_dir={data}", f"out_dir={out}", "--no-progress", *extra]


def _losses(run_dir, key="train/loss"):
    from altgrad.tracking import read_metrics
    return {r["step"]: r[key] for r in read_metrics(Path(run_dir) / "metrics.jsonl", merge=True) if key in r}


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    "EurLex (first 40 documents per split) prepared by the `altgrad-prepare` CLI."
    sd = _shared()
    out = tmp_path_factory.mktemp("data") / "eurlex"
    r = _run(_exe("altgrad-prepare"), "--source", sd / "eurlex", "--out", out, "--max-docs", "40", "--quiet")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "altgrad-prepare:" in r.stdout and (out / "meta.json").exists()
    return out


@pytest.fixture(scope="module")
def offline_run(data, tmp_path_factory):
    "One CLI run with offline W&B: 8 steps, evaluation and checkpoint every 4."
    out = tmp_path_factory.mktemp("runs") / "offline"
    r = _run(*_train_args(data, out, "max_steps=8", "eval_interval=4", "checkpoint_interval=4", "wandb_mode=offline"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    return out, r


def test_cli_train_writes_run_folder(offline_run):
    out, r = offline_run
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_step"] == 8 and summary["stopped_reason"] == "max_steps"
    assert json.loads(r.stdout[r.stdout.index("{"):]) == summary          # the CLI prints the summary
    for f in ("metrics.jsonl", "alerts.jsonl", "config.yaml", "summary.json", "tracker.json"):
        assert (out / f).exists(), f
    assert (out / "wandb").is_dir()
    ck = sorted(p.name for p in (out / "checkpoints").glob("*.pt"))
    assert ck == ["best.pt", "step_000004.pt", "step_000008.pt"], ck
    from altgrad.config import load_config
    cfg = load_config(out / "config.yaml")
    assert (cfg.max_steps, cfg.n_layer, cfg.wandb_mode, cfg.out_dir) == (8, 2, "offline", str(out))
    from altgrad.tracking import read_metrics
    recs = read_metrics(out)
    assert [r["step"] for r in recs] == list(range(1, 9))
    for rec in recs:
        for k in ("train/loss", "train/lr", "perf/tokens_per_sec", "perf/step_time", "grad_cos_sim/global"):
            assert k in rec, (rec["step"], k)
        assert ("val/loss" in rec) == (rec["step"] % 4 == 0)


def test_cli_bad_key_exit_code(data, tmp_path):
    r = _run(*_train_args(data, tmp_path / "bad", "n_layers=3"), timeout=120)
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "unknown config key 'n_layers'" in r.stderr and "did you mean 'n_layer'" in r.stderr
    assert "Traceback" not in r.stderr
    r = _run(*_train_args(data, tmp_path / "bad", "lr=fast"), timeout=120)
    assert r.returncode == 2 and "lr must be a float" in r.stderr
    r = _run(*_train_args(tmp_path / "nodata", tmp_path / "bad"), timeout=120)
    assert r.returncode == 2 and "altgrad-prepare --source ../shared/data/eurlex --out" in r.stderr
    assert not (tmp_path / "bad" / "metrics.jsonl").exists()


def test_kill_and_resume_is_exact(data, tmp_path):
    "SIGKILL a training process after its first checkpoint, resume it: the losses equal an uninterrupted run's."
    steps = ["max_steps=30", "eval_interval=10", "checkpoint_interval=5", "wandb_mode=offline", "shadow=false"]
    ref = tmp_path / "ref"
    r = _run(*_train_args(data, ref, *steps))
    assert r.returncode == 0, r.stderr[-3000:]

    run = tmp_path / "killed"
    p = subprocess.Popen(_train_args(data, run, *steps), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not list((run / "checkpoints").glob("step_*.pt")):
            assert p.poll() is None, f"training exited ({p.returncode}) before its first checkpoint: {p.stderr.read()[-2000:]}"
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.02)
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
    finally:
        if p.poll() is None: p.kill(); p.wait()
    assert p.returncode == -signal.SIGKILL
    assert not (run / "summary.json").exists()                           # it really died mid-run
    killed_at = max(_losses(run))
    assert killed_at < 30

    r = _run(*_train_args(data, run, *steps, "resume=true"))
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_step"] == 30 and summary["resumed_from"].endswith(".pt")
    resumed_from = int(Path(summary["resumed_from"]).stem.split("_")[-1])
    assert 5 <= resumed_from <= killed_at and summary["steps_this_run"] == 30 - resumed_from
    want, got = _losses(ref), _losses(run)
    assert sorted(got) == sorted(want) == list(range(1, 31))
    assert [got[s] for s in range(1, 31)] == [want[s] for s in range(1, 31)]   # bit for bit
    assert _losses(run, "val/loss") == _losses(ref, "val/loss")
    # the same W&B run continues: one run id in the tracker, the summary and every W&B run file
    from altgrad.tracking import read_wandb_run_ids
    run_id = json.loads((run / "tracker.json").read_text())["run_id"]
    assert summary["run_id"] == run_id
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                                   # the killed run's file may have a torn tail
        ids = read_wandb_run_ids(run)
    assert len(ids) >= 2 and set(ids) == {run_id}


def test_offline_wandb_has_every_step(offline_run):
    "The offline W&B run file holds every step's metrics, equal to metrics.jsonl."
    out, _ = offline_run
    from altgrad.tracking import read_wandb_history, read_metrics
    hist = read_wandb_history(out)
    recs = read_metrics(out)
    assert [h["_step"] for h in hist] == [r["step"] for r in recs] == list(range(1, 9))
    for h, rec in zip(hist, recs):
        for k, v in rec.items():
            if k == "step": continue
            assert k in h, (rec["step"], k)
            if isinstance(v, float) and math.isfinite(v): assert h[k] == pytest.approx(v, rel=1e-12, abs=0), k
            else: assert h[k] == v, k


def test_concurrent_prepare_shares_one_folder(tmp_path):
    "Two processes preparing one data folder at once (study shards sharing an --out): one tokenizes, the other waits and reuses it."
    src, out = _shared() / "eurlex", tmp_path / "eurlex"
    code = ("import sys; from altgrad.data import prepare_eurlex; "
            "m = prepare_eurlex(sys.argv[1], source=sys.argv[2], max_docs=400, progress=False); print('cached', m['cached'])")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(out), str(src)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    res = [(*p.communicate(timeout=300), p.returncode) for p in procs]
    assert all(rc == 0 for _, _, rc in res), [err[-2000:] for _, err, _ in res]
    assert sorted(o.split()[-1] for o, _, _ in res) == ["False", "True"]      # exactly one of them tokenized
    from altgrad.data import load_meta
    assert load_meta(out)["max_docs"] == 400


def _main_job_refused(tmp_path, fmt, out, data):
    "The error of `papermill nbs/run_format.ipynb -p fmt FMT -p preset smoke -p out_dir OUT`, which must refuse to run."
    import papermill as pm
    with pytest.raises(pm.PapermillExecutionError) as e:
        pm.execute_notebook(str(ROOT / "nbs" / "run_format.ipynb"), str(tmp_path / "run.ipynb"), cwd=str(ROOT), kernel_name="python3",
                            parameters=dict(fmt=fmt, preset="smoke", out_dir=str(out), data_dir=str(data), wandb_mode="disabled"),
                            progress_bar=False)
    return e.value


def test_main_job_refuses_to_replace_a_writeup(data, tmp_path):
    """`papermill nbs/run_format.ipynb -p fmt E7M0 -p preset smoke` with no `steps`: the preset's length, not a notebook
    default. A committed write-up of another config (here 500 steps) in out_dir is refused in one line before anything
    trains, naming `-p overwrite True` and `-p out_dir`, and the tree stays byte-identical."""
    from altgrad.config import save_config
    from altgrad.sweep import format_config
    out = tmp_path / "outputs"
    cfg = format_config("E7M0", out, preset="smoke", steps=500, data_dir=str(data), wandb_mode="disabled")
    run = Path(cfg.out_dir); run.mkdir(parents=True); save_config(cfg, run / "config.yaml")
    (run / "summary.json").write_text(json.dumps(dict(final_step=500, max_steps=500, stopped_reason="max_steps")))
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "train/loss": 5.0}) + "\n" for s in range(1, 501)))
    (out / "E7M0" / "report.md").write_text("# committed write-up\n")
    snap = lambda: {p.relative_to(out): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    before = snap()
    e = _main_job_refused(tmp_path, "E7M0", out, data)
    msg = e.evalue
    assert "max_steps: 500 -> 20" in msg and "-p overwrite True" in msg and "-p out_dir" in msg and "\n" not in msg, msg
    assert snap() == before


def test_main_job_refuses_to_replace_a_reuse_page(data, tmp_path):
    """A committed "run reused" page (`report.md` + `reused.json`, no run beside it: what `sweep.mark_reused` leaves) is a
    write-up too: `papermill nbs/run_format.ipynb -p fmt E0M7` refuses in the same one line before anything trains, and
    the tree stays byte-identical."""
    out = tmp_path / "outputs"; dest = out / "E0M7"; dest.mkdir(parents=True)
    (dest / "reused.json").write_text(json.dumps(dict(reused_from="E1M6", format="E0M7", source_format="E1M6", power_of_two=-1,
                                                      note="E0M7: same grid as E1M6 up to 2^-1 (E0M7 = 2^-1 × E1M6); run reused")) + "\n")
    (dest / "report.md").write_text("# E0M7: run reused\n\nThe run is in [../E1M6/run](../E1M6/run).\n")
    snap = lambda: {p.relative_to(tmp_path): p.read_bytes() for p in sorted(tmp_path.rglob("*")) if p.is_file() and p.name != "run.ipynb"}
    before = snap()
    e = _main_job_refused(tmp_path, "E0M7", out, data)
    msg = e.evalue
    assert "report.md and reused.json but no finished run of this config" in msg and "-p overwrite True" in msg, msg
    assert "\n" not in msg and e.ename == "RunConflict", msg
    assert snap() == before and sorted(p.name for p in dest.iterdir()) == ["report.md", "reused.json"]
