"""The kernel benchmarks' summaries (`nibble.bench.kernels.summarize`, `nibble.bench.w4a4.summarize`), pure
functions of their rows."""
import math

import pytest

from nibble.bench import w4a4
from nibble.bench.kernels import summarize


def rows(base_op):
    # 4096 x 4096 (32 MB of 16-bit weight) and 12288 x 4096 (96 MB) at one M, plus tinygemm on one shape
    return [dict(op=base_op, M=1, N=4096, K=4096, us=12.0), dict(op="nibble", M=1, N=4096, K=4096, us=6.0),
            dict(op=base_op, M=1, N=12288, K=4096, us=27.0), dict(op="nibble", M=1, N=12288, K=4096, us=9.0),
            dict(op="tinygemm", M=1, N=12288, K=4096, us=18.0)]


@pytest.mark.parametrize("base_op", ["bf16", "fp16"])
def test_summary_names_its_baseline_and_takes_the_large_shapes_apart(base_op):
    (s,) = summarize(rows(base_op), base_op=base_op)
    assert s["baseline"] == base_op
    assert s["geomean_vs_cublas"] == pytest.approx(math.sqrt(2.0 * 3.0))  # 12 / 6 and 27 / 9
    assert s["geomean_vs_cublas_big"] == pytest.approx(3.0)               # 12288 x 4096 only
    assert s["min_vs_cublas"] == pytest.approx(2.0)
    assert s["geomean_vs_tinygemm"] == pytest.approx(2.0) and s["min_vs_tinygemm"] == pytest.approx(2.0)


def test_summary_without_tinygemm_rows_says_nan():
    (s,) = summarize([r for r in rows("fp16") if r["op"] != "tinygemm"], base_op="fp16")
    assert math.isnan(s["geomean_vs_tinygemm"]) and math.isnan(s["min_vs_tinygemm"])


def test_w4a4_summary_takes_the_large_shapes_apart_and_says_nan_for_an_op_not_timed():
    """It printed the geomean over all shapes alone, where issue 4 sets its M = 1 and 128 bars on the >= 64 MB ones
    (session 72's M = 128: 1.75x over all, 1.85x over those), and returned nothing for the JSON."""
    timed = [dict(op="bf16", M=1, N=4096, K=4096, us=12.0), dict(op="w4a4", M=1, N=4096, K=4096, us=6.0),
             dict(op="fp8", M=1, N=4096, K=4096, us=9.0), dict(op="w4a4_h", M=1, N=4096, K=4096, us=8.0),
             dict(op="bf16", M=1, N=12288, K=4096, us=27.0), dict(op="w4a4", M=1, N=12288, K=4096, us=9.0),
             dict(op="fp8", M=1, N=12288, K=4096, us=18.0), dict(op="w4a4_h", M=1, N=12288, K=4096, us=13.5)]
    said = []
    (s,) = w4a4.summarize(timed, log=said.append)
    assert s["M"] == 1
    assert s["geomean_vs_bf16"] == pytest.approx(math.sqrt(2.0 * 3.0)) and s["geomean_vs_bf16_big"] == pytest.approx(3.0)
    assert s["geomean_vs_fp8"] == pytest.approx(math.sqrt(1.5 * 2.0))
    assert s["hadamard_geomean_vs_bf16"] == pytest.approx(math.sqrt(1.5 * 2.0))
    assert s["hadamard_geomean_vs_bf16_big"] == pytest.approx(2.0)
    assert said[-1].split() == ["1", "2.45x", "3.00x", "1.73x", "1.73x", "2.00x"]
    (s,) = w4a4.summarize([r for r in timed if r["op"] != "fp8"], log=said.append)
    assert math.isnan(s["geomean_vs_fp8"]) and s["geomean_vs_bf16"] == pytest.approx(math.sqrt(6.0))


def test_the_big_shapes_hold_at_least_64_mb_of_16_bit_weight():
    from nibble.bench.timing import holds_big_weight

    assert holds_big_weight(4096, 8192)  # exactly 64 MiB
    assert not holds_big_weight(4096, 8191) and not holds_big_weight(4096, 4096)
    assert holds_big_weight(12288, 4096) and holds_big_weight(8192, 28672)


def test_geomean_leaves_out_what_was_not_timed():
    """None (an op a shape does not run) and non-positive values are left out, not a math error; none left: NaN."""
    from nibble.bench.timing import geomean

    assert geomean([1.0, None, 4.0, 0.0, -2.0]) == pytest.approx(2.0)
    assert math.isnan(geomean([None, 0.0])) and math.isnan(geomean([]))


def test_an_int4_layer_is_its_packed_codes_and_fp16_scales_and_zeros():
    from nibble.bench.kernels import int4_bytes

    assert int4_bytes(4096, 4096, 128) == 4096 * 4096 // 2 + 2 * (4096 // 128) * 4096 * 2
    assert int4_bytes(64, 256, 32) == 64 * 256 // 2 + 2 * 8 * 64 * 2


def test_the_cublas_rows_are_named_by_the_activations_dtype():
    import torch

    from nibble.bench.kernels import baseline_op

    assert baseline_op(torch.bfloat16) == "bf16" and baseline_op(torch.float16) == "fp16"


def test_random_int4_zero_points_take_every_code():
    """Asymmetric integer zero points 0..15 (z = -zp * scale), positive scales, in the canonical layout."""
    import torch

    from nibble.bench.kernels import random_int4

    qweight, scales, zeros = random_int4(4096, 256, 128, "cpu")
    assert qweight.shape == (32, 4096) and qweight.dtype == torch.int32
    assert scales.shape == zeros.shape == (2, 4096) and bool((scales > 0).all())
    zp = torch.round(-zeros.float() / scales.float())
    assert set(zp.unique().tolist()) == set(range(16))


def test_the_w4a4_int8_baseline_weight_is_the_codes_minus_8_per_row_of_n():
    import torch

    from nibble.formats.int4 import unpack_int4

    qweight = torch.randint(-2**31, 2**31 - 1, (8, 48), dtype=torch.int32)
    w = w4a4.unpack_weight_int8(qweight)
    assert w.dtype == torch.int8 and w.shape == (48, 64)
    torch.testing.assert_close(w, (unpack_int4(qweight).to(torch.int16) - 8).to(torch.int8).t())
    assert int(w.min()) >= -8 and int(w.max()) <= 7


def test_w4a4_summary_takes_each_m_on_its_own_rows_and_lists_only_the_ops_timed():
    timed = [dict(op="bf16", M=1, N=4096, K=4096, us=12.0), dict(op="w4a4", M=1, N=4096, K=4096, us=6.0),
             dict(op="bf16", M=128, N=4096, K=4096, us=40.0), dict(op="w4a4", M=128, N=4096, K=4096, us=10.0)]
    said = []
    summary = w4a4.summarize(timed, log=said.append)
    assert [s["M"] for s in summary] == [1, 128]
    assert [s["geomean_vs_bf16"] for s in summary] == [pytest.approx(2.0), pytest.approx(4.0)]
    assert said[0].split() == ["bf16", "w4a4", "w4a4/bf16"]  # no column for an op no row has
    assert said[1].split() == ["4096x4096", "M=1", "12.0", "6.0", "2.00x"]
