"""System checks across the package: notebooks and modules in sync, the engine usable from a fresh process."""
import ast, subprocess, sys, pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_modules_match_notebooks(tmp_path):
    "nbdev_export of nbs/ reproduces altgrad/*.py exactly (exported into a copy: the tree other tests import stays untouched)."
    import shutil
    for d in ("nbs", "altgrad"): shutil.copytree(ROOT / d, tmp_path / d, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for f in ("settings.ini", "setup.py"): shutil.copy(ROOT / f, tmp_path / f)
    before = {p.name: p.read_text() for p in (ROOT / "altgrad").glob("*.py")}
    for p in (tmp_path / "altgrad").glob("*.py"): p.unlink()                      # every module must come from a notebook
    subprocess.run([sys.executable, "-c", "from nbdev.doclinks import nbdev_export; nbdev_export()"], cwd=tmp_path, check=True)
    after = {p.name: p.read_text() for p in (tmp_path / "altgrad").glob("*.py")}
    assert before == after, sorted(set(before.items()) ^ set(after.items()), key=str)[:2]


def _module_level_imports(body):
    "The altgrad modules imported by statements that run at import time (not inside functions or classes)."
    for n in body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)): continue
        if isinstance(n, ast.Import): yield from (a.name.split(".")[1] for a in n.names if a.name.startswith("altgrad."))
        elif isinstance(n, ast.ImportFrom):
            mod = n.module or ""
            if n.level == 1 and not mod or mod == "altgrad": yield from (a.name for a in n.names)      # from . import x
            elif n.level == 1 or mod.startswith("altgrad."): yield mod.split(".")[-1]
        else:
            for f in ("body", "orelse", "finalbody", "handlers"):
                yield from _module_level_imports(getattr(n, f, []) or [])


def test_notebooks_are_numbered_by_dependency():
    "A module imports, at module level, only modules whose notebooks have lower numbers (imports inside functions may look ahead)."
    import re
    num, deps = {}, {}
    for p in (ROOT / "altgrad").glob("*.py"):
        m = re.search(r"nbs/(\d+)([a-z]?)_\w+\.ipynb", p.read_text())    # 30b_x comes after 30_y, before 31_z
        if not m: continue
        num[p.stem] = (int(m.group(1)), m.group(2))
        deps[p.stem] = set(_module_level_imports(ast.parse(p.read_text()).body))
    assert len(num) >= 20, num
    late = [(m, d) for m, ds in deps.items() for d in ds if d in num and num[d] >= num[m] and d != m]
    assert not late, f"module-level imports of later notebooks: {late}"


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


def test_license_is_apache2():
    "LICENSE is the full, unmodified Apache License 2.0 text that settings.ini declares (license = apache2)."
    import configparser, hashlib
    cfg = configparser.ConfigParser(); cfg.read(ROOT / "settings.ini")
    assert cfg["DEFAULT"]["license"] == "apache2"
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    for heading in ("1. Definitions.", "9. Accepting Warranty or Additional Liability.", "END OF TERMS AND CONDITIONS",
                    "APPENDIX: How to apply the Apache License to your work."):
        assert heading in text, f"LICENSE lacks {heading!r}"
    assert hashlib.sha256(text.encode()).hexdigest() == \
        "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30", "LICENSE differs from the canonical Apache 2.0 text"


def test_notebooks_open_unmodified_in_jupyterlab():
    """Every notebook carries the metadata JupyterLab writes when it opens one, so it opens unmodified.

    JupyterLab adds `language_info` on load when it is missing, then sets `kernelspec` (with the kernel's display name)
    and `language_info` from the started kernel; any difference marks the notebook modified. settings.ini keeps
    `language_info` through `nbdev_clean`, and the install step names the kernel `python3` as `nbdev_clean` writes it
    (`tools/notebook_metadata.py` stamps a new notebook)."""
    import json
    from ipykernel.ipkernel import IPythonKernel
    from jupyter_client.kernelspec import KernelSpecManager
    spec = KernelSpecManager().get_kernel_spec("python3")
    want = {k: v for k, v in IPythonKernel.language_info.items() if k != "version"}   # the Python patch version varies
    nbs = sorted((ROOT / "nbs").glob("*.ipynb"))
    assert len(nbs) > 20
    for p in nbs:
        md = json.loads(p.read_text())["metadata"]
        assert md.get("kernelspec") == dict(display_name=spec.display_name, language=spec.language, name="python3"), (p.name, md, "run: python -m ipykernel install --sys-prefix --name python3 --display-name python3")
        got = dict(md.get("language_info") or {}); got.pop("version", None)
        assert got == want, f"{p.name} language_info {got!r} != {want!r}: run python tools/notebook_metadata.py nbs/*.ipynb"

def test_nbdev_clean_keeps_the_metadata(tmp_path):
    "What JupyterLab writes survives `nbdev_clean` (else the stamp would be undone before every commit)."
    import json, shutil, subprocess, sys
    src = ROOT / "nbs" / "index.ipynb"; dst = tmp_path / "nbs" / src.name
    dst.parent.mkdir(); shutil.copy(src, dst); shutil.copy(ROOT / "settings.ini", tmp_path / "settings.ini")
    before = json.loads(dst.read_text())["metadata"]
    subprocess.run([sys.executable, "-c", "from nbdev.clean import nbdev_clean; nbdev_clean(fname='nbs/index.ipynb')"],
                   cwd=tmp_path, check=True, capture_output=True)
    after = json.loads(dst.read_text())["metadata"]
    assert after.get("language_info") == before.get("language_info") and after.get("kernelspec") == before.get("kernelspec"), (before, after)
