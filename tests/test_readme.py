"The README's library examples run as written: every python block of a README section, in order, in a fresh process."
import json, os, re, subprocess, sys, pathlib
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def python_blocks(text: str, section: str) -> list[str]:
    "The ```python blocks under the level-2 heading `section` (up to the next level-2 heading)."
    m = re.search(rf"^## {re.escape(section)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert m, f"README.md has no section '## {section}'"
    return re.findall(r"^```python\n(.*?)^```", m.group(1), re.S | re.M)


# Each block is compiled under its own name, so a failure's traceback says which block and line failed.
_RUNNER = """
import json, sys
ns = {"__name__": "__main__"}
for i, src in enumerate(json.load(sys.stdin), 1):
    print(f"--- block {i}", flush=True)
    exec(compile(src, f"<README block {i}>", "exec"), ns)
"""


def run_blocks(blocks: list[str], cwd) -> subprocess.CompletedProcess:
    "Run `blocks` in one fresh Python process in `cwd` (the installed altgrad, as a reader's own script would)."
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="error::UserWarning")
    return subprocess.run([sys.executable, "-c", _RUNNER], input=json.dumps(blocks), capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=600)


def test_python_blocks_are_found():
    blocks = python_blocks("## A\n```python\nx = 1\n```\n```sh\nls\n```\n## B\n```python\ny\n```\n", "A")
    assert blocks == ["x = 1\n"]
    with pytest.raises(AssertionError, match="no section"): python_blocks("## A\n", "Missing")


def test_runner_fails_on_a_raising_block(tmp_path):
    out = run_blocks(["x = 1\n", "raise ValueError('boom')\n"], tmp_path)
    assert out.returncode != 0 and '<README block 2>' in out.stderr and "boom" in out.stderr


@pytest.mark.parametrize("section, n", [("Use", 1), ("Use altgrad in your own model", 5)])
def test_readme_python_blocks_run(section, n, tmp_path):
    "The section's python blocks run, top to bottom, in one fresh process (as a reader pastes them), with no warning."
    blocks = python_blocks(README.read_text(), section)
    assert len(blocks) == n, f"README section '{section}' has {len(blocks)} python blocks, expected {n}"
    out = run_blocks(blocks, tmp_path)
    assert out.returncode == 0, f"README section '{section}' failed:\n{out.stdout[-3000:]}\n{out.stderr[-6000:]}"
    if section == "Use altgrad in your own model":      # what the prose claims about the printed results
        got = dict(re.findall(r"^E7M0 (\w+) +loss ([\d.]+)", out.stdout, re.M))
        assert set(got) == {"nearest", "stochastic", "kahan"}, out.stdout
        assert float(got["nearest"]) > 2 * max(float(got["stochastic"]), float(got["kahan"])), out.stdout
        assert "weights on the grid: True" in out.stdout, out.stdout
