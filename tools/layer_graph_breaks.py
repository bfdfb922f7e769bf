"""Why the 8-bit layer does not compile yet: lift `QuantizedLinear.forward`'s `@torch.compiler.disable` (in this
process only) and list where dynamo breaks the graph of one training forward, by source line (issue 29, item 2).

    python tools/layer_graph_breaks.py [--fmt E4M3] [--rounding nearest|stochastic] [--json OUT]

Nothing in the library changes: the census is the to-do list of a compiled layer (each line must become traceable,
or move outside the compiled region behind a documented boundary)."""
import argparse, json, time
import torch
from altgrad.quantized import QuantizedLinear


def census(fmt: str = "E4M3", rounding: str = "nearest") -> dict:
    "Graphs, breaks and the distinct break sites of one training forward of a lifted `QuantizedLinear`."
    fwd = QuantizedLinear.forward
    QuantizedLinear.forward = getattr(fwd, "__wrapped__", fwd)       # the undecorated forward
    try:
        m = QuantizedLinear(48, 40, fmt=fmt, fmt_backward="E5M2", rounding=rounding, quantize_grads=True)
        t = time.perf_counter()
        ex = torch._dynamo.explain(m)(torch.randn(8, 48, generator=torch.Generator().manual_seed(0)))
        sites = {}
        for b in ex.break_reasons:
            fr = b.user_stack[-1] if b.user_stack else None
            key = f"{fr.filename.split('/')[-1]}:{fr.lineno}" if fr else "?"
            s = sites.setdefault(key, dict(reason=str(b.reason).splitlines()[0][:160],
                                           line=(fr.line or "").strip() if fr else "", count=0))
            s["count"] += 1
        return dict(fmt=fmt, rounding=rounding, graphs=ex.graph_count, breaks=ex.graph_break_count,
                    seconds=round(time.perf_counter() - t, 1), sites=sites)
    finally:
        QuantizedLinear.forward = fwd


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fmt", default="E4M3")
    ap.add_argument("--rounding", default="nearest", choices=("nearest", "stochastic"))
    ap.add_argument("--json", help="also write the census to this file")
    a = ap.parse_args()
    out = census(a.fmt, a.rounding)
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f: f.write(json.dumps(out, indent=1) + "\n")
