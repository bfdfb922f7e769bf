"""The fast step: the step's statistics stay on the device until two batched reads per step (`metrics.HostRead`),
and log exactly what the step logged when it read each statistic separately (commit REF), for every registered regime."""
import io, json, os, subprocess, sys, tarfile
from pathlib import Path
import pytest

ROOT = Path(__file__).resolve().parents[1]
REF = "be3f9c5"     # the last commit whose step read each statistic to the host on its own (about 10 reads a step)


def _ref_tree(dest: Path) -> Path:
    "The `altgrad` package as it was at REF, unpacked under `dest` (skip where the repository's history is not there)."
    try: blob = subprocess.run(["git", "-C", str(ROOT), "archive", REF, "altgrad"], capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e: pytest.skip(f"reference commit {REF} not available: {e}")
    dest.mkdir(parents=True)
    tarfile.open(fileobj=io.BytesIO(blob)).extractall(dest, filter="data")
    return dest


def _start(code: Path, out: Path, data: Path) -> subprocess.Popen:
    "tools/bit_identity.py with --metrics (every regime on E4M3 and E7M0, 3 steps, shadow on) against the package in `code`."
    env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, str(ROOT / "tools" / "bit_identity.py"), "run", "--metrics", "--steps", "3",
                             "--out", str(out), "--data", str(data)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_batched_reads_log_the_same_metrics(tmp_path, small_data):
    ref = _ref_tree(tmp_path / "ref")
    procs = {k: (_start(code, tmp_path / f"{k}.json", small_data), tmp_path / f"{k}.json") for k, code in (("ref", ref), ("new", ROOT))}
    res = {}
    for k, (p, out) in procs.items():
        log = p.communicate(timeout=1800)[0].decode(errors="replace")
        assert p.returncode == 0, f"{k}: bit_identity.py failed:\n{log[-3000:]}"
        res[k] = json.loads(out.read_text())["hashes"]
    a, b = res["ref"], res["new"]
    from altgrad.regimes import UPDATE_REGIMES
    assert set(a) == set(b) and len(b) == 2 * len(UPDATE_REGIMES), (sorted(a), sorted(b))
    n = 0
    for k in a:
        assert (a[k]["model"], a[k]["optimizer"]) == (b[k]["model"], b[k]["optimizer"]), f"{k}: the state moved"
        assert len(a[k]["metrics"]) == len(b[k]["metrics"]) == 3, k
        for step, (ma, mb) in enumerate(zip(a[k]["metrics"], b[k]["metrics"]), 1):
            assert list(ma) == list(mb), f"{k} step {step}: other metrics or another order: {set(ma) ^ set(mb)}"
            bad = [m for m in ma if repr(ma[m]) != repr(mb[m])]       # repr: bit for bit (NaN equal to NaN), int vs float
            assert not bad, f"{k} step {step}: {[(m, ma[m], mb[m]) for m in bad[:5]]}"
            n += len(ma)
    assert n > 1000, n


def test_committed_configs_keep_their_step():
    """The fast step: the `compile` switch leaves every committed run's resolved config as it was (each holds
    `compile: false`, which still reads as `off` and is written back as `false`), so `same_config`/`check_run` reuse
    and resume them, the confirmatory study's runs included; a config without the key means `off` as well."""
    import glob, json, yaml
    import pyarrow.parquet as pq
    from altgrad.config import TrainConfig, load_config, missing_keys
    raws = [yaml.safe_load(open(f)) for f in glob.glob(str(ROOT / "outputs/**/config.yaml"), recursive=True)]
    for f in glob.glob(str(ROOT / "outputs/**/runs.parquet"), recursive=True):
        raws += [json.loads(s) if s.lstrip().startswith("{") else yaml.safe_load(s)
                 for s in pq.read_table(f, columns=["config"]).column("config").to_pylist()]
    assert len(raws) > 500, len(raws)
    for raw in raws:
        assert raw["compile"] is False and "compile" not in missing_keys(raw)
    for raw in raws[:: max(1, len(raws) // 25)]:                     # a sample through the whole loader: ~25 configs
        raw = dict(raw); cfg = load_config(raw.pop("preset", None), **raw)
        assert cfg.compile is False and cfg.to_dict()["compile"] is False
    assert TrainConfig().compile is False and TrainConfig(**{}).to_dict()["compile"] is False
