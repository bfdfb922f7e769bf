"""`tools/compile_drift.py`'s arithmetic on made-up curves (its real run, on the study preset, is committed as
`outputs/bench/compile-drift.json`; a smoke run costs two compilations, about 30 s, so it is left to the tool)."""
import importlib.util
from pathlib import Path
import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "tools" / "compile_drift.py"
spec = importlib.util.spec_from_file_location("compile_drift", SCRIPT)
cd = importlib.util.module_from_spec(spec); spec.loader.exec_module(cd)


def test_drift_figures():
    d = cd.drift({"eager": [5.0, 4.0, 3.0, 2.5], "compiled": [5.0, 4.0, 3.25, 2.375]})
    assert d["first_differing_step"] == 3 and d["max_abs_diff"] == 0.25 and d["final_abs_diff"] == 0.125
    assert d["final_loss"] == {"eager": 2.5, "compiled": 2.375}
    same = cd.drift({"eager": [1.0, 2.0], "compiled": [1.0, 2.0]})
    assert same["first_differing_step"] is None and same["max_abs_diff"] == 0 == same["final_abs_diff"]


def test_bad_steps_is_refused(capsys):
    with pytest.raises(SystemExit):
        cd.main(["--out", "/nonexistent/x.json", "--steps", "0"])
    assert "--steps must be >= 1" in capsys.readouterr().err
