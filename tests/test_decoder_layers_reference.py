"""kernels/decoder_layers: the one-call C layers against their readable reference, directly.

tests/test_native_layers.py checks the C layers through the engine (against engine/model.py's
layers and the naive loop). Here the C call gets descriptors built by hand from small random
tensors, and its output, and the K/V it wrote, are compared with ``decoder_layers_ref`` over the
very same tensors: fp32 and bf16, several layers, GQA, biases, a sliding window. A copy of the
reference with one mistake planted shows that the comparison is strict enough to catch it.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kernels.decoder_layers import (
    LINEAR_KINDS,
    Layer,
    Linear,
    ModelDims,
    decoder_layers_native,
    kernel_pointers,
    reference,
    why_library_cannot_load,
)
from kernels.decoder_layers.reference import LayerTensors, decoder_layers_ref
from kernels.paged_attention.reference import NULL_BLOCK

needs_c = pytest.mark.skipif(why_library_cannot_load() is not None,
                             reason=f"no C layers here: {why_library_cannot_load()}")

# max |C - reference| allowed, as a fraction of the reference's largest |value|. fp32: float
# sums in another order. bf16: the C layers round where torch rounds, but a sum in another order
# can land on the other side of a rounding boundary (a bf16 step: up to 2^-7 of the value), and
# that step then travels through the following ops and layers.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
EPS, ROPE_BASE = 1e-5, 10_000.0
E, F, BS, NB, L = 64, 96, 4, 64, 3  # hidden size, MLP size, block size, blocks per pool, layers


def assert_agree(c: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """c and ref within the dtype's tolerance; on failure, print where and by how much."""
    assert c.dtype == ref.dtype and c.shape == ref.shape, (c.dtype, c.shape, ref.dtype, ref.shape)
    err = (c.float() - ref.float()).abs()
    allowed = TOLERANCE[ref.dtype] * float(ref.float().abs().max())
    worst = tuple(int(i) for i in torch.unravel_index(err.argmax(), err.shape))
    assert float(err.max()) <= allowed, (
        f"{what} ({ref.dtype}): max |C - reference| = {float(err.max()):.3g} at {worst} "
        f"(C {float(c[worst]):.6g}, reference {float(ref[worst]):.6g}); allowed {allowed:.3g} "
        f"= {TOLERANCE[ref.dtype]} x max |reference|; {int((err > allowed).sum())} of "
        f"{err.numel()} values outside")


def random_layers(dtype, H, Hkv, D, bias: bool, g: torch.Generator) -> list[LayerTensors]:
    """L layers of small random weights (scaled by 1 / sqrt(K), so activations stay near 1) and
    pools full of random "past" K/V."""
    def w(n, k):
        return (torch.randn(n, k, generator=g) / math.sqrt(k)).to(dtype)

    def b(n):
        return (torch.randn(n, generator=g) * 0.3).to(dtype) if bias else None

    def norm():
        return (1 + 0.2 * torch.randn(E, generator=g)).to(dtype)

    def pool():
        return torch.randn(NB, BS, Hkv, D, generator=g).to(dtype)

    qkv_n = (H + 2 * Hkv) * D
    return [LayerTensors(norm(), norm(), w(qkv_n, E), w(E, H * D), w(2 * F, E), w(E, F), pool(),
                         pool(), b(qkv_n), b(E), b(2 * F), b(E)) for _ in range(L)]


def decode_step(seq_lens: list[int], D: int, window: int | None, g: torch.Generator):
    """A step's tables: each sequence's blocks drawn at random from the pool, the new token's slot
    at position seq_len - 1, RoPE angles at that position; a block wholly before the window is
    NULL_BLOCK (freed), as the block manager leaves it."""
    M, max_blocks = len(seq_lens), max(-(-n // BS) for n in seq_lens)
    blocks = torch.randperm(NB, generator=g)[: M * max_blocks].reshape(M, max_blocks)
    tables = blocks.to(torch.int32)
    for b, n in enumerate(seq_lens):
        first = max(0, n - window) if window else 0
        tables[b, : first // BS] = NULL_BLOCK
    pos = torch.tensor(seq_lens) - 1  # [M]
    slots = (blocks[torch.arange(M), pos // BS] * BS + pos % BS).to(torch.int64)  # [M]
    inv_freq = ROPE_BASE ** (-torch.arange(0, D, 2).float() / D)  # [D/2]
    angles = pos[:, None].float() * inv_freq  # [M, D/2]
    angles = torch.cat((angles, angles), dim=-1)  # [M, D]
    return (angles.cos(), angles.sin(), slots, tables.contiguous(),
            torch.tensor(seq_lens, dtype=torch.int32))


def run_c(layers: list[LayerTensors], x, cos, sin, slots, tables, seq_lens, *, window):
    """The C call over descriptors that point at ``layers``' tensors (its pools are written)."""
    dtype, keep = x.dtype, []  # keep: every tensor the descriptors point at, alive until we return

    def ptr(t):
        if t is None:
            return None
        t = t.contiguous()
        keep.append(t)  # alive until the call returns
        return t.data_ptr()

    def linear(weight, bias):
        n, k = weight.shape
        return Linear(LINEAR_KINDS[weight.dtype], n, k, ptr(weight),
                      ptr(None if bias is None else bias.float()))

    Hkv, D = layers[0].k_pool.shape[2:]
    H = layers[0].qkv.shape[0] // D - 2 * Hkv
    gemv, quant, attend = kernel_pointers()
    dims = ModelDims(E=E, H=H, Hkv=Hkv, D=D, F=F, BS=BS, window=window or 0, eps=EPS,
                     scale=1 / math.sqrt(D), bf16=int(dtype == torch.bfloat16), gemv=gemv,
                     quant=quant, attend=attend)
    descriptors = (Layer * len(layers))()
    for i, ly in enumerate(layers):
        assert ly.k_pool.is_contiguous() and ly.v_pool.is_contiguous()  # written where they lie
        descriptors[i] = Layer(ptr(ly.input_norm), ptr(ly.post_norm), linear(ly.qkv, ly.qkv_bias),
                               linear(ly.o, ly.o_bias), linear(ly.gate_up, ly.gate_up_bias),
                               linear(ly.down, ly.down_bias), ly.k_pool.data_ptr(),
                               ly.v_pool.data_ptr())
    x32 = x.to(torch.float32, copy=True)  # updated in place by C; bf16 values in a bf16 model
    decoder_layers_native(dims, descriptors, x32, cos, sin, slots, tables, seq_lens)
    return x32.to(dtype)


def with_own_pools(layers: list[LayerTensors]) -> list[LayerTensors]:
    """The same layers with copies of their pools (C and the reference each write their own)."""
    return [dataclasses.replace(ly, k_pool=ly.k_pool.clone(), v_pool=ly.v_pool.clone())
            for ly in layers]


def both(dtype, H, Hkv, D, bias, window, seq_lens, seed=0, mutant=None):
    """Run one decode step through C and through the reference on the same random tensors:
    (x after C, x after the reference, C's layers, the reference's layers)."""
    g = torch.Generator().manual_seed(seed)
    c_layers = random_layers(dtype, H, Hkv, D, bias, g)
    ref_layers = with_own_pools(c_layers)
    cos, sin, slots, tables, lens = decode_step(seq_lens, D, window, g)
    x = torch.randn(len(seq_lens), E, generator=g).to(dtype)
    c = run_c(c_layers, x, cos, sin, slots, tables, lens, window=window)
    ref = decoder_layers_ref(ref_layers, x, cos, sin, slots, tables, lens, eps=EPS,
                             scale=1 / math.sqrt(D), window=window)
    return c, ref, c_layers, ref_layers, slots


SHAPES = [(4, 2, 16), (4, 1, 16), (2, 2, 64), (8, 2, 64)]  # (H, Hkv, D): GQA 2, MQA, MHA, GQA 4


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,Hkv,D", SHAPES)
@pytest.mark.parametrize("bias,window", [(False, None), (True, None), (False, 5)])
def test_the_c_layers_compute_what_the_reference_computes(dtype, H, Hkv, D, bias, window):
    seq_lens = [1, 6, 11]  # a first token, a partly filled block, three blocks (a window's NULLs)
    c, ref, c_layers, ref_layers, slots = both(dtype, H, Hkv, D, bias, window, seq_lens)
    assert_agree(c, ref, "x after the layers")
    blocks, offsets = slots // BS, slots % BS
    for i, (cl, rl) in enumerate(zip(c_layers, ref_layers, strict=True)):
        for name in ("k_pool", "v_pool"):  # the new tokens' K/V, and nothing else, written alike
            cp, rp = getattr(cl, name), getattr(rl, name)
            assert_agree(cp[blocks, offsets], rp[blocks, offsets], f"layer {i} {name} new slots")
            cp[blocks, offsets] = rp[blocks, offsets] = 0
            assert torch.equal(cp, rp), f"layer {i} {name}: a slot outside the step was written"


@needs_c
def test_sixteen_rows_in_one_call_agree_too():
    """As many rows as the engine gives the fp32 C layers (GEMV_MAX_ROWS): four passes of the
    gemv kernel's four rows."""
    seq_lens = [1 + (5 * b) % 13 for b in range(16)]
    c, ref, *_ = both(torch.float32, 4, 2, 16, True, None, seq_lens, seed=3)
    assert_agree(c, ref, "x after the layers, 16 rows")


def without_rope(x, cos, sin):
    return x


def without_kv_write(k, v, k_pool, v_pool, slots):
    return None  # attention then reads whatever the new token's slot held before


def silu_dropped(gu):
    gate, up = gu.chunk(2, dim=-1)
    return gate * up


def layer_without_residual(layer, x, *args, **kwargs):
    """The layer's output with its input not added back: f(x) instead of x + f(x)."""
    return ORIGINAL_LAYER(layer, x, *args, **kwargs) - x


ORIGINAL_LAYER = reference.decoder_layer_ref
MUTANTS = {"RoPE left out": ("rope_ref", without_rope),
           "K/V never written": ("write_kv_ref", without_kv_write),
           "SiLU left out": ("silu_mul_ref", silu_dropped),
           "residual dropped": ("decoder_layer_ref", layer_without_residual)}


@needs_c
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mutant", MUTANTS)
def test_a_reference_with_a_planted_mistake_fails_the_comparison(dtype, mutant, monkeypatch):
    """Swap one piece of the reference for a wrong one (in the module the reference reads its
    pieces from): the comparison with the C layers must fail, and say where."""
    name, wrong = MUTANTS[mutant]
    monkeypatch.setattr(reference, name, wrong)
    c, ref, *_ = both(dtype, 4, 2, 16, False, None, [1, 6, 11], seed=1)
    with pytest.raises(AssertionError, match=r"max \|C - reference\| = .* allowed"):
        assert_agree(c, ref, f"x after the layers, {mutant}")


def test_the_reference_names_a_bad_layer():
    g = torch.Generator().manual_seed(0)
    layers = random_layers(torch.float32, 4, 2, 16, False, g)
    cos, sin, slots, tables, lens = decode_step([3, 4], 16, None, g)
    x = torch.randn(2, E)
    layers[1] = dataclasses.replace(layers[1], o=layers[1].o[:, :32])  # [E, H D / 2]
    with pytest.raises(ValueError, match=r"^layers\[1\]\.o: expected torch.float32 \[64, 64\]"):
        decoder_layers_ref(layers, x, cos, sin, slots, tables, lens, eps=EPS, scale=0.25)
    with pytest.raises(ValueError, match="^x: expected fp32 or bf16"):
        decoder_layers_ref(layers, x.half(), cos, sin, slots, tables, lens, eps=EPS, scale=0.25)
