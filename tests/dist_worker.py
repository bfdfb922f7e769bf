"""Run by tests/test_distributed.py under `torchrun`: train a `smoke` config with the `Trainer` API, then dump this
rank's model state (weights, scales, amax histories, grid scales) to DUMP/rank<r>.pt and the scale every quantizer
used at every step ({step: {'<layer>.<role>': scale}}, read after the step's amax commit) to DUMP/scales<r>.pt.

    torchrun --nproc_per_node 2 tests/dist_worker.py DUMP key=value ...

`DIST_WORKER_STALL=R:S` makes rank R stop answering after the backward of step S (it writes DUMP/stalled<R> with its
pid and sleeps): the test then kills it (or sends it SIGTERM, which `sigterm_as_exit` turns into SystemExit, as in
`altgrad-train`), or lets the collective timeout end the job. `DIST_WORKER_NAN=R:S` puts a NaN
into one gradient of rank R only, after DDP's all-reduce of step S (the other rank's gradients stay finite).
"""
import os, sys, time
from pathlib import Path
import torch
from altgrad.config import load_config, parse_overrides
from altgrad.distributed import destroy_distributed, sigterm_as_exit
from altgrad.trainer import Trainer


def main():
    dump, *over = sys.argv[1:]
    dump = Path(dump); dump.mkdir(parents=True, exist_ok=True)
    stall, nan = os.environ.get("DIST_WORKER_STALL"), os.environ.get("DIST_WORKER_NAN")
    box, scales = {}, {}

    def fault(step, model):
        from altgrad.quantized import quantized_layers
        scales[step] = {f"{n}.{role}": q.scale.detach().cpu().clone()
                        for n, m in quantized_layers(model) for role, q in m.quantizers().items()}
        if nan:
            r, s = map(int, nan.split(":"))
            if box["t"].rank == r and step == s: next(model.parameters()).grad.view(-1)[0] = float("nan")
        if stall:
            r, s = map(int, stall.split(":"))
            if box["t"].rank == r and step == s:
                (dump / f"stalled{r}").write_text(str(os.getpid()))
                time.sleep(600)

    t = box["t"] = Trainer(load_config("smoke", **parse_overrides(over)), fault=fault, progress=False)
    with sigterm_as_exit(t.world > 1): t.fit()
    torch.save(scales, dump / f"scales{t.rank}.pt")
    torch.save({k: v.detach().cpu().clone() for k, v in t.model.state_dict().items() if torch.is_tensor(v)}, dump / f"rank{t.rank}.pt")
    destroy_distributed()


if __name__ == "__main__":
    main()
