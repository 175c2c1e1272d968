"""The kernel benchmark's summary (`nibble.bench.kernels.summarize`), a pure function of its rows."""
import math

import pytest

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
