"""What the Hopper W4A16 GEMM (`csrc/w4a16_wgmma.cu`) could do at 16 / 32 tokens (and more) if its weights cost
fewer instructions to unpack: knockout builds, timed against the op (the skinny kernel at 16 tokens).

Session 26 ran 16- and 32-token tiles (m64n16k16 / m64n32k16) at 1.5-2.5x the skinny kernel's time,
its exact fp32 dequantization (6 instructions a register of two weights) the suspect. The skinny
kernel feeds raw codes (bf16 128 + q, one lop3 a register) to the MMA and folds scale and zero per
group. The variants here replace the bf16 dequantization by the instruction count of such raw codes
(outputs wrong on purpose; only timed):

    exact   the shipped dequantization (the session-26 kernel)
    raw2    shift + lop3 a register (x permuted in shared memory, nibbles (t, t + 4) of a word)
    raw3    prmt + imad + lop3 a register (x as it is, byte t of a word)
    raw3x   raw3 + one more wgmma a step (the x sums the fold needs, against a constant A)
    none    the loaded word straight into the MMA (the unpacking's upper bound)

A variant named with "_big" keeps the shipped tiles (64-256 tokens x 128-256 channels) instead of the
16- and 32-token ones: what free or cheap unpacking would buy at 64 to 4,096 tokens (`--ms 128,1024`),
each variant at its best tile and split.

    PYTHONPATH=. python3 benchmarks/scripts/w4a16_wgmma_raw_knockout.py --build-only DIR   # here
    PYTHONPATH=. python3 benchmarks/scripts/w4a16_wgmma_raw_knockout.py --prebuilt DIR --json out.json  # H200
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.kernels import GROUP, SHAPES, TIMING, weight_sets  # noqa: E402
from nibble.bench.timing import bench_us, env_meta  # noqa: E402
from nibble.kernels import cuda_build, hopper  # noqa: E402
from nibble.kernels import w4a16 as W  # noqa: E402

# m64n16k16 / m64n32k16 (session 26's commit 08220ca)
SMALL_WGMMA = """
#define NIBBLE_D8 "{%0, %1, %2, %3, %4, %5, %6, %7}"
#define NIBBLE_D16 "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}"
#define NIBBLE_SMALL_WGMMA(KIND, TYPE)                                                                     \\
  template <> struct Wgmma<KIND, 16> {                                                                     \\
    static __device__ __forceinline__ void mma(float (&d)[8], const uint32_t* a, uint64_t desc) {          \\
      asm volatile("wgmma.mma_async.sync.aligned.m64n16k16.f32." TYPE "." TYPE " " NIBBLE_D8               \\
                   ", {%8, %9, %10, %11}, %12, 1, 1, 1, 0;"                                                \\
                   : NIBBLE_OPS8("+f", 0) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));         \\
    }                                                                                                      \\
  };                                                                                                       \\
  template <> struct Wgmma<KIND, 32> {                                                                     \\
    static __device__ __forceinline__ void mma(float (&d)[16], const uint32_t* a, uint64_t desc) {         \\
      asm volatile("wgmma.mma_async.sync.aligned.m64n32k16.f32." TYPE "." TYPE " " NIBBLE_D16              \\
                   ", {%16, %17, %18, %19}, %20, 1, 1, 1, 0;"                                              \\
                   : NIBBLE_OPS8("+f", 0), NIBBLE_OPS8("+f", 8)                                             \\
                   : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc));                                \\
    }                                                                                                      \\
  };
NIBBLE_SMALL_WGMMA(F16, "f16")
NIBBLE_SMALL_WGMMA(BF16, "bf16")
"""
TILES = [(16, 128), (16, 256), (32, 128), (32, 256)]
LAUNCHES = ("  NIBBLE_LAUNCH_GROUPS(64, 256)\n  NIBBLE_LAUNCH_GROUPS(128, 256)\n  NIBBLE_LAUNCH_GROUPS(128, 128)\n"
            "  NIBBLE_LAUNCH_GROUPS(256, 128)\n  NIBBLE_LAUNCH_GROUPS(64, 128)\n")
SMALL_LAUNCHES = "".join(f"  NIBBLE_LAUNCH({bn}, {ch}, 8)\n" for bn, ch in TILES)
DEQUANT = """    const uint32_t r = __funnelshift_l(word, word, select);
    const float lo = __uint_as_float(and_or(r, 0x00078000u, 0x3F800000u));
    const float hi = __uint_as_float(and_or(r, 0x00780000u, 0x3F800000u));
    return Elem<T>::pack(fmaf(lo, a.s256, a.z256), fmaf(hi, a.s16, a.z16));"""
RAW = {
    "raw2": "    return and_or(word >> select, 0x000F000Fu, 0x43004300u);",
    "raw3": "    return and_or(__byte_perm(word, 0u, 0x4440u | (select & 3u)) * 0x1001u, 0x000F000Fu, 0x43004300u);",
    "none": "    return word;",
}
MMA = "for (int j = 0; j < J; ++j) Wgmma<typename Elem<T>::Kind, BN>::mma(acc[j], a[j], desc);"
X_SUMS = [
    ("  zero_accumulators(acc);", "  zero_accumulators(acc);\n  float xsum[R];\n"
     "#pragma unroll\n  for (int r = 0; r < R; ++r) xsum[r] = 0.f;\n"
     "  const uint32_t ones[4] = {0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u};"),
    (MMA, MMA + "\n      Wgmma<typename Elem<T>::Kind, BN>::mma(xsum, ones, desc);"),
    ("  wgmma_wait<0>();", "  wgmma_wait<0>();\n  fence_operands(xsum);\n"
     "#pragma unroll\n  for (int r = 0; r < R; ++r) acc[0][r] += xsum[r];"),
]
# "_wD": D steps' MMAs in flight instead of one (the A registers of a step in flight are not kept
# apart from the next step's here, so outputs are wrong; a kept kernel would hold D sets)
VARIANTS = ("exact", "raw2", "raw3", "raw3x", "none", "none_w2", "none_w3", "raw2_w2", "raw2_w3", "raw3x_w3",
            "none_r4", "raw2_r4", "raw3x_r4", "exact_2cta", "raw2_2cta", "raw3x_2cta", "none_2cta",
            "exact_big", "raw2_big", "none_big")
# "_2cta": two CTAs an SM (registers 96 a consumer thread, half the shared memory each)
TWO_CTAS = [
    ("__launch_bounds__(THREADS, 1)", "__launch_bounds__(THREADS, 2)"),
    ("setmaxnreg.inc.sync.aligned.u32 232;", "setmaxnreg.inc.sync.aligned.u32 96;"),
    ("(227 * 1024 - 1024 - 128) / STAGE < 6 ? (227 * 1024 - 1024 - 128) / STAGE : 6",
     "(113 * 1024 - 1024 - 128) / STAGE < 6 ? (113 * 1024 - 1024 - 128) / STAGE : 6"),
    ("w4a16_wgmma_kernel<__nv_bfloat16, 128, 256, 8, true>;", "w4a16_wgmma_kernel<__nv_bfloat16, 16, 256, 8, true>;"),
    ("Tile<128, 256, 8>::SMEM", "Tile<16, 256, 8>::SMEM"),
]
# "_r4": 3 steps in flight, each step's A registers its own set of a ring of 4
WAIT = "wgmma_wait<1>();  // the previous step's group is done"
RELEASE = "if (k == 0 && i > 0 && (tid & 127) == 0)"


def edits(variant: str) -> list:
    ring, two, big = variant.endswith("_r4"), variant.endswith("_2cta"), variant.endswith("_big")
    base, _, depth = variant.removesuffix("_r4").removesuffix("_2cta").removesuffix("_big").partition("_w")
    depth = "3" if ring else depth
    out = [] if big else [('#include "skinny.cuh"\n', '#include "skinny.cuh"\n' + SMALL_WGMMA), (LAUNCHES, SMALL_LAUNCHES)]
    if base != "exact":
        out.append((DEQUANT, RAW["raw3" if base == "raw3x" else base]))
    if base == "raw3x":
        out += X_SUMS
    if depth:
        out += [(WAIT, WAIT.replace("<1>", f"<{depth}>")), (RELEASE, RELEASE.replace("k == 0", f"k == {int(depth) - 1}"))]
    if two:
        out += TWO_CTAS
    if ring:
        out += [("  Affine<T> aff[2 * J];", "  Affine<T> aff[2 * J];\n  uint32_t ring[4][J][4];"),
                ("      uint32_t a[J][4];", "      uint32_t (&a)[J][4] = ring[k % 4];")]
    return out


def build_all(out: Path) -> None:
    for v in VARIANTS:
        if (out / v / "w4a16_wgmma_edited.so").exists():
            continue
        try:
            cuda_build.build_edited("w4a16_wgmma", edits(v), out / v, append="")
        except OSError:
            pass  # built; no driver here to load it
        print("built", v, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build-only", type=Path)
    ap.add_argument("--prebuilt", type=Path)
    ap.add_argument("--ms", default="16")
    ap.add_argument("--splits", default="1,2,3,6")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.build_only:
        build_all(args.build_only)
        return
    dev = torch.device("cuda")
    shipped = W.WGMMA.lib
    libs, variants = {}, args.variants.split(",")
    for v in variants:
        lib = ctypes.CDLL(str(args.prebuilt / v / "w4a16_wgmma_edited.so"))
        W.WGMMA.signatures(lib)
        libs[v] = lib
    shipped_tiles = W.WGMMA.tiles()  # the model below adds the knockout tiles
    stage = {**W.WGMMA.model.stage_us, **{t: 0.5 for t in TILES}}
    item = {**W.WGMMA.model.item_us, **{t: 3.0 for t in TILES}}
    W.WGMMA.model = hopper.CostModel(stage, item, W.WGMMA.model.split_output_us, W.WGMMA.model.split_us,
                                     {**W.WGMMA.model.max_tokens, **{t: t[0] for t in TILES}})
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for N, K in SHAPES:
        w4, wb, wf = weight_sets(N, K, GROUP, dev)
        k_tiles = -(-K // hopper.STAGE_K)
        for M in map(int, args.ms.split(",")):
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            ref = x.float() @ wf.t()
            W.WGMMA.lib = shipped
            res = {"bf16": bench_us(lambda i: (lambda: F.linear(x, wb[i])), len(wb), **TIMING),
                   "op": bench_us(lambda i: (lambda: W.w4a16_linear(x, *w4[i], GROUP)), len(w4), **TIMING)}
            for bn, ch in TILES + list(shipped_tiles):
                small = (bn, ch) in TILES
                if not (M <= bn < 2 * M if small else bn < 2 * M and M <= W.WGMMA.model.max_tokens.get((bn, ch), M)):
                    continue  # small: the one token tile that fits M; big: the tiles swept at M
                for sp in map(int, args.splits.split(",")):
                    if sp > 1 and (hopper.tile_count(M, N, bn, ch) * sp > 2 * sms or k_tiles // sp < 2):
                        continue
                    cfg = dict(bn=bn, channels=ch, split_k=sp)
                    for v, lib in libs.items():
                        if small == v.endswith("_big"):
                            continue
                        W.WGMMA.lib = lambda _d, lib=lib: lib
                        y = W.w4a16_wgmma(x, *w4[0], GROUP, config=cfg)
                        torch.cuda.synchronize()
                        if v.split("_")[0] == "exact":  # the only builds meant to be right
                            err = ((y.float() - ref).norm() / ref.norm()).item()
                            assert err < 1e-2, f"exact build wrong at {N}x{K} M={M} {cfg}: {err}"
                        res[f"{v}_bn{bn}_ch{ch}_s{sp}"] = bench_us(
                            lambda i: (lambda: W.w4a16_wgmma(x, *w4[i], GROUP, config=cfg)), len(w4), **TIMING)
            best = {v: min((u, k) for k, u in res.items() if k.split("_bn")[0] == v) for v in variants}
            print(f"{N}x{K} M={M} bf16 {res['bf16']:.2f} op {res['op']:.2f} | " + " ".join(
                f"{v} {u:.2f} ({k.split('_', 1)[1]})" for v, (u, k) in best.items()), flush=True)
            rows.append(dict(N=N, K=K, M=M, **{k: round(u, 3) for k, u in res.items()}))
    for M in map(int, args.ms.split(",")):
        big = [r for r in rows if r["M"] == M and r["N"] * r["K"] * 2 >= 64 * 2**20]
        for v in ("op", *variants):
            sp = [r["bf16"] / (r[v] if v == "op" else min(u for k, u in r.items() if k.split("_bn")[0] == v))
                  for r in big]
            print(f"M={M} {v}: geomean vs bf16 on the >= 64 MB shapes {statistics.geometric_mean(sp):.3f}x")
    if args.json:
        args.json.write_text(json.dumps(dict(meta=env_meta(), command=" ".join(sys.argv), rows=rows), indent=1))


if __name__ == "__main__":
    main()
