"""Where dynamo breaks the graph of one training forward of a `QuantizedLinear`, by source line.

    python tools/layer_graph_breaks.py [--fmt E4M3] [--rounding nearest|stochastic] [--traced] [--json OUT]

Without `--traced`: the eager layer with its `@torch.compiler.disable` lifted (in this process only; the to-do list
that the traced layer answered). With `--traced`: the layer as compiled runs take it (`traced.enable_traced`,
state from `prepare_traced`): one graph, no break."""
import argparse, json, time
import torch
from altgrad.quantized import QuantizedLinear
from altgrad.traced import enable_traced, prepare_traced
from altgrad.formats import ALL_FORMATS, FP8Format


def census(fmt: str = "E4M3", rounding: str = "nearest", past_constants: bool = False, traced: bool = False) -> dict:
    """Graphs, breaks and the distinct break sites of one training forward of a lifted `QuantizedLinear`.
    `past_constants`: first make the formats' constants plain Python floats (in this process only), to see the breaks
    that the first layer hides."""
    fwd, mv = QuantizedLinear._forward_eager, FP8Format.max_value
    if past_constants:
        maxes = {id(f): float(f.values[-1]) for f in ALL_FORMATS.values()}   # fills the cached_property: no lock later
        FP8Format.max_value = property(lambda self: maxes[id(self)] if id(self) in maxes else mv.fget(self))
    QuantizedLinear._forward_eager = getattr(fwd, "__wrapped__", fwd)    # the undecorated eager forward
    try:
        m = QuantizedLinear(48, 40, fmt=fmt, fmt_backward="E5M2", rounding=rounding, quantize_grads=True)
        x = torch.randn(8, 48, generator=torch.Generator().manual_seed(0))
        if traced: enable_traced(m); prepare_traced(m, x[:, 0])
        t = time.perf_counter()
        ex = torch._dynamo.explain(m)(x)
        sites = {}
        for b in ex.break_reasons:
            fr = b.user_stack[-1] if b.user_stack else None
            key = f"{fr.filename.split('/')[-1]}:{fr.lineno}" if fr else "?"
            s = sites.setdefault(key, dict(reason=str(b.reason).splitlines()[0][:160],
                                           line=(fr.line or "").strip() if fr else "", count=0))
            s["count"] += 1
        return dict(fmt=fmt, rounding=rounding, past_constants=past_constants, traced=traced, graphs=ex.graph_count, breaks=ex.graph_break_count,
                    seconds=round(time.perf_counter() - t, 1), sites=sites)
    finally:
        QuantizedLinear._forward_eager, FP8Format.max_value = fwd, mv


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fmt", default="E4M3")
    ap.add_argument("--rounding", default="nearest", choices=("nearest", "stochastic"))
    ap.add_argument("--traced", action="store_true", help="the traced layer of compiled runs (enable_traced)")
    ap.add_argument("--json", help="also write the census to this file")
    ap.add_argument("--past-constants", action="store_true", help="formats' constants as Python floats first")
    a = ap.parse_args()
    out = census(a.fmt, a.rounding, a.past_constants, a.traced)
    print(json.dumps(out, indent=1))
    if a.json:
        with open(a.json, "w") as f: f.write(json.dumps(out, indent=1) + "\n")
