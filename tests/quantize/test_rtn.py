import pytest
import torch

from nibble.kernels.reference import dequantize
from nibble.quantize.rtn import rtn_quantize


def _dq(w):
    return dequantize(w.qweight, w.scales, w.zeros, w.group_size)


@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("symmetric,zero_point", [(False, "int"), (False, "float"), (True, "int")])
@pytest.mark.parametrize("magnitude", [0.02, 1e-5, 1e-6])  # the small ones: scales below float16's normal range
def test_rtn_error_is_at_most_half_a_step_inside_the_range(group_size, symmetric, zero_point, magnitude):
    w = torch.randn(48, 256) * magnitude
    q = rtn_quantize(w, group_size, symmetric=symmetric, zero_point=zero_point, clip_search=False)
    g = 256 if group_size == -1 else group_size
    step = q.scales.float().t().repeat_interleave(g, dim=1)
    err = (_dq(q) - w).abs()
    # Without clipping every weight is inside the representable range: error <= s/2, + the float16 rounding of the
    # offset z, which moves the grid's ends (relative, or 2^-25 where z is subnormal)
    assert (err <= step / 2 + 1e-3 * step + 2.0 ** -25).all()


def test_symmetric_weights_are_exactly_q_minus_8_times_s():
    q = rtn_quantize(torch.randn(16, 128), -1, symmetric=True)
    assert torch.equal(q.zeros, (-8 * q.scales.float()).half())


def test_clip_search_never_increases_the_error():
    w = torch.randn(64, 512) * 0.02
    w[::7, ::31] *= 25  # outliers that stretch the plain range
    plain = ((_dq(rtn_quantize(w, 128, clip_search=False)) - w) ** 2).sum()
    clipped = ((_dq(rtn_quantize(w, 128, clip_search=True)) - w) ** 2).sum()
    assert clipped < plain


@pytest.mark.parametrize("symmetric,zero_point", [(False, "int"), (False, "float"), (True, "int")])
def test_clip_search_keeps_each_groups_best_of_the_21_ratios_1_to_0_5(symmetric, zero_point):
    """By brute force: each group's range shrunk by 1, 0.975, ..., 0.5, the ratio with the least squared error (the
    first on a tie) wins. Error bounds alone let a search that never tried 0.975 pass (explore64c's Q4)."""
    from nibble.quantize.rtn import group_range, round_to_codes, scale_and_zero

    spikes = torch.rand(8, 2048) - 0.5
    spikes[:, :2] = torch.tensor([1.0, -1.0])  # a bulk in [-0.5, 0.5] under two spikes: 0.5 wins per channel
    winners = set()
    for w, G in ((torch.randn(64, 512) * 0.02, 32), (spikes, -1)):  # Gaussian groups of 32: 1 or 0.975 win most
        groups = w.reshape(-1, w.shape[1] if G == -1 else G)
        lo, hi = group_range(groups, symmetric, zero_point)
        candidates = [scale_and_zero(lo * (1 - 0.025 * i), hi * (1 - 0.025 * i), symmetric, zero_point)
                      for i in range(21)]
        errors = torch.cat([((round_to_codes(groups, s, z) * s + z - groups) ** 2).sum(1, keepdim=True)
                            for s, z in candidates], 1)
        best = errors.argmin(1, keepdim=True)  # the first of equal minima
        winners |= set(best.flatten().tolist())
        q = rtn_quantize(w, G, symmetric=symmetric, zero_point=zero_point)
        for i, stored in enumerate((q.scales, q.zeros)):
            chosen = torch.cat([c[i] for c in candidates], 1).gather(1, best)
            assert torch.equal(stored.float(), chosen.reshape(w.shape[0], -1).t())
    assert {0, 1, 20} <= winners  # the grid's ends and its first shrink each win somewhere


def test_ties_round_half_to_even_as_autogptq_and_autoawq_round():
    """Codes and integer zero points are torch.round's, ties to even, as AutoGPTQ's and AutoAWQ's RTN (and the W4A4
    kernels' activations, cvt.rni); floor(x + 0.5) would move each tie below up a level. The group spans
    [-1.25, 6.25]: s = 0.5, -lo / s = 2.5 -> zero point 2 (z = -1), so w = -1 + 0.5 (k + 1/2) are ties."""
    ties = torch.tensor([-1.25, -0.25, 0.25, 0.75, 5.75, 6.25])
    want = torch.tensor([-1.0, 0.0, 0.0, 1.0, 6.0, 6.0])  # codes 0, 2, 2, 4, 14, 14 (half up: zero point 3)
    w = torch.empty(2, 32).uniform_(-1.2, 6.2)  # strictly inside: the tie values set the range
    w[:, :6] = ties
    q = rtn_quantize(w, 32, clip_search=False)
    assert torch.equal(q.scales.float(), torch.full((1, 2), 0.5))
    assert torch.equal(q.zeros.float(), torch.full((1, 2), -1.0))
    assert torch.equal(_dq(q)[:, :6], want.expand(2, 6))


def test_integer_zero_points_are_recoverable_exactly():
    q = rtn_quantize(torch.randn(32, 256), 64)
    zp = -q.zeros.float() / q.scales.float()
    assert (zp - zp.round()).abs().max() < 0.01
    assert ((zp.round() >= 0) & (zp.round() <= 15)).all()


def test_q4_1_blocks_are_reproduced_exactly():
    """Q4_1 (llama.cpp): w = d*q + m per block of 32; re-quantizing asymmetric g32 with a float min is exact."""
    d = (torch.rand(40, 256 // 32) * 0.01 + 1e-3).half()
    m = (-torch.rand(40, 256 // 32) * 0.1).half()
    codes = torch.randint(0, 16, (40, 256))
    codes[:, ::32] = 0  # llama.cpp's quantizer puts the block min at 0 and the max at 15
    codes[:, 1::32] = 15
    w = codes.float() * d.float().repeat_interleave(32, 1) + m.float().repeat_interleave(32, 1)
    q = rtn_quantize(w, 32, zero_point="float", clip_search=False)
    assert torch.equal(_dq(q), w)


@pytest.mark.parametrize("bad,err,match", [
    (torch.randn(4, 120), ValueError, r"not divisible by group_size=64; .*: 120 or 40 or 24 \(Triton\), or -1"),
    (torch.randn(4, 100), ValueError, "not a multiple of 8, which INT4 packing needs"),
    (torch.randint(0, 3, (4, 128)), TypeError, "floating-point"),
    (torch.tensor([[float("nan")] * 64] * 2), ValueError, "NaN or Inf"),
    (torch.tensor([[float("inf")] * 64] * 2), ValueError, "NaN or Inf"),
])
def test_bad_weights_raise_clear_errors(bad, err, match):
    with pytest.raises(err, match=match):
        rtn_quantize(bad, 64)


def test_smollm2_q4_1_linears_are_reproduced_exactly_by_g32_float_min_rtn():
    """The embedded model's linears are Q4_1; RTN asym g32 with a float minimum must give them back bit for bit."""
    from nibble.models.gguf import read_q4_1_blocks
    from nibble.models.loading import default_model_path

    blocks = read_q4_1_blocks(default_model_path(), ["model.layers.0.self_attn.q_proj.weight",
                                                     "model.layers.29.mlp.down_proj.weight"])
    for b in blocks.values():
        w = b.codes.float() * b.d.float().repeat_interleave(32, 1) + b.m.float().repeat_interleave(32, 1)
        q = rtn_quantize(w, 32, zero_point="float", clip_search=False)
        assert torch.equal(_dq(q), w)


# Every way RTN places its levels, as QuantConfig reaches them: W4A16 (int / float zero points, symmetric, with
# or without the clipping search, grouped or per channel) and W4A4's symmetric per-channel search.
PLACEMENTS = [dict(symmetric=s, zero_point=zp, clip_search=c)
              for s, zp in ((False, "int"), (False, "float"), (True, "int")) for c in (False, True)]


def _placement(kw):
    return f"sym{int(kw['symmetric'])}-{kw['zero_point']}-clip{int(kw['clip_search'])}"


@pytest.mark.parametrize("group_size", [64, -1])
@pytest.mark.parametrize("kw", PLACEMENTS, ids=_placement)
def test_constant_groups_get_finite_scales_and_keep_their_value(group_size, kw):
    """An all-zero group (pruned or padded rows) once stored a scale of 0 (a float32 floor that float16 rounds
    to 0) and an integer zero point of 0 / 0 = NaN, which reached the model's output."""
    w = torch.randn(6, 128) * 0.02
    g = 128 if group_size == -1 else group_size
    c = float(torch.randn(()).sign() * 10 ** (torch.rand(()) * 4 - 2))  # |c| in [0.01, 100]
    w[1, :g] = 0
    w[3, g:2 * g] = c if group_size != -1 else 0
    w[4, :g] = c
    q = rtn_quantize(w, group_size, **kw)
    assert torch.isfinite(q.scales).all() and torch.isfinite(q.zeros).all() and (q.scales > 0).all()
    d = _dq(q)
    assert torch.equal(d[1, :g], torch.zeros(g))
    assert ((d[4, :g] - c).abs() <= 2 ** -10 * abs(c)).all()  # float16's own rounding of c, about
    assert torch.isfinite(d).all()


@pytest.mark.parametrize("big", [1e6, -1e5])
@pytest.mark.parametrize("kw", PLACEMENTS[::2], ids=_placement)
def test_weights_float16_scales_cannot_hold_are_refused(big, kw):
    w = torch.randn(4, 128) * 0.02
    w[2, 70] = big
    with pytest.raises(ValueError, match=r"\|w\| = 1e\+0[56] need a scale or zero point beyond float16's range.*"
                                         "modules_to_not_convert"):
        rtn_quantize(w, 64, **kw)


@pytest.mark.parametrize("kw", PLACEMENTS[::2], ids=_placement)
def test_weights_whose_scales_float16_holds_with_2_bits_or_fewer_are_refused(kw):
    """Every scale a float16 subnormal a few steps of 2^-24 above 0: the codes missed the weights by 7x more than on
    normal scales (|w| ~ 1e-7), without a word. One small group among normal ones, or a layer of zeros, is fine."""
    from nibble.quantize.rtn import check_values

    w = torch.randn(4, 128)
    w /= w.abs().max()
    for tiny in (w * 1e-6, w * 1e-7):
        with pytest.raises(ValueError, match=r"\|w\| = 1e-0[67] need group scales below 2\.38e-07, which float16.* "
                                             "2 bits or fewer: keep this layer in 16 bits"):
            rtn_quantize(tiny, 64, **kw)
        with pytest.raises(ValueError, match="2 bits or fewer"):
            check_values(tiny, 64, kw["symmetric"], kw["zero_point"])
        check_values(tiny, 64, kw["symmetric"], kw["zero_point"], scales=False)  # GPTQ, AWQ
    for fine in (torch.zeros(4, 128), torch.cat([w[:2] * 1e-7, w[2:] * 0.02]), w * 2e-6):
        rtn_quantize(fine, 64, **kw)
        check_values(fine, 64, kw["symmetric"], kw["zero_point"])


def test_gptq_and_awq_scales_of_a_zero_group_are_finite():
    """GPTQ and AWQ place their levels with RTN's helpers: a zero group (GPTQ zeroes the columns of inputs that
    calibration never saw) gets a scale above 0 there too."""
    from nibble.quantize.awq import clip_quantize
    from nibble.quantize.gptq import gptq_quantize_weight

    w = torch.randn(32, 128) * 0.02
    w[5, 64:] = 0
    x = torch.randn(256, 128)
    x[:, 32:64] = 0  # inputs never active: GPTQ zeroes their weights, a whole group of every row
    H = 2 * x.t() @ x / x.shape[0]
    gptq = [gptq_quantize_weight(w, H, 32, clip_search=c, act_order=a, static_groups=a).weight
            for c in (False, True) for a in (False, True)]
    # AWQ quantizes w as it is; GPTQ moves each column's error into later columns, never into dead inputs
    awq = clip_quantize(w, H / 2, 32)
    for q, zero in [(q, (slice(None), slice(32, 64))) for q in gptq] + [(awq, (5, slice(64, None)))]:
        assert torch.isfinite(q.scales).all() and torch.isfinite(q.zeros).all() and (q.scales > 0).all()
        d = _dq(q)
        assert torch.isfinite(d).all()
        assert torch.equal(d[zero], torch.zeros_like(d[zero]))


@pytest.mark.parametrize("symmetric,zero_point", [(False, "int"), (False, "float"), (True, "int")])
def test_check_values_refuses_what_rtn_quantize_refuses_without_quantizing(symmetric, zero_point):
    """quantize_model checks every weight up front with it (a refusal at a layer's turn left the model half
    quantized); near float16's edge it must agree with rtn_quantize group by group, all-positive, all-negative and
    mixed groups alike."""
    from nibble.quantize.rtn import ScaleOverflowError, check_values

    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        w = (torch.rand(4, 64, generator=g) * 2 - 1) * (54_000 + 16_000 * torch.rand(1, generator=g))
        w = (w.abs(), -w.abs(), w)[trial % 3]
        outcomes = []
        for check in (lambda: rtn_quantize(w, 32, symmetric, zero_point, clip_search=False),
                      lambda: check_values(w, 32, symmetric, zero_point)):
            try:
                check()
                outcomes.append(None)
            except ScaleOverflowError as e:
                outcomes.append(str(e))
        assert outcomes[0] == outcomes[1]
    w[1, 2] = float("nan")
    with pytest.raises(ValueError, match="weight contains NaN or Inf"):
        check_values(w.bfloat16(), 32, symmetric, zero_point, scales=False)


@pytest.mark.parametrize("kwargs, message", [
    (dict(chunk_rows=0), "chunk_rows must be an integer >= 1, got 0"),
    (dict(chunk_rows=-1), "chunk_rows must be an integer >= 1, got -1"),
    (dict(grid=0), "grid must be an integer >= 1, got 0"),
    (dict(grid=2.5), "grid must be an integer >= 1, got 2.5"),
    (dict(min_shrink=0), r"min_shrink must be in \(0, 1\]")])
def test_rtn_options_out_of_range_are_refused_by_name(kwargs, message):
    """chunk_rows=0 failed in range(), -1 in torch.cat of nothing."""
    with pytest.raises(ValueError, match=message):
        rtn_quantize(torch.randn(8, 64), 32, **kwargs)


def test_a_min_shrink_of_1_is_a_search_that_never_clips():
    """min_shrink is in (0, 1]: 1 is allowed, every ratio tried is then the full range, and the result is plain
    min/max RTN."""
    W = torch.randn(24, 128, generator=torch.Generator().manual_seed(18)) * 0.05
    a = rtn_quantize(W, 32, clip_search=True, min_shrink=1.0)
    b = rtn_quantize(W, 32, clip_search=False)
    for name in ("qweight", "scales", "zeros"):
        assert torch.equal(getattr(a, name), getattr(b, name))
