"""`quantize_blocks` gives the same bits as the kernel it replaced: sha256 digests of its outputs over every recipe,
scale rounding, 1-D and 2-D blocks, both axes, nearest and stochastic rounding, against a fixture written by the
previous implementation (eager kernel), and the compiled kernel against the eager one (`python tests/test_block_kernel.py --write` rewrites it: only do that on
purpose, from code whose bits are the reference)."""
import hashlib, json, sys
from dataclasses import replace
from pathlib import Path
import pytest
import torch

FIXTURE = Path(__file__).parent / "fixtures" / "quantize_blocks.json"


def _variants():
    "Every registered recipe under every scale rounding it accepts, as 1-D blocks and as 2-D weight tiles."
    from altgrad.microscaling import RECIPES, SCALE_ROUNDINGS
    for name, r in RECIPES.items():
        for sr in SCALE_ROUNDINGS[r.scale]:
            for tiles in (False, True):
                yield f"{name}/{sr}/{'2d' if tiles else '1d'}", replace(r, scale_rounding=sr, weight_tiles=tiles)


def _inputs(r) -> torch.Tensor:
    "`r`'s adversarial blocks (amaxes at powers of two and ties, subnormals, zeros), inf, NaN and -0, as a 1024 × 64 matrix."
    from altgrad.microscaling import peer_inputs, nvfp4_inputs
    from altgrad.formats import get_format
    x = nvfp4_inputs(4096, seed=3) if r.scale == "UE4M3" else peer_inputs(32, 1024, seed=3, elem_max=get_format(r.elem).max_value)
    x = x.reshape(-1)[-1024 * 64:].reshape(1024, 64).clone()            # the tail: every adversarial block
    x[0, 5], x[1, 7], x[2, 9], x[3, :] = float("inf"), float("nan"), -0.0, -x[3, :]
    x[4, :32] = float("-inf"); x[5, 3] = -3.0e38
    return x


def _digest(b) -> str:
    h = hashlib.sha256()
    for t in (b.values, b.elements, b.scales, b.tensor_scale):
        if t is not None: h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:24]


def digests(compiled: bool = False) -> dict[str, str]:
    "{case: digest} of every variant's 1-D / 2-D blocks along both axes, nearest and stochastic (seeded)."
    from altgrad.microscaling import quantize_blocks
    out = {}
    for key, r in _variants():
        x = _inputs(r); w = r.weight_tiles
        for rounding in (("nearest",) if compiled else ("nearest", "stochastic")):
            g = torch.Generator().manual_seed(7)
            out[f"{key}/{rounding}/axis-1"] = _digest(quantize_blocks(x, r, -1, w, rounding, g, compiled=compiled))
            out[f"{key}/{rounding}/axis0"] = _digest(quantize_blocks(x.T.contiguous(), r, 0, w, rounding, g, compiled=compiled))
    return out


def test_quantize_blocks_bits_match_the_fixture():
    want = json.loads(FIXTURE.read_text())
    got = digests(compiled=False)
    assert sorted(got) == sorted(want)
    bad = [k for k in want if got[k] != want[k]]
    assert not bad, f"{len(bad)} of {len(want)} cases moved: {bad[:8]}"


def _canonical(t: torch.Tensor) -> torch.Tensor:
    "The bits of `t` (float32: every NaN as 0x7FC00000; a compiled reduction or clamp makes other NaN payloads)."
    return torch.where(t.isnan(), float("nan"), t).view(torch.int32) if t.is_floating_point() else t


def _interleaved_cases():
    """Every variant under nearest and stochastic rounding along both axes, ordered so that the element format changes
    from one case to the next while the graph's static key (scale rounding, 1-D/2-D, rounding mode) stays: the order in
    which a graph compiled for one element format was once reused, wrongly, for the next (mxfp8, then mxfp8_e5m2)."""
    cases = [(k, r, rd, ax) for k, r in _variants() for rd in ("nearest", "stochastic") for ax in (-1, 0)]
    return sorted(cases, key=lambda c: (c[0].split("/")[1:], c[2], c[3], c[0]))


def compiled_vs_eager(scale_roundings, names=None, elements: bool = True) -> tuple[int, int, list]:
    """The compiled kernel (forced) against the eager kernel (which the fixture pins) on every case of
    `_interleaved_cases` whose scale rounding is in `scale_roundings` (and recipe in `names`, if given), asking for the
    elements or not (`elements=False`: the GEMM operands' path, none kept): (#tensors, #graphs compiled, differing
    cases)."""
    from altgrad.microscaling import quantize_blocks, _compiled_view
    from altgrad.formats import _compile_broken
    if _compile_broken: pytest.skip("torch.compile does not work here")
    bad, n = [], 0
    for key, r, rd, ax in _interleaved_cases():
        if r.scale_rounding not in scale_roundings or (names and key.split("/")[0] not in names): continue
        x = _inputs(r)
        if ax == 0: x = x.T.contiguous()
        e, c = (quantize_blocks(x, r, ax, r.weight_tiles, rd, torch.Generator().manual_seed(7), compiled=k,
                                elements=elements) for k in (False, True))
        assert not _compile_broken and (e.packed is None) == (c.packed is None) == (not elements)
        fields = lambda b: (b.values, b.elements if elements else None, b.scales, b.tensor_scale)   # (compiled: packed)
        for u, v in zip(fields(e), fields(c)):
            if u is None: assert v is None; continue
            n += 1
            if not torch.equal(_canonical(u), _canonical(v)): bad.append(f"{key}/{rd}/axis{ax}")
    return n, len(_compiled_view), bad


def test_compiled_block_kernel_matches_the_eager_one_floor_ceil():
    """The compiled kernel gives the eager kernel's bits, NaN payloads aside, for every registered MX recipe under the
    FLOOR and CEIL scale roundings, 1-D and 2-D blocks, both axes, nearest and stochastic, in one process, element
    formats interleaved (the other roundings and NVFP4: `tests/test_block_kernel_rest.py`, a file of its own so that
    the two halves run on both of CI's workers). The kernel it replaced differed from its eager path in NaN payloads."""
    n, graphs, bad = compiled_vs_eager({"floor", "ceil"})
    assert graphs >= 4, graphs                  # 2 E8M0 roundings × nearest/stochastic: all compiled
    assert n == 20 * 2 * 2 * 3, n               # values, elements, scales of 20 variants × 2 roundings × 2 axes
    assert not bad, f"{len(bad)} of {n} tensors differ: {bad[:8]}"


if __name__ == "__main__" and "--write" in sys.argv:
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    FIXTURE.write_text(json.dumps(digests(), indent=1, sort_keys=True) + "\n")
    print(f"wrote {FIXTURE}")
