"""AutoAWQ GEMM <-> canonical: bit-exact round trips and agreement with AWQ's published dequant formula."""
import pytest
import torch

from conftest import assert_unchanged_by_edits, random_canonical
from nibble.formats.awq import from_awq, to_awq
from nibble.formats.int4 import Int4Weight
from nibble.kernels.reference import dequantize
from nibble.quantize.rtn import rtn_quantize

# The published layout (AutoAWQ WQLinear_GEMM): qweight [K, N/8] int32, nibble i (bits 4i) of word c holds
# output column 8c + ORDER[i]; qzeros [K/G, N/8] packed the same way; W = (q - zp) * s.
ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


def awq_unpack_reference(words: torch.Tensor) -> torch.Tensor:
    """[R, N/8] int32 -> [R, N] int64, written from the format description (independent of nibble)."""
    out = torch.zeros(words.shape[0], words.shape[1] * 8, dtype=torch.int64)
    for i, col in enumerate(ORDER):
        out[:, col::8] = (words.to(torch.int64) >> (4 * i)) & 0xF
    return out


def awq_pack_reference(values: torch.Tensor) -> torch.Tensor:
    """Inverse of awq_unpack_reference, as AutoAWQ's from_linear loop writes it (OR of shifted columns)."""
    R, N = values.shape
    words = torch.zeros(R, N // 8, dtype=torch.int64)
    for c in range(N // 8):
        for i, col in enumerate(ORDER):
            words[:, c] |= values[:, 8 * c + col].to(torch.int64) << (4 * i)
    words = torch.where(words >= 2 ** 31, words - 2 ** 32, words)
    return words.to(torch.int32)


def awq_dequant_reference(qweight, qzeros, scales, G) -> torch.Tensor:
    """W [N, K] in float64: (q - zp) * s, the AWQ formula."""
    q = awq_unpack_reference(qweight)
    zp = awq_unpack_reference(qzeros).repeat_interleave(G, dim=0)
    s = scales.double().repeat_interleave(G, dim=0)
    return ((q - zp) * s).t()


def random_awq(K, N, G, seed=0):
    g = torch.Generator().manual_seed(seed)
    words = lambda r, c: torch.randint(-2 ** 31, 2 ** 31, (r, c), generator=g, dtype=torch.int64).to(torch.int32)
    return words(K, N // 8), words(K // G, N // 8), (torch.rand(K // G, N, generator=g) * 0.05 + 1e-3).half()


GROUPS = [32, 64, 128, -1]


def assert_same_weight(a: Int4Weight, b: Int4Weight):
    assert a.group_size == b.group_size
    for name in ("qweight", "scales", "zeros"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("G", GROUPS)
@pytest.mark.parametrize("symmetric", [True, False])
def test_canonical_to_awq_to_canonical_is_bit_exact(G, symmetric):
    K, N = 256, 48
    w = random_canonical(K, N, K if G == -1 else G, symmetric)
    t = to_awq(w)
    assert t["qweight"].shape == (K, N // 8) and t["qweight"].dtype == torch.int32
    assert t["qzeros"].shape == (w.scales.shape[0], N // 8) and t["scales"].dtype == torch.float16
    assert_same_weight(from_awq(t["qweight"], t["qzeros"], t["scales"], G), w)


@pytest.mark.parametrize("G", GROUPS)
def test_awq_to_canonical_to_awq_is_bit_exact(G):
    K, N = 256, 64
    qweight, qzeros, scales = random_awq(K, N, K if G == -1 else G)
    back = to_awq(from_awq(qweight, qzeros, scales, G))
    assert torch.equal(back["qweight"], qweight)
    assert torch.equal(back["qzeros"], qzeros)
    assert torch.equal(back["scales"], scales)


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("G", [32, 128])
def test_rtn_weights_round_trip_and_pack_like_autoawq(G, symmetric):
    w = rtn_quantize(torch.randn(96, 256), G, symmetric=symmetric)
    t = to_awq(w)
    codes = w.codes().t()  # [K, N]
    zp = torch.round(-w.zeros.float() / w.scales.float()).long()
    assert torch.equal(t["qweight"], awq_pack_reference(codes))
    assert torch.equal(t["qzeros"], awq_pack_reference(zp))
    assert_same_weight(from_awq(t["qweight"], t["qzeros"], t["scales"], G), w)


@pytest.mark.parametrize("G", GROUPS)
def test_dequantized_awq_layer_matches_the_awq_formula(G):
    K, N = 256, 64
    Gk = K if G == -1 else G
    qweight, qzeros, scales = random_awq(K, N, Gk, seed=1)
    expected = awq_dequant_reference(qweight, qzeros, scales, Gk)
    w = from_awq(qweight, qzeros, scales, G)
    got = dequantize(w.qweight, w.scales, w.zeros, w.group_size).double()
    # The canonical form q*s + z rounds z = -zp*s to fp16 once: the only difference from (q - zp)*s,
    # at most half an fp16 ulp of zp*s (2^-11 relative; 2^-25 absolute in the subnormal range).
    zps = (awq_unpack_reference(qzeros).double() * scales.double()).repeat_interleave(Gk, dim=0).t()
    bound = zps.abs() * 2.0 ** -11 + 2.0 ** -25
    assert ((got - expected).abs() <= bound).all()
    # ...and that error is small next to the quantization step itself
    assert (got - expected).abs().max() <= scales.double().max() * 15 * 2 ** -11


def test_nibble_order_of_one_word():
    # column 8c + j lives in nibble REVERSE[j] = (0, 4, 1, 5, 2, 6, 3, 7)[j]
    codes = torch.zeros(8, 8, dtype=torch.uint8)
    codes[0, :] = torch.arange(1, 9, dtype=torch.uint8)  # column j of row k=0 holds j+1
    w = Int4Weight.from_codes(codes.t(), torch.ones(8, 1), torch.zeros(8, 1), 8)
    word = to_awq(w)["qweight"][0, 0].item() & 0xFFFFFFFF
    nibbles = [(word >> (4 * i)) & 0xF for i in range(8)]
    assert nibbles == [1, 3, 5, 7, 2, 4, 6, 8]


def test_float_zero_points_are_refused():
    w = rtn_quantize(torch.randn(16, 64), 32, zero_point="float")
    with pytest.raises(ValueError, match="float zero points"):
        to_awq(w)


def test_bad_shapes_are_refused():
    qweight, qzeros, scales = random_awq(64, 16, 32)
    with pytest.raises(ValueError, match="shapes disagree"):
        from_awq(qweight, qzeros, scales, 16)
    with pytest.raises(ValueError, match="float16"):
        from_awq(qweight, qzeros, scales.float(), 32)
    # K = 12 rows, one group per channel: K % G is 0, and only K % 8 refuses it before the unpacking
    with pytest.raises(ValueError, match=r"^AWQ qweight has K=12 rows, which must be divisible by 8 and by "
                                         r"group_size=-1$"):
        from_awq(torch.zeros(12, 2, dtype=torch.int32), torch.zeros(1, 2, dtype=torch.int32),
                 torch.ones(1, 16, dtype=torch.float16), -1)
    w = random_canonical(64, 12, 32, False)  # N = 12 is not a multiple of 8
    with pytest.raises(ValueError, match="multiple of 8"):
        to_awq(w)


def test_the_converted_tensors_share_no_memory_with_their_source():
    """to_awq and from_awq return tensors of their own: an edit of the exported scales (a cast or rescale in place
    before writing them) reached the model's weight, and an edit of the checkpoint's tensors the imported weight."""
    w = random_canonical(128, 16, 32, symmetric=False, seed=int(torch.randint(0, 2 ** 31, ())))
    assert_unchanged_by_edits(w, to_awq(w).values())
    qweight, qzeros, scales = random_awq(128, 16, 32, seed=int(torch.randint(0, 2 ** 31, ())))
    assert_unchanged_by_edits(from_awq(qweight, qzeros, scales, 32), (qweight, qzeros, scales))


@pytest.mark.parametrize("group_size", [0, -8])
def test_a_group_size_of_zero_or_below_is_refused_by_name(group_size):
    """group_size 0 was a bare ZeroDivisionError (K % 0) where AWQ's group size is read from a config.json."""
    qweight, qzeros, scales = random_awq(64, 16, 32, seed=int(torch.randint(0, 2 ** 31, ())))
    with pytest.raises(ValueError, match=rf"^AWQ qweight has K=64 rows, which must be divisible by 8 and by "
                                         rf"group_size={group_size}$"):
        from_awq(qweight, qzeros, scales, group_size)


@pytest.mark.parametrize("part", ["qzeros", "scales"])
def test_zero_points_or_scales_of_fewer_groups_than_the_group_size_makes_are_refused(part):
    """qzeros of one group row where the group size makes two broadcast over both groups (every group read with the
    first one's zero points), and scales of one row were refused only by the weight's own check, naming no AWQ shape."""
    K, N, G = 64, 16, 32
    tensors = dict(zip(("qweight", "qzeros", "scales"), random_awq(K, N, G, seed=int(torch.randint(0, 2 ** 31, ())))))
    tensors[part] = tensors[part][:1]
    with pytest.raises(ValueError, match=r"^AWQ shapes disagree: qweight \(64, 2\) \(K=64, N=16\), group 32 needs "
                                         r"qzeros \(2, 2\) and scales \(2, 16\)"):
        from_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"], G)


@pytest.mark.parametrize("part", ["qweight", "qzeros"])
def test_packed_awq_words_of_another_dtype_than_int32_are_refused(part):
    tensors = dict(zip(("qweight", "qzeros", "scales"), random_awq(64, 16, 32, seed=int(torch.randint(0, 2 ** 31, ())))))
    tensors[part] = tensors[part].to(torch.int64)
    with pytest.raises(ValueError, match=r"^AWQ qweight/qzeros must be int32"):
        from_awq(tensors["qweight"], tensors["qzeros"], tensors["scales"], 32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_awq_scales_of_another_dtype_than_float16_are_refused_as_awqs(dtype):
    qweight, qzeros, scales = random_awq(64, 16, 32, seed=int(torch.randint(0, 2 ** 31, ())))
    with pytest.raises(ValueError, match=rf"^AWQ scales must be float16, got {dtype}$"):
        from_awq(qweight, qzeros, scales.to(dtype), 32)
