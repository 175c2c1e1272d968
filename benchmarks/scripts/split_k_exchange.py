"""What the Hopper GEMMs' split-K hand-off costs, and hand-offs through distributed shared memory.

An experiment on the sources of commit da157ea, whose split-K hand-off went through global memory
(hopper.cuh: store_partial, cluster_sync_partials, sum_partials); its edits anchor on those texts, so
it runs on a checkout of that commit. Variants of csrc/hopper.cuh and the two GEMMs
(`cuda_build.build_edited`), each timed against the package's build on the same inputs, with every
correct variant's outputs equal to the package's bit for bit:
  nofence     the __threadfence before the cluster barrier removed (the barrier's release / acquire at
              cluster scope already orders the partials' stores for the cluster's readers)
  dsmem       partials in the CTA's own ring (free after the mainloop for a CTA with one item), a
              cluster barrier, the others' rings read with ld.shared::cluster, a second barrier
  dsmem_wide  dsmem with 64-register load batches
  push        each CTA stores the rows the others own into their rings between two barriers
  x_nodata    (wrong results) the fence and barrier without any partial: the floor of a hand-off
  x_nosync    (wrong results) no hand-off at all
Only configs whose tiles fit the GPU's clusters at once are timed (one item per CTA).

    python3 benchmarks/scripts/split_k_exchange.py --build          # compile the variants (nvcc)
    NIBBLE_CACHE_DIR=... PYTHONPATH=. python3 benchmarks/scripts/split_k_exchange.py --json out.json
    (VARIANTS=dsmem,x_nodata to time a subset; SPLIT_VARIANTS=folder of the builds, default
    /tmp/nibble-split-variants; results: benchmarks/results/split-k-dsmem-h200.json)
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.kernels import cuda_build, hopper, w4a4, w4a16  # noqa: E402

OUT = Path(os.environ.get("SPLIT_VARIANTS", "/tmp/nibble-split-variants"))  # the variants' sources and builds

FENCE = ("__device__ __forceinline__ void cluster_sync_partials() {\n  __threadfence();\n",
         "__device__ __forceinline__ void cluster_sync_partials() {\n")

DSMEM_HELPERS = r'''
// ---- experiment: the split-K hand-off through distributed shared memory ----
__device__ __forceinline__ uint32_t cluster_address(uint32_t addr, int rank) {
  uint32_t r;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(addr), "r"(rank));
  return r;
}
__device__ __forceinline__ void cluster_sync_all() {
  asm volatile("barrier.cluster.arrive.release.aligned; barrier.cluster.wait.acquire.aligned;" ::: "memory");
}
template <int W>
__device__ __forceinline__ void st_shared_words(uint32_t addr, const uint32_t (&v)[W]) {
  if constexpr (W == 2) asm volatile("st.shared.v2.b32 [%0], {%1, %2};" ::"r"(addr), "r"(v[0]), "r"(v[1]) : "memory");
  else asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3]) : "memory");
}
template <int W>
__device__ __forceinline__ void ld_cluster_words(uint32_t addr, uint32_t (&v)[W]) {
  if constexpr (W == 2) asm volatile("ld.shared::cluster.v2.b32 {%0, %1}, [%2];" : "=r"(v[0]), "=r"(v[1]) : "r"(addr) : "memory");
  else asm volatile("ld.shared::cluster.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3]) : "r"(addr) : "memory");
}
// slot of (b, p) of consumer thread `slot`: conflict-free (consecutive threads, consecutive 8J bytes);
// the reader of a row in another split's CTA is the thread of the same index.
template <int J> __device__ __forceinline__ uint32_t xchg_slot(uint32_t xchg, int b, int p, int slot) {
  return xchg + ((2 * b + p) * 256 + slot) * 8 * J;  // 256 consumer threads
}
template <int BN, typename A, int J, int R>
__device__ __forceinline__ void xchg_store(const A (&acc)[J][R], uint32_t xchg, int slot, RowShare skip) {
#pragma unroll
  for (int b = 0; b < BN / 8; ++b)
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      if (skip.mine(b)) continue;
      A v[2 * J];
      token_values(acc, b, p, v);
      uint32_t w[2 * J];
#pragma unroll
      for (int i = 0; i < 2 * J; ++i) w[i] = reinterpret_cast<const uint32_t&>(v[i]);
      st_shared_words<2 * J>(xchg_slot<J>(xchg, b, p, slot), w);
    }
}
template <int BN, typename A, int J, int R, typename Done>
__device__ __forceinline__ void xchg_sum(A (&acc)[J][R], uint32_t xchg, int slot, int splits, int own, RowShare share,
                                         Done done) {
  constexpr int LOAD_REGS = BN * J >= 256 ? 8 : 32;
  constexpr int ROWS = LOAD_REGS / (4 * J) < BN / 8 ? LOAD_REGS / (4 * J) : BN / 8;
#pragma unroll
  for (int b0 = 0; b0 < BN / 8; b0 += ROWS) {
    if (share.hi <= b0 || b0 + ROWS <= share.lo) continue;
    if (own < 0)
#pragma unroll
      for (int b = b0; b < b0 + ROWS; ++b)
#pragma unroll
        for (int j = 0; j < J; ++j)
#pragma unroll
          for (int i = 0; i < 4; ++i) acc[j][4 * b + i] = A(0);
#pragma unroll 1
    for (int s = 0; s < splits; ++s) {
      if (s == own) continue;
      const uint32_t there = cluster_address(xchg, s);
      uint32_t o[ROWS][2][2 * J];
#pragma unroll
      for (int b = b0; b < b0 + ROWS; ++b)
#pragma unroll
        for (int p = 0; p < 2; ++p)
          if (share.mine(b)) ld_cluster_words<2 * J>(xchg_slot<J>(there, b, p, slot), o[b - b0][p]);
#pragma unroll
      for (int b = b0; b < b0 + ROWS; ++b)
#pragma unroll
        for (int p = 0; p < 2; ++p)
#pragma unroll
          for (int j = 0; j < J; ++j) {
            acc[j][4 * b + p] += reinterpret_cast<const A&>(o[b - b0][p][2 * j]);
            acc[j][4 * b + 2 + p] += reinterpret_cast<const A&>(o[b - b0][p][2 * j + 1]);
          }
    }
#pragma unroll
    for (int b = b0; b < b0 + ROWS; ++b) done(b);
  }
}

// push: every CTA stores the rows the other splits own straight into their rings (the owner's slot
// for writer w: its rank among the other splits), then one barrier, then each sums its own share
// from its own shared memory. A first barrier makes sure every ring is done with its mainloop.
__device__ __forceinline__ int row_owner(int b, int groups, int splits) { return ((b + 1) * splits + groups - 1) / groups - 1; }
template <int W>
__device__ __forceinline__ void st_cluster_words(uint32_t addr, const uint32_t (&v)[W]) {
  if constexpr (W == 2) asm volatile("st.shared::cluster.v2.b32 [%0], {%1, %2};" ::"r"(addr), "r"(v[0]), "r"(v[1]) : "memory");
  else asm volatile("st.shared::cluster.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(addr), "r"(v[0]), "r"(v[1]), "r"(v[2]), "r"(v[3]) : "memory");
}
template <int W>
__device__ __forceinline__ void ld_shared_words(uint32_t addr, uint32_t (&v)[W]) {
  if constexpr (W == 2) asm volatile("ld.shared.v2.b32 {%0, %1}, [%2];" : "=r"(v[0]), "=r"(v[1]) : "r"(addr) : "memory");
  else asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];" : "=r"(v[0]), "=r"(v[1]), "=r"(v[2]), "=r"(v[3]) : "r"(addr) : "memory");
}
// slot of (writer rank w among the others, row group bb of the owner's share, p) of thread `slot`
template <int J> __device__ __forceinline__ uint32_t push_slot(uint32_t xchg, int w, int share_groups, int bb, int p, int slot) {
  return xchg + (((w * share_groups + bb) * 2 + p) * 256 + slot) * 8 * J;
}
// ORDERED (fp32): the share's sums run over the splits in split order, this CTA's own in its place.
template <int BN, bool ORDERED, typename A, int J, int R, typename Done>
__device__ __forceinline__ void push_exchange(A (&acc)[J][R], uint32_t xchg, int slot, int split, int splits,
                                              RowShare share, Done done) {
  constexpr int G = BN / 8;
  const int sg = (G + splits - 1) / splits;
  cluster_sync_all();  // every split's ring is free
#pragma unroll
  for (int b = 0; b < G; ++b)
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      if (share.mine(b)) continue;
      const int owner = row_owner(b, G, splits);
      const int w = split < owner ? split : split - 1;
      const int bb = b - G * owner / splits;
      A v[2 * J];
      token_values(acc, b, p, v);
      uint32_t words[2 * J];
#pragma unroll
      for (int i = 0; i < 2 * J; ++i) words[i] = reinterpret_cast<const uint32_t&>(v[i]);
      st_cluster_words<2 * J>(cluster_address(push_slot<J>(xchg, w, sg, bb, p, slot), owner), words);
    }
  cluster_sync_all();  // every push landed
#pragma unroll
  for (int b = 0; b < G; ++b) {
    if (!share.mine(b)) continue;
    const int bb = b - share.lo;
    A sum[4 * J];
#pragma unroll
    for (int i = 0; i < 4 * J; ++i) sum[i] = ORDERED ? A(0) : acc[i / 4][4 * b + i % 4];
#pragma unroll 1
    for (int s = 0; s < splits; ++s) {
      if (s == split) {
        if constexpr (ORDERED)
#pragma unroll
          for (int i = 0; i < 4 * J; ++i) sum[i] += acc[i / 4][4 * b + i % 4];
        continue;
      }
      const int w = s < split ? s : s - 1;
#pragma unroll
      for (int p = 0; p < 2; ++p) {
        uint32_t o[2 * J];
        ld_shared_words<2 * J>(push_slot<J>(xchg, w, sg, bb, p, slot), o);
#pragma unroll
        for (int j = 0; j < J; ++j) {
          sum[4 * j + p] += reinterpret_cast<const A&>(o[2 * j]);
          sum[4 * j + 2 + p] += reinterpret_cast<const A&>(o[2 * j + 1]);
        }
      }
    }
#pragma unroll
    for (int i = 0; i < 4 * J; ++i) acc[i / 4][4 * b + i % 4] = sum[i];
    done(b);
  }
}
'''
HELPER_ANCHOR = ('__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait;" ::: "memory"); }\n',)

WIDE = DSMEM_HELPERS.replace("constexpr int LOAD_REGS = BN * J >= 256 ? 8 : 32;", "constexpr int LOAD_REGS = BN * J >= 256 ? 16 : 64;")
W4A4_SPLIT = """      store_partial<BN>(acc, partial, M, N, m0, ch, t, split, share);
      cluster_sync_partials();
      sum_partials<BN>(acc, partial, M, N, m0, ch, t, splits, split, share, [](int) {});
"""
W4A4_DSMEM = """      asm volatile("bar.sync 1, 256;" ::: "memory");  // both warpgroups' wgmmas are done with the ring
      xchg_store<BN>(acc, base, tid, share);
      cluster_sync_all();
      xchg_sum<BN>(acc, base, tid, splits, split, share, [](int) {});
      cluster_sync_all();  // the other splits are done reading this CTA's ring
"""
W4A4_PUSH = """      asm volatile("bar.sync 1, 256;" ::: "memory");  // both warpgroups' wgmmas are done with the ring
      push_exchange<BN, false>(acc, base, tid, split, splits, share, [](int) {});
"""
W4A16_PUSH = """    asm volatile("bar.sync 1, 256;" ::: "memory");  // both warpgroups' wgmmas are done with the ring
    push_exchange<BN, true>(acc, base, tid, blockIdx.y, splits, share, store_rows);
"""
W4A4_NODATA = "      cluster_sync_partials();\n"
W4A4_PRODUCER = """        if constexpr (SPLIT) {  // the consumers' barrier of this item (hopper.cuh: cluster_arrive_relaxed)
          if (w != (int)blockIdx.x) cluster_wait();
          cluster_arrive_relaxed();
        }
"""

W4A16_SPLIT = """    store_partial<BN>(acc, partial, M, N, m0, ch, t, blockIdx.y, RowShare{0, 0});
    cluster_sync_partials();
    sum_partials<BN>(acc, partial, M, N, m0, ch, t, splits, -1, share, store_rows);
"""
W4A16_DSMEM = """    asm volatile("bar.sync 1, 256;" ::: "memory");  // both warpgroups' wgmmas are done with the ring
    xchg_store<BN>(acc, base, tid, RowShare{0, 0});
    cluster_sync_all();
    xchg_sum<BN>(acc, base, tid, splits, -1, share, store_rows);
    cluster_sync_all();  // the other splits are done reading this CTA's ring
"""
W4A16_SHARE_ONLY = """
#pragma unroll
    for (int b = 0; b < BN / 8; ++b) if (share.mine(b)) store_rows(b);
"""

VARIANTS = {
    "w4a4": {
        "nofence": dict(edits=[], header_edits={"hopper.cuh": [FENCE]}),
        "dsmem": dict(edits=[(W4A4_SPLIT, W4A4_DSMEM)],
                      header_edits={"hopper.cuh": [(HELPER_ANCHOR[0], HELPER_ANCHOR[0] + DSMEM_HELPERS)]}),
        "dsmem_wide": dict(edits=[(W4A4_SPLIT, W4A4_DSMEM)],
                           header_edits={"hopper.cuh": [(HELPER_ANCHOR[0], HELPER_ANCHOR[0] + WIDE)]}),
        "push": dict(edits=[(W4A4_SPLIT, W4A4_PUSH)],
                     header_edits={"hopper.cuh": [(HELPER_ANCHOR[0], HELPER_ANCHOR[0] + DSMEM_HELPERS)]}),
        "x_nodata": dict(edits=[(W4A4_SPLIT, W4A4_NODATA)], header_edits=None),
        "x_nosync": dict(edits=[(W4A4_SPLIT, ""), (W4A4_PRODUCER, "")], header_edits=None),
    },
    "w4a16": {
        "nofence": dict(edits=[], header_edits={"hopper.cuh": [FENCE]}),
        "dsmem": dict(edits=[(W4A16_SPLIT, W4A16_DSMEM)],
                      header_edits={"hopper.cuh": [(HELPER_ANCHOR[0], HELPER_ANCHOR[0] + DSMEM_HELPERS)]}),
        "dsmem_wide": dict(edits=[(W4A16_SPLIT, W4A16_DSMEM)],
                           header_edits={"hopper.cuh": [(HELPER_ANCHOR[0], HELPER_ANCHOR[0] + WIDE)]}),
        "push": dict(edits=[(W4A16_SPLIT, W4A16_PUSH)],
                     header_edits={"hopper.cuh": [(HELPER_ANCHOR[0], HELPER_ANCHOR[0] + DSMEM_HELPERS)]}),
        "x_nodata": dict(edits=[(W4A16_SPLIT, "    cluster_sync_partials();" + W4A16_SHARE_ONLY)], header_edits=None),
        "x_nosync": dict(edits=[(W4A16_SPLIT, W4A16_SHARE_ONLY)], header_edits=None),
    },
}


def so_path(kernel, name):
    return OUT / f"{kernel}-{name}" / f"{kernel}_wgmma_edited.so"


def build_all(only=None):
    for kernel, vs in VARIANTS.items():
        for name, v in vs.items():
            if only and name not in only:
                continue
            try:
                cuda_build.build_edited(f"{kernel}_wgmma", v["edits"], OUT / f"{kernel}-{name}", "90a",
                                        header_edits=v["header_edits"])
            except OSError:
                pass  # built; loading needs the driver
            print("built", so_path(kernel, name), so_path(kernel, name).exists(), flush=True)


# (N, K, M, tile, split)
W4A4_CASES = [(4096, 11008, 128, (128, 128), 1), (4096, 11008, 128, (128, 128), 2), (4096, 11008, 128, (128, 128), 3),
              (4096, 11008, 128, (64, 128), 2), (4096, 11008, 128, (64, 256), 3), (4096, 11008, 128, (128, 256), 3),
              (4096, 14336, 128, (128, 128), 3), (4096, 14336, 128, (64, 128), 2),
              (4096, 4096, 128, (64, 128), 2), (4096, 4096, 128, (64, 128), 3), (4096, 4096, 128, (128, 128), 2),
              (8192, 28672, 128, (128, 128), 2), (4096, 11008, 64, (64, 128), 2), (4096, 11008, 256, (128, 128), 2),
              (12288, 4096, 128, (128, 128), 1)]
W4A16_CASES = [(4096, 11008, 128, (128, 128), 1), (4096, 11008, 128, (128, 128), 2), (4096, 11008, 128, (128, 128), 3),
               (4096, 11008, 128, (64, 128), 2), (4096, 14336, 128, (128, 128), 3), (4096, 4096, 128, (64, 128), 2),
               (8192, 28672, 128, (128, 128), 2), (4096, 11008, 64, (64, 128), 2), (12288, 4096, 128, (128, 128), 1)]


def run(rounds):
    import torch
    from nibble.bench.timing import bench_us, rotations
    dev = torch.device("cuda")
    rows = []
    for kernel, cases in (("w4a4", W4A4_CASES), ("w4a16", W4A16_CASES)):
        mod = w4a4 if kernel == "w4a4" else w4a16
        shipped = mod._wgmma_lib
        libs = {"pkg": shipped(dev)}
        for name in (os.environ.get("VARIANTS") or ",".join(VARIANTS[kernel])).split(","):
            lib = ctypes.CDLL(str(so_path(kernel, name)))
            mod._WGMMA_SIGNATURES(lib)
            libs[name] = lib
        clusters = mod.wgmma_clusters(dev)
        for N, K, M, tile, split in cases:
            tiles = hopper.tile_count(M, N, *tile)
            if split > 1 and tiles > clusters[split]:
                print(f"skip {kernel} {N}x{K} M={M} {tile}/{split}: {tiles} tiles > {clusters[split]} clusters")
                continue
            cfg = dict(bn=tile[0], channels=tile[1], split_k=split)
            n_rot = rotations(K * N // 2)
            if kernel == "w4a4":
                ws = [torch.randint(-2**31, 2**31 - 1, (K // 8, N), dtype=torch.int32, device=dev) for _ in range(n_rot)]
                w_scale = torch.rand(N, device=dev, dtype=torch.bfloat16) / 64
                qx = torch.randint(-8, 8, (M, K), dtype=torch.int8, device=dev)
                sx = torch.rand(M, device=dev) / 8
                call = lambda j, i32=False: w4a4.w4a4_wgmma(qx, sx, ws[j], w_scale, out_int32=i32, order="even_odd", config=cfg)
                outs = lambda: [call(0, True), call(0)]
            else:
                G = 128
                ws = [torch.randint(-2**31, 2**31 - 1, (K // 8, N), dtype=torch.int32, device=dev) for _ in range(n_rot)]
                sc = (torch.rand(K // G, N, device=dev) / 64).half()
                z = (torch.randn(K // G, N, device=dev) / 16).half()
                x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
                call = lambda j: w4a16.w4a16_wgmma(x, ws[j], sc, z, G, config=cfg)
                outs = lambda: [call(0)]
            times = {n: [] for n in libs}
            ref = None
            order = list(libs) + list(reversed(list(libs)))
            for r in range(rounds):
                for name in (order if r % 2 == 0 else list(reversed(order))):
                    mod._wgmma_lib = lambda _d, lib=libs[name]: lib
                    o = outs()
                    if name == "pkg" and ref is None:
                        ref = o
                    if not name.startswith("x_") and ref is not None:
                        same = all(torch.equal(a, b) for a, b in zip(o, ref))
                        if not same:
                            print(f"  !! {kernel} {name} differs at {N}x{K} M={M} {tile}/{split}", flush=True)
                    times[name].append(bench_us(lambda j: lambda: call(j), n_rot))
            mod._wgmma_lib = shipped
            med = {n: sorted(t)[len(t) // 2] for n, t in times.items()}
            row = dict(kernel=kernel, N=N, K=K, M=M, tile=list(tile), split=split, **med)
            rows.append(row)
            print(f"{kernel} {N:5d}x{K:5d} M={M:4d} {tile[0]}x{tile[1]}/{split}: "
                  + "  ".join(f"{n} {v:6.2f}" for n, v in med.items()), flush=True)
    return rows


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", action="store_true")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    a = ap.parse_args()
    if a.build:
        build_all(a.only)
    else:
        rows = run(a.rounds)
        if a.json:
            Path(a.json).write_text(json.dumps(rows, indent=1))
