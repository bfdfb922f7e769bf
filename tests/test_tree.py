"The tracked tree stays lean: a budget on its size, and no checkpoint, W&B folder, raw log or prepared data."
import re, subprocess
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
BUDGET = 25 * 2**20          # bytes (each study one dataset, room left for the next); the GPU machine's copy limit is 64 MiB
FORBIDDEN = [(r"(^|/)checkpoints?(\.[^/]*)?/|\.pt$", "a checkpoint"), (r"(^|/)wandb/", "a W&B folder"),
             (r"(^|/)metrics(\.[^/]*)?\.jsonl$", "raw per-step metrics (commit the compact metrics.parquet)"),
             (r"(^|/)(data|data_prepared)/|\.bin$|(^|/)_data/", "prepared data (altgrad-prepare makes it again)"),
             (r"^outputs/.*/runs/[^/]+/", "a study's run folder (commit the study as one dataset: altgrad.runs.write_dataset)")]

def tracked() -> list[Path]:
    try: out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError): pytest.skip("not a git checkout")
    return [Path(p) for p in out.decode().split("\0") if p]

def test_tracked_tree_within_budget():
    files = tracked()
    sizes = {p: (ROOT / p).stat().st_size for p in files if (ROOT / p).is_file()}
    total = sum(sizes.values())
    big = ", ".join(f"{p} ({s/2**20:.1f} MiB)" for p, s in sorted(sizes.items(), key=lambda kv: -kv[1])[:5])
    assert total <= BUDGET, f"tracked files total {total/2**20:.1f} MiB > {BUDGET/2**20:.0f} MiB; largest: {big}"

def test_no_forbidden_paths():
    bad = [(str(p), why) for p in tracked() for rx, why in FORBIDDEN if re.search(rx, p.as_posix())]
    assert not bad, f"tracked files that must not be committed: {bad[:10]}"

def test_forbidden_patterns_catch_examples():
    "The patterns are live: each example below would be refused."
    examples = ["outputs/E7M0/run/checkpoints/step_100.pt", "outputs/x/run/wandb/run-1/files/a", "outputs/x/run/metrics.jsonl",
                "data/eurlex/train.bin", "outputs/study/_data/eurlex/val.bin", "outputs/study/runs/E0M7-fp32-x1-s42/metrics.parquet"]
    for e in examples: assert any(re.search(rx, e) for rx, _ in FORBIDDEN), e
    for ok in ("outputs/E7M0/run/metrics.parquet", "outputs/study/steps.parquet", "tests/fixtures/study-decisive/runs/a/config.yaml"):
        assert not any(re.search(rx, ok) for rx, _ in FORBIDDEN), ok
