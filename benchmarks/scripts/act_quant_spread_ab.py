"""W4A4 at prefill sizes that launch early (17-128 tokens): the activation quantization on fewer SMs,
so that the product's CTAs, which need a whole SM each, start beside it and copy their first weight
stages while it runs (early_launch.py). The shipped kernel gives each row its own program (128 of
132 SMs at 128 tokens), so the product's CTAs mostly wait for SMs to empty.

Arms: the op as shipped; "legacy", the op with session 30's quantization (rint and a float-to-int
conversion per value, -q0 in the remainder's FMA: the kernel copied below); "clamped", session 31's
(the shipped arithmetic with its never-active clamp of the quotients to [-8, 7]); and the op with its
quantization replaced by the shipped code holding ROWS rows per program, either whole rows in
registers ("whole") or two passes over BLOCK_K-wide chunks ("chunk"). Every variant's codes and
scales checked equal to the shipped kernel's. Timed: `w4a4_linear` (quantize
+ product) and the quantization alone, CUDA graphs, weights rotated past the L2, rounds alternating
the arms' order, median of rounds.

    PYTHONPATH=. python3 benchmarks/scripts/act_quant_spread_ab.py --ms 64,128 --json out.json

With --cluster-lib, also arms "clusterC": benchmarks/scripts/quantize_rows_cluster.cu (CUDA), each row
split over a thread-block cluster of C CTAs (build it first with --build-cluster-lib PATH.so; nvcc, no GPU).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.timing import bench_us, env_meta, rotations, shape_list  # noqa: E402
from nibble.bench.w4a4 import random_w4a4  # noqa: E402
from nibble.kernels import cuda_build, launch, reference, w4a4  # noqa: E402
from nibble.kernels.early_launch import after_prior_grids, early_launch  # noqa: E402
from nibble.kernels.triton_device import interpreting  # noqa: E402
from triton.language.extra import libdevice  # noqa: E402

SHAPES = "4096x4096,12288x4096,11008x4096,4096x11008,14336x4096,4096x14336,28672x8192,8192x28672"


@triton.jit
def spread_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, fmax, ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
                  ONE_PASS: tl.constexpr, INTERPRET: tl.constexpr, PDL: tl.constexpr):
    after_prior_grids(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    r = rows[:, None].to(tl.int64)
    rmask = rows[:, None] < M
    if ONE_PASS:
        c = tl.arange(0, BLOCK_K)[None, :]
        mask = rmask & (c < K)
        xf = tl.load(x_ptr + r * stride_x + c, mask=mask, other=0.0).to(tl.float32)
        w4a4.store_int4_rows(xf, q_ptr + r * stride_q + c, mask, s_ptr + rows, rows < M, fmax, True, INTERPRET)
    else:
        amax = tl.zeros((ROWS,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            c = k0 + tl.arange(0, BLOCK_K)[None, :]
            xf = w4a4._sanitize(tl.load(x_ptr + r * stride_x + c, mask=rmask & (c < K), other=0.0).to(tl.float32), fmax)
            amax = tl.maximum(amax, tl.max(tl.abs(xf), axis=1))
        scale = w4a4._int4_scale(amax)
        for k0 in range(0, K, BLOCK_K):
            c = k0 + tl.arange(0, BLOCK_K)[None, :]
            mask = rmask & (c < K)
            xf = w4a4._sanitize(tl.load(x_ptr + r * stride_x + c, mask=mask, other=0.0).to(tl.float32), fmax)
            w4a4._store_int4_codes(xf, scale, q_ptr + r * stride_q + c, mask, True, INTERPRET)
        tl.store(s_ptr + rows, scale, mask=rows < M)


def spread_quantize(x, rows, block_k, warps):
    M, K = x.shape
    q = torch.empty((M, K), dtype=torch.int8, device=x.device)
    s = torch.empty((M,), dtype=torch.float32, device=x.device)
    pdl = early_launch(x.device, M, w4a4.PRODUCT_EARLY_TOKENS)
    spread_kernel[(triton.cdiv(M, rows),)](x, q, s, M, K, x.stride(0), q.stride(0), float(torch.finfo(x.dtype).max),
                                           ROWS=rows, BLOCK_K=block_k, ONE_PASS=block_k >= K, INTERPRET=interpreting(), PDL=pdl,
                                           num_warps=warps, launch_pdl=pdl)
    return q, s


@triton.jit
def legacy_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, fmax, ROWS: tl.constexpr, BLOCK: tl.constexpr,
                  CLAMPED: tl.constexpr, PDL: tl.constexpr):
    """Session 30's act-quant (no Hadamard, even_odd): per value rint, a float-to-int conversion and -q0;
    with CLAMPED session 31's: the shipped arithmetic with its quotients still clamped to [-8, 7]."""
    after_prior_grids(PDL)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    r = rows[:, None].to(tl.int64)
    c = tl.arange(0, BLOCK)[None, :]
    mask = (rows[:, None] < M) & (c < K)
    xf = w4a4._sanitize(tl.load(x_ptr + r * stride_x + c, mask=mask, other=0.0).to(tl.float32), fmax)
    scale = w4a4._int4_scale(tl.max(tl.abs(xf), axis=1))
    safe = tl.where(scale > 0.0, scale, 1.0)
    if CLAMPED:
        q = w4a4._round_to_int8(tl.minimum(tl.maximum(w4a4._row_quotients(xf, safe, False), -8.0), 7.0))
    else:
        pre = tl.where(safe < 1.0e-19, 18446744073709551616.0, 1.0)
        sp = safe * pre
        inv = tl.math.div_rn(tl.full(sp.shape, 1.0, tl.float32), sp)
        x = xf * pre[:, None]
        q0 = x * inv[:, None]
        rem = tl.fma(-q0, tl.broadcast_to(sp[:, None], x.shape), x)
        y = libdevice.rint(tl.fma(rem, tl.broadcast_to(inv[:, None], x.shape), q0))
        q = tl.minimum(tl.maximum(y, -8.0), 7.0).to(tl.int8)
    tl.store(q_ptr + r * stride_q + c, w4a4._codes(q, True), mask=mask)
    tl.store(s_ptr + rows, scale, mask=rows < M)


def legacy_quantize(x, clamped=False):
    """The shipped whole-row launch (`quantize_activations_triton`'s rows, block and warps) of legacy_kernel
    (where the shipped op takes the chunked kernel, M >= 512 of K > 16384, this stays whole-row)."""
    M, K = x.shape
    rows, block, warps, _ = w4a4._act_plan(K, False)
    if triton.cdiv(M, rows) < launch.num_sms(x.device):
        warps = min(32, max(warps, rows * block // 256))
    q = torch.empty((M, K), dtype=torch.int8, device=x.device)
    s = torch.empty((M,), dtype=torch.float32, device=x.device)
    pdl = early_launch(x.device, M, w4a4.PRODUCT_EARLY_TOKENS)
    legacy_kernel[(triton.cdiv(M, rows),)](x, q, s, M, K, x.stride(0), q.stride(0), float(torch.finfo(x.dtype).max),
                                           ROWS=rows, BLOCK=block, CLAMPED=clamped, PDL=pdl, num_warps=warps,
                                           launch_pdl=pdl)
    return q, s


def arms_for(K: int) -> dict:
    """name -> (rows, block_k, warps): whole rows up to 32768 values a program, chunks of 16 values a thread."""
    full = triton.next_power_of_2(K)
    arms = {}
    for r in (2, 4, 8):
        if r * full <= 32768:
            arms[f"whole{r}"] = (r, full, 32)
    if K > 16384:
        arms["chunk1x4096"] = (1, 4096, 8)
    return arms


def cluster_quantizer(lib, cluster: int):
    """x -> (q, scales) by benchmarks/scripts/quantize_rows_cluster.cu, each row over a cluster of CTAs."""
    def quantize(x):
        M, K = x.shape
        q = torch.empty((M, K), dtype=torch.int8, device=x.device)
        s = torch.empty((M,), dtype=torch.float32, device=x.device)
        pdl = early_launch(x.device, M, w4a4.PRODUCT_EARLY_TOKENS)
        err = lib.nibble_quantize_rows_cluster(cluster, x.data_ptr(), x.stride(0), q.data_ptr(), q.stride(0), s.data_ptr(),
                                               M, K, float(torch.finfo(x.dtype).max), 1, int(pdl),
                                               torch.cuda.current_stream().cuda_stream)
        if err:
            raise RuntimeError(f"quantize_rows_cluster: CUDA error {err} (cluster {cluster}, K {K})")
        return q, s
    return quantize


def load_cluster_lib(path):
    lib = ctypes.CDLL(str(Path(path).resolve()))
    lib.nibble_quantize_rows_cluster.restype = ctypes.c_int
    lib.nibble_quantize_rows_cluster.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
                                                 ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_float, ctypes.c_int,
                                                 ctypes.c_int, ctypes.c_void_p]
    return lib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default=SHAPES, help="N x K, comma-separated")
    ap.add_argument("--ms", default="64,128")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-spread", action="store_true", help="leave out the rows-a-program arms")
    ap.add_argument("--cluster-lib", help="quantize_rows_cluster.cu built (--build-cluster-lib): arms cluster2, 4, 8")
    ap.add_argument("--build-cluster-lib", help="compile benchmarks/scripts/quantize_rows_cluster.cu to this .so and exit")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.build_cluster_lib:
        cuda_build._compile(cuda_build.find_nvcc(), Path(__file__).with_name("quantize_rows_cluster.cu"),
                            Path(args.build_cluster_lib), "90a")
        return
    dev = torch.device("cuda")
    shipped_quantize = w4a4.quantize_activations_gpu
    cluster_lib = load_cluster_lib(args.cluster_lib) if args.cluster_lib else None
    results = []
    for N, K in shape_list(args.shapes):
        n4 = rotations(K // 8 * N * 4)
        ws = [random_w4a4(N, K, dev) for _ in range(n4)]
        arms = {"legacy": (None, legacy_quantize), "clamped": (None, lambda x: legacy_quantize(x, clamped=True))}
        if not args.no_spread:
            arms.update({name: (p, lambda x, p=p: spread_quantize(x, *p)) for name, p in arms_for(K).items()})
        if cluster_lib is not None:
            arms.update({f"cluster{c}": (c, cluster_quantizer(cluster_lib, c)) for c in (1, 2, 4, 8)
                         if -(-K // (32 * c)) * 32 <= 8 * 8 * 256})
        names = ["shipped", *arms]
        for M in (int(m) for m in args.ms.split(",")):
            x = (torch.randn(M, K, device=dev) * torch.logspace(-1, 1, K, device=dev)).to(torch.bfloat16)
            cfg = w4a4.WGMMA.config(M, N, K, w4a4.WGMMA.clusters(dev))
            tiles = -(-M // cfg["bn"]) * -(-N // cfg["channels"])
            ref = shipped_quantize(x, False, "even_odd")
            spec_q, spec_s = reference.quantize_activations(x)
            assert torch.equal(ref[0], w4a4.to_even_odd(spec_q)) and torch.equal(ref[1], spec_s), (N, K, M, "spec")
            for name, (_, quantize) in arms.items():
                got = quantize(x)
                assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1]), (N, K, M, name)

            def quantizer(arm):
                if arm == "shipped":
                    return shipped_quantize
                quantize = arms[arm][1]
                return lambda x, input_hadamard=False, order="natural", product_warps=None: quantize(x)

            op = {a: [] for a in names}
            alone = {}
            for rnd in range(args.rounds):
                for arm in (names if rnd % 2 == 0 else names[::-1]):
                    w4a4.quantize_activations_gpu = quantizer(arm)
                    try:
                        op[arm].append(bench_us(lambda i: (lambda: w4a4.w4a4_linear(x, ws[i][0], ws[i][1], None, False)),
                                                n4, warmup_ms=10.0, reps=20))
                        if rnd == 0:
                            alone[arm] = bench_us(lambda i: (lambda: w4a4.quantize_activations_gpu(x, False, "even_odd")),
                                                  1, warmup_ms=10.0, reps=20)
                    finally:
                        w4a4.quantize_activations_gpu = shipped_quantize
            med = {a: statistics.median(v) for a, v in op.items()}
            best = min(names, key=med.get)
            results.append(dict(N=N, K=K, M=M, config=cfg, product_ctas=tiles * cfg["split_k"], op_us=med, quantize_us=alone,
                                op_rounds=op, arms={a: arms[a][0] if a in arms else None for a in names}))
            print(f"{N:6d} x {K:6d} M={M:4d} ({tiles * cfg['split_k']} product CTAs): shipped {med['shipped']:6.2f} us "
                  f"(q {alone['shipped']:5.2f}), best {best} {med[best]:6.2f} ({med['shipped'] / med[best]:.3f}x); "
                  + " ".join(f"{a} {med[a]:.2f}/{alone[a]:.2f}" for a in names[1:]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": env_meta(benchmark="act_quant_spread_ab"), "rows": results}, indent=1))


if __name__ == "__main__":
    main()
