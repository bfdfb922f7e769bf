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


def test_readme_is_generated_from_index():
    "README.md is nbs/index.ipynb rendered by nbconvert (regenerate with the command in the assertion message)."
    cmd = [sys.executable, "-m", "nbconvert", "--to", "markdown", "--stdout", str(ROOT / "nbs" / "index.ipynb")]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    assert out == (ROOT / "README.md").read_text(), \
        "README.md is stale: run `jupyter nbconvert --to markdown --stdout nbs/index.ipynb > README.md`"


def test_notebooks_open_with_a_kernel(tmp_path):
    "Every notebook names the Python 3 kernel (JupyterLab opens it ready to run), and nbdev_clean keeps it."
    import json, shutil
    for nb in sorted((ROOT / "nbs").glob("*.ipynb")):
        copy = tmp_path / nb.name
        shutil.copy(nb, copy)
        subprocess.run(["nbdev_clean", "--fname", str(copy)], cwd=ROOT, check=True, capture_output=True)
        for p in (nb, copy):
            ks = json.loads(p.read_text())["metadata"].get("kernelspec") or {}
            assert ks.get("name") == "python3" and ks.get("language") == "python", f"{p.name}: kernelspec {ks!r}"
