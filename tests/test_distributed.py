"""Data-parallel training through `torchrun` (gloo, 2 CPU processes): the same batches and metrics as one process with
`grad_accum=2`, the same scales and weights on every rank, a dead, stuck or terminated rank ends the job, exact resume.

Each test launches real `torchrun --nproc_per_node 2` jobs of the `smoke` preset (a few steps) on a small slice of the
shared EurLex sample (`small_data` in conftest.py). The collective timeout is short (`ALTGRAD_DIST_TIMEOUT`).
"""
import json, math, os, signal, socket, subprocess, sys, time
from pathlib import Path
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "dist_worker.py"
TIMEOUT = 20          # seconds a collective may wait in these tests
STEPS = ["max_steps=6", "eval_interval=3", "checkpoint_interval=3", "batch_size=2", "wandb_mode=disabled"]
# E4M3, delayed scaling, 8-bit weight gradients and a one-step amax history: the dW amax of a checkpointed step is
# still pending (pushed by the next step), so exact resume needs it from the checkpoint
RUN = ["fmt=E4M3", "quantize_grads=true", "amax_history_len=1"]


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


def _worker(data, out, dump, *extra, scales=False, **env):
    r = _run(_torchrun(WORKER, dump, f"data_dir={data}", f"out_dir={out}", *STEPS, *extra), **env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    states = [torch.load(Path(dump) / f"rank{i}.pt") for i in range(2)]
    return (states, [torch.load(Path(dump) / f"scales{i}.pt") for i in range(2)]) if scales else states


@pytest.fixture(scope="module")
def two_ranks(small_data, tmp_path_factory):
    """An uninterrupted 2-rank run of `RUN` (2 sequences per rank, 6 steps, checkpoints every 3): its folder, each rank's
    final state and each rank's scales at every step."""
    tmp = tmp_path_factory.mktemp("ddp")
    states, scales = _worker(small_data, tmp / "run", tmp / "dump", *RUN, scales=True)
    return tmp / "run", states, scales


@pytest.fixture(scope="module")
def one_process(small_data, tmp_path_factory):
    "The same global batch in one plain process (this pytest process, one thread as each rank, no torchrun): batch 2 x grad_accum 2."
    from altgrad.config import load_config, parse_overrides
    from altgrad.trainer import Trainer
    out = tmp_path_factory.mktemp("one") / "run"
    cfg = load_config("smoke", **parse_overrides([f"data_dir={small_data}", f"out_dir={out}", *STEPS, *RUN, "grad_accum=2"]))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)              # as the torchrun workers (OMP_NUM_THREADS=1): the same reduction order
    try: Trainer(cfg, progress=False).fit()
    finally: torch.set_num_threads(threads)
    return out


def _numeric(run_dir) -> dict:
    "{step: {key: value}} of every numeric logged metric but the timings (perf/*)."
    from altgrad.tracking import read_metrics
    return {r["step"]: {k: float(v) for k, v in r.items() if k not in ("step", "time") and not k.startswith("perf/")
                        and isinstance(v, (int, float)) and not isinstance(v, bool)}
            for r in read_metrics(Path(run_dir), merge=True)}


def test_two_ranks_match_one_process_with_grad_accum(two_ranks, one_process):
    """2 ranks x batch 2 = 1 process x batch 2 x grad_accum 2: same batches, every logged metric within 1e-5 relative;
    W scales equal on both ranks at every step, A and G scales from step 2 on (step 1: each rank's own amax)."""
    run, (s0, s1), (sc0, sc1) = two_ranks
    one, two = _numeric(one_process), _numeric(run)
    assert sorted(two) == sorted(one) == list(range(1, 7))
    for s in one:
        assert set(two[s]) == set(one[s]), (s, set(two[s]) ^ set(one[s]))
        off = {k: (two[s][k], one[s][k]) for k in one[s]
               if not abs(two[s][k] - one[s][k]) <= 1e-5 * max(abs(one[s][k]), abs(two[s][k])) and
               not (math.isnan(one[s][k]) and math.isnan(two[s][k]))}
        assert not off, (s, off)
    assert "val/loss" in two[6] and len(two[6]) > 100
    # the scales each rank used, step by step
    assert sorted(sc0) == sorted(sc1) == list(range(1, 7))
    roles = lambda *rs: [k for k in sc0[1] if k.rsplit(".", 1)[1] in rs]
    assert len(roles("w")) == len(roles("a")) == len(roles("g")) == len(roles("dw")) == 8
    for step in range(1, 7):
        for k in roles("w", "dw") + (roles("a", "g") if step >= 2 else []):
            assert torch.equal(sc0[step][k], sc1[step][k]), (step, k, sc0[step][k], sc1[step][k])
    assert any(not torch.equal(sc0[1][k], sc1[1][k]) for k in roles("a", "g"))    # the documented step-1 exception
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["global_batch"] == 4 and summary["final_step"] == 6
    assert json.loads((one_process / "summary.json").read_text())["global_batch"] == 4
    # every scale, amax history and weight is the same on both ranks (bit for bit)
    scales = [k for k in s0 if k.endswith((".scale", ".history", ".grid_scale"))]
    assert len([k for k in scales if k.endswith(".scale") and s0[k].numel()]) == 8 * 4      # W, A, G, dW of 8 layers
    assert set(s0) == set(s1)
    assert [k for k in s0 if not torch.equal(s0[k], s1[k])] == []
    # only rank 0 wrote the run folder's files (one metrics line per logged step)
    assert len([ln for ln in (run / "metrics.jsonl").read_text().splitlines() if ln.strip()]) == 6


def test_one_worker_is_the_single_process_run(one_process, small_data, tmp_path):
    "torchrun with one worker (WORLD_SIZE=1) takes the single-process path: every logged metric bit-identical."
    from altgrad.tracking import read_metrics
    r = _run(_torchrun("-m", "altgrad.trainer", "smoke", f"data_dir={small_data}", f"out_dir={tmp_path / 'run'}", *STEPS,
                       *RUN, "grad_accum=2", "--no-progress", n=1))
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
    anomaly = torch.load(tmp_path / "run" / "checkpoints" / "anomaly_step_000003.pt", weights_only=False)   # by rank 0
    batches = anomaly["anomaly"]["batches"]                   # both ranks' micro-batches, rank 1's (the NaN one) included
    assert len(batches) == 2 and batches[0][0].shape == (2, 32) and not torch.equal(batches[0][0], batches[1][0])
    grid = [k for k in s0 if k.endswith("grid_scale")]
    assert len(grid) == 8 and all(s0[k].numel() for k in grid)
    assert [k for k in s0 if not torch.equal(s0[k], s1[k])] == []


def _wait_for(path: Path, p: subprocess.Popen, limit=120):
    deadline = time.monotonic() + limit
    while not path.exists():
        assert p.poll() is None, f"the job exited ({p.returncode}) early: {p.communicate()[1][-3000:]}"
        assert time.monotonic() < deadline, f"{path} did not appear within {limit} s"
        time.sleep(0.05)


def test_current_scaling_stochastic_accumulation_ranks_agree(small_data, tmp_path):
    """Current scaling, stochastic rounding, grad_accum=2 and 8-bit weight gradients on 2 ranks: no deadlock, every
    scale equal on both ranks at every step (current A/G amaxes are max-reduced), final states bit-equal."""
    (s0, s1), (sc0, sc1) = _worker(small_data, tmp_path / "run", tmp_path / "dump", "fmt=E4M3", "scaling=current",
                                   "rounding=stochastic", "grad_accum=2", "quantize_grads=true", "shadow=false", scales=True)
    assert _losses(tmp_path / "run")[6] > 0
    assert [k for k in s0 if not torch.equal(s0[k], s1[k])] == []
    assert [(st, k) for st in sc0 for k in sc0[st] if not torch.equal(sc0[st][k], sc1[st][k])] == []


def test_killed_rank_ends_job_and_resume_is_exact(two_ranks, small_data, tmp_path):
    """kill -9 rank 1 mid-run: the job fails within the timeout; resuming on 2 ranks reproduces the uninterrupted
    losses (with 8-bit weight gradients: their pending amax comes back from the checkpoint)."""
    ref = two_ranks[0]
    run, dump = tmp_path / "run", tmp_path / "dump"
    cmd = _torchrun(WORKER, dump, f"data_dir={small_data}", f"out_dir={run}", *STEPS, *RUN)
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

    r = _run(_torchrun("-m", "altgrad.trainer", "smoke", f"data_dir={small_data}", f"out_dir={run}", *STEPS, *RUN,
                       "resume=true", "--no-progress"))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_step"] == 6 and summary["resumed_from"].endswith("step_000003.pt") and summary["world_size"] == 2
    want, got = _losses(ref), _losses(run)
    assert sorted(got) == list(range(1, 7)) and [got[s] for s in range(1, 7)] == [want[s] for s in range(1, 7)]
    assert _losses(run, "val/loss") == _losses(ref, "val/loss")


def test_sigterm_runs_cleanup(small_data, tmp_path):
    """SIGTERM (how torchrun stops surviving ranks) becomes SystemExit: rank 0's `fit` still writes summary.json with the
    reason, and the job ends (rank 1 loses its peer) without waiting for the collective timeout."""
    run, dump = tmp_path / "run", tmp_path / "dump"
    cmd = _torchrun(WORKER, dump, f"data_dir={small_data}", f"out_dir={run}", *STEPS, "fmt=E4M3", "shadow=false")
    p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=_env(DIST_WORKER_STALL="0:2"))
    try:
        _wait_for(dump / "stalled0", p)
        os.kill(int((dump / "stalled0").read_text()), signal.SIGTERM)
        _, err = p.communicate(timeout=TIMEOUT + 60)
    finally:
        if p.poll() is None: p.kill(); p.communicate()
    assert p.returncode != 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_step"] == 1 and summary["stopped_reason"].startswith("terminated: rank 0 of 2 got SIGTERM"), summary


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
