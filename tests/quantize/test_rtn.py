import pytest
import torch

from nibble.kernels.reference import dequantize
from nibble.quantize.rtn import rtn_quantize


def _dq(w):
    return dequantize(w.qweight, w.scales, w.zeros, w.group_size)


@pytest.mark.parametrize("group_size", [32, 64, 128, -1])
@pytest.mark.parametrize("symmetric,zero_point", [(False, "int"), (False, "float"), (True, "int")])
def test_rtn_error_is_at_most_half_a_step_inside_the_range(group_size, symmetric, zero_point):
    w = torch.randn(48, 256) * 0.02
    q = rtn_quantize(w, group_size, symmetric=symmetric, zero_point=zero_point, clip_search=False)
    g = 256 if group_size == -1 else group_size
    step = q.scales.float().t().repeat_interleave(g, dim=1)
    err = (_dq(q) - w).abs()
    # Without clipping every weight is inside the representable range: error <= s/2 (+ fp16 slack).
    assert (err <= step / 2 + 1e-3 * step + 1e-7).all()


def test_symmetric_weights_are_exactly_q_minus_8_times_s():
    q = rtn_quantize(torch.randn(16, 128), -1, symmetric=True)
    assert torch.equal(q.zeros, (-8 * q.scales.float()).half())


def test_clip_search_never_increases_the_error():
    w = torch.randn(64, 512) * 0.02
    w[::7, ::31] *= 25  # outliers that stretch the plain range
    plain = ((_dq(rtn_quantize(w, 128, clip_search=False)) - w) ** 2).sum()
    clipped = ((_dq(rtn_quantize(w, 128, clip_search=True)) - w) ** 2).sum()
    assert clipped < plain


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
    (torch.randn(4, 100), ValueError, "not divisible by group_size=64"),
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
