"""W4A4 kernel benchmark: ``python -m nibble.bench w4a4 [--quick] [--out DIR] [--shapes N,K ...] [--ms M ...]``.

At each weight shape (N, K) and token count M, the median time (``nibble.bench.timing.bench_us``:
CUDA-graph replay, weights rotated over enough copies that the working set is several times the L2;
the ops timed in ``--rounds`` (3) interleaved rounds, ``bench_rounds``, each cell the median of its rounds) of

  bf16        cuBLAS bf16 ``F.linear`` (the baseline every speedup is against)
  int8        cuBLAS INT8 ``torch._int_mm`` on int8 operands, int32 out, no quantization (M > 16 only)
  fp8         cuBLAS FP8 ``torch._scaled_mm`` e4m3 x e4m3 with per-row / per-column scales, bf16 out
  actquant    nibble per-token INT4 activation quantization alone (bf16 x -> int8 q + fp32 scales)
  actquant_h  the same with the online Hadamard rotation, the kernel the op picks for M (up to 16
              rows on sm_90: csrc/rotate_quantize.cu; else the fused Triton kernel)
  gemm        nibble W4A4 matrix kernel alone (int8 q + scales -> bf16), the one the op picks for M
              (M <= 16: csrc/w4a4_mma.cu; above, on sm_90: csrc/w4a4_wgmma.cu; else Triton)
  w4a4        nibble quantize + matrix kernel together: ``torch.ops.nibble.w4a4_linear`` (no rotation)
  w4a4_h      the same with ``input_hadamard=True``

Writes ``DIR/w4a4-<gpu>.json`` (meta, its ``summary`` the per-M geomeans of `summarize`, + one row per (shape, M, op)
with us, speedup over bf16, and effective TOPS / TB/s) and ``.png`` (speedup over bf16 vs M, one panel per shape);
``DIR/w4a4-partial.json`` holds the rows so far while it runs (what a timeout leaves), and is removed once the JSON is
written.
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import sys

import torch
import torch.nn.functional as F

from nibble.bench.timing import (ROUNDS, add_rounds_argument, bench_rounds, bench_us, env_meta, geomean, gpu_tag,
                                 holds_big_weight, json_text, parse_bench_args, rotations, whole_number,
                                 write_results)
from nibble.formats.int4 import unpack_int4

SHAPES = [(4096, 4096), (12288, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (4096, 14336),
          (28672, 8192), (8192, 28672)]
MS = [1, 16, 128, 1024, 4096]
QUICK_SHAPES = [(4096, 4096), (14336, 4096), (28672, 8192)]
QUICK_MS = [1, 16, 128, 1024]
OPS = ("bf16", "int8", "fp8", "actquant", "actquant_h", "gemm", "w4a4", "w4a4_h")


def random_w4a4(N: int, K: int, device, gen=None):
    """Canonical W4A4 weight (symmetric per channel): random packed codes, w_scale [N] fp16."""
    qweight = torch.randint(-2**31, 2**31 - 1, (K // 8, N), dtype=torch.int32, device=device, generator=gen)
    w_scale = (torch.rand(N, device=device, generator=gen) * 0.002 + 0.0005).half()
    return qweight, w_scale


def unpack_weight_int8(qweight: torch.Tensor) -> torch.Tensor:
    """Canonical packed [K // 8, N] -> int8 (q - 8) [N, K]: the weight of the int8 GEMM baselines."""
    return (unpack_int4(qweight).to(torch.int16) - 8).to(torch.int8).t().contiguous()


def _dense_bf16(qweight, w_scale):
    return (unpack_weight_int8(qweight).float() * w_scale.float()[:, None]).to(torch.bfloat16)  # [N, K]


def _precompile_task(args):
    """Worker (own process): run every kernel variant the timing of (N, K, M) will use once, so the
    Triton disk cache is warm; compiles run in parallel across processes."""
    N, K, M, ops, tune = args
    import nibble.kernels.w4a4 as w4a4
    dev = torch.device("cuda")
    qw, ws = random_w4a4(N, K, dev)
    x = torch.randn(M, K, device=dev).to(torch.bfloat16)
    errs = []
    for fn in ([lambda: w4a4.quantize_activations_gpu(x, False)] if "actquant" in ops or "w4a4" in ops else []) + \
              ([lambda: w4a4.quantize_activations_gpu(x, True)] if "actquant_h" in ops or "w4a4_h" in ops else []):
        try:
            fn()
        except Exception as e:
            errs.append(f"{type(e).__name__}: {e}")
    qx, sx = w4a4.quantize_activations(x)
    b = w4a4.m_bucket(M)
    cands = w4a4.CANDIDATES[b] if tune else [w4a4.pick_config(M, N, K)]
    for c in cands:
        try:
            w4a4.w4a4_matmul_triton(qx, sx, qw, ws, None, torch.bfloat16, config=c)
        except Exception as e:
            errs.append(f"{c}: {type(e).__name__}: {e}")
    torch.cuda.synchronize()
    return (N, K, M, errs)


def precompile(shapes, ms, ops, tune, procs=8, log=print):
    import multiprocessing as mp
    import time
    t0 = time.time()
    tasks = [(N, K, M, ops, tune) for N, K in shapes for M in ms]
    with mp.get_context("spawn").Pool(procs) as pool:
        for N, K, M, errs in pool.imap_unordered(_precompile_task, tasks):
            for e in errs:
                log(f"  precompile N={N} K={K} M={M}: {e[:300]}")
    log(f"precompiled {len(tasks)} (shape, M) cases in {time.time() - t0:.1f}s with {procs} processes")


def bench_shape(N: int, K: int, ms, ops=OPS, log=print, tune=False, tuning=None, rounds: int = ROUNDS):
    from nibble.kernels import w4a4

    dev = torch.device("cuda")
    rows = []
    int4_bytes = K // 8 * N * 4
    n4 = rotations(int4_bytes)
    nb = rotations(N * K * 2)
    n8 = rotations(N * K)
    w4 = [random_w4a4(N, K, dev) for _ in range(n4)]
    wb = [_dense_bf16(*w4[i % n4]) for i in range(nb)] if "bf16" in ops else None
    w8 = None
    if "int8" in ops or "fp8" in ops:
        w8 = [unpack_weight_int8(w4[i % n4][0]) for i in range(n8)]  # [N, K] int8 (K-major)
    wf8 = [w.to(torch.float8_e4m3fn) for w in w8] if (w8 is not None and "fp8" in ops) else None
    sw_f8 = torch.rand(1, N, device=dev) * 0.01 + 1e-3

    for M in ms:
        x = (torch.randn(M, K, device=dev) * torch.logspace(-1, 1, K, device=dev)).to(torch.bfloat16)
        order = w4a4.product_order(M, N, K, dev)  # the activation order the op quantizes into
        qx, sx = w4a4.quantize_activations(x, order=order)
        flops = 2.0 * M * N * K
        arms = {}
        if "bf16" in ops:
            arms["bf16"] = (lambda i: (lambda: F.linear(x, wb[i])), nb)
        if "int8" in ops and M > 16:
            xi8 = qx.contiguous()
            arms["int8"] = (lambda i: (lambda: torch._int_mm(xi8, w8[i].t())), n8)
        if "fp8" in ops:
            xf8 = qx.to(torch.float8_e4m3fn)
            sa = sx[:, None].contiguous()
            arms["fp8"] = (lambda i: (lambda: torch._scaled_mm(xf8, wf8[i].t(), scale_a=sa, scale_b=sw_f8,
                                                               out_dtype=torch.bfloat16)), n8)
        if "actquant" in ops:
            arms["actquant"] = (lambda i: (lambda: w4a4.quantize_activations_gpu(x, False, order)), 1)
        if "actquant_h" in ops:
            arms["actquant_h"] = (lambda i: (lambda: w4a4.quantize_activations_gpu(x, True, order)), 1)
        if "gemm" in ops and not tune:
            arms["gemm"] = (lambda i: (lambda: w4a4.w4a4_matmul(qx, sx, w4[i][0], w4[i][1], None, torch.bfloat16,
                                                                 order)), n4)
        if "w4a4" in ops:
            arms["w4a4"] = (lambda i: (lambda: torch.ops.nibble.w4a4_linear(x, w4[i][0], w4[i][1], None, False)), n4)
        if "w4a4_h" in ops:
            arms["w4a4_h"] = (lambda i: (lambda: torch.ops.nibble.w4a4_linear(x, w4[i][0], w4[i][1], None, True)), n4)

        def measure(factory, n_rot, **timing):
            r = bench_us(factory, n_rot, return_all=True, **timing)
            if r["mode"] != "graph":
                log(f"  N={N:6d} K={K:6d} M={M:5d}: an op timed eagerly (its CUDA-graph capture failed)")
            return r["us"]

        # every op may be missing at a shape (e.g. int8 / fp8 where cuBLAS lacks them): recorded as None
        times = bench_rounds(arms, rounds, optional=tuple(arms), measure=measure, warmup_ms=10.0, reps=20,
                             log=lambda line: log(f"  N={N:6d} K={K:6d} M={M:5d}{line}"))
        res = {op: statistics.median(t) if t else None for op, t in times.items()}
        for op, us in res.items():
            if us:
                log(f"  N={N:6d} K={K:6d} M={M:5d} {op:11s} {us:10.2f} us  (rounds: "
                    + ", ".join(f"{t:.2f}" for t in times[op]) + ")")
        if "gemm" in ops and tune:
            # time every candidate of this M bucket, keep the fastest for the op (w4a4.TUNED)
            b = w4a4.m_bucket(M)
            candidate_us = []
            for idx, c in enumerate(w4a4.CANDIDATES[b]):
                cfg = dict(c, split_k=w4a4.auto_split(c, M, N, K))
                try:
                    t = bench_us(lambda i, cfg=cfg: (lambda: w4a4.w4a4_matmul_triton(
                        qx, sx, w4[i][0], w4[i][1], None, torch.bfloat16, config=cfg)), n4,
                        warmup_ms=10.0, reps=20)
                except Exception as e:
                    t = None
                    log(f"  candidate {idx} {cfg} failed: {type(e).__name__}: {str(e)[:200]}")
                candidate_us.append(t)
                log(f"  N={N:6d} K={K:6d} M={M:5d} cand{idx} {cfg['kind']} "
                    f"{ {k: v for k, v in cfg.items() if k != 'kind'} } {t}")
            valid = [(t, i) for i, t in enumerate(candidate_us) if t]
            if valid:
                best = min(valid)[1]
                w4a4.TUNED[(b, N, K)] = best
                res["gemm"] = candidate_us[best]
                if tuning is not None:
                    tuning.append(dict(N=N, K=K, M=M, bucket=b, times_us=candidate_us, best=best))

        base = res.get("bf16")
        cfg = dict(kernel=w4a4.product_kernel(qx, N, order))
        if cfg["kernel"] == "w4a4_wgmma":
            cfg.update(w4a4.WGMMA.config(M, N, K, w4a4.WGMMA.clusters(x.device)))
        elif cfg["kernel"] == "triton":
            cfg.update(w4a4.pick_config(M, N, K))
        for op, us in res.items():
            row = dict(N=N, K=K, M=M, op=op, us=us, us_rounds=times.get(op),
                       speedup=(base / us) if (base and us) else None)
            if us:  # the W4A16 benchmark's fields: bytes moved (the weight and 16-bit x and out), 2MNK per second
                if op in ("actquant", "actquant_h"):
                    row["GBps"] = round((M * K * 2 + M * K + 4 * M) / us / 1e3, 1)
                else:
                    wbytes = {"bf16": 2 * N * K, "int8": N * K, "fp8": N * K}.get(op, N * K / 2)
                    row["GBps"] = round((wbytes + 2 * M * (K + N)) / us / 1e3, 1)
                    row["TFLOPs"] = round(flops / us / 1e6, 2)  # integer ops for the int8 / int4 products
            if op in ("gemm", "w4a4", "w4a4_h"):
                row["config"] = {k: v for k, v in cfg.items()}
            rows.append(row)
        x = qx = sx = None  # freed (not del: the timed lambdas close over them)
    w4 = wb = w8 = wf8 = None
    torch.cuda.empty_cache()
    return rows


def summarize(rows, log=print) -> list[dict]:
    """Per M, the geomean speedup of quantize + GEMM (``w4a4``; ``w4a4_h``: with the online Hadamard) over cuBLAS
    bf16 on all shapes and on those of >= 64 MB of 16-bit weight (where issue 4 sets its bars), and over cuBLAS FP8;
    logged after the per-shape table, and returned (NaN where the rows lack an op)."""
    by = {}
    for r in rows:
        by.setdefault((r["N"], r["K"], r["M"]), {})[r["op"]] = r["us"]
    ops = [o for o in OPS if any(o in v for v in by.values())]
    log("\n" + " " * 20 + "".join(f"{o:>11s}" for o in ops) + "   w4a4/bf16")
    for (N, K, M), v in sorted(by.items()):
        cells = "".join(f"{v[o]:11.1f}" if v.get(o) else f"{'-':>11s}" for o in ops)
        sp = v["bf16"] / v["w4a4"] if v.get("bf16") and v.get("w4a4") else float("nan")
        log(f"{N:6d}x{K:<6d} M={M:<5d}{cells}   {sp:6.2f}x")

    def speedup(M, op, base, big=False):
        return geomean(v[base] / v[op] for (n, k, m), v in by.items()
                       if m == M and v.get(base) and v.get(op) and (not big or holds_big_weight(n, k)))
    summary = [dict(M=M, geomean_vs_bf16=speedup(M, "w4a4", "bf16"),
                    geomean_vs_bf16_big=speedup(M, "w4a4", "bf16", big=True), geomean_vs_fp8=speedup(M, "w4a4", "fp8"),
                    hadamard_geomean_vs_bf16=speedup(M, "w4a4_h", "bf16"),
                    hadamard_geomean_vs_bf16_big=speedup(M, "w4a4_h", "bf16", big=True))
               for M in sorted({k[2] for k in by})]
    columns = {"vs bf16": "geomean_vs_bf16", "vs bf16 >=64MB": "geomean_vs_bf16_big", "vs fp8": "geomean_vs_fp8",
               "w4a4_h vs bf16": "hadamard_geomean_vs_bf16", "w4a4_h >=64MB": "hadamard_geomean_vs_bf16_big"}
    log("\nquantize + GEMM (w4a4_h: with the online Hadamard), geomean speedup over cuBLAS:")
    log("      M" + "".join(f"  {c:>15s}" for c in columns))
    for s in summary:
        log(f"  {s['M']:5d}" + "".join(f"  {s[key]:14.2f}x" for key in columns.values()))
    return summary


def _shape(text: str) -> tuple[int, int]:
    """``--shapes``' ``N,K``: two whole numbers above 0 (a malformed one was a traceback after the GPU's set-up)."""
    parts = text.split(",")
    if len(parts) != 2 or not all(p.isdecimal() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"a shape is N,K: two whole numbers above 0, e.g. 4096,4096; got {text!r}")
    return int(parts[0]), int(parts[1])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m nibble.bench w4a4", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="3 shapes, M in 1, 16, 128, 1024")
    p.add_argument("--out", default="benchmarks/results", help="folder for w4a4-<gpu>.json / .png")
    p.add_argument("--shapes", nargs="+", type=_shape, default=None, help="N,K pairs, e.g. 4096,4096 28672,8192")
    p.add_argument("--ms", nargs="+", type=whole_number("a token count M"), default=None,
                   help="token counts M, e.g. 1 16 128 (default: the suite's)")
    # an unknown name was timed as nothing, and its column left out without a word
    p.add_argument("--ops", nargs="+", choices=OPS, default=None, help=f"subset of {', '.join(OPS)}")
    p.add_argument("--name", default=None, help="output file stem (default w4a4-<gpu>)")
    p.add_argument("--tune", action="store_true",
                   help="time every candidate config per (M bucket, shape), use the fastest (w4a4.TUNED)")
    p.add_argument("--procs", type=int, default=8, help="processes that pre-compile the kernels (0: none)")
    add_rounds_argument(p)
    a = parse_bench_args(p, argv)
    if not torch.cuda.is_available():
        print("nibble.bench w4a4 needs a CUDA GPU", file=sys.stderr)
        return 2
    import nibble.kernels.w4a4  # noqa: F401  registers torch.ops.nibble.w4a4_linear
    shapes = a.shapes or (QUICK_SHAPES if a.quick else SHAPES)
    ms = a.ms or (QUICK_MS if a.quick else MS)
    ops = tuple(a.ops) if a.ops else OPS
    torch.backends.cuda.matmul.allow_tf32 = False
    if a.procs > 0:
        precompile(shapes, ms, ops, a.tune, a.procs)
    rows, tuning = [], []
    import os
    os.makedirs(a.out, exist_ok=True)
    partial = os.path.join(a.out, "w4a4-partial.json")
    for N, K in shapes:
        rows += bench_shape(N, K, ms, ops, tune=a.tune, tuning=tuning, rounds=a.rounds)
        with open(partial, "w") as f:  # survives a timeout
            f.write(json_text({"rows": rows, "tuning": tuning}, default=str))
    summary = summarize(rows)
    if tuning:
        from nibble.kernels import w4a4
        print("TUNED =", {k: v for k, v in sorted(w4a4.TUNED.items())})
    command = shlex.join(["python", "-m", "nibble.bench", "w4a4", *(sys.argv[1:] if argv is None else argv)])
    meta = env_meta(benchmark="w4a4", shapes=shapes, ms=ms, ops=ops, tuning=tuning, rounds=a.rounds, command=command,
                    note="speedup = cuBLAS bf16 time / op time; w4a4 = quantize + GEMM (no rotation)", summary=summary)
    paths = write_results(rows, meta, a.out, a.name or f"w4a4-{gpu_tag()}", baseline="bf16",
                          title=f"W4A4 speedup over cuBLAS bf16 ({torch.cuda.get_device_name()})")
    os.remove(partial)  # the running copy of what the JSON now holds: beside it, it read as another run's
    print("wrote", paths)
    return 0


if __name__ == "__main__":
    sys.exit(main())
