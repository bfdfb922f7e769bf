"""Pack the committed studies of many small run folders into one dataset each: a conversion, not retraining.

- `outputs/study` (the decisive study, 432 runs under runs/<name>/) -> outputs/study/{runs.parquet, steps.parquet, alerts.parquet},
  keeping the per-step columns its answer reads (`altgrad.answer.STUDY_COLUMNS`: val/loss and the update mechanism's totals);
- the sweep cells `outputs/regimes/<regime>/<format>/run` and `outputs/weights-on-grid/<format>/run` -> one dataset per sweep
  command's --out (`outputs/regimes`, `outputs/weights-on-grid`), keeping every column the sweep summaries read
  (`SWEEP_COLUMNS`: the compact run format's totals and the per-layer overflow; not the per-layer underflow, stall and
  lost-update columns, which no summary reads); the references (`_reference/`) stay folders;
- every run's summary, config and alerts are kept whole, and every kept value is read back and compared with its folder
  (by `altgrad.runs.write_dataset`, and again here) before a folder is removed.

The columns left out stay in git history: `git show 88d98cb:outputs/study/runs/<name>/metrics.parquet` (the commit before this one).
Run from the repository root: `python tools/pack_outputs.py` (add `--keep-folders` to pack without removing), then
regenerate (`altgrad-study --out outputs/study --report-only`, `altgrad-report outputs`) and check `git status` is clean.
"""
import fnmatch, json, shutil, sys
from pathlib import Path
from altgrad.runs import load_run, run_folders, write_dataset, _dataset_run, _same_run
from altgrad.answer import STUDY_COLUMNS
from altgrad.tracking import COMPACT_COLUMNS

SWEEP_COLUMNS = (*COMPACT_COLUMNS, "overflow/*", "grad_cos_sim/*.weight", "grad_norm_l2/*")
PACKS = {"outputs/study": STUDY_COLUMNS, "outputs/regimes": SWEEP_COLUMNS, "outputs/weights-on-grid": SWEEP_COLUMNS}

def kept(k: str, keep) -> bool: return k == "step" or any(fnmatch.fnmatchcase(k, p) for p in keep)

def pack(folder: Path, keep, remove: bool) -> dict:
    runs = run_folders(folder)
    before = {r: load_run(r) for r in runs}
    dropped = sorted({k for run in before.values() for m in run.metrics for k in m if not kept(k, keep)})
    res = write_dataset(folder, runs, keep=keep)
    for r, b in before.items():                       # again, independently of write_dataset's own check
        name = r.relative_to(folder).as_posix()
        a = _dataset_run(r, folder, name)
        b.metrics = [{k: v for k, v in m.items() if kept(k, keep)} for m in b.metrics]
        if not _same_run(a, b): raise SystemExit(f"{r}: the dataset row differs from the folder; nothing removed")
    if remove:
        for r in runs: shutil.rmtree(r)
    return dict(res, folders=len(runs), dropped_columns=len(dropped), dropped_examples=dropped[:4])

def main(argv) -> int:
    remove = "--keep-folders" not in argv
    for f, keep in PACKS.items():
        print(f, json.dumps(pack(Path(f), keep, remove)))
    return 0

if __name__ == "__main__": sys.exit(main(sys.argv[1:]))
