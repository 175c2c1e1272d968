"""x shared by several column blocks of one CTA in the skinny W4A16 kernel (csrc/w4a16_mma.cu), an
experiment against the shipped kernel, timed side by side in one process.

At 8 and 16 tokens every 32-column CTA of the skinny kernel copies x for its whole K: as many bytes
as its weight at 8 tokens, twice as many at 16, all through the L2 (notes-w4a16.md, session 19:
12288 x 4096 at M = 16, copies alone 12.8 us against 9.0 at M = 1). The variant gives a CTA `cols`
column blocks of 32 (warp = K range x column block). The warps of one K range copy that range's x
once into a ring they share (token tile mt by column block mt % cols) and pass one named barrier a
step (`bar.sync 1 + range, 32 cols`) where the shipped kernel passes a warp barrier; each keeps its
own weight ring. So x crosses the L2 once per `cols` column blocks. With the same K ranges the sums
are the shipped kernel's, in the same order: every output is compared bit for bit with the shipped
kernel at the same warps per column block.

`cols` comes from the environment (NIBBLE_XSHARE_COLS, read at every launch, so a CUDA graph keeps
the value it was captured with; 1 to 4, compiled for single weights, one or two token tiles and
groups of 128); the op's `warps` is the K ranges per column block.

    PYTHONPATH=. python3 benchmarks/scripts/w4a16_shared_x.py --build .exp/xshare      # nvcc only
    PYTHONPATH=. python3 benchmarks/scripts/w4a16_shared_x.py --libs .exp/xshare --ms 8,16 --json $OUT/x.json
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.kernels import cuda_build  # noqa: E402

KERNEL_EDITS = [
    ("#include \"skinny.cuh\"\n", "#include \"skinny.cuh\"\n#include <stdlib.h>\n"),
    # COLS column blocks a CTA, at compile time (a run-time count made the one-block kernel 16% slower
    # at 16 tokens: 12288 x 4096 13.6 -> 15.8 us). One token tile above one block: ptxas spills 8-40
    # bytes at the shipped 64-register cap, and one CTA an SM of up to 16 warps is what it is for, so
    # the cap is lifted there.
    ("""template <typename T, int MT, int GS, bool MANY, bool X_L1>
__global__ void __launch_bounds__(MT <= 2 ? 512 : 256, MT == 1 || MT == 4 ? 2 : 1)""",
     """template <typename T, int MT, int GS, bool MANY, bool X_L1, int COLS>
__global__ void __launch_bounds__(MT <= 2 ? 512 : 256, (MT == 1 && COLS == 1) || MT == 4 ? 2 : 1)"""),
    # one column block: x in each warp's own stages, as shipped; more: a ring per K range after them
    ("""  constexpr bool RUNNING = running_fold(MT), TWO_BASES = two_bases<T>(MT);
  constexpr int SZ = 512, XS = stage_x_offset(MT), STAGE = XS + 512 * MT, GSTEP = GS ? GS : 1;""",
     "  constexpr bool RUNNING = false, TWO_BASES = false;  // session 27's fold and codes at every tile count\n"
     "  constexpr int STAGE = COLS == 1 ? 640 + 512 * MT : 640, XSTAGE = COLS == 1 ? STAGE : 512 * MT, SZ = 512,\n"
     "                GSTEP = GS ? GS : 1, cols = COLS;"),
    ("""  const int warps = blockDim.x >> 5;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;""",
     """  const int all_warps = blockDim.x >> 5;
  const int lane = threadIdx.x & 31, all_warp = threadIdx.x >> 5;
  // warp: the K range, cb: the column block (the shipped kernel: cols = 1, cb = 0)
  const int cb = all_warp % cols, warp = all_warp / cols, warps = all_warps / cols;"""),
    ("  const int which = cta_weight<MANY>(weights.cta_end, tile_col);\n",
     "  const int which = cta_weight<MANY>(weights.cta_end, tile_col);\n"
     "  if (!MANY) tile_col = (blockIdx.x * cols + cb) * 32;\n"),
    ("  const int steps = K >> 5;", "  const bool col_live = cols == 1 || tile_col < N;\n  const int steps = K >> 5;"),
    ("  unsigned char* ring = smem + (size_t)warp * RING * STAGE;",
     "  unsigned char* ring = smem + (size_t)all_warp * RING * STAGE;\n"
     "  unsigned char* xring = COLS == 1 ? ring + 640\n"
     "                                  : smem + (size_t)all_warps * RING * STAGE + (size_t)warp * RING * XSTAGE;\n"
     "  const uint32_t xring_addr = (uint32_t)__cvta_generic_to_shared(ring) + (uint32_t)(xring - ring);"),
    ("  const bool copies_sz = lane < (RUNNING ? 24 : 16);", "  const bool copies_sz = lane < 16 && col_live;"),
    ("  ws.prefetch<RING>(s_begin, s_end);", "  ws.prefetch<RING>(s_begin, col_live ? s_end : s_begin);"),
    ("ring + XS, STAGE, RING);", "xring, XSTAGE, RING);"),
    ("    cp_async_16(live, ws.copy_dst + stage * STAGE, ws.src);",
     "    cp_async_16(live && col_live, ws.copy_dst + stage * STAGE, ws.src);"),
    ("cp_async_16<X_L1>(live && xstream.live[mt], ring_addr + stage * STAGE + XS + xstream.offset(mt),",
     "cp_async_16<X_L1>(live && xstream.live[mt] && mt % cols == cb, xring_addr + stage * XSTAGE + xstream.offset(mt),"),
    ("*reinterpret_cast<const uint4*>(here + XS + xstream.offset(mt)),",
     "*reinterpret_cast<const uint4*>(xring + i * XSTAGE + xstream.offset(mt)),"),
    ("run_pipeline<RING, AHEAD>(s_begin, s_end, issue, step, [&] { xstream.advance(RING); });",
     "run_pipeline<RING, AHEAD>(s_begin, s_end, issue, step, [&] { xstream.advance(RING); }, 1 + warp, 32 * cols);"),
    ("store_fragments<MT>(partial, warp, lane,", "store_fragments<MT>(partial, all_warp, lane,"),
    ("""  for (int i = threadIdx.x; i < m_rows * 32; i += blockDim.x) {
    float sum = 0.f;""",
     """  if (COLS > 1) {
    const int width = 32 * cols, col0 = blockIdx.x * width;
    for (int i = threadIdx.x; i < m_rows * width; i += blockDim.x) {
      const int m = i / width, col = i % width;
      if (col0 + col >= N) continue;
      float sum = 0.f;
      for (int w = 0; w < warps; ++w) sum += partial[(w * cols + (col >> 5)) * (MT * 8 * 32) + m * 32 + (col & 31)];
      out[(size_t)m * ldo + col0 + col] = Num<T>::from_float(sum);
    }
    return;
  }
  for (int i = threadIdx.x; i < m_rows * 32; i += blockDim.x) {
    float sum = 0.f;"""),
    ("""size_t smem_bytes(int warps, int mt) {
  const size_t ring = (size_t)warps * RING * (stage_x_offset(mt) + 512 * mt), partial = (size_t)warps * mt * 8 * 32 * sizeof(float);""",
     """int xshare_cols() {
  const char* e = getenv("NIBBLE_XSHARE_COLS");
  return e ? atoi(e) : 1;
}

size_t smem_bytes(int warps, int mt, int cols) {
  const size_t ring = (size_t)cols * warps * RING * 640 + (size_t)warps * RING * 512 * mt,
               partial = (size_t)cols * warps * mt * 8 * 32 * sizeof(float);"""),
    ("""template <typename T, int MT, int GS, bool MANY, bool X_L1>
cudaError_t launch_gs(const void* x, const Weights<T>& weights, int ctas, int M, int K, int group_shift_steps, int ldx,
                      int warps, cudaStream_t stream, bool pdl, int successor) {
  constexpr auto kernel = w4a16_mma_kernel<T, MT, GS, MANY, X_L1>;
  cudaError_t err = opt_in_shared_memory<kernel>();
  if (err != cudaSuccess) return err;
  int trigger = 0;
  size_t smem = smem_bytes(warps, MT);
  if ((err = successor_smem<kernel>(successor, pdl, ctas, warps * 32, smem, trigger)) != cudaSuccess) return err;
  return launch_kernel(kernel, ctas, warps * 32, smem, stream, pdl, static_cast<const T*>(x), weights, M, K,
                       group_shift_steps, ldx, trigger);
}""",
     """template <typename T, int MT, int GS, bool MANY, bool X_L1, int COLS>
cudaError_t launch_cols(const void* x, const Weights<T>& weights, int ctas, int M, int K, int group_shift_steps,
                        int ldx, int warps, cudaStream_t stream, bool pdl, int successor) {
  constexpr auto kernel = w4a16_mma_kernel<T, MT, GS, MANY, X_L1, COLS>;
  cudaError_t err = opt_in_shared_memory<kernel>();
  if (err != cudaSuccess) return err;
  if (COLS > 1 && warps > 15) return cudaErrorInvalidValue;  // named barriers 1..15
  int trigger = 0;
  ctas = (ctas + COLS - 1) / COLS;
  size_t smem = smem_bytes(warps, MT, COLS);
  if ((err = successor_smem<kernel>(successor, pdl, ctas, COLS * warps * 32, smem, trigger)) != cudaSuccess)
    return err;
  return launch_kernel(kernel, ctas, COLS * warps * 32, smem, stream, pdl, static_cast<const T*>(x), weights, M, K,
                       group_shift_steps, ldx, trigger);
}

// Column blocks a CTA from NIBBLE_XSHARE_COLS: single weights, one or two token tiles, groups of 128.
template <typename T, int MT, int GS, bool MANY, bool X_L1>
cudaError_t launch_gs(const void* x, const Weights<T>& weights, int ctas, int M, int K, int group_shift_steps, int ldx,
                      int warps, cudaStream_t stream, bool pdl, int successor) {
  const int cols = xshare_cols();
  if constexpr (!MANY && MT <= 2 && GS == 4) {
    switch (cols) {
      case 2: return launch_cols<T, MT, GS, MANY, X_L1, 2>(x, weights, ctas, M, K, group_shift_steps, ldx, warps,
                                                           stream, pdl, successor);
      case 3: return launch_cols<T, MT, GS, MANY, X_L1, 3>(x, weights, ctas, M, K, group_shift_steps, ldx, warps,
                                                           stream, pdl, successor);
      case 4: return launch_cols<T, MT, GS, MANY, X_L1, 4>(x, weights, ctas, M, K, group_shift_steps, ldx, warps,
                                                           stream, pdl, successor);
      default: break;
    }
  }
  if (cols != 1) return cudaErrorInvalidValue;
  return launch_cols<T, MT, GS, MANY, X_L1, 1>(x, weights, ctas, M, K, group_shift_steps, ldx, warps, stream, pdl,
                                               successor);
}"""),
]
HEADER_EDITS = {"skinny.cuh": [
    ("void run_pipeline(int s_begin, int s_end, Issue issue, Step step, EndRound end_round) {",
     "void run_pipeline(int s_begin, int s_end, Issue issue, Step step, EndRound end_round, int bar_id = 0,\n"
     "                                             int bar_threads = 32) {"),
    ('      asm volatile("bar.warp.sync -1;" ::: "memory");',
     '      if (bar_threads == 32) asm volatile("bar.warp.sync -1;" ::: "memory");\n'
     '      else asm volatile("bar.sync %0, %1;" ::"r"(bar_id), "r"(bar_threads) : "memory");'),
]}
SHAPES = [(4096, 4096), (12288, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (4096, 14336), (28672, 8192),
          (8192, 28672)]


def build(out_dir: Path) -> None:
    cuda_build.build_edited("w4a16_mma", KERNEL_EDITS, out_dir, arch="90", header_edits=HEADER_EDITS)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", type=Path, help="only compile the variant into this folder")
    ap.add_argument("--libs", type=Path, help="the folder --build filled")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--ms", default="8,16")
    ap.add_argument("--cols", default="1,2,3,4", help="column blocks a CTA, 1 to 4")
    ap.add_argument("--warps", default="2,4,8", help="K ranges per column block")
    ap.add_argument("--shapes", default="all", help="'all' or NxK,NxK,...")
    ap.add_argument("--rounds", type=int, default=2, help="timing rounds, each in another order; median")
    args = ap.parse_args()
    if args.build:
        build(args.build)
        return

    import torch
    import torch.nn.functional as F
    from nibble.bench.kernels import GROUP, TIMING, random_int4
    from nibble.bench.timing import bench_us, env_meta, rotations, shape_list
    from nibble.kernels import w4a16 as W

    dev = torch.device("cuda")
    G = GROUP
    shipped_lib = W._mma_lib(dev)
    variant_lib = ctypes.CDLL(str(args.libs / "w4a16_mma_edited.so"))
    W._MMA_SIGNATURES(variant_lib)
    libs = {"shipped": shipped_lib, "xshare": variant_lib}

    def call(lib, cols, x, w, cfg, out):
        os.environ["NIBBLE_XSHARE_COLS"] = str(cols)
        W._mma_lib = lambda _device, lib=libs[lib]: lib
        W.w4a16_mma_many(x, [w], G, config=cfg, outs=[out])

    shapes = SHAPES if args.shapes == "all" else shape_list(args.shapes)
    rows = []
    for N, K in shapes:
        sets = [random_int4(N, K, G, dev) for _ in range(rotations(N * K // 2 + 4 * (K // G) * N))]
        wb = [torch.randn(N, K, device=dev, dtype=torch.bfloat16) for _ in range(rotations(2 * N * K))]
        for M in map(int, args.ms.split(",")):
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            outs = [torch.empty(M, N, device=dev, dtype=x.dtype) for _ in sets]
            picked = W.select_mma_config(M, N, K)
            cells = [("shipped", 1, picked.warps)]  # (library, cols, K ranges)
            max_threads = 512 if picked.token_tiles <= 2 else 256
            for warps in map(int, args.warps.split(",")):
                for cols in map(int, args.cols.split(",")):
                    if cols * warps * 32 <= max_threads and warps <= 15 and K // 32 >= warps:
                        cells.append(("xshare", cols, warps))
            refs, exact = {}, {}
            for lib, cols, warps in cells:
                cfg = replace(picked, warps=warps)
                if warps not in refs:
                    refs[warps] = torch.full((M, N), float("nan"), device=dev, dtype=x.dtype)
                    call("shipped", 1, x, sets[0], cfg, refs[warps])
                got = torch.full((M, N), float("nan"), device=dev, dtype=x.dtype)
                try:
                    call(lib, cols, x, sets[0], cfg, got)
                    torch.cuda.synchronize()
                except RuntimeError as e:  # e.g. more shared memory than a CTA may have
                    print(f"{N}x{K} M={M} {lib} c{cols} w{warps}: {e}", flush=True)
                    exact[(lib, cols, warps)] = None
                    continue
                exact[(lib, cols, warps)] = torch.equal(got, refs[warps])
            cells = [c for c in cells if exact[c] is not None]
            times = {c: [] for c in cells}
            times["bf16"] = []
            order = ["bf16", *cells]
            for r in range(args.rounds):
                for c in (order if r % 2 == 0 else order[::-1]):
                    if c == "bf16":
                        times[c].append(bench_us(lambda i: (lambda: F.linear(x, wb[i])), len(wb), **TIMING))
                        continue
                    lib, cols, warps = c
                    cfg = replace(picked, warps=warps)
                    times[c].append(bench_us(lambda i: (lambda: call(lib, cols, x, sets[i], cfg, outs[i])),
                                             len(sets), **TIMING))
            bf16 = statistics.median(times["bf16"])
            rows.append(dict(N=N, K=K, M=M, variant="bf16", us=round(bf16, 3), rounds=times["bf16"]))
            line = []
            for c in cells:
                lib, cols, warps = c
                us = statistics.median(times[c])
                rows.append(dict(N=N, K=K, M=M, variant=lib, cols=cols, warps=warps, us=round(us, 3),
                                 speedup=round(bf16 / us, 3), exact=exact[c], rounds=[round(t, 3) for t in times[c]]))
                line.append(f"{lib[0]}{cols}x{warps}={us:.2f}{'' if exact[c] else '!'}")
            best = min(cells, key=lambda c: statistics.median(times[c]))
            ship = statistics.median(times[cells[0]])
            print(f"{N}x{K} M={M:2d} bf16 {bf16:7.2f} shipped(w{picked.warps}) {ship:7.2f} ({bf16 / ship:.2f}x) "
                  f"best {best} {statistics.median(times[best]):7.2f} ({bf16 / statistics.median(times[best]):.2f}x) | "
                  + " ".join(line), flush=True)
        sets = wb = outs = None
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(dict(meta=env_meta(), rows=rows), indent=1))


if __name__ == "__main__":
    main()
