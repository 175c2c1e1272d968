"""The reference ops against independent float64 math."""
import math

import pytest
import torch

from nibble.formats.int4 import unpack_int4
from nibble.kernels import reference
from nibble.quantize.rtn import rtn_quantize


def _float64_weight(q):
    codes = unpack_int4(q.qweight).double()  # [K, N]
    g = q.group_size
    return (codes * q.scales.double().repeat_interleave(g, 0) + q.zeros.double().repeat_interleave(g, 0)).t()


@pytest.mark.parametrize("K,N,G", [(576, 40, 32), (576, 40, 64), (1536, 24, 128), (384, 8, 48), (576, 40, 576)])
def test_dequantize_is_the_formula_bit_for_bit(K, N, G):
    """Broadcast over [K // G, G, N] in place (the cheap CPU path), still the formula in float32: each code times its
    group's scale, rounded, plus its zero, rounded; G = K is one group a row (per channel)."""
    torch.manual_seed(K + G)
    qweight = torch.randint(-2**31, 2**31, (K // 8, N), dtype=torch.int64).to(torch.int32)
    scales, zeros = torch.rand(K // G, N).half() / 7, -torch.rand(K // G, N).half()
    group = torch.arange(K) // G
    formula = unpack_int4(qweight).float() * scales.float()[group] + zeros.float()[group]  # [K, N]
    w = reference.dequantize(qweight, scales, zeros, G)
    assert w.shape == (N, K) and torch.equal(w.view(torch.int32), formula.t().view(torch.int32))


def test_dequantize_refuses_scales_of_another_shape_than_the_groups():
    """Broadcasting would spread one row of scales over every group of a [256, N] weight without a word (the old
    repeat_interleave failed on it by chance); a group size that does not divide K likewise."""
    qweight = torch.randint(-2**31, 2**31, (32, 8), dtype=torch.int64).to(torch.int32)  # K = 256
    for scales, G in ((torch.rand(1, 8), 64), (torch.rand(4, 8), 96), (torch.rand(4, 4), 64)):
        with pytest.raises(ValueError, match=r"scales and zeros must be \[K // group_size, N\]"):
            reference.dequantize(qweight, scales, -scales, G)
    with pytest.raises(ValueError, match="got \\(4, 8\\) and \\(1, 8\\)"):
        reference.dequantize(qweight, torch.rand(4, 8), torch.rand(1, 8), 64)


@pytest.mark.parametrize("M", [1, 3, 17])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_w4a16_matmul_matches_float64(M, dtype):
    w = rtn_quantize(torch.randn(96, 256), 64)
    x = torch.randn(M, 256).to(dtype)
    bias = torch.randn(96).to(dtype)
    y = reference.w4a16_matmul(x, w.qweight, w.scales, w.zeros, 64, bias)
    ref = x.double() @ _float64_weight(w).t() + bias.double()
    assert y.dtype == dtype and y.shape == (M, 96)
    tol = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}[dtype]
    assert ((y.double() - ref).norm() / ref.norm()) < tol


def test_w4a16_matmul_keeps_leading_dims():
    w = rtn_quantize(torch.randn(32, 64), 32)
    x = torch.randn(2, 5, 64)
    y = reference.w4a16_matmul(x, w.qweight, w.scales, w.zeros, 32)
    assert y.shape == (2, 5, 32)
    assert torch.allclose(y[1, 3], reference.w4a16_matmul(x[1, 3:4], w.qweight, w.scales, w.zeros, 32)[0])


def test_activation_quantization_is_per_token_symmetric_int4():
    x = torch.randn(7, 128) * torch.logspace(-2, 2, 7).unsqueeze(1)
    # each row and its negation: one of the two has its largest magnitude below zero, so a scale from max(x)
    # instead of amax|x| fails here (seed 0's seven rows all peaked above zero, and let it pass)
    x = torch.cat([x, -x])
    q, s = reference.quantize_activations(x)
    assert q.dtype == torch.int8 and s.shape == (14,)
    assert torch.allclose(s, x.abs().amax(1) / 7)
    assert q.abs().max() <= 7 and q.abs().amax(1).eq(7).all()  # the largest entry of each row maps to +-7
    assert ((q.float() * s.unsqueeze(1) - x).abs() <= s.unsqueeze(1) / 2 + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_activation_quantization_rounds_ties_to_even(dtype):
    """Rows whose quotients x / scale fall exactly on k + 1/2 (the scale a power of two): the codes are round half
    to even's, the spec every kernel is checked against (0.5 -> 0, 1.5 -> 2, -2.5 -> -2). Random inputs never hit a
    tie, so rounding half away from zero passed every other test."""
    g = torch.Generator().manual_seed(7)
    ties = torch.randint(-7, 7, (6, 63), generator=g).double() + 0.5  # -6.5 .. 6.5
    peak = 7.0 * (torch.randint(0, 2, (6, 1), generator=g) * 2 - 1)  # amax = 7 * scale, either sign
    rows = torch.cat([peak, ties], dim=1)
    scale = 2.0 ** torch.randint(-8, 9, (6, 1), generator=g).double()  # x exact in float16 too
    q, s = reference.quantize_activations((rows * scale).to(dtype))
    assert torch.equal(s.double(), scale.squeeze(1))
    # the even one of floor(v) and floor(v) + 1 for a half-integer v; the peak +-7 as it is
    half_even = [[v if v == int(v) else math.floor(v) + math.floor(v) % 2 for v in row] for row in rows.tolist()]
    assert torch.equal(q, torch.tensor(half_even).to(torch.int8))


def test_activation_quantization_handles_zero_rows_and_non_finite_values():
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    x[0] = 0
    x[1, 5] = float("nan")
    x[2, 7] = float("inf")
    q, s = reference.quantize_activations(x)
    assert s[0] == 0 and (q[0] == 0).all()
    assert torch.isfinite(s).all() and q[1, 5] == 0
    assert q[2, 7] == 7 and (q[2, torch.arange(64) != 7] == 0).all()  # +Inf saturates, the rest rounds to 0
    w = rtn_quantize(torch.randn(16, 64), -1, symmetric=True)
    y = reference.w4a4_linear(x, w.qweight, w.scales[0])
    assert torch.isfinite(y).all() and (y[0] == 0).all()


def test_w4a4_accumulation_is_the_exact_integer_product():
    K, N = 512, 48
    w = rtn_quantize(torch.randn(N, K), -1, symmetric=True)
    qx = torch.randint(-8, 8, (5, K), dtype=torch.int8)
    acc = reference.w4a4_accumulate(qx, w.qweight)
    exact = qx.long() @ (unpack_int4(w.qweight).long() - 8)
    assert acc.dtype == torch.int32 and torch.equal(acc.long(), exact)


def test_w4a4_matmul_scales_after_the_integer_sum():
    K, N = 256, 32
    w = rtn_quantize(torch.randn(N, K), -1, symmetric=True)
    x = torch.randn(9, K)
    qx, sx = reference.quantize_activations(x)
    y = reference.w4a4_matmul(qx, sx, w.qweight, w.scales[0], out_dtype=torch.float32)
    ref = (qx.double() @ (unpack_int4(w.qweight).double() - 8)) * sx.double()[:, None] * w.scales[0].double()
    assert torch.allclose(y.double(), ref, rtol=1e-6, atol=1e-6)
    # and it approximates the float product (4-bit noise, no bias)
    dense = x @ reference.dequantize(w.qweight, w.scales, w.zeros, K).t()
    assert torch.nn.functional.cosine_similarity(y.flatten(), dense.flatten(), dim=0) > 0.97


def _float64_w4a4_product(qx, sx, w, bias):
    """acc * sx * sw + bias in float64: the W4A4 layer's formula, with the spec's own codes and scales."""
    acc = qx.double() @ (unpack_int4(w.qweight).double() - 8)
    return acc * sx.double()[:, None] * w.scales[0].double() + bias.double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_w4a4_linear_returns_the_activations_dtype_and_the_formula(dtype):
    """The whole layer on [2, 5, K] activations with a bias: the dtype it came in (a float32 output for 16-bit
    activations passed every other test on the CPU), each value the float64 formula rounded once to it."""
    K, N = 256, 48
    w = rtn_quantize(torch.randn(N, K), -1, symmetric=True)
    x = torch.randn(2, 5, K).to(dtype)
    bias = torch.randn(N).to(dtype)
    y = reference.w4a4_linear(x, w.qweight, w.scales[0], bias)
    assert y.dtype == dtype and y.shape == (2, 5, N)
    ref = _float64_w4a4_product(*reference.quantize_activations(x.reshape(10, K)), w, bias)
    err = (y.reshape(10, N).double() - ref).abs().max()
    assert err <= 2 * torch.finfo(dtype).eps * ref.abs().max()


def test_w4a4_silu_mul_is_silu_of_the_gate_product_times_the_up_product():
    """The spec of the gated W4A4 GEMM (its GPU test compares the fused kernel with it): SiLU(gate) * up, not
    SiLU(up) * gate, against float64, biases on both."""
    K, N = 128, 40
    gate, up = (rtn_quantize(torch.randn(N, K), -1, symmetric=True) for _ in range(2))
    gate_bias, up_bias = torch.randn(N), torch.randn(N)
    qx, sx = reference.quantize_activations(torch.randn(6, K))
    y = reference.w4a4_silu_mul(qx, sx, (gate.qweight, gate.scales[0], gate_bias), (up.qweight, up.scales[0], up_bias),
                                out_dtype=torch.float32)
    g, u = _float64_w4a4_product(qx, sx, gate, gate_bias), _float64_w4a4_product(qx, sx, up, up_bias)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y.double(), g * torch.sigmoid(g) * u, rtol=1e-5, atol=1e-5)


def test_the_w4a16_ops_on_the_cpu_check_shapes_before_the_reference_runs():
    """Scales of another group size once reached the reference's broadcast: a bare "size of tensor a (256) must
    match ..." instead of the shapes the layer needs."""
    from nibble import kernels

    w = rtn_quantize(torch.randn(64, 256), 64)
    x = torch.randn(3, 256)
    qw, s, z = w.qweight, w.scales, w.zeros
    cases = [
        ((x, qw, s, z, 128), r"scales must have shape \(2, 64\) for K=256, N=64, group 128; got \(4, 64\)"),
        ((x, qw, s.t(), z.t(), 64), r"scales must have shape \(4, 64\) .*got \(64, 4\)"),
        ((x, qw, s, z[:3], 64), r"zeros must have shape \(4, 64\) .*got \(3, 64\)"),
        ((x, qw, s, z, 0), "group_size must be -1 .* or a positive multiple of 8 .*got 0"),
        ((x, qw, s, z, -64), "group_size must be -1 .* or a positive multiple of 8 .*got -64"),
        ((torch.randn(3, 128), qw, s, z, 64), r"x has K=128 in its last dimension but qweight \(32, 64\) packs K=256"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            kernels.w4a16_linear(*args)
        with pytest.raises(ValueError, match=match):
            kernels.w4a16_linears(args[0], [(*args[1:4], None), (qw, s, z, None)], args[4])
    torch.testing.assert_close(kernels.w4a16_linear(x, qw, s, z, 64), reference.w4a16_matmul(x, qw, s, z, 64))


def test_the_w4a16_ops_on_the_cpu_refuse_what_the_gpu_op_refuses():
    """The CPU path took float32 and even int32 scales, which the GPU op refuses; a numpy group size got "group_size=32
    must be a positive multiple of 8 dividing K=64" (which 32 is), and -1, which QuantLinear takes, a message that
    did not name it. The format's checks now (`Int4Weight`'s), on every device."""
    import numpy as np
    from nibble import kernels

    w = rtn_quantize(torch.randn(64, 256), 64)
    x = torch.randn(3, 256)
    qw, s, z = w.qweight, w.scales, w.zeros
    cases = [
        ((x, qw, s.float(), z.float(), 64), TypeError, "scales must be float16, got torch.float32"),
        ((x, qw, s, z.int(), 64), TypeError, "zeros must be float16, got torch.int32"),
        ((x, qw.long(), s, z, 64), TypeError, r"qweight must be a 2-D int32 tensor \[K // 8, N\], got torch.int64"),
        ((x, qw, s, z, np.int64(64)), ValueError, r"group_size must be an int .*got np.int64\(64\)"),
        ((x, qw, s[:1], z[:1], -1), ValueError, r"group_size is a group's width \(in_features=256 for one group a "
                                                r"row\), not -1, the shorthand only the quantizers"),
        ((x, qw, s[:1], z[:1], 96), ValueError, "in_features=256 is not divisible by group_size=96"),
    ]
    for args, error, match in cases:
        with pytest.raises(error, match=match):
            kernels.w4a16_linear(*args)
        with pytest.raises(error, match=match):
            kernels.w4a16_linears(args[0], [(*args[1:4], None)], args[4])
        if not isinstance(args[4], np.integer):  # the op's schema makes a numpy int an int
            with pytest.raises(error, match=match):
                torch.ops.nibble.w4a16_linear(x.half(), *args[1:])  # the op's own checks: the same words


def test_the_w4a4_ops_on_the_cpu_check_shapes_before_the_reference_runs():
    """A K or a scale count that does not match reached the reference's matmul as a bare shape error; a [N, 1]
    scale with as many tokens as channels broadcast along the tokens without one. The CPU path now asks for the
    shapes the GPU op does: a [N] scale, nothing that broadcasts."""
    from nibble import kernels

    w = rtn_quantize(torch.randn(64, 256), -1, symmetric=True)
    x = torch.randn(64, 256)
    qw, s = w.qweight, w.scales[0]
    cases = [
        ((torch.randn(3, 128), qw, s), r"qweight \(32, 64\) packs K=256 rows but x has K=128"),
        ((x, qw, s[:32]), r"w_scale must be a per-channel \[64\] .*got torch.float16 \(32,\)"),
        ((x, qw, s[:, None]), r"w_scale must be a per-channel \[64\] .*got torch.float16 \(64, 1\)"),
        ((x, qw, w.scales), r"w_scale must be a per-channel \[64\] .*got torch.float16 \(1, 64\)"),
        ((x, qw.flatten(), s), r"qweight must be the canonical packed int32"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            kernels.w4a4_linear(*args)
        with pytest.raises(ValueError, match=match):
            kernels.w4a4_linears(args[0], [(*args[1:], None), (qw, s, None)])
    torch.testing.assert_close(kernels.w4a4_linear(x, qw, s), reference.w4a4_linear(x, qw, s))


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_a_bias_of_another_shape_than_one_per_output_channel_is_refused(mode):
    """A [N, 1] bias with as many tokens as channels, or a [M, N] one, broadcast into another sum on the CPU
    path (and on W4A16's GPU path, which adds the bias after the op)."""
    from nibble import kernels

    w = rtn_quantize(torch.randn(64, 256), -1, symmetric=True)
    x = torch.randn(64, 256)
    if mode == "w4a16":
        linear = lambda bias: kernels.w4a16_linear(x, w.qweight, w.scales, w.zeros, 256, bias)
        linears = lambda bias: kernels.w4a16_linears(x, [(w.qweight, w.scales, w.zeros, bias)], 256)
    else:
        linear = lambda bias: kernels.w4a4_linear(x, w.qweight, w.scales[0], bias)
        linears = lambda bias: kernels.w4a4_linears(x, [(w.qweight, w.scales[0], bias)])
    bias = torch.randn(64)
    for bad in (bias[:, None], bias.expand(64, 64), torch.arange(64)):
        for op in (linear, linears):
            with pytest.raises(ValueError, match=r"bias must be a float tensor of shape \[64\]"):
                op(bad)
    torch.testing.assert_close(linear(bias), linear(None) + bias)


def test_the_layer_ops_refuse_activations_they_would_cast_or_cannot_read():
    """An int32 x came back truncated to int32 from W4A16 and a float64 one overflowed W4A4's float32 reference;
    a 0-d x and a float group size met an IndexError and a repeat_interleave error."""
    from nibble import kernels

    w = rtn_quantize(torch.randn(64, 256), -1, symmetric=True)
    ops = {"w4a16": lambda x, g=256: kernels.w4a16_linear(x, w.qweight, w.scales, w.zeros, g),
           "w4a4": lambda x: kernels.w4a4_linear(x, w.qweight, w.scales[0])}
    x = torch.randn(3, 256) * 8
    for op in ops.values():
        for dtype in (torch.int32, torch.float64, torch.bool):
            with pytest.raises(TypeError, match=f"activations must be float16, bfloat16 or float32, got {dtype}"):
                op(x.to(dtype))
        with pytest.raises(ValueError, match="at least one dimension"):
            op(torch.tensor(1.5))
    with pytest.raises(ValueError, match="group_size must be an int .*got 256.0"):
        ops["w4a16"](x, 256.0)
