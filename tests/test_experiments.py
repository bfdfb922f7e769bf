"System tests of the experiment layer: the papermill notebook and the sweep CLI, on the smoke preset."
import json, os, subprocess, sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ["## Setup", "## Results", "## Loss", "## Gradient agreement", "## Where the format hurts: overflow",
            "## Where the format hurts: underflow", "## Where the format hurts: bit-stall", "## Code histograms",
            "## Interventions", "## Failure analysis", "## Verdict"]
FIGURES = {"loss.png", "grad_cosine.png", "overflow_heatmap.png", "underflow_heatmap.png", "stall_heatmap.png", "histograms.png"}


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    return tmp_path_factory.mktemp("experiments")


@pytest.mark.parametrize("fmt", ["E5M2", "E7M0"])
def test_run_format_papermill(out, fmt):
    import papermill as pm
    nb_out = out / f"{fmt}.ipynb"
    pm.execute_notebook(str(ROOT / "nbs" / "run_format.ipynb"), str(nb_out), cwd=str(ROOT), kernel_name="python3",
                        parameters=dict(fmt=fmt, preset="smoke", steps=12, out_dir=str(out)), progress_bar=False)
    report = (out / fmt / "report.md").read_text()
    for s in SECTIONS: assert s in report, f"{fmt}: missing section {s}"
    last = report.split("\n## ")[-1].splitlines()
    assert last[0] == "Verdict"
    verdict = [l for l in last if l.strip()][1]
    assert verdict.startswith("Verdict: ") and (verdict in ("Verdict: PASS", "Verdict: INVESTIGATE") or verdict.startswith("Verdict: FAIL at step "))
    assert FIGURES <= {p.name for p in (out / fmt / "figures").glob("*.png")}, "figures missing"
    assert "Not available for this run" not in report, "a figure section had no data"
    from altgrad.tracking import read_metrics
    metrics = read_metrics(out / fmt / "run")
    assert metrics[0]["step"] == 1 and any(k.startswith("overflow/") for k in metrics[0])
    executed = json.loads(nb_out.read_text())
    assert any("Verdict: " in "".join(o.get("text", "")) for c in executed["cells"] for o in c.get("outputs", []))
    # training progress reached the notebook's output as text (what papermill --log-output streams)
    assert any("12/12" in "".join(o.get("text", "")) for c in executed["cells"] for o in c.get("outputs", [])), "no progress shown"


def test_reference_reused(out):
    "The second format run above reused the reference trained by the first."
    refs = list((out / "_reference").iterdir())
    assert len(refs) == 1 and (refs[0] / "summary.json").exists()


def sweep(out, data, *args, steps=8):
    return subprocess.run(["altgrad-sweep", "--preset", "smoke", "--out", str(out), "--steps", str(steps), "--data-dir", str(data),
                           "--no-retry", *args], cwd=ROOT, env={**os.environ}, capture_output=True, text=True, timeout=600)


def saved(run_dir) -> dict:
    import yaml
    return yaml.safe_load((Path(run_dir) / "config.yaml").read_text())


def test_sweep_cli(tmp_path, small_data):
    r = sweep(tmp_path, small_data, "--formats", "E3M4")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    md = (tmp_path / "summary.md").read_text()
    assert "| [E3M4](E3M4/report.md) | E3M4 | uniform | 8/8 |" in md, md     # smoke: 2 blocks x 4 linear layers, all 8-bit
    assert (tmp_path / "E3M4" / "report.md").exists() and (tmp_path / "summary.png").exists()
    assert "unigram baseline" in md and (tmp_path / "reference.png").exists() and "Master weights: FP32" in md
    assert "Update regime: optimizer `adamw`" in md and "NaN policy: stop at the first non-finite step" in md
    for col in ("progress lost", "quantized-layer cosine", "all-parameter cosine", "lost update", "verdict"): assert col in md
    # a second call reuses the finished runs (an interrupted sweep continues) and writes the same table
    r2 = subprocess.run(r.args, cwd=ROOT, env={**os.environ}, capture_output=True, text=True, timeout=600)
    assert r2.returncode == 0 and "E3M4: reusing the finished run" in r2.stdout, r2.stdout[-2000:] + r2.stderr[-2000:]
    assert "reusing reference run" in r2.stdout
    assert (tmp_path / "summary.md").read_text() == md
    # another config of the same length is not the same run: a finished run of another config is refused in one line
    # (exit 2, naming --force) before anything trains, leaving the folder as it was
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    r3 = sweep(tmp_path, small_data, "--formats", "E3M4", "--interventions")
    assert r3.returncode == 2 and "--force" in r3.stderr and "interventions: False -> True" in r3.stderr, r3.stderr[-2000:]
    assert len(r3.stderr.strip().splitlines()) == 1 and "Traceback" not in r3.stderr
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    # --force retrains the format, keeps the reference (interventions do not apply to it), no longer stops at the first NaN
    r3 = sweep(tmp_path, small_data, "--formats", "E3M4", "--interventions", "--force")
    assert r3.returncode == 0, r3.stdout[-2000:] + r3.stderr[-3000:]
    assert "E3M4: reusing" not in r3.stdout, r3.stdout[-2000:]
    cfg = saved(tmp_path / "E3M4" / "run")
    assert cfg["interventions"] is True and cfg["stop_on_nan"] is False
    assert "NaN policy: interventions on" in (tmp_path / "summary.md").read_text()


def test_sweep_reference_incomplete_is_retrained(tmp_path, small_data):
    "A reference whose per-step metrics are gone (as in a git clone) is trained again, not reused (it used to crash the sweep)."
    r = sweep(tmp_path, small_data, "--formats", "E5M2", steps=6)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    ref = tmp_path / "_reference" / "smoke-s42-n6"
    for f in ref.glob("metrics*"): f.unlink()
    r2 = sweep(tmp_path, small_data, "--formats", "E5M2", steps=6)
    assert r2.returncode == 0, r2.stdout[-2000:] + r2.stderr[-3000:]
    assert f"not reusing the reference run in {ref}: per-step metrics missing" in r2.stdout, r2.stdout[-2000:]
    assert "E5M2: reusing the finished run" in r2.stdout
    from altgrad.report import load_run
    assert load_run(ref).metrics[-1]["step"] == 6


def test_reference_from_git_clone(tmp_path, monkeypatch, capsys):
    """The committed outputs/ as a fresh `git clone` has it: every committed run folder is complete (its per-step
    metrics load from metrics.parquet), the reference is reused for the same config and data, and retrained, saying
    why, for other data. (Before: summary.json without metrics fooled the completeness check and the main job crashed.)"""
    clone = tmp_path / "clone"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(clone)], check=True, timeout=300)
    from altgrad import sweep as sw
    from altgrad.runs import check_run
    from altgrad.report import load_run
    from altgrad.data import prepare_eurlex, shared_data_dir
    runs = [p.parent for p in (clone / "outputs").rglob("summary.json") if (p.parent / "config.yaml").exists()]
    assert runs, "no committed run folders"
    for d in runs:
        assert not (d / "metrics.jsonl").exists()                      # git-ignored: what a clone does not have
        run, why = check_run(d)
        assert run is not None and why == [], (d, why)
        assert run.metrics[-1]["step"] == json.loads((d / "summary.json").read_text())["final_step"], d
    ref = Path("outputs/_reference/cpu-s42-n500")
    monkeypatch.chdir(clone)
    calls = []
    monkeypatch.setattr(sw, "train", lambda cfg: calls.append(cfg) or {})
    prepare_eurlex("outputs/_data/eurlex", source=shared_data_dir() / "eurlex", progress=False)     # the committed runs' data
    assert sw.reference_run("outputs", "cpu", 42, 500, data_dir="outputs/_data/eurlex", wandb_mode="offline") == ref
    assert calls == [] and "reusing reference run" in capsys.readouterr().out
    prepare_eurlex("small", source=shared_data_dir() / "eurlex", max_docs=50, progress=False)      # other data: refused
    with pytest.raises(sw.RunConflict, match="different token content.*pass --force"):
        sw.reference_run("outputs", "cpu", 42, 500, data_dir="small", wandb_mode="offline")
    assert calls == []


def test_sweep_equivalent_formats_train_once(tmp_path, small_data):
    r = sweep(tmp_path, small_data, "--formats", "E1M6,E0M7", steps=6)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "E0M7: same grid as E1M6 up to 2^-1" in r.stdout and "[altgrad-sweep] E0M7 (" not in r.stdout, r.stdout[-2000:]
    assert sorted(p.name for p in (tmp_path / "E0M7").iterdir()) == ["report.md", "reused.json"]
    assert json.loads((tmp_path / "E0M7" / "reused.json").read_text())["reused_from"] == "E1M6"
    assert "(../E1M6/report.md)" in (tmp_path / "E0M7" / "report.md").read_text()      # the source's write-up exists: linked
    md = (tmp_path / "summary.md").read_text()
    assert "| [E1M6](E1M6/report.md) | E1M6 | uniform |" in md and "| [E0M7](E1M6/report.md) (= E1M6 run) | E0M7 | uniform |" in md
    assert "- E0M7: same grid as E1M6 up to 2^-1 (E0M7 = 2^-1 × E1M6); run reused" in md
    # the other order: E0M7 trains, E1M6 reuses it (the marker is replaced by the run)
    r2 = sweep(tmp_path, small_data, "--formats", "E0M7,E1M6", steps=6)
    assert r2.returncode == 0 and "E1M6: same grid as E0M7 up to 2^1" in r2.stdout, r2.stdout[-2000:] + r2.stderr[-2000:]
    assert (tmp_path / "E0M7" / "run").is_dir() and not (tmp_path / "E0M7" / "reused.json").exists()
    assert len(list((tmp_path / "E0M7" / "_previous").glob("*/reused.json"))) == 1           # the old reuse page: set aside whole
    assert (tmp_path / "E1M6" / "reused.json").exists() and not (tmp_path / "E1M6" / "run").exists()


def test_sweep_update_regime_flags(tmp_path, small_data):
    "--optimizer/--rounding/--weight-update reach the format runs (the reference stays the standard one) and summary.md states them."
    r = sweep(tmp_path, small_data, "--formats", "E5M2", "--rounding", "stochastic", "--master-weights", "format",
              "--weight-update", "stochastic", steps=6)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    cfg = saved(tmp_path / "E5M2" / "run")
    assert (cfg["rounding"], cfg["weight_update"], cfg["master_weights"]) == ("stochastic", "stochastic", "format")
    assert [p.name for p in (tmp_path / "_reference").iterdir()] == ["smoke-s42-n6"]
    ref = saved(tmp_path / "_reference" / "smoke-s42-n6")
    assert ref["rounding"] == "nearest" and ref["fmt"] is None
    md = (tmp_path / "summary.md").read_text()
    assert "GEMM operands (W, A, G) rounded `stochastic`; weight update `stochastic` (how `w + u` lands on the grid)" in md
    assert "Config overrides: `rounding=stochastic`, `weight_update=stochastic`" in md


def test_sweep_set_override(tmp_path, small_data):
    "--set key=value reaches the run and (for a key that changes the problem) the reference, which gets its own folder."
    r = sweep(tmp_path, small_data, "--formats", "E4M3", "--set", "lr=0.002", steps=6)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert saved(tmp_path / "E4M3" / "run")["lr"] == 0.002
    assert saved(tmp_path / "_reference" / "smoke-s42-n6-lr=0.002")["lr"] == 0.002


def test_sweep_cli_bad_format(tmp_path):
    r = subprocess.run(["altgrad-sweep", "--formats", "E9M9", "--out", str(tmp_path)], capture_output=True, text=True)
    assert r.returncode == 2 and "valid formats: E5M2" in r.stderr


@pytest.mark.parametrize("args, msg", [(["--set", "max_steps=3"], "max_steps (use --steps)"),
                                       (["--optimizer", "sgd"], "optimizer"), (["--set", "lrr=1"], "did you mean 'lr'")])
def test_sweep_cli_bad_override(tmp_path, args, msg):
    r = subprocess.run(["altgrad-sweep", "--out", str(tmp_path), *args], capture_output=True, text=True)
    assert r.returncode == 2 and msg in r.stderr, r.stderr


def test_committed_runs_reused_with_their_config():
    "Every committed run folder is reused for the config it ran, although its config.yaml says `rules:` (renamed "
    "`layer_formats`) and lacks keys added since (`eval_tokens`, whose default is what those runs did). Read-only."
    from altgrad import sweep as sw
    from altgrad.runs import saved_config
    runs = sorted(p.parent for p in (ROOT / "outputs").rglob("config.yaml") if (p.parent / "summary.json").exists())
    old = [d for d in runs if "rules:" in (d / "config.yaml").read_text()]
    assert old, "no committed run with the old key"
    for d in old[:40] + [ROOT / "outputs" / "_reference" / "cpu-s42-n500"]:
        action, run, why = sw.run_plan(d, saved_config(d))
        assert action == "reuse" and run is not None, (d, why)
