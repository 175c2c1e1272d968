"""GPTQ <-> canonical: bit-exact round trips (v1 and v2 zero points, act-order g_idx) and the GPTQ dequant formula."""
import re

import pytest
import torch

from conftest import assert_unchanged_by_edits, random_canonical
from nibble.formats.awq import to_awq
from nibble.formats.gptq import from_gptq, holds_in_v1, to_gptq
from nibble.formats.int4 import Int4Weight
from nibble.formats.zero_points import pack_along_n
from nibble.kernels.reference import dequantize
from nibble.quantize.rtn import rtn_quantize

# Published layout (AutoGPTQ / GPTQModel QuantLinear): qweight [K/8, N] with row 8i+j in bits 4j of word i;
# qzeros [K/G, N/8] with column 8c+j in bits 4j of word c, holding zp - 1 in the v1 format ("gptq") and
# zp in v2 ("gptq_v2"); v1 <-> v2 word-wise by -/+ 0x11111111; W[n, k] = (q[k, n] - zp[g_idx[k], n]) * s[g_idx[k], n].


def unpack_k_reference(words):
    K8, N = words.shape
    out = torch.zeros(K8 * 8, N, dtype=torch.int64)
    for j in range(8):
        out[j::8] = (words.to(torch.int64) >> (4 * j)) & 0xF
    return out


def unpack_n_reference(words):
    R, C = words.shape
    out = torch.zeros(R, C * 8, dtype=torch.int64)
    for j in range(8):
        out[:, j::8] = (words.to(torch.int64) >> (4 * j)) & 0xF
    return out


def zero_points_reference(qzeros, checkpoint_format):
    w = qzeros.to(torch.int64) & 0xFFFFFFFF
    if checkpoint_format == "gptq":
        w = (w + 0x11111111) & 0xFFFFFFFF
    return unpack_n_reference(w)


def gptq_dequant_reference(qweight, qzeros, scales, g_idx, checkpoint_format) -> torch.Tensor:
    """W [N, K] in float64 by the GPTQ formula."""
    q = unpack_k_reference(qweight)
    zp = zero_points_reference(qzeros, checkpoint_format)
    g = g_idx.long()
    return ((q - zp[g]) * scales.double()[g]).t()


def random_gptq(K, N, G, seed=0, act_order=False, checkpoint_format="gptq_v2"):
    """Random GPTQ tensors; v1's zero points in [1, 15], the ones it can hold (`test_v1_refuses_a_zero_point_of_0`)."""
    gen = torch.Generator().manual_seed(seed)
    words = lambda r, c: torch.randint(-2 ** 31, 2 ** 31, (r, c), generator=gen, dtype=torch.int64).to(torch.int32)
    scales = (torch.rand(K // G, N, generator=gen) * 0.05 + 1e-3).half()
    g_idx = (torch.arange(K) // G).to(torch.int32)
    if act_order:  # GPTQ act-order: the j-th column in quantization order belongs to group j // G
        order = torch.randperm(K, generator=gen)
        g_idx = torch.empty(K, dtype=torch.int32)
        g_idx[order] = (torch.arange(K) // G).to(torch.int32)
    qzeros = words(K // G, N // 8)
    if checkpoint_format == "gptq":
        qzeros = pack_along_n(torch.randint(0, 15, (K // G, N), generator=gen, dtype=torch.int32))
    return words(K // 8, N), qzeros, scales, g_idx


GROUPS = [32, 64, 128, -1]
FORMATS = ["gptq", "gptq_v2"]


def assert_same_weight(a: Int4Weight, b: Int4Weight):
    assert a.group_size == b.group_size
    for name in ("qweight", "scales", "zeros"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("G", GROUPS)
@pytest.mark.parametrize("symmetric", [True, False])
def test_canonical_to_gptq_to_canonical_is_bit_exact(G, symmetric, fmt):
    K, N = 256, 48
    Gk = K if G == -1 else G
    w = random_canonical(K, N, Gk, symmetric, min_zp=1 if fmt == "gptq" else 0)
    t = to_gptq(w, checkpoint_format=fmt)
    assert torch.equal(t["qweight"], w.qweight)  # the K-packed qweight is the canonical one
    assert torch.equal(t["g_idx"], (torch.arange(K) // Gk).to(torch.int32))
    back, perm = from_gptq(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], G, checkpoint_format=fmt)
    assert perm is None
    assert_same_weight(back, w)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("G", GROUPS)
def test_gptq_to_canonical_to_gptq_is_bit_exact(G, fmt):
    K, N = 256, 64
    qweight, qzeros, scales, g_idx = random_gptq(K, N, K if G == -1 else G, checkpoint_format=fmt)
    w, perm = from_gptq(qweight, qzeros, scales, g_idx, G, checkpoint_format=fmt)
    back = to_gptq(w, perm, checkpoint_format=fmt)
    for name, t in {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}.items():
        assert torch.equal(back[name], t), name


def test_v1_refuses_a_zero_point_of_0():
    """v1 stores zp - 1: a zp of 0 borrowed from the next nibble, and AutoGPTQ / vLLM (nibble-wise + 1) read that group
    at 16 and the next output's at its zp - 1 (a group with no negative weight has zp 0)."""
    w = rtn_quantize(torch.randn(16, 64) + torch.tensor([4.0, 0.0]).repeat_interleave(32), 32)  # group 0 all positive
    zp_v2 = unpack_n_reference(to_gptq(w, checkpoint_format="gptq_v2")["qzeros"])
    assert (zp_v2[0] == 0).all() and (zp_v2[1] > 0).all()
    assert not holds_in_v1(w) and holds_in_v1(rtn_quantize(torch.randn(16, 64) - 4.0, 32))
    with pytest.raises(ValueError, match="16 groups have zero point 0 .* write checkpoint_format 'gptq_v2'"):
        to_gptq(w, checkpoint_format="gptq")


def test_symmetric_zero_points_in_both_conventions():
    w = rtn_quantize(torch.randn(16, 64), 32, symmetric=True)
    assert (to_gptq(w, checkpoint_format="gptq")["qzeros"] == 0x77777777).all()  # 8 - 1 in every nibble
    assert (to_gptq(w, checkpoint_format="gptq_v2")["qzeros"] == 0x88888888 - 2 ** 32).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("G", GROUPS)
def test_dequantized_gptq_layer_matches_the_gptq_formula(G, fmt):
    K, N = 256, 64
    Gk = K if G == -1 else G
    qweight, qzeros, scales, g_idx = random_gptq(K, N, Gk, seed=2, checkpoint_format=fmt)
    expected = gptq_dequant_reference(qweight, qzeros, scales, g_idx, fmt)
    w, perm = from_gptq(qweight, qzeros, scales, g_idx, G, checkpoint_format=fmt)
    got = dequantize(w.qweight, w.scales, w.zeros, w.group_size).double()
    zps = (zero_points_reference(qzeros, fmt).double() * scales.double()).repeat_interleave(Gk, dim=0).t()
    bound = zps.abs() * 2.0 ** -11 + 2.0 ** -25  # z = fp16(-zp*s): half an fp16 ulp of zp*s
    assert ((got - expected).abs() <= bound).all()


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("G", [32, 128])
def test_act_order_g_idx_is_handled_by_permuting_the_input(G, fmt):
    K, N = 256, 32
    qweight, qzeros, scales, g_idx = random_gptq(K, N, G, seed=3, act_order=True, checkpoint_format=fmt)
    w, perm = from_gptq(qweight, qzeros, scales, g_idx, G, checkpoint_format=fmt)
    assert perm is not None and perm.shape == (K,)
    assert (g_idx[perm].long() == torch.arange(K) // G).all()  # groups are contiguous after the permutation
    expected = gptq_dequant_reference(qweight, qzeros, scales, g_idx, fmt)
    got = dequantize(w.qweight, w.scales, w.zeros, w.group_size).double()
    # canonical column j is original input feature perm[j]: x[..., perm] @ got.T == x @ expected.T
    zps = (zero_points_reference(qzeros, fmt).double() * scales.double())[g_idx.long()].t()
    assert ((got - expected[:, perm]).abs() <= zps[:, perm].abs() * 2.0 ** -11 + 2.0 ** -25).all()
    back = to_gptq(w, perm, checkpoint_format=fmt)
    for name, t in {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}.items():
        assert torch.equal(back[name], t), name


def test_uneven_g_idx_is_refused():
    qweight, qzeros, scales, g_idx = random_gptq(64, 16, 32)
    g_idx = g_idx.clone()
    g_idx[0] = 1  # group 1 now has 33 members
    with pytest.raises(ValueError, match="exactly 32"):
        from_gptq(qweight, qzeros, scales, g_idx, 32)


@pytest.mark.parametrize("bad", [-1, 2])
def test_a_g_idx_naming_a_group_that_does_not_exist_is_refused(bad):
    """A negative group failed in torch.bincount as a bare RuntimeError ("only supports ... non-negative")."""
    qweight, qzeros, scales, g_idx = random_gptq(64, 16, 32, seed=int(torch.randint(0, 2 ** 31, ())))
    g_idx = g_idx.clone()
    g_idx[int(torch.randint(0, 64, ()))] = bad
    with pytest.raises(ValueError, match="g_idx must assign exactly 32 of the 64 input features to each of the 2 "
                                         "groups"):
        from_gptq(qweight, qzeros, scales, g_idx, 32)


@pytest.mark.parametrize("export", [to_awq, lambda w: to_gptq(w, checkpoint_format="gptq"),
                                    lambda w: to_gptq(w, checkpoint_format="gptq_v2")], ids=["awq", "gptq", "gptq_v2"])
def test_a_zero_point_of_16_is_refused_as_a_float_zero_point(export):
    """z = fp16(-16 s) is an integer zero point past what a nibble holds: the message says to re-quantize, not
    the packer's "4-bit codes must lie in [0, 15]"."""
    s = torch.full((2, 16), 0.01, dtype=torch.float16)
    w = Int4Weight(torch.zeros(8, 16, dtype=torch.int32), s, (s.float() * -16).half(), 32)
    with pytest.raises(ValueError, match=r"has float zero points .*-z/s=16 is not an integer in \[0, 15\].*"
                                         "Re-quantize with zero_point='int'"):
        export(w)


@pytest.mark.parametrize("export", [to_awq, lambda w: to_gptq(w, checkpoint_format="gptq"),
                                    lambda w: to_gptq(w, checkpoint_format="gptq_v2")], ids=["awq", "gptq", "gptq_v2"])
def test_a_negative_zero_point_is_refused_as_a_float_zero_point(export):
    """z = fp16(+s) is -zp * s with zp = -1, an integer below what a nibble holds: refused as a zero point to
    re-quantize, not left to the packer's bare "4-bit codes must lie in [0, 15]"."""
    s = torch.full((2, 16), 0.01, dtype=torch.float16)
    w = Int4Weight(torch.zeros(8, 16, dtype=torch.int32), s, s.clone(), 32)
    with pytest.raises(ValueError, match=r"has float zero points .*-z/s=-1 is not an integer in \[0, 15\].*"
                                         "Re-quantize with zero_point='int'"):
        export(w)


def test_a_perm_that_is_not_a_permutation_is_refused():
    """A repeated index wrote two canonical rows onto one input feature and left another's codes unwritten
    (torch.empty): a checkpoint of garbage, without a word."""
    w = random_canonical(64, 16, 32, symmetric=True)
    perm = torch.arange(64)
    perm[3] = 5
    with pytest.raises(ValueError, match=r"^perm must be a permutation of range\(64\)$"):
        to_gptq(w, perm)


@pytest.mark.parametrize("N,needs", [(12, r"qzeros \(2, 1\), and N a multiple of 8 \(the zero points a qzeros word "
                                          r"holds\)"),
                                     (16, r"qzeros \(2, 2\)")], ids=["N not a multiple of 8", "qzeros too narrow"])
def test_gptq_shapes_that_disagree_are_refused_before_the_data(N, needs):
    """N = 12 (not a multiple of 8: one qzeros word for its 12 zero points) was refused naming shapes that all
    matched, and without its own check the unpacking's bare RuntimeError of mismatched sizes came instead."""
    K, G = 64, 32
    with pytest.raises(ValueError, match=rf"GPTQ shapes disagree: qweight \(8, {N}\) \(K=64, N={N}\) needs scales "
                                         rf"\(2, {N}\) and {needs}; got \(2, {N}\) and \(2, 1\)$"):
        from_gptq(torch.zeros(K // 8, N, dtype=torch.int32), torch.zeros(K // G, 1, dtype=torch.int32),
                  torch.ones(K // G, N, dtype=torch.float16))


def test_float_zero_points_and_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="float zero points"):
        to_gptq(rtn_quantize(torch.randn(16, 64), 32, zero_point="float"))
    qweight, qzeros, scales, g_idx = random_gptq(64, 16, 32)
    with pytest.raises(ValueError, match="checkpoint_format"):
        from_gptq(qweight, qzeros, scales, g_idx, 32, checkpoint_format="gptq_v3")
    with pytest.raises(ValueError, match="disagrees"):
        from_gptq(qweight, qzeros, scales, g_idx, 16)


@pytest.mark.parametrize("act_order", [False, True])
def test_the_converted_tensors_share_no_memory_with_their_source(act_order):
    """to_gptq and from_gptq return tensors of their own (the qweight of an act-order one is repacked anyway): an
    edit of the exported tensors in place reached the model's weight, and an edit of the checkpoint's the import."""
    seed = int(torch.randint(0, 2 ** 31, ()))
    qweight, qzeros, scales, g_idx = random_gptq(128, 16, 32, seed=seed, act_order=act_order)
    w, perm = from_gptq(qweight, qzeros, scales, g_idx, 32, checkpoint_format="gptq_v2")
    assert_unchanged_by_edits(w, (qweight, qzeros, scales))
    assert_unchanged_by_edits(w, to_gptq(w, perm, checkpoint_format="gptq_v2").values())


@pytest.mark.parametrize("part", ["qweight", "qzeros"])
def test_packed_gptq_words_of_another_dtype_than_int32_are_refused(part):
    """int64 qzeros were read as they were (taken mod 2^32): a file of another layout than GPTQ's, loaded silently."""
    qweight, qzeros, scales, g_idx = random_gptq(64, 16, 32, seed=int(torch.randint(0, 2 ** 31, ())))
    tensors = {"qweight": qweight, "qzeros": qzeros}
    tensors[part] = tensors[part].to(torch.int64)
    with pytest.raises(ValueError, match=r"^GPTQ qweight/qzeros must be int32"):
        from_gptq(tensors["qweight"], tensors["qzeros"], scales, g_idx, 32, checkpoint_format="gptq_v2")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gptq_scales_of_another_dtype_than_float16_are_refused_as_gptqs(dtype):
    qweight, qzeros, scales, g_idx = random_gptq(64, 16, 32, seed=int(torch.randint(0, 2 ** 31, ())))
    with pytest.raises(ValueError, match=rf"^GPTQ scales must be float16, got {dtype}$"):
        from_gptq(qweight, qzeros, scales.to(dtype), g_idx, 32)


def test_scales_whose_group_rows_do_not_divide_the_inputs_are_refused_naming_them():
    """3 group rows for 64 inputs made a group size of 21, refused only by the weight's check as a group size no
    kernel runs, where the checkpoint's scales are what is wrong."""
    qweight, qzeros, scales, _ = random_gptq(64, 16, 32, seed=int(torch.randint(0, 2 ** 31, ())))
    scales = torch.cat([scales, scales[:1]])
    qzeros = torch.cat([qzeros, qzeros[:1]])
    with pytest.raises(ValueError, match=r"^GPTQ scales have 3 group rows, which do not divide in_features=64 "
                                         r"evenly$"):
        from_gptq(qweight, qzeros, scales)


def test_scales_of_another_width_than_the_outputs_are_refused_as_gptq_shapes():
    """Scales of 8 columns fewer than qweight's outputs met the zero points in a bare broadcasting RuntimeError."""
    qweight, qzeros, scales, g_idx = random_gptq(64, 16, 32, seed=int(torch.randint(0, 2 ** 31, ())))
    with pytest.raises(ValueError, match=r"^GPTQ shapes disagree: qweight \(8, 16\) \(K=64, N=16\) needs scales "
                                         r"\(2, 16\) and qzeros \(2, 2\); got \(2, 8\) and \(2, 2\)$"):
        from_gptq(qweight, qzeros, scales[:, :8], g_idx, 32)


@pytest.mark.parametrize("shape", [(16,), (2, 2, 8)])
def test_zero_points_to_pack_along_n_that_are_not_2d_are_refused_naming_the_shape(shape):
    with pytest.raises(ValueError, match=rf"^expected a 2-D \[rows, N\] tensor, got shape {re.escape(str(shape))}$"):
        pack_along_n(torch.randint(0, 16, shape, dtype=torch.int32))


@pytest.mark.parametrize("act_order", [False, True])
def test_the_exported_g_idx_is_int32_as_gptq_stores_it(act_order):
    qweight, qzeros, scales, g_idx = random_gptq(128, 16, 32, seed=int(torch.randint(0, 2 ** 31, ())),
                                                 act_order=act_order)
    w, perm = from_gptq(qweight, qzeros, scales, g_idx, 32, checkpoint_format="gptq_v2")
    back = to_gptq(w, perm, checkpoint_format="gptq_v2")["g_idx"]
    assert back.dtype == torch.int32 and torch.equal(back, g_idx)
