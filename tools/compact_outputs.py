"""Convert the committed `outputs/` to the compact run format: a conversion, not retraining.

- every run folder (config.yaml + metrics) is rewritten by `altgrad.tracking.compact_run`:
  the main job's write-up runs (`outputs/<FMT>/run`) keep every column and their histograms (their report draws them);
  study runs (`outputs/study*/runs/*`) are read through their totals only (`layers=False`);
  every other run (sweep cells, references) keeps the per-layer columns a sweep summary reads;
- the sweep cells' own write-ups (executed notebook, figures, report.md) are removed: only the main job keeps its write-up;
- every value a reader uses is checked by `compact_run` before anything is deleted.

Run from the repository root: `python tools/compact_outputs.py outputs`, then regenerate the write-ups
(`altgrad-report outputs`, `altgrad-study --out outputs/study --report-only`, the same for outputs/study-x1).
"""
import shutil, sys, json
from pathlib import Path
from altgrad.tracking import compact_run, METRICS_COMPACT, METRICS_JSONL

WRITEUP_FILES = ("run_format.ipynb", "figures", "report.md")   # report_inputs.json stays: the sweep summary reads its reference and unigram

def run_dirs(root: Path):
    for cfg in sorted(root.rglob("config.yaml")):
        d = cfg.parent
        if (d / METRICS_COMPACT).exists() or (d / METRICS_JSONL).exists(): yield d

def kind(d: Path, root: Path) -> str:
    rel = d.relative_to(root).parts
    if len(rel) == 2 and rel[1] == "run" and (d.parent / "run_format.ipynb").exists(): return "writeup"
    if rel[0].startswith("study") and "runs" in rel: return "study"
    return "sweep"

def main(root="outputs"):
    root = Path(root); tot_b = tot_a = 0; counts = {}
    for d in run_dirs(root):
        k = kind(d, root)
        s = compact_run(d, keep_histograms=(k == "writeup"), layers=(k != "study"))
        tot_b += s["before"]; tot_a += s["after"]; counts[k] = counts.get(k, 0) + 1
    removed = 0
    for nb in sorted(root.rglob("run_format.ipynb")):
        cell = nb.parent
        if cell.parent == root: continue                      # the main job's write-ups stay whole
        for f in WRITEUP_FILES:
            p = cell / f
            if p.is_dir(): removed += sum(q.stat().st_size for q in p.rglob("*") if q.is_file()); shutil.rmtree(p)
            elif p.exists(): removed += p.stat().st_size; p.unlink()
    old = "every cell's write-up is `<regime>/<format>/report.md`"
    new = "the cells keep their runs (`<regime>/<format>/run/`) only: write-ups are kept for the main job's formats"
    for p in list(root.rglob("summary.md")) + list(root.rglob("matrix.json")):   # the stored matrix note says where write-ups are
        t = p.read_text()
        if old in t: p.write_text(t.replace(old, new))
    print(json.dumps(dict(runs=counts, run_bytes_before=tot_b, run_bytes_after=tot_a, writeup_bytes_removed=removed)))

if __name__ == "__main__": main(*sys.argv[1:])
