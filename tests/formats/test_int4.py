import re

import pytest
import torch

from nibble.formats.int4 import Int4Weight, pack_int4, unpack_int4


@pytest.mark.parametrize("K,N", [(8, 1), (64, 3), (576, 1536), (4096, 24), (8, 0), (0, 5)])
def test_pack_unpack_roundtrip_is_bit_exact(K, N):
    codes = torch.randint(0, 16, (K, N), dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.dtype == torch.int32 and packed.shape == (K // 8, N)
    assert torch.equal(unpack_int4(packed), codes)
    for dtype in (torch.float32, torch.float64):  # the dequantization's codes, cast from the words once
        assert torch.equal(unpack_int4(packed, dtype), codes.to(dtype))


def test_packing_puts_row_8i_plus_j_in_bits_4j():
    codes = torch.zeros(16, 2, dtype=torch.uint8)
    codes[8 + 3, 1] = 0xA  # row k = 8*1 + 3 -> word 1, bits 12..15
    codes[7, 0] = 0xF  # top nibble: sign bit of the int32 word
    packed = pack_int4(codes)
    assert packed[1, 1].item() == 0xA << 12
    assert packed[0, 0].item() == -(1 << 28)  # 0xF0000000 as two's complement


def test_pack_rejects_bad_codes_and_shapes():
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack_int4(torch.full((8, 2), 16))
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int4(torch.zeros(12, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match="int32"):
        unpack_int4(torch.zeros(2, 2, dtype=torch.int64))
    codes = torch.randint(0, 16, (8, 2))
    for fractional in (codes + torch.rand(8, 2) * 0.9, codes > 7):  # were packed truncated
        with pytest.raises(TypeError, match=f"integer codes, got {fractional.dtype}"):
            pack_int4(fractional)


def test_int4weight_validates_shapes_and_divisibility():
    q = torch.zeros(8, 4, dtype=torch.int32)  # K = 64
    s = torch.ones(2, 4, dtype=torch.float16)
    w = Int4Weight(q, s, s.clone(), 32)
    assert (w.in_features, w.out_features) == (64, 4)
    with pytest.raises(ValueError, match="not divisible by group_size=48"):
        Int4Weight(q, s, s, 48)
    with pytest.raises(ValueError, match="scales must have shape"):
        Int4Weight(q, torch.ones(1, 4, dtype=torch.float16), s, 32)
    with pytest.raises(ValueError, match="float16"):
        Int4Weight(q, s.float(), s, 32)
    # a group size no kernel reads (not whole words of 8 codes), and a qweight that is not 2-D, named as such
    with pytest.raises(ValueError, match="positive multiple of 8.*got 4"):
        Int4Weight(q, torch.ones(16, 4, dtype=torch.float16), torch.ones(16, 4, dtype=torch.float16), 4)
    with pytest.raises(ValueError, match=r"qweight must be a 2-D int32 tensor \[K // 8, N\], got torch.int32 \(1, 8, 4\)"):
        Int4Weight(q[None], s, s, 32)
    # -1 is the quantizers' shorthand; a weight holds the width itself (it was "not divisible by group_size=-1")
    with pytest.raises(ValueError, match=r"group_size is a group's width \(in_features=64 for one group a row\)"):
        Int4Weight(q, s[:1], s[:1], -1)


def test_pack_refuses_a_negative_code_which_would_corrupt_its_neighbours():
    """-1 as an int32 is all ones: shifted into its nibble it set every bit above it, the codes of the rows after."""
    codes = torch.randint(0, 16, (16, 3))
    codes[9, 1] = -1
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        pack_int4(codes)


@pytest.mark.parametrize("shape", [(16,), (2, 8, 3)])
def test_pack_refuses_codes_that_are_not_2d_naming_the_shape(shape):
    with pytest.raises(ValueError, match=rf"2-D \[K, N\] tensor of codes, got shape {re.escape(str(shape))}"):
        pack_int4(torch.randint(0, 16, shape))


@pytest.mark.parametrize("part", ["scales", "zeros"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_int4weight_refuses_scales_or_zeros_of_another_16_or_32_bit_float(part, dtype):
    """bfloat16 is as wide as float16: scales of another float format, read as float16 by the kernels, are refused."""
    q = torch.randint(-2 ** 31, 2 ** 31, (8, 4), dtype=torch.int64).to(torch.int32)  # K = 64
    tensors = {"scales": (torch.rand(2, 4) * 0.05 + 1e-3).half(), "zeros": -(torch.rand(2, 4) * 0.4).half()}
    tensors[part] = tensors[part].to(dtype)
    with pytest.raises(ValueError, match=rf"^{part} must be float16, got {dtype}$"):
        Int4Weight(q, tensors["scales"], tensors["zeros"], 32)


def test_int4weight_nbytes_counts_its_codes_scales_and_zeros():
    K, N, G = 128, 24, 32
    w = Int4Weight(torch.randint(-2 ** 31, 2 ** 31, (K // 8, N), dtype=torch.int64).to(torch.int32),
                   (torch.rand(K // G, N) * 0.05 + 1e-3).half(), -(torch.rand(K // G, N) * 0.4).half(), G)
    assert w.nbytes() == K // 8 * N * 4 + 2 * (K // G * N * 2)


def test_int4weight_refuses_a_qweight_of_64_bit_words():
    """int64 words hold the codes of 16 rows where the format's int32 holds 8: read as int32's, every other row."""
    q = torch.randint(-2 ** 31, 2 ** 31, (8, 4), dtype=torch.int64)  # K = 64 as int32 words
    s = (torch.rand(2, 4) * 0.05 + 1e-3).half()
    with pytest.raises(ValueError, match=r"^qweight must be a 2-D int32 tensor \[K // 8, N\], got torch.int64 \(8, 4\)$"):
        Int4Weight(q, s, -(s * 8), 32)
