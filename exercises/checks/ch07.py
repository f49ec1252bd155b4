"""Checks for chapter 07: the int4 grid, a per-group int4 quantizer, a dequantizing GEMV, a
granularity picked from an error budget, and the byte counts of question 5.

Each `check_<claim>(mod)` runs against the student's `exercises/ch07_quantization.py` or the
reference in `exercises/solutions/`. The oracles are the kernels' own PyTorch reference (`quantize`,
`dequantize`, `quant_matmul_ref`, `int4_scale_and_zero`) and `gemv_bytes_per_output`, plus numbers
worked by hand.
"""

from __future__ import annotations

import torch

from exercises.checks import raises_naming
from kernels.quant_matmul.reference import (
    dequantize,
    int4_scale_and_zero,
    quant_matmul_ref,
    quantize,
    unpack_int4,
)
from kernels.quant_matmul.triton import gemv_bytes_per_output

SEED = 7
ATOL = 1e-5  # fp32 rounding of a few hundred products
TIE_FRACTION = 1e-3  # codes may differ from the engine's only where w/s + z lands on a .5 tie
BF16_ULPS = 1.0  # fp32 math, then one rounding to bf16: within half a bf16 step of the exact value
# a budget this much (relative) under a granularity's error must reject it: far above fp32's
# summation noise (~1e-7), far below the gap between int8 granularities (~20%)
JUST_UNDER = 1e-3
JUST_OVER = 1e-6  # and this much over must accept it, however the student sums the squares


def _weight(n: int = 32, k: int = 256, outliers: int = 3) -> torch.Tensor:
    """A random [N, K] weight with a few large entries, like a real layer's tails."""
    g = torch.Generator().manual_seed(SEED)
    w = torch.randn(n, k, generator=g) * 0.02
    w.view(-1)[torch.randint(0, n * k, (outliers,), generator=g)] = 0.5
    return w


def _close(got, want, what: str, atol: float = ATOL) -> None:
    assert isinstance(got, torch.Tensor), f"{what}: expected a tensor, got {type(got).__name__}"
    assert got.shape == want.shape, (
        f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    diff = (got.float() - want.float()).abs().max().item()
    assert diff <= atol, f"{what}: max |difference| from the expected values is {diff:.3g}"


# ---- the int4 grid -------------------------------------------------------------------------------


def check_int4_grid_maps_min_and_max_to_0_and_15(mod) -> None:
    # lo = -1.5, hi = 3.0: scale = 4.5 / 15 = 0.3, zero = 1.5 / 0.3 = 5
    # (so q = 5 means 0.0, q = 15 means 3.0).
    scale, zero = mod.int4_scale_and_zero(torch.tensor([-1.5]), torch.tensor([3.0]))
    _close(scale, torch.tensor([0.3]), "int4_scale_and_zero(-1.5, 3.0) scale")
    _close(zero, torch.tensor([5.0]), "int4_scale_and_zero(-1.5, 3.0) zero")
    # all positive, lo = 0.2, hi = 1.7: the range is stretched down to 0 so that 0.0 stays exact:
    # scale = 1.7 / 15, zero = 0.
    scale, zero = mod.int4_scale_and_zero(torch.tensor([0.2]), torch.tensor([1.7]))
    _close(scale, torch.tensor([1.7 / 15]),
           "int4_scale_and_zero(0.2, 1.7) scale (0 must stay in the range)")
    _close(zero, torch.tensor([0.0]), "int4_scale_and_zero(0.2, 1.7) zero")


def check_int4_grid_matches_the_engine(mod) -> None:
    g = torch.Generator().manual_seed(SEED)
    lo, hi = -torch.rand(64, 8, generator=g), torch.rand(64, 8, generator=g) * 3
    lo[0, 0], hi[0, 0] = 0.0, 0.0  # an all-zero group
    got_scale, got_zero = mod.int4_scale_and_zero(lo, hi)
    want_scale, want_zero = int4_scale_and_zero(lo, hi)
    _close(got_scale, want_scale, "int4_scale_and_zero scales", atol=1e-7)
    _close(got_zero, want_zero, "int4_scale_and_zero zero points (integers 0..15)")
    assert got_scale[0, 0] > 0, (
        "an all-zero group needs a positive scale (dequantizing divides by nothing, "
        "but quantizing divides by it)")


def check_int4_grid_rounds_a_tied_zero_point_to_even(mod) -> None:
    # lo = -1.25, hi = 6.25: scale = 7.5 / 15 = 0.5 exactly, -lo / scale = 2.5 exactly, a tie.
    # torch.round (and the engine) round half to even: zero = 2; round half up would give 3.
    _scale, zero = mod.int4_scale_and_zero(torch.tensor([-1.25]), torch.tensor([6.25]))
    assert zero.tolist() == [2.0], (
        f"int4_scale_and_zero(-1.25, 6.25): zero point {zero.tolist()}, expected [2.0]: "
        "-lo / scale is exactly 2.5, and an exact tie rounds to even (torch.round, the engine), "
        "not up")


# ---- the quantizer -------------------------------------------------------------------------------


def check_quantize_int4_matches_the_engine(mod) -> None:
    w = _weight()
    for group_size in (32, 64, 256):
        got, want = mod.quantize_int4(w, group_size), quantize(w, 4, group_size)
        what = f"quantize_int4(w [32, 256], group_size={group_size})"
        assert got.qweight.dtype == torch.uint8 and tuple(got.qweight.shape) == (32, 128), (
            f"{what}: qweight must be uint8 [N, K // 2] (two codes a byte), got "
            f"{got.qweight.dtype} {list(got.qweight.shape)}")
        _close(got.scales, want.scales, f"{what} scales [N, K // G]", atol=1e-7)
        _close(got.zeros, want.zeros, f"{what} zero points [N, K // G]")
        differ = (unpack_int4(got.qweight) != unpack_int4(want.qweight)).float().mean().item()
        assert differ <= TIE_FRACTION, (
            f"{what}: {differ:.1%} of the codes differ from round(w / s + z)")


def check_quantize_int4_packs_the_even_input_in_the_low_nibble(mod) -> None:
    # One group of 4: min -0.3, max 1.2 -> scale 0.1, zero 3;
    # codes round(w / 0.1 + 3) = [0, 3, 15, 8].
    w = torch.tensor([[-0.3, 0.0, 1.2, 0.5]])
    qw = mod.quantize_int4(w, 4)
    # byte 0 = 0 | 3 << 4 = 48, byte 1 = 15 | 8 << 4 = 143
    assert qw.qweight.tolist() == [[48, 143]], (
        f"quantize_int4([-0.3, 0, 1.2, 0.5]): packed bytes {qw.qweight.tolist()}, "
        "expected [[48, 143]] (codes [0, 3, 15, 8]: even input in the low nibble, odd input "
        "in the high one)")


def check_quantize_int4_round_trip_error_is_at_most_half_a_step(mod) -> None:
    w = _weight(16, 128)
    qw = mod.quantize_int4(w, 32)
    step = qw.scales.repeat_interleave(32, dim=1)  # [N, K]: each weight's scale
    excess = ((dequantize(qw) - w).abs() - step / 2).max().item()
    assert excess <= ATOL, (
        f"quantize_int4: a weight came back {excess:.3g} further than half a step from itself")


def check_quantize_int4_rounds_exact_ties_to_even(mod) -> None:
    # One group of 8: min -3.0, max 4.5 -> scale 0.5, zero 6, all exact in binary. The middle
    # weights land exactly on ties: w / s + z = 6.5, 8.5, 4.5, 11.5, 1.5 -> 6, 8, 4, 12, 2
    # (to even).
    w = torch.tensor([[-3.0, 4.5, 0.25, 1.25, -0.75, 0.0, 2.75, -2.25]])
    codes = unpack_int4(mod.quantize_int4(w, 8).qweight).tolist()[0]
    want = [0, 15, 6, 8, 4, 6, 12, 2]
    assert codes == want, (
        f"quantize_int4({w.tolist()[0]}, 8): codes {codes}, expected {want}: w / s + z = 6.5, 8.5, "
        "4.5, 11.5, 1.5 are exact ties, and a tie rounds to even (torch.round, the engine); "
        "rounding half up would push every tie the same way")


def check_quantize_int4_of_a_bf16_weight_matches_the_engine(mod) -> None:
    w = _weight().to(torch.bfloat16)  # a bf16 checkpoint's weight
    got, want = mod.quantize_int4(w, 64), quantize(w, 4, 64)
    what = "quantize_int4(bf16 w [32, 256], group_size=64)"
    assert got.scales.dtype == torch.float32 and got.zeros.dtype == torch.float32, (
        f"{what}: scales {got.scales.dtype}, zeros {got.zeros.dtype}; both must be float32 (the "
        "format's contract): compute the grid in fp32, bf16 has only 8 bits of mantissa")
    _close(got.scales, want.scales, f"{what} scales", atol=1e-7)
    differ = (unpack_int4(got.qweight) != unpack_int4(want.qweight)).float().mean().item()
    assert differ <= TIE_FRACTION, f"{what}: {differ:.1%} of the codes differ from the engine's"


def check_quantize_int4_rejects_a_group_size_that_does_not_divide_k(mod) -> None:
    raises_naming("group_size", lambda: mod.quantize_int4(_weight(4, 96), 64),
                  "quantize_int4(K=96, group_size=64)")


# ---- the dequantizing GEMV -----------------------------------------------------------------------


def check_dequant_gemv_by_hand(mod) -> None:
    # Codes [0, 3, 15, 8] (bytes [48, 143]), scale 0.1, zero 3 -> weights [-0.3, 0, 1.2, 0.5];
    # x = [1, 2, 3, 4]: y = -0.3 + 0 + 3.6 + 2.0 = 5.3.
    qw = quantize(torch.tensor([[-0.3, 0.0, 1.2, 0.5]]), 4, 4)
    y = mod.quant_matmul_ref(torch.tensor([1.0, 2.0, 3.0, 4.0]), qw)
    _close(y, torch.tensor([5.3]), "quant_matmul_ref(x=[1, 2, 3, 4], w=[-0.3, 0, 1.2, 0.5])")


def check_dequant_gemv_matches_the_engine_for_int8_and_int4(mod) -> None:
    w = _weight()
    g = torch.Generator().manual_seed(SEED + 1)
    bias = torch.randn(32, generator=g)
    for bits, group_size, per_tensor in ((8, None, False), (8, None, True), (4, 64, False),
                                         (4, None, False), (4, None, True), (4, 32, False)):
        qw = quantize(w, bits, group_size, per_tensor=per_tensor)
        for x in (torch.randn(256, generator=g), torch.randn(3, 256, generator=g)):
            what = (f"quant_matmul_ref(x {list(x.shape)}, int{bits} "
                    f"{'per-tensor' if per_tensor else f'groups of {group_size or 256}'})")
            _close(mod.quant_matmul_ref(x, qw), quant_matmul_ref(x, qw), what)
            _close(mod.quant_matmul_ref(x, qw, bias), quant_matmul_ref(x, qw, bias),
                   what + " with a bias")


def check_dequant_gemv_returns_the_activations_dtype(mod) -> None:
    qw = quantize(_weight(), 4, 64)
    x = torch.randn(2, 256).to(torch.bfloat16)
    y = mod.quant_matmul_ref(x, qw)
    assert y.dtype == torch.bfloat16, (
        f"quant_matmul_ref(bf16 x): returned {y.dtype}, expected x's dtype")


def check_dequant_gemv_computes_in_fp32_for_bf16_activations(mod) -> None:
    # bf16 x is exact in fp32; the weights (q - z) * s are not exact in bf16. Multiplying in fp32
    # and rounding the result once to bf16 lands within half a bf16 step of the exact answer;
    # multiplying bf16 by bf16 weights is off by many steps.
    g = torch.Generator().manual_seed(SEED + 2)
    for bits, group_size in ((4, 64), (8, None)):
        qw = quantize(_weight(), bits, group_size)
        x = torch.randn(4, 256, generator=g).to(torch.bfloat16)
        exact = x.float() @ dequantize(qw).T  # [4, N]
        got = mod.quant_matmul_ref(x, qw)
        assert isinstance(got, torch.Tensor) and got.shape == exact.shape, (
            "quant_matmul_ref(bf16 x [4, 256]): expected a [4, 32] tensor")
        step = torch.finfo(torch.bfloat16).eps * exact.abs()  # one bf16 step at each output
        steps = ((got.float() - exact).abs() / step).max().item()
        assert steps <= BF16_ULPS, (
            f"quant_matmul_ref(bf16 x, int{bits}): {steps:.1f} bf16 steps from x.float() @ W^T; "
            "compute in fp32 (x.float(), fp32 weights) and round to x's dtype once, at the end")


# ---- granularity from an error budget ------------------------------------------------------------


def _errors(w: torch.Tensor, bits: int) -> dict:
    def err(qw):
        return ((dequantize(qw) - w).norm() / w.norm()).item()

    out = {"per-tensor": err(quantize(w, bits, per_tensor=True)),
           "per-channel": err(quantize(w, bits))}
    out.update({g: err(quantize(w, bits, g)) for g in (128, 64, 32) if w.shape[1] % g == 0})
    return out


def check_pick_granularity_returns_the_coarsest_that_meets_the_budget(mod) -> None:
    w = _weight()
    errors = _errors(w, 4)  # per-tensor > per-channel > 128 > 64 > 32 on this weight
    for want in ("per-tensor", "per-channel", 128, 64, 32):
        # a budget exactly at this granularity's error
        got = mod.pick_granularity(w, 4, errors[want])
        assert got == want, (
            f"pick_granularity(int4, max_error={errors[want]:.4f}) returned {got!r}; "
            f"{want!r} meets it (errors: { {k: round(v, 4) for k, v in errors.items()} })")
    assert mod.pick_granularity(w, 8, 1.0) == "per-tensor", (
        "a budget of 100% error: the coarsest will do")


def check_pick_granularity_meets_a_tight_int8_budget(mod) -> None:
    # int8's errors are small (0.7% to 5% here) and close together: a budget a hair over one
    # granularity's error accepts it, a hair under rejects it for the next finer one. Slack on the
    # comparison, rounded errors, errors measured in bf16 or int4 grids tried for int8 all pick
    # wrongly.
    w = _weight()
    errors = _errors(w, 8)
    order = list(errors)  # coarse to fine: per-tensor, per-channel, 128, 64, 32
    shown = {k: round(v, 5) for k, v in errors.items()}
    for i, want in enumerate(order):
        over = errors[want] * (1 + JUST_OVER)
        got = mod.pick_granularity(w, 8, over)
        assert got == want, (f"pick_granularity(int8, max_error={over:.6f}) returned {got!r}; "
                             f"{want!r} meets it (int8 errors: {shown})")
        under = errors[want] * (1 - JUST_UNDER)
        if i + 1 < len(order):
            got = mod.pick_granularity(w, 8, under)
            assert got == order[i + 1], (
                f"pick_granularity(int8, max_error={under:.6f}) returned {got!r}; {want!r} misses "
                f"it by {JUST_UNDER:.1%}, {order[i + 1]!r} is the coarsest that meets it "
                f"(int8 errors: {shown}); compare the exact fp32 error with the budget, no slack")
        else:
            raises_naming("max_error", lambda b=under: mod.pick_granularity(w, 8, b),
                          f"pick_granularity(int8, max_error={under:.6f}, below every error)")


def check_pick_granularity_skips_group_sizes_that_do_not_divide_k(mod) -> None:
    w = _weight(16, 96)  # 96 = 3 x 32: groups of 128 and 64 do not fit
    errors = _errors(w, 4)
    got = mod.pick_granularity(w, 4, errors[32])
    assert got == 32, (
        f"pick_granularity(K=96, max_error={errors[32]:.4f}) returned {got!r}, expected 32")


def check_pick_granularity_says_when_nothing_is_good_enough(mod) -> None:
    raises_naming("max_error", lambda: mod.pick_granularity(_weight(), 4, 1e-6),
                   "pick_granularity(int4, max_error=1e-6)")


# ---- bytes ---------------------------------------------------------------------------------------


def check_quantized_bytes_of_a_4096_square_layer(mod) -> None:
    # int4 g128: 4096 * 4096 / 2 = 8,388,608 bytes of codes + 4096 * 32 groups * (4 + 4) = 1,048,576
    # -> 9,437,184 (4.5 bits per weight).
    # int8 per channel (G = K): 16,777,216 + 4096 * 4 = 16,793,600.
    assert mod.quantized_bytes(4096, 4096, 4, 128) == 9_437_184, (
        "quantized_bytes(4096, 4096, int4, 128)")
    assert mod.quantized_bytes(4096, 4096, 8, 4096) == 16_793_600, (
        "quantized_bytes(4096, 4096, int8, per channel)")


def check_quantized_bytes_match_the_engine(mod) -> None:
    for n, k, bits, g in ((32, 256, 4, 32), (64, 128, 4, 128), (48, 256, 8, 256), (16, 64, 8, 64)):
        want = quantize(torch.ones(n, k), bits, g).nbytes()
        got = mod.quantized_bytes(n, k, bits, g)
        assert got == want, (
            f"quantized_bytes({n}, {k}, {bits}, {g}) = {got}, the engine stores {want}")


def check_naive_dequant_moves_more_bytes_than_fp32(mod) -> None:
    # K = 4096, int4 g128: codes 2048 + 32 groups * 8 = 256 of scales and zeros; naive also writes
    # the fp32 row (16,384) and reads it back (16,384): 35,072 bytes, against fp32's 16,384;
    # fused 2,304.
    got = mod.gemv_bytes_per_output(4096, 4, 128)
    assert got.get("naive") == 35_072 and got.get("fp32") == 16_384 and got.get("fused") == 2_304, (
        f"gemv_bytes_per_output(4096, int4, 128) = {got}; "
        "expected naive 35,072, fp32 16,384, fused 2,304")


def check_gemv_bytes_match_the_engine(mod) -> None:
    for k, bits, g in ((4096, 4, 128), (4096, 8, 4096), (576, 4, 64), (1536, 8, 1536),
                       (256, 4, 32)):
        got, want = mod.gemv_bytes_per_output(k, bits, g), gemv_bytes_per_output(k, bits, g)
        assert got == want, f"gemv_bytes_per_output({k}, {bits}, {g}) = {got}, expected {want}"
