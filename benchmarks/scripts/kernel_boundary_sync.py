"""What a kernel boundary costs a decode step, and what a finer-grained hand-off could take off it.

A decode step is a chain of ~290 dependent launches (9 a layer: norm, q/k/v, RoPE, attention, its
combine, o_proj, norm, gate/up, SiLU, down), each a few microseconds, every one waiting for the whole
previous grid (`griddepcontrol.wait`: the grid's last CTA exits, its writes are flushed, then the
dependents' waits release). Fusions that remove a boundary have cost as much as they saved
(benchmarks/notes-w4a16.md, sessions 22-25, 41). This prices the boundary itself: a CUDA graph of a
chain of short Triton kernels (each CTA reads the previous kernel's whole output, a 4096-wide row, as
a matmul or a norm does, and writes its slice of the next), handed over four ways:

- ``plain``: no early launch (stream order);
- ``pdl``: the engine's glue today: launched early, `griddepcontrol.wait`, then let the next launch;
- ``flag``: launched early, each CTA polls per-CTA counters of the previous kernel's CTAs (each CTA
  publishes its own after its stores: a CTA barrier, then a release store of its run count) and
  lets the next kernel launch once its own wait is over (two grids in flight, as the matmuls do);
- ``flag_early``: the same hand-off, but each kernel lets the next one launch as it starts (its launch
  and first polls under this one's work: many grids in flight, polling);
- ``none``: launched early, no wait at all (outputs racy: the floor no hand-off can beat).

Chains of `--length` kernels of 1 CTA (glue-like), 128 CTAs (matmul-like), and the two alternating.
Counters only grow, so a graph replays without resetting them: run r of a CTA waits for every
producer CTA's counter to reach r + 1 (the first kernel of the chain waits on the last one's, one run
behind). Not a correctness test of the flag hand-off beyond its ordering; timing only.

    PYTHONPATH=. python3 benchmarks/scripts/kernel_boundary_sync.py --json $OUT/boundary.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.timing import bench_us, env_meta  # noqa: E402

N = 4096  # the row each CTA reads (a hidden state of Llama-2-7B)
MODES = ("plain", "pdl", "flag", "flag_early", "none")


@triton.jit
def _acquire_fence(x):
    """fence.acq_rel.gpu after the polling loads: with them, an acquire pattern (PTX memory model)."""
    return tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _step_kernel(x_ptr, y_ptr, prev_flags, own_flags, n_prev, behind, N: tl.constexpr, SLICE: tl.constexpr,
                 PREV_P: tl.constexpr, MODE: tl.constexpr):
    pid = tl.program_id(0)
    if MODE == 1:  # pdl
        gdc_wait()
        gdc_launch_dependents()
    if MODE == 3:  # flag_early: the next kernel launches at once and polls beside this one
        gdc_launch_dependents()
    if MODE == 2 or MODE == 3:  # flag
        run = tl.load(own_flags + pid, volatile=True)
        offs = tl.arange(0, PREV_P)
        m = offs < n_prev
        done = tl.min(tl.load(prev_flags + offs, mask=m, other=1 << 30, volatile=True), axis=0)
        while done < run + 1 - behind:
            done = tl.min(tl.load(prev_flags + offs, mask=m, other=1 << 30, volatile=True), axis=0)
        run = _acquire_fence(run)
    if MODE == 2:
        gdc_launch_dependents()
    if MODE == 4:  # none
        gdc_launch_dependents()
    cols = tl.arange(0, N)
    x = tl.load(x_ptr + cols)
    r = tl.rsqrt(tl.sum(x * x, axis=0) / N + 1e-6)
    mine = pid * SLICE + tl.arange(0, SLICE)
    tl.store(y_ptr + mine, tl.load(x_ptr + mine) * r + 1.0)
    if MODE == 2 or MODE == 3:
        tl.debug_barrier()  # every thread's stores before the one release below
        tl.atomic_xchg(own_flags + pid, run + 1, sem="release", scope="gpu")


class Chain:
    """``length`` kernels of ``ctas[i % len(ctas)]`` CTAs, ping-ponging between two rows."""

    def __init__(self, mode: str, ctas: list[int], length: int):
        self.mode, self.length = MODES.index(mode), length
        self.ctas = [ctas[i % len(ctas)] for i in range(length)]
        self.rows = torch.randn(2, N, device="cuda")
        self.flags = torch.zeros(length, max(ctas), dtype=torch.int32, device="cuda")

    def __call__(self):
        for i, p in enumerate(self.ctas):
            j = (i - 1) % self.length
            _step_kernel[(p,)](self.rows[i % 2], self.rows[(i + 1) % 2], self.flags[j], self.flags[i], self.ctas[j],
                               int(i == 0), N=N, SLICE=N // p, PREV_P=triton.next_power_of_2(self.ctas[j]), MODE=self.mode,
                               num_warps=4, launch_pdl=self.mode != 0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    shapes = {"1 CTA": [1], "128 CTAs": [128], "1 / 128 alternating": [1, 128]}
    rows = []
    for label, ctas in shapes.items():
        chains = {mode: Chain(mode, ctas, args.length) for mode in MODES}
        for chain in chains.values():
            chain()  # compile outside the graphs
        torch.cuda.synchronize()
        times = {mode: [] for mode in MODES}
        for r in range(args.rounds):
            for mode in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:
                times[mode].append(bench_us(lambda i, c=chains[mode]: c))
        for mode in MODES:
            us = statistics.median(times[mode])
            rows.append(dict(chain=label, mode=mode, length=args.length, us_per_chain=us,
                             us_per_kernel=us / args.length, rounds=times[mode]))
            print(f"{label:20s} {mode:6s} {us / args.length:6.3f} us a kernel ({us:8.1f} us a chain of {args.length})",
                  flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": env_meta(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
