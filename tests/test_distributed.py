"""Data-parallel training through `torchrun` (gloo, 2 CPU processes): the same batches and losses as one process with
`grad_accum=2`, the same scales and weights on every rank, a dead or stuck rank ends the job, exact resume.

Each test launches real `torchrun --nproc_per_node 2` jobs of the `smoke` preset (a few steps) on a small slice of the
shared EurLex sample (`small_data` in conftest.py). The collective timeout is short (`ALTGRAD_DIST_TIMEOUT`).
"""
import json, os, signal, socket, subprocess, sys, time
from pathlib import Path
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "dist_worker.py"
TIMEOUT = 20          # seconds a collective may wait in these tests
STEPS = ["max_steps=6", "eval_interval=3", "checkpoint_interval=3", "batch_size=2", "wandb_mode=disabled"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); return s.getsockname()[1]


def _env(**extra) -> dict:
    env = {**os.environ, "ALTGRAD_DIST_TIMEOUT": str(TIMEOUT), "OMP_NUM_THREADS": "1", **extra}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def _torchrun(*args, n=2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(n), "--master_addr", "127.0.0.1",
            "--master_port", str(_port()), *map(str, args)]


def _run(cmd, timeout=240, **env):
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env=_env(**env))


def _losses(run_dir, key="train/loss") -> dict:
    from altgrad.tracking import read_metrics
    return {r["step"]: r[key] for r in read_metrics(Path(run_dir), merge=True) if key in r}


def _worker(data, out, dump, *extra, **env):
    r = _run(_torchrun(WORKER, dump, f"data_dir={data}", f"out_dir={out}", *STEPS, *extra), **env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    return [torch.load(Path(dump) / f"rank{i}.pt") for i in range(2)]


@pytest.fixture(scope="module")
def two_ranks(small_data, tmp_path_factory):
    "An uninterrupted 2-rank E4M3 run (2 sequences per rank, 6 steps, checkpoints every 3) and each rank's final state."
    tmp = tmp_path_factory.mktemp("ddp")
    states = _worker(small_data, tmp / "run", tmp / "dump", "fmt=E4M3")
    return tmp / "run", states


@pytest.fixture(scope="module")
def one_process(small_data, tmp_path_factory):
    "The same global batch in one plain process (this pytest process, no torchrun): batch 2 x grad_accum 2."
    from altgrad.config import load_config, parse_overrides
    from altgrad.trainer import Trainer
    out = tmp_path_factory.mktemp("one") / "run"
    cfg = load_config("smoke", **parse_overrides([f"data_dir={small_data}", f"out_dir={out}", *STEPS, "fmt=E4M3", "grad_accum=2"]))
    Trainer(cfg, progress=False).fit()
    return out


def test_two_ranks_match_one_process_with_grad_accum(two_ranks, one_process):
    "2 ranks x batch 2 = 1 process x batch 2 x grad_accum 2: same batches, losses within 1e-5; same scales on every rank."
    run, (s0, s1) = two_ranks
    one, two = _losses(one_process), _losses(run)
    assert sorted(two) == sorted(one) == list(range(1, 7))
    for s in one: assert abs(two[s] - one[s]) <= 1e-5 * abs(one[s]), (s, two[s], one[s])
    assert abs(_losses(run, "val/loss")[6] - _losses(one_process, "val/loss")[6]) <= 1e-5 * _losses(run, "val/loss")[6]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_batch"] == 4 and summary["final_step"] == 6
    assert json.loads((one_process / "summary.json").read_text())["global_batch"] == 4
    # every scale, amax history and weight is the same on both ranks (bit for bit)
    scales = [k for k in s0 if k.endswith((".scale", ".history", ".grid_scale"))]
    assert len([k for k in scales if k.endswith(".scale") and s0[k].numel()]) == 8 * 3      # W, A, G of 8 layers
    assert set(s0) == set(s1)
    assert [k for k in s0 if not torch.equal(s0[k], s1[k])] == []
    # only rank 0 wrote the run folder's files (one metrics line per logged step)
    assert len([ln for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]) == 6


def test_one_worker_is_the_single_process_run(one_process, small_data, tmp_path):
    "torchrun with one worker (WORLD_SIZE=1) takes the single-process path: every logged metric bit-identical."
    from altgrad.tracking import read_metrics
    r = _run(_torchrun("-m", "altgrad.trainer", "smoke", f"data_dir={small_data}", f"out_dir={tmp_path / 'run'}", *STEPS,
                       "fmt=E4M3", "grad_accum=2", "--no-progress", n=1))
    assert r.returncode == 0, r.stderr[-3000:]
    strip = lambda d: [{k: v for k, v in x.items() if not k.startswith("perf/")} for x in read_metrics(d)]
    got, want = strip(tmp_path / "run"), strip(one_process)
    assert len(got) == 6 and json.dumps(got, sort_keys=True) == json.dumps(want, sort_keys=True)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["world_size"] == 1


def test_weights_on_grid_identical_across_ranks(small_data, tmp_path):
    """master_weights=format with stochastic landing: after 20 steps the parameters are bit-equal on both ranks, also
    after a step whose gradient was NaN on rank 1 only (both ranks skipped it: one NaN policy)."""
    s0, s1 = _worker(small_data, tmp_path / "run", tmp_path / "dump", "fmt=E4M3", "master_weights=format",
                     "weight_update=stochastic", "max_steps=20", "eval_interval=20", "checkpoint_interval=20", "shadow=false",
                     DIST_WORKER_NAN="1:3")
    assert _losses(tmp_path / "run")[20] > 0
    skipped = _losses(tmp_path / "run", "train/skipped")
    assert [s for s in skipped if skipped[s]] == [3] and _losses(tmp_path / "run", "nan/streak") == {3: 1}
    assert list((tmp_path / "run" / "checkpoints").glob("anomaly_step_000003.pt"))       # written once, by rank 0
    grid = [k for k in s0 if k.endswith("grid_scale")]
    assert len(grid) == 8 and all(s0[k].numel() for k in grid)
    assert [k for k in s0 if not torch.equal(s0[k], s1[k])] == []


def _wait_for(path: Path, p: subprocess.Popen, limit=120):
    deadline = time.monotonic() + limit
    while not path.exists():
        assert p.poll() is None, f"the job exited ({p.returncode}) early: {p.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"{path} did not appear within {limit} s"
        time.sleep(0.05)


def test_killed_rank_ends_job_and_resume_is_exact(two_ranks, small_data, tmp_path):
    "kill -9 rank 1 mid-run: the job fails within the timeout; resuming on 2 ranks reproduces the uninterrupted losses."
    ref, _ = two_ranks
    run, dump = tmp_path / "run", tmp_path / "dump"
    cmd = _torchrun(WORKER, dump, f"data_dir={small_data}", f"out_dir={run}", *STEPS, "fmt=E4M3")
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=_env(DIST_WORKER_STALL="1:5"))
    try:
        _wait_for(dump / "stalled1", p)
        assert (run / "checkpoints" / "step_000003.pt").exists()
        os.kill(int((dump / "stalled1").read_text()), signal.SIGKILL)
        t0 = time.monotonic()
        _, err = p.communicate(timeout=TIMEOUT + 60)
        took = time.monotonic() - t0
    finally:
        if p.poll() is None: p.kill(); p.communicate()
    assert p.returncode != 0 and took < TIMEOUT + 30, (p.returncode, took)
    assert "SIGKILL" in err or "Signal 9" in err, err[-3000:]                 # torchrun names the dead rank
    assert not (run / "summary.json").exists() or json.loads((run / "summary.json").read_text())["final_step"] < 6

    r = _run(_torchrun("-m", "altgrad.trainer", "smoke", f"data_dir={small_data}", f"out_dir={run}", *STEPS, "fmt=E4M3",
                       "resume=true", "--no-progress"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_step"] == 6 and summary["resumed_from"].endswith("step_000003.pt") and summary["world_size"] == 2
    want, got = _losses(ref), _losses(run)
    assert sorted(got) == list(range(1, 7)) and [got[s] for s in range(1, 7)] == [want[s] for s in range(1, 7)]
    assert _losses(run, "val/loss") == _losses(ref, "val/loss")


def test_stuck_rank_times_out(small_data, tmp_path):
    "A rank that stops answering (alive, not dead) makes the others fail after ALTGRAD_DIST_TIMEOUT: no hang."
    cmd = _torchrun(WORKER, tmp_path / "dump", f"data_dir={small_data}", f"out_dir={tmp_path / 'run'}", *STEPS, "fmt=E4M3")
    t0 = time.monotonic()
    r = _run(cmd, timeout=TIMEOUT + 120, DIST_WORKER_STALL="1:2", ALTGRAD_DIST_TIMEOUT="8")
    assert r.returncode != 0 and time.monotonic() - t0 < 8 + 90
    assert "DistributedError" in r.stderr and "rank 0 of 2" in r.stderr and "ALTGRAD_DIST_TIMEOUT=8" in r.stderr, r.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (nccl does not run two ranks on one GPU)")
def test_nccl_two_gpus_match_one_process(small_data, tmp_path):
    "On 2 GPUs (nccl): the 2-rank run matches one process with grad_accum=2 and the ranks hold identical states."
    s0, s1 = _worker(small_data, tmp_path / "two", tmp_path / "dump", "fmt=E4M3", "device=cuda", "precision=fp32")
    assert [k for k in s0 if not torch.equal(s0[k], s1[k])] == []
    r = _run(_torchrun("-m", "altgrad.trainer", "smoke", f"data_dir={small_data}", f"out_dir={tmp_path / 'one'}", *STEPS,
                       "fmt=E4M3", "device=cuda", "precision=fp32", "grad_accum=2", "--no-progress", n=1))
    assert r.returncode == 0, r.stderr[-3000:]
    one, two = _losses(tmp_path / "one"), _losses(tmp_path / "two")
    assert all(abs(two[s] - one[s]) <= 1e-5 * abs(one[s]) for s in one) and len(one) == 6
