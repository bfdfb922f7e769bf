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
    n, _, bad = compiled_vs_eager({"floor", "nearest"}, names={"mxfp8", "mxfp4", "nvfp4"}, elements=False)
    assert n == 3 * 2 * 2 * 2 * 2 + 2 * 2 * 2, n      # values and scales of 24 cases + nvfp4's tensor scale
    assert not bad, f"{len(bad)} of {n} tensors differ: {bad[:8]}"
