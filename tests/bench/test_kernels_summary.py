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
