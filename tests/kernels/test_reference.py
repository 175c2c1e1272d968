"""The reference ops against independent float64 math."""
import math

import pytest
import torch

from nibble.formats.int4 import pack_int4, unpack_int4
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


def test_dequantize_rounds_the_float32_weight_once_to_the_dtype_asked():
    """dtype= (the CPU fallback of the dense dequantization, the benchmarks' bf16 copy) is the float32 formula rounded
    once to it: the weight came back float32 whatever was asked and every test asked for float32."""
    K, N, G = 256, 24, 64
    torch.manual_seed(5)
    qweight = torch.randint(-2**31, 2**31, (K // 8, N), dtype=torch.int64).to(torch.int32)
    scales, zeros = torch.rand(K // G, N).half() / 7, -torch.rand(K // G, N).half()
    w32 = reference.dequantize(qweight, scales, zeros, G)
    for dtype in (torch.bfloat16, torch.float16):
        w = reference.dequantize(qweight, scales, zeros, G, dtype=dtype)
        assert w.dtype == dtype and w.shape == (N, K) and torch.equal(w, w32.to(dtype))


def test_dequantize_refuses_scales_of_another_shape_than_the_groups():
    """Broadcasting would spread one row of scales over every group of a [256, N] weight without a word (the old
    repeat_interleave failed on it by chance); a group size that does not divide K likewise."""
    qweight = torch.randint(-2**31, 2**31, (32, 8), dtype=torch.int64).to(torch.int32)  # K = 256
    # (2, 8) at G = 96 is K // G groups, but 96 does not divide K = 256; G = 0 is no group at all
    for scales, G in ((torch.rand(1, 8), 64), (torch.rand(4, 8), 96), (torch.rand(4, 4), 64), (torch.rand(2, 8), 96),
                      (torch.rand(4, 8), 0)):
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w4a16_matmul_of_16_bit_activations_sums_the_float32_weight_in_float32(dtype):
    """16-bit x times the float32 weight, summed in float32, rounded once to x's type: the float64 product of the
    same operands rounded once, but for a rare double rounding (one ulp). A weight rounded to x's type first (a
    16-bit matmul) moves about 40% of the outputs, which the relative-norm tolerance above let through."""
    torch.manual_seed(9)
    w = rtn_quantize(torch.randn(96, 512), 64)
    x = torch.randn(7, 512).to(dtype)
    y = reference.w4a16_matmul(x, w.qweight, w.scales, w.zeros, 64)
    w32 = reference.dequantize(w.qweight, w.scales, w.zeros, 64)
    want = (x.double() @ w32.double().t()).to(dtype)
    assert y.dtype == dtype and (y != want).float().mean() < 0.02
    ulp = torch.finfo(dtype).eps * want.double().abs()
    assert ((y.double() - want.double()).abs() <= ulp).all()


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



def _spec_codes(x: torch.Tensor):
    """The activation spec computed by hand in float64: scale = amax|x| / 7 rounded once to float32 (+-Inf counted
    as the dtype's largest value), codes = x / scale as float32 divides (a float64 quotient rounded once to float32
    is that: 53 bits >= 2 * 24 + 2), rounded half to even by floor and parity, clamped to [-8, 7]; a row whose scale
    is 0 gets codes 0. No NaN in these rows."""
    big = torch.finfo(x.dtype).max
    xd = x.double().clamp(-big, big)
    scale = (xd.abs().amax(-1, keepdim=True) / 7).float().double()
    v = (xd / torch.where(scale > 0, scale, 1.0)).float().double()
    low = v.floor()
    frac = v - low
    code = low + (frac > 0.5) + ((frac == 0.5) & (low % 2 == 1))
    code = torch.where(scale > 0, code.clamp(-8, 7), 0.0)
    return code.to(torch.int8), scale.squeeze(-1).float()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_activation_scales_are_amax_over_7_rounded_once(dtype):
    """scale = amax / 7 as one correctly rounded division, bit for bit (the GPU kernels are held to it): amax times
    a rounded 1/7 is an ulp off on a fraction of the tokens, which allclose let through."""
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(512, 48, generator=g) * torch.logspace(-3, 3, 512).unsqueeze(1)).to(dtype)
    q, s = reference.quantize_activations(x)
    want_q, want_s = _spec_codes(x)
    assert torch.equal(s, want_s) and torch.equal(q, want_q)


def test_activation_codes_of_float32_tokens_at_the_subnormal_end():
    """float32 tokens whose amax / 7 lands among the last subnormals: [-10, 3] * 2^-149 has scale 2^-149 and a
    code of -10 that only the clamp brings to -8 (the one token that reaches -8, the module comment's), and
    [1, -1] * 2^-149 has a scale that underflows to 0, which must give codes 0, never x / 0 = +-Inf clamped."""
    tiny = 2.0 ** -149
    g = torch.Generator().manual_seed(12)
    x = torch.randn(4, 16, generator=g)
    x[0], x[1] = 0, 0
    x[0, :2] = torch.tensor([-10 * tiny, 3 * tiny])
    x[1, 3:5] = torch.tensor([tiny, -tiny])
    q, s = reference.quantize_activations(x)
    want_q, want_s = _spec_codes(x)
    assert s[0] == tiny and s[1] == 0 and q[0, 0] == -8  # the cases the test is for, as computed by hand
    assert torch.equal(s, want_s) and torch.equal(q, want_q)


def test_a_float32_code_rounded_past_7_by_a_subnormal_scale_is_clamped_to_7():
    """The mirror of the -8 case: [10, -3] * 2^-149 has scale 2^-149 (10 / 7 rounds down to the last subnormal) and a
    quotient of +10, which the clamp brings to 7, the top of [-8, 7]; never 8, which is no 4-bit code."""
    tiny = 2.0 ** -149
    g = torch.Generator().manual_seed(15)
    x = torch.randn(3, 16, generator=g)
    x[0] = 0
    x[0, :2] = torch.tensor([10 * tiny, -3 * tiny])
    q, s = reference.quantize_activations(x)
    assert s[0] == tiny and q[0, 0] == 7 and q[0, 1] == -3 and (q[0, 2:] == 0).all()
    assert q.max() == 7 and torch.equal(q, _spec_codes(x)[0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_activation_quantization_saturates_infinities_to_the_dtypes_largest_value(dtype):
    """+-Inf count as +-finfo(x.dtype).max, each sign its own (the scale of a float16 token holding +Inf is
    65504 / 7, not float32's largest / 7): the docstring's rule, which the GPU kernels follow."""
    g = torch.Generator().manual_seed(13)
    x = torch.randn(3, 64, generator=g).to(dtype)
    x[0, 7], x[1, 9] = float("inf"), -float("inf")
    q, s = reference.quantize_activations(x)
    want_q, want_s = _spec_codes(x)
    big = torch.tensor(torch.finfo(dtype).max / 7, dtype=torch.float64).float()
    assert s[0] == s[1] == big and q[0, 7] == 7 and q[1, 9] == -7
    assert torch.equal(s, want_s) and torch.equal(q, want_q)


def test_a_float16_token_rotated_past_65504_saturates_instead_of_being_zeroed():
    """The rotation runs in float32 and is rounded to float16 before the quantization: a token of 65504s rotates to
    65504 * 8 = 524032 (float16's Inf) at index 0 and exact zeros elsewhere. Finite in float32, it saturates
    (scale 65504 / 7, code 7) as the docs say; only a token whose float32 rotation is not finite becomes zeros."""
    g = torch.Generator().manual_seed(14)
    x = torch.randn(3, 64, generator=g).half()
    x[0] = 65504
    q, s = reference.rotate_quantize_activations(x)
    assert s[0] == torch.tensor(65504 / 7, dtype=torch.float64).float()
    assert q[0, 0] == 7 and (q[0, 1:] == 0).all() and (s[1:] > 0).all()
    qb, sb = reference.rotate_quantize_activations(x.bfloat16() * 2.0 ** 112)  # past float32: zeroed
    assert sb[0] == 0 and (qb[0] == 0).all() and (sb[1:] > 0).all()

def test_w4a4_accumulation_is_the_exact_integer_product():
    K, N = 512, 48
    w = rtn_quantize(torch.randn(N, K), -1, symmetric=True)
    qx = torch.randint(-8, 8, (5, K), dtype=torch.int8)
    acc = reference.w4a4_accumulate(qx, w.qweight)
    exact = qx.long() @ (unpack_int4(w.qweight).long() - 8)
    assert acc.dtype == torch.int32 and torch.equal(acc.long(), exact)


def test_w4a4_accumulation_stays_exact_past_float32s_24_bits():
    """|acc| <= 64 K, past 2^24 from K = 2^18: float32 sums hold no odd integer there (2^24 + 1 rounds to 2^24), so
    the reference sums in float64, exact for any layer's K. 2^18 codes of -8 against -8, then one 1 times 1."""
    K = 2**18 + 8
    qx = torch.full((1, K), -8, dtype=torch.int8)
    qx[0, -8:] = 0
    qx[0, -1] = 1
    codes = torch.zeros(K, 2, dtype=torch.int32)  # q - 8 = -8
    codes[-8:] = 8  # q - 8 = 0
    codes[-1, 0] = 9  # q - 8 = 1: column 0 sums to 2^24 + 1, column 1 to 2^24
    acc = reference.w4a4_accumulate(qx, pack_int4(codes))
    assert acc.dtype == torch.int32 and acc.tolist() == [[2**24 + 1, 2**24]]


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


def test_w4a4_matmul_returns_bfloat16_by_default_as_the_gpu_products_do():
    """out_dtype defaults to bfloat16 here as in `w4a4.w4a4_matmul_triton`: one call, one output type on every device."""
    w = rtn_quantize(torch.randn(32, 128), -1, symmetric=True)
    qx, sx = reference.quantize_activations(torch.randn(5, 128))
    y = reference.w4a4_matmul(qx, sx, w.qweight, w.scales[0])
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, reference.w4a4_matmul(qx, sx, w.qweight, w.scales[0], out_dtype=torch.float32).bfloat16())


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


def test_w4a4_silu_mul_rounds_each_product_to_the_output_dtype_first():
    """Hugging Face's order in bfloat16 (the default out_dtype): each product rounded to bfloat16, then F.silu(g) * u
    in bfloat16, op by op. The test above runs float32 throughout, where SiLU of an unrounded gate, a float32 up, or
    one rounding at the end give the same values; here they move a fraction of the outputs."""
    K, N = 128, 256
    gate, up = (rtn_quantize(torch.randn(N, K), -1, symmetric=True) for _ in range(2))
    gate = (gate.qweight, gate.scales[0], torch.randn(N))
    up = (up.qweight, up.scales[0], torch.randn(N))
    qx, sx = reference.quantize_activations(torch.randn(8, K))
    y = reference.w4a4_silu_mul(qx, sx, gate, up)
    g = reference.w4a4_matmul(qx, sx, *gate, out_dtype=torch.bfloat16)
    u = reference.w4a4_matmul(qx, sx, *up, out_dtype=torch.bfloat16)
    assert g.dtype == u.dtype == y.dtype == torch.bfloat16
    assert torch.equal(y, torch.nn.functional.silu(g) * u)


def test_the_rounding_op_is_a_cast_whose_output_never_aliases_its_input():
    """`rounded`'s op, what a compiled W4A4 reference holds for the rounding of the rotation: its fake gives the target
    dtype (one in x's type would trace what follows in float32), and its output is a new tensor even where x has
    the dtype already (an op's output may not alias its input: x.to(x.dtype) is x)."""
    x = torch.randn(4, 64)
    for dtype in (torch.bfloat16, torch.float32):
        torch.library.opcheck(torch.ops.nibble.rounded.default, (x, dtype),
                              test_utils=("test_schema", "test_faketensor"))
        y = torch.ops.nibble.rounded(x, dtype)
        assert y.dtype == dtype and torch.equal(y, x.to(dtype)) and y.data_ptr() != x.data_ptr()


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


def test_a_float32_token_holding_inf_gives_the_representable_product():
    """A +Inf saturates to float32's largest value, so its token's scale is finfo.max / 7: acc * x_scale alone
    overflows to Inf (clamped to finfo.max on every output) where acc * (x_scale * w_scale) is representable."""
    K, N = 128, 16
    w = rtn_quantize(torch.randn(N, K) / 100, -1, symmetric=True)  # w_scale ~ 1e-3: |y| <= 56 / 7 * max * w_scale
    x = torch.randn(3, K)
    x[1, 5] = float("inf")
    y = reference.w4a4_linear(x, w.qweight, w.scales[0])
    ref = _float64_w4a4_product(*reference.quantize_activations(x), w, torch.zeros(N))
    assert torch.isfinite(ref).all() and ref[1].abs().max() < torch.finfo(torch.float32).max / 4
    torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=1e-6)
