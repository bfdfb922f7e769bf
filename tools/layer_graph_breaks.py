"""Why the 8-bit layer does not compile yet: lift `QuantizedLinear.forward`'s `@torch.compiler.disable` (in this
process only) and list where dynamo breaks the graph of one training forward, by source line.

    python tools/layer_graph_breaks.py [--fmt E4M3] [--rounding nearest|stochastic] [--json OUT]

Nothing in the library changes: the census is the to-do list of a compiled layer (each line must become traceable,
or move outside the compiled region behind a documented boundary)."""
import argparse, json, time
import torch
from altgrad.quantized import QuantizedLinear
from altgrad.formats import ALL_FORMATS, FP8Format


def census(fmt: str = "E4M3", rounding: str = "nearest", past_constants: bool = False) -> dict:
    """Graphs, breaks and the distinct break sites of one training forward of a lifted `QuantizedLinear`.
    `past_constants`: first make the formats' constants plain Python floats (in this process only), to see the breaks
    that the first layer hides."""
    fwd, mv = QuantizedLinear.forward, FP8Format.max_value
    if past_constants:
        maxes = {id(f): float(f.values[-1]) for f in ALL_FORMATS.values()}   # fills the cached_property: no lock later
        FP8Format.max_value = property(lambda self: maxes[id(self)] if id(self) in maxes else mv.fget(self))
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
        return dict(fmt=fmt, rounding=rounding, past_constants=past_constants, graphs=ex.graph_count, breaks=ex.graph_break_count,
                    seconds=round(time.perf_counter() - t, 1), sites=sites)
    finally:
        QuantizedLinear.forward, FP8Format.max_value = fwd, mv


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fmt", default="E4M3")
    ap.add_argument("--rounding", default="nearest", choices=("nearest", "stochastic"))
    ap.add_argument("--json", help="also write the census to this file")
    ap.add_argument("--past-constants", action="store_true", help="formats' constants as Python floats first")
    a = ap.parse_args()
    out = census(a.fmt, a.rounding, a.past_constants)
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f: f.write(json.dumps(out, indent=1) + "\n")
