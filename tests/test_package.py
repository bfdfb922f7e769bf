"""System checks across the package: notebooks and modules in sync, the engine usable from a fresh process."""
import subprocess, sys, pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_modules_match_notebooks(tmp_path):
    "nbdev_export of nbs/ reproduces altgrad/*.py exactly."
    before = {p.name: p.read_text() for p in (ROOT / "altgrad").glob("*.py")}
    subprocess.run([sys.executable, "-c", "from nbdev.doclinks import nbdev_export; nbdev_export()"], cwd=ROOT, check=True)
    after = {p.name: p.read_text() for p in (ROOT / "altgrad").glob("*.py")}
    assert before == after


def test_unknown_format_lists_valid_ones():
    out = subprocess.run([sys.executable, "-c", "from altgrad.formats import get_format; get_format('E9M9')"],
                         capture_output=True, text=True)
    assert out.returncode != 0 and "valid formats: E5M2, E4M3, E3M4, E1M6, E0M7, E7M0" in out.stderr
