"""The compiled block kernel against the eager one, second half: the EVEN and RCEIL scale roundings of every MX
recipe and NVFP4 (first half, and the helpers: `tests/test_block_kernel.py`)."""
from test_block_kernel import compiled_vs_eager


def test_compiled_block_kernel_matches_the_eager_one_even_rceil_nvfp4():
    """The compiled kernel gives the eager kernel's bits, NaN payloads aside, under EVEN and RCEIL (MX) and NVFP4's
    scale rounding, 1-D and 2-D blocks, both axes, nearest and stochastic, element formats interleaved."""
    from altgrad.microscaling import SCALE_ROUNDINGS
    rest = set(SCALE_ROUNDINGS["UE4M3"]) | {"even", "rceil"}
    n, graphs, bad = compiled_vs_eager(rest)
    assert graphs >= 6, graphs                  # 2 E8M0 roundings + NVFP4's, × nearest/stochastic: all compiled
    assert n == 22 * 2 * 2 * 3 + 2 * 2 * 2, n   # + NVFP4's tensor scale (1-D and 2-D × 2 roundings × 2 axes)
    assert not bad, f"{len(bad)} of {n} tensors differ: {bad[:8]}"


def test_values_only_kernel_matches_the_eager_one():
    """`quantize_blocks(..., elements=False)`, the GEMM operands' path (one graph along the last axis, two along the rows;
    no elements written), gives the eager kernel's values, scales and tensor scale, NaN payloads aside: mxfp8 and
    mxfp4 (FLOOR) and nvfp4, 1-D and 2-D blocks, both axes, nearest and stochastic, on the adversarial inputs."""
    import torch
    from dataclasses import replace
    from test_block_kernel import _inputs, _canonical
    from altgrad.microscaling import get_recipe, quantize_blocks
    from altgrad.formats import _compile_broken
    bad, n = [], 0
    for name in ("mxfp8", "mxfp4", "nvfp4"):
        for tiles in (False, True):
            r = replace(get_recipe(name), weight_tiles=tiles); x = _inputs(r)
            for rd in ("nearest", "stochastic"):
                for ax in (-1, 0):
                    xi = x if ax == -1 else x.T.contiguous()
                    e, c = (quantize_blocks(xi, r, ax, tiles, rd, torch.Generator().manual_seed(7), compiled=k,
                                            elements=False) for k in (False, True))
                    assert not _compile_broken and e.packed is None and c.packed is None
                    for u, v in ((e.values, c.values), (e.scales, c.scales), (e.tensor_scale, c.tensor_scale)):
                        if u is None: assert v is None; continue
                        n += 1
                        if not torch.equal(_canonical(u), _canonical(v)): bad.append(f"{name}/{tiles}/{rd}/axis{ax}")
    assert n == 3 * 2 * 2 * 2 * 2 + 2 * 2 * 2, n      # values and scales of 24 cases + nvfp4's tensor scale
    assert not bad, f"{len(bad)} of {n} tensors differ: {bad[:8]}"
