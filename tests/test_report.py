"""System tests of trustworthy results: a real run's compact metrics, and `altgrad-report` regenerating write-ups and
sweep summaries from committed files alone, byte for byte, in a separate process.

The real run uses the `smoke` preset on a small slice of the shared EurLex sample, prepared into a temporary folder.
"""
import json, math, shutil, subprocess, sys
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _report_cmd() -> list[str]:
    "The `altgrad-report` console script of this environment, or the same entry point through this interpreter."
    exe = BIN / "altgrad-report"
    if exe.exists(): return [str(exe)]
    if shutil.which("altgrad-report"): return [shutil.which("altgrad-report")]
    return [sys.executable, "-c",
            "import sys; from altgrad.sweep_summary import report_cli; sys.exit(report_cli(sys.argv[1:]))"]


def _cli(*args, cwd=ROOT):
    return subprocess.run(_report_cmd() + [str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=600)


def _sweep(root: Path, names=("E7M0", "E5M2")) -> Path:
    "A sweep-like folder: a reference, one write-up per name (run/ + report), the sweep's summary.json and summary.md."
    from altgrad.report import write_report
    from altgrad.testing import write_synthetic_run
    ref = write_synthetic_run(root / "_reference" / "smoke-s42-n50", fmt=None)
    for n, kw in zip(names, (dict(val_factor=1.09, cos=0.8, master_weights="format"), {})):
        write_synthetic_run(root / n / "run", fmt=n, **kw)
        write_report(root / n / "run", ref, root / n, extra_setup={"preset": "smoke"}, unigram=ref_loss(ref) + 2.0)
    (root / "summary.json").write_text(json.dumps([dict(name=n) for n in names]))
    (root / "summary.md").write_text("# Sweep summary\n\nMaster weights: on the 8-bit grid (test).\n")
    return root


def ref_loss(ref_dir) -> float:
    from altgrad.report import load_run
    return load_run(ref_dir).last("val/loss")


def _files(root: Path, names=("report.md", "summary.json", "report_inputs.json")) -> dict:
    return {p.relative_to(root).as_posix(): p.read_bytes() for n in names for p in sorted(root.rglob(n))}


def test_cli_regenerates_writeups_byte_identical(tmp_path):
    "From compact metrics alone (no metrics.jsonl anywhere), in another process and another cwd: the same bytes, twice."
    from altgrad.tracking import compact_metrics
    sw = _sweep(tmp_path / "outputs")
    before = _files(sw)
    assert len([k for k in before if k.endswith("report.md")]) == 2
    for d in [sw / "E7M0" / "run", sw / "E5M2" / "run", *sorted((sw / "_reference").iterdir())]:
        compact_metrics(d, remove_jsonl=True)
    assert not list(sw.rglob("metrics.jsonl"))
    for n in ("E7M0", "E5M2"):
        shutil.rmtree(sw / n / "figures")
        (sw / n / "report.md").write_text("stale\n")   # a write-up (report.md present; without one a cell holds its run only)
    r = _cli(sw, "--no-summary", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert _files(sw) == before
    r2 = _cli(sw.relative_to(tmp_path) / "E7M0", "--no-summary", cwd=tmp_path)
    assert r2.returncode == 0, r2.stdout + r2.stderr
    assert _files(sw) == before
    assert {p.name for p in (sw / "E7M0" / "figures").glob("*.png")} >= {"loss.png", "grad_cosine.png", "stall_heatmap.png"}
    md = (sw / "E7M0" / "report.md").read_text()
    assert "Verdict: INVESTIGATE" in md and "0.800 (not above 0.9)" in md and "Progress lost: **" in md
    assert str(tmp_path) not in md


def test_cli_rewrites_sweep_summary(tmp_path):
    "A sweep folder: the write-ups and summary.md (altgrad.sweep_summary.write_summary) come out the same every call."
    sw = _sweep(tmp_path / "outputs")
    r = _cli(sw)
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert "summary.md: rewritten by altgrad.sweep_summary.write_summary" in out, out
    md = (sw / "summary.md").read_text()
    assert "[E7M0](E7M0/report.md)" in md and "Master weights: on the 8-bit grid (test)." in md
    first = _files(sw, ("report.md", "summary.md", "summary.json"))
    r = _cli(sw)
    assert r.returncode == 0 and _files(sw, ("report.md", "summary.md", "summary.json")) == first


def test_cli_bad_paths(tmp_path):
    r = _cli(tmp_path / "missing")
    assert r.returncode == 2 and "is not a folder" in r.stderr
    r = _cli(tmp_path)
    assert r.returncode == 2 and "no write-up under" in r.stderr and "run/config.yaml" in r.stderr
    # a write-up whose run has no metrics at all (committed before compact metrics existed) is skipped, status 1
    sw = _sweep(tmp_path / "outputs", names=("E7M0",))
    (sw / "E7M0" / "run" / "metrics.jsonl").unlink()
    r = _cli(sw, "--no-summary")
    assert r.returncode == 1 and "neither metrics.jsonl nor metrics.parquet" in r.stderr
    # ... and the sweep summary is left alone rather than rewritten with the run missing
    before = (sw / "summary.md").read_bytes()
    r = _cli(sw)
    assert r.returncode == 1 and "summary.md left as it is" in r.stderr and (sw / "summary.md").read_bytes() == before


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from altgrad.data import shared_data_dir, prepare_eurlex
    sd = shared_data_dir(ROOT)
    if sd is None or not (sd / "eurlex").is_dir():
        pytest.skip("no shared EurLex sample: set ALTGRAD_SHARED_DATA to the folder holding eurlex/")
    out = tmp_path_factory.mktemp("data") / "eurlex"
    prepare_eurlex(out, source=sd / "eurlex", max_docs=40, progress=False)
    return out


def test_real_run_compact_metrics(data, tmp_path):
    "A real 8-bit smoke run: the tracker writes metrics.parquet at the end, identical to metrics.jsonl (NaN-safe), "
    "and the run's summary row is the same from either file."
    from altgrad.config import load_config
    from altgrad.trainer import Trainer
    from altgrad.tracking import read_metrics, read_metrics_compact, same_records, metrics_file, compact_info
    from altgrad.report import load_run, run_summary
    out = tmp_path / "run"
    cfg = load_config("smoke", data_dir=str(data), out_dir=str(out), fmt="E5M2", max_steps=6, eval_interval=3,
                      checkpoint_interval=100, wandb_mode="disabled")
    Trainer(cfg, progress=False).fit()
    jsonl, compact = out / "metrics.jsonl", out / "metrics.parquet"
    assert compact.exists() and compact_info(compact)["source_bytes"] == jsonl.stat().st_size
    a, b = read_metrics(jsonl), read_metrics_compact(compact)
    assert len(a) == 6 and same_records(a, b) and len(a[0]) > 100
    assert compact.stat().st_size < jsonl.stat().st_size
    s1 = run_summary(load_run(out))
    jsonl.unlink()
    assert metrics_file(out) == compact
    s2 = run_summary(load_run(out))
    assert json.dumps(s1, default=str) == json.dumps(s2, default=str)
    assert s1["quantized_layers"] is not None and s1["finished"] is True


def test_cli_regenerates_regime_matrix(tmp_path):
    "A folder of weights-on-grid sweeps, one per update regime: `altgrad-report` rewrites each sweep, then the matrix."
    from altgrad.report import write_report
    from altgrad.testing import write_synthetic_run
    from altgrad.matrix import write_matrix
    root = tmp_path / "regimes"
    for regime, wu, factors in (("nearest", "nearest", (1.09, 1.02)), ("kahan", "kahan", (1.03, 1.01))):
        sw = root / regime
        ref = write_synthetic_run(sw / "_reference" / "smoke-s42-n50", fmt=None)
        for fmt, vf in zip(("E7M0", "E5M2"), factors):
            write_synthetic_run(sw / fmt / "run", fmt=fmt, val_factor=vf, master_weights="format", weight_update=wu,
                                mechanism=True)
            write_report(sw / fmt / "run", ref, sw / fmt, extra_setup={"preset": "smoke"}, unigram=ref_loss(ref) + 2.0)
        (sw / "summary.json").write_text(json.dumps([dict(name=n) for n in ("E7M0", "E5M2")]))
        (sw / "summary.md").write_text("# Sweep summary\n\nMaster weights: on the 8-bit grid (test).\n")
        r = _cli(sw)
        assert r.returncode == 0 and "rewritten by altgrad.sweep_summary.write_summary" in r.stdout, r.stdout + r.stderr
    write_matrix(root, note="Settings: synthetic.")
    first = _files(root, ("summary.md", "matrix.json"))
    (root / "summary.md").unlink(); (root / "matrix.png").unlink()
    r = _cli(root)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "No artists with labels" not in r.stderr and "Warning" not in r.stderr, r.stderr
    assert _files(root, ("summary.md", "matrix.json")) == first and (root / "matrix.png").exists()
    md = (root / "summary.md").read_text()
    assert "| format | nearest | kahan |" in md and "Settings: synthetic." in md
    m = json.loads((root / "matrix.json").read_text())
    loss = m["metrics"]["final_val_loss"]
    assert loss["E7M0"]["nearest"] > loss["E7M0"]["kahan"] and loss["E5M2"]["nearest"] > loss["E5M2"]["kahan"]
    assert m["metrics"]["mean_stall"]["E7M0"]["kahan"] is not None


def test_lean_run_folder_regenerates(tmp_path):
    "A write-up whose run keeps only what the lean tree keeps (compact metrics and alerts, no histograms.json) renders "
    "the same report, minus the histogram figure."
    from altgrad.report import write_report
    from altgrad.testing import write_synthetic_run
    from altgrad.tracking import compact_run
    sw = _sweep(tmp_path / "outputs", names=("E5M2",))
    run = sw / "E5M2" / "run"
    compact_run(run, keep_histograms=True); (run / "histograms.json").unlink()
    assert {p.name for p in run.iterdir()} >= {"metrics.parquet", "alerts.parquet"} and not list(run.glob("*.jsonl"))
    r = _cli(sw / "E5M2", "--no-summary")
    assert r.returncode == 0, r.stdout + r.stderr
    md = (sw / "E5M2" / "report.md").read_text()
    assert "## Code histograms\n\nNot available for this run" in md and "Verdict: " in md


def _committed_md() -> list[Path]:
    "Every tracked markdown file under outputs/ still in the working tree."
    out = subprocess.run(["git", "ls-files", "outputs"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split("\n")
    return [ROOT / p for p in out if p.endswith(".md") and (ROOT / p).exists()]


def _relative_targets(md: Path) -> list[str]:
    "The relative link and image targets `](target)` of `md` (no URLs, no in-page anchors; fragments dropped)."
    import re
    targets = re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", md.read_text())
    return [t.split("#")[0] for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t) and not t.startswith("#")]


def test_relative_targets_parsed(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("[a](b/report.md) ![f](figures/x.png \"t\") [w](https://x.org/y) [s](#sec) [r](../E1M6/run#top)\n")
    assert _relative_targets(md) == ["b/report.md", "figures/x.png", "../E1M6/run"]


def test_committed_writeups_have_no_dangling_links():
    "Every relative link or image in a committed outputs/**/*.md points at a file or folder that exists."
    mds = _committed_md()
    if not mds: pytest.skip("no committed outputs/ in this checkout")
    dangling = [f"{md.relative_to(ROOT)} -> {t}" for md in mds for t in _relative_targets(md) if not (md.parent / t).exists()]
    assert not dangling, "dangling links:\n" + "\n".join(dangling)
