"""W4A4's Hopper GEMM with a stream-K schedule in its unsplit (persistent) kernel, priced against the
shipped data-parallel / split-K picks. At 128 tokens the wide 4096-deep layers make 86-112 tiles of
128 x 128 for 132 SMs, one tile per busy SM: 12288 x 4096 leaves 36 SMs idle, so its product runs
at 96 / 132 of what the SMs could give. Split-K, stream-K (session 12) and the 64 x 128 tile all lost
there, each paying the kernel's per-item costs of that time (~4-5 us: the scale loads in the
epilogue, the partials through global memory in the epilogue's layout, the split path compiled into
the unsplit kernel); session 13-16 took most of those costs out.

The variant: the U = tiles x KT K tiles of all output tiles laid end to end, CTA b of G (one per SM)
taking [b U / G, (b + 1) U / G), the ring running on across its pieces as it does across items. A
CTA's first piece may be the tail (or middle) of a tile whose head another CTA holds: it stores its
int32 sums, each thread its own in a lane-private slot (int4 stores, 512 contiguous bytes a warp
instruction), and raises its flag (st.release.gpu); the CTA holding a tile's head (its last piece,
which ends its range) waits for the flags of the CTAs after it that hold the rest of the tile, adds
their sums (exact) and runs the epilogue. Tails come first in their CTAs and heads last, so a head
waits only where a CTA's whole range lies inside one tile (benchmarks/notes-w4a4.md, session 34, says
what that wait costs). The split-K (cluster) kernel is untouched. Partials and flags are static device
arrays of the library (this script only: one launch at a time).

    PYTHONPATH=. python3 benchmarks/scripts/w4a4_stream_k.py --build-only .exp/streamk
    PYTHONPATH=. python3 benchmarks/scripts/w4a4_stream_k.py --prebuilt .exp/streamk --ms 128 --json out.json
"""
from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from wgmma_ab import SHAPES, build_variants, time_builds, time_ops, variant_builds, variants_main  # noqa: E402


HELPERS = """\
// Stream-K (this script's variant): a CTA's tail piece hands its int32 sums on through its own slot.
constexpr int SK_MAX_CTAS = 160;
__device__ int4 sk_partial[SK_MAX_CTAS][128 * 256 / 4];
__device__ unsigned sk_flag[SK_MAX_CTAS];

"""

STREAM_K_EDITS = [
    ("// The GATED epilogue: SiLU(gate) * up as the engine computes it from the two products, to the bit.\n",
     HELPERS + "// The GATED epilogue: SiLU(gate) * up as the engine computes it from the two products, to the bit.\n"),
    ("  const int tiles = ((M + BN - 1) / BN) * ((N + CH - 1) / CH), items = tiles * splits;\n",
     "  const int tiles = ((M + BN - 1) / BN) * ((N + CH - 1) / CH), items = tiles * splits;\n"
     "  const int kt = (K + BK - 1) / BK;\n"
     "  const long long units = SPLIT ? items : (long long)tiles * kt;\n"
     "  const int w_begin = SPLIT ? (int)blockIdx.x : (int)(blockIdx.x * units / gridDim.x);\n"
     "  const int w_end = SPLIT ? items : (int)((blockIdx.x + 1) * units / gridDim.x);\n"
     "  const auto next_w = [&](int w) { return SPLIT ? w + (int)gridDim.x : min(w_end, (w / kt + 1) * kt); };\n"
     "  const auto work_of = [&](int w) {\n"
     "    if (SPLIT) return cta_work(M, N, K, BN, CH, tiles_per_split, w / splits, w % splits);\n"
     "    CtaWork c = cta_work(M, N, K, BN, CH, kt, w / kt, 0);\n"
     "    c.k_begin = w % kt;\n"
     "    c.k_tiles = next_w(w) - w;\n"
     "    return c;\n"
     "  };\n"),
    ("      for (int w = blockIdx.x, first = 0; w < items; w += gridDim.x) {\n"
     "        const CtaWork work = cta_work(M, N, K, BN, CH, tiles_per_split, SPLIT ? w / splits : w, SPLIT ? w % splits : 0);\n",
     "      for (int w = w_begin, first = 0; w < w_end; w = next_w(w)) {\n"
     "        const CtaWork work = work_of(w);\n"),
    ("  for (int w = blockIdx.x, first = 0; w < items; w += gridDim.x) {\n"
     "    const int tile = SPLIT ? w / splits : w, split = SPLIT ? w % splits : 0;\n"
     "    const CtaWork work = cta_work(M, N, K, BN, CH, tiles_per_split, tile, split);\n",
     "  for (int w = w_begin, first = 0; w < w_end; w = next_w(w)) {\n"
     "    const int tile = SPLIT ? w / splits : w / kt, split = SPLIT ? w % splits : 0;\n"
     "    const CtaWork work = work_of(w);\n"),
    ("    first += k_tiles;\n\n    // the token rows this CTA finishes\n",
     "    first += k_tiles;\n"
     "    if constexpr (!SPLIT) {\n"
     "      if (work.k_begin != 0 || k_tiles != kt) {  // a piece of a cut tile\n"
     "        if (work.k_begin != 0) {  // its tail or middle: the sums go to this CTA's slot\n"
     "          int4* const mine = sk_partial[blockIdx.x] + tid;\n"
     "#pragma unroll\n"
     "          for (int j = 0; j < J; ++j)\n"
     "#pragma unroll\n"
     "            for (int r = 0; r < R; r += 4)\n"
     "              mine[(j * R + r) / 4 * CONSUMER_THREADS] = make_int4(acc[j][r], acc[j][r + 1], acc[j][r + 2], acc[j][r + 3]);\n"
     "          __threadfence();\n"
     "          consumers_sync();\n"
     "          if (tid == 0) asm volatile(\"st.release.gpu.global.u32 [%0], 1;\" ::\"l\"(sk_flag + blockIdx.x) : \"memory\");\n"
     "          continue;\n"
     "        }\n"
     "        // its head: the rest of the tile is in the CTAs after this one, up to the last stage's\n"
     "        const long long last_unit = (long long)tile * kt + kt - 1;\n"
     "        const int last = (int)(((last_unit + 1) * gridDim.x - 1) / units);\n"
     "        if (tid == 0)\n"
     "          for (int b = blockIdx.x + 1; b <= last; ++b) {\n"
     "            unsigned ready = 0;\n"
     "            while (!ready) asm volatile(\"ld.acquire.gpu.global.u32 %0, [%1];\" : \"=r\"(ready) : \"l\"(sk_flag + b) : \"memory\");\n"
     "            asm volatile(\"st.relaxed.gpu.global.u32 [%0], 0;\" ::\"l\"(sk_flag + b) : \"memory\");\n"
     "          }\n"
     "        consumers_sync();\n"
     "        for (int b = blockIdx.x + 1; b <= last; ++b) {\n"
     "          const int4* const theirs = sk_partial[b] + tid;\n"
     "#pragma unroll\n"
     "          for (int j = 0; j < J; ++j)\n"
     "#pragma unroll\n"
     "            for (int r = 0; r < R; r += 4) {\n"
     "              const int4 p = __ldcg(theirs + (j * R + r) / 4 * CONSUMER_THREADS);\n"
     "              acc[j][r] += p.x, acc[j][r + 1] += p.y, acc[j][r + 2] += p.z, acc[j][r + 3] += p.w;\n"
     "            }\n"
     "        }\n"
     "      }\n"
     "    }\n\n"
     "    // the token rows this CTA finishes\n"),
    ("    if (ctas > sms) ctas = sms;\n",
     "    ctas *= (K + BK - 1) / BK;  // stream-K: every SM, each with a K tile at least\n"
     "    if (ctas > sms) ctas = sms;\n"
     "    if (ctas > SK_MAX_CTAS) ctas = SK_MAX_CTAS;\n"),
]

VARIANT_EDITS = {"stream_k": STREAM_K_EDITS}
# Diagnostic (wrong outputs, timed only): the schedule without the hand-off, tails dropping their sums
# and heads neither waiting nor adding.
KNOCKOUT_EDITS = {"no_handoff": [(old, new.replace("if (work.k_begin != 0 || k_tiles != kt) {",
                                                   "if (work.k_begin != 0) continue;\n      if (false) {"))
                                 for old, new in STREAM_K_EDITS]}
TILES = ((128, 128), (128, 256), (64, 128), (64, 256))


def forced(bn: int, channels: int) -> dict:
    """The config of this tile, unsplit (the stream-K kernel)."""
    return {"bn": bn, "channels": channels, "split_k": 1}


def time_variants(prebuilt: Path, ms) -> list[dict]:
    """The product: the shipped library at the op's pick, then stream-K at each tile (split 1), all
    exact against the first; then the op (quantization + product), stream-K at its fastest tile per
    (shape, M); then, at 128 tokens on the 4096-deep and 4096-wide layers, the knockout beside the
    shipped and stream-K 128 x 128."""
    say = lambda line: print(line, flush=True)  # noqa: E731
    (_, shipped, _), (_, stream_k, _) = variant_builds(prebuilt, VARIANT_EDITS)
    tile_of = {f"sk_{bn}x{ch}": (bn, ch) for bn, ch in TILES}
    builds = [("shipped", shipped, None)] + [(name, stream_k, forced(*tile)) for name, tile in tile_of.items()]
    rows = time_builds(builds, SHAPES, ms, say)
    best = {}
    for row in rows:
        row["stream_k_best"] = min(tile_of, key=lambda n: row[n])
        best[row["N"], row["K"], row["M"]] = tile_of[row["stream_k_best"]]
    rows += time_ops([("shipped", shipped, None), ("stream_k", stream_k, lambda n, k, m: forced(*best[n, k, m]))],
                     SHAPES, ms, say)
    deep = [(n, k) for n, k in SHAPES if n != k and 4096 in (n, k)]  # the 4096-deep and the 4096-wide layers
    knockout = variant_builds(prebuilt, KNOCKOUT_EDITS)[1][1]
    return rows + time_builds(builds[:2] + [("no_handoff_128x128", knockout, forced(128, 128))], deep, [128], say,
                              exact=False)


if __name__ == "__main__":
    variants_main(__doc__, partial(build_variants, {**VARIANT_EDITS, **KNOCKOUT_EDITS}), time_variants, "128",
                  dict(variants=list(VARIANT_EDITS), knockouts=list(KNOCKOUT_EDITS), tiles=[list(t) for t in TILES]))
