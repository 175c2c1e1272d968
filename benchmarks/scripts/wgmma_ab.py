"""A/B of two builds of the W4A4 Hopper GEMM (`csrc/w4a4_wgmma.cu`): each build's library is
loaded in turn in place of the shipped one and times `w4a4_wgmma` on the same inputs with the
config the op picks (CUDA graphs, weights rotated past the L2, median; the builds timed A, B, B, A
and each one's two medians averaged, so neither always runs first). The int32 products of every
build must equal the first build's.

    nvcc -O3 -std=c++17 -shared -Xcompiler -fPIC -gencode=arch=compute_90a,code=sm_90a \\
        -I nibble/kernels/csrc a.cu -o a.so     # one per variant
    PYTHONPATH=. python3 benchmarks/scripts/wgmma_ab.py a.so b.so --json ab.json
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.bench.timing import bench_us, env_meta, rotations  # noqa: E402
from nibble.bench.w4a4 import random_w4a4  # noqa: E402
from nibble.kernels import cuda_build, hopper, w4a4  # noqa: E402

SHAPES = ((4096, 4096), (12288, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (4096, 14336),
          (28672, 8192), (8192, 28672))


def load_build(kernels, path) -> ctypes.CDLL:
    """Another build of the Hopper GEMM of ``kernels`` (the module `w4a4` or `w4a16`), the shared
    library at ``path``, loaded with the package's ctypes signatures."""
    lib = ctypes.CDLL(str(Path(path).resolve()))
    kernels.WGMMA.signatures(lib)
    return lib


def package_and_builds(kernels, paths) -> dict:
    """{"package": the package's own build of ``kernels``' Hopper GEMM, then <file stem>: each
    shared library of ``paths`` (other builds of the same source, `load_build`)}."""
    return {"package": kernels.WGMMA.lib(torch.device("cuda")),
            **{Path(path).stem: load_build(kernels, path) for path in paths}}


def time_builds(builds, shapes, ms, say=print, exact: bool = True) -> list[dict]:
    """Rows {N, K, M, config (the op's pick), <build name>: us} for builds (name, library, config, or
    None for the op's pick) of csrc/w4a4_wgmma.cu on the same inputs: every build's int32 products,
    and its bf16 outputs with and without a bias, must equal the first one's (``exact``; knockout
    builds, wrong on purpose, are only timed); timed A, B, ..., B, A and each build's two medians
    averaged."""
    order = list(range(len(builds))) + list(reversed(range(len(builds))))
    shipped, dev, rows = w4a4.WGMMA.lib, torch.device("cuda"), []
    for N, K in shapes:
        n_rot = rotations(K * N // 2)
        weights = [torch.randint(-2**31, 2**31 - 1, (K // 8, N), dtype=torch.int32, device=dev) for _ in range(n_rot)]
        w_scale = torch.rand(N, device=dev, dtype=torch.bfloat16) / 64
        bias = torch.randn(N, device=dev, dtype=torch.bfloat16)
        for M in ms:
            qx = torch.randint(-8, 8, (M, K), dtype=torch.int8, device=dev)
            sx = torch.rand(M, device=dev) / 8
            cfg = w4a4.WGMMA.config(M, N, K, w4a4.WGMMA.clusters(dev))
            times: dict = {name: [] for name, _, _ in builds}
            ref = None
            for i in order:
                name, lib, config = builds[i]
                w4a4.WGMMA.lib = lambda _d, lib=lib: lib
                outs = [w4a4.w4a4_wgmma(qx, sx, weights[0], w_scale, out_int32=True, order="even_odd", config=config)]
                outs += [w4a4.w4a4_wgmma(qx, sx, weights[0], w_scale, b, order="even_odd", config=config)
                         for b in (None, bias)]
                if ref is None:
                    ref = outs
                assert not exact or all(torch.equal(o, r) for o, r in zip(outs, ref)), \
                    f"{name} differs from {builds[order[0]][0]} at M={M} N={N} K={K}"
                times[name].append(bench_us(lambda j: lambda: w4a4.w4a4_wgmma(
                    qx, sx, weights[j], w_scale, order="even_odd", config=config), n_rot))
            row = dict(N=N, K=K, M=M, config=cfg, **{n: sum(t) / len(t) for n, t in times.items()})
            rows.append(row)
            base = row[builds[0][0]]
            say(f"{N:5d} x {K:5d} M={M:5d} {cfg['bn']}x{cfg['channels']}/{cfg['split_k']}: "
                + "  ".join(f"{n} {row[n]:7.2f} us ({base / row[n]:.3f}x)" for n in times))
    w4a4.WGMMA.lib = shipped
    return rows


def time_ops(builds, shapes, ms, say=print) -> list[dict]:
    """The op (quantize + GEMM) with each build's GEMM: outputs equal to the first build's, timed A, B, ..., B, A.
    A build's config (None: the op's pick) may be a function of (N, K, M)."""
    order = list(range(len(builds))) + list(reversed(range(len(builds))))
    shipped, pick, dev, rows = w4a4.WGMMA.lib, hopper.pick_config, torch.device("cuda"), []
    for N, K in shapes:
        n_rot = rotations(K // 8 * N * 4)
        ws = [random_w4a4(N, K, dev) for _ in range(n_rot)]
        for M in ms:
            x = (torch.randn(M, K, device=dev) * torch.logspace(-1, 1, K, device=dev)).to(torch.bfloat16)
            times, ref = {name: [] for name, _, _ in builds}, None
            for i in order:
                name, lib, config = builds[i]
                w4a4.WGMMA.lib = lambda _d, lib=lib: lib
                if callable(config):
                    config = config(N, K, M)
                hopper.pick_config = pick if config is None else lambda *_a, c=config, **_k: dict(c)
                out = w4a4.w4a4_linear(x, ws[0][0], ws[0][1], None, False)
                ref = out if ref is None else ref
                assert torch.equal(out, ref), f"{name} differs at M={M} N={N} K={K}"
                times[name].append(bench_us(lambda j: lambda: w4a4.w4a4_linear(x, ws[j][0], ws[j][1], None, False), n_rot))
            row = dict(N=N, K=K, M=M, op="w4a4_linear", **{n: sum(t) / len(t) for n, t in times.items()})
            rows.append(row)
            base = row[builds[0][0]]
            say(f"op {N:5d} x {K:5d} M={M:4d}: " + "  ".join(f"{n} {row[n]:7.2f} us ({base / row[n]:.3f}x)" for n in times))
    w4a4.WGMMA.lib, hopper.pick_config = shipped, pick
    return rows


def build_variants(variant_edits: dict, out_dir: Path, header_edits: dict | None = None) -> None:
    """Each name -> (old, new) edits of ``variant_edits``: csrc/w4a4_wgmma.cu built with them into
    ``out_dir`` / name (`cuda_build.build_edited`: nvcc, no GPU needed), every variant with
    ``header_edits`` ({"hopper.cuh": edits}) too."""
    for name, edits in variant_edits.items():
        cuda_build.build_edited("w4a4_wgmma", edits, out_dir / name, header_edits=header_edits)
        print(f"built {out_dir / name}", flush=True)


def time_product_and_op(prebuilt: Path, ms, names) -> list[dict]:
    """The shipped build and the variants ``names`` built into ``prebuilt``: the product alone
    (`time_builds`), then the op around it (`time_ops`), on SHAPES at each M of ``ms``."""
    builds = variant_builds(prebuilt, names)
    say = lambda line: print(line, flush=True)  # noqa: E731
    return time_builds(builds, SHAPES, ms, say) + time_ops(builds, SHAPES, ms, say)


def variant_builds(prebuilt: Path, names) -> list:
    """Builds for `time_builds`: the package's own ("shipped"), then each variant ``names`` built by
    `cuda_build.build_edited` into ``prebuilt`` / name, loaded with the package's ctypes signatures."""
    return [("shipped", w4a4.WGMMA.lib(torch.device("cuda")), None)] + [
        (name, load_build(w4a4, prebuilt / name / "w4a4_wgmma_edited.so"), None) for name in names]


def variants_main(doc: str, build_all, time_variants, default_ms: str, meta: dict) -> None:
    """The command line of a script that rebuilds csrc/w4a4_wgmma.cu as variants and times them:
    ``--build-only DIR`` runs build_all(DIR) (nvcc, no GPU needed), ``--prebuilt DIR`` loads what it
    built, neither builds into a temporary folder; time_variants(folder, ms) returns the rows, which
    ``--json`` writes with ``meta``."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--build-only", type=Path)
    ap.add_argument("--prebuilt", type=Path)
    ap.add_argument("--ms", default=default_ms)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.build_only:
        build_all(args.build_only)
        return
    with tempfile.TemporaryDirectory() as tmp:
        if args.prebuilt is None:
            args.prebuilt = Path(tmp)
            build_all(args.prebuilt)
        rows = time_variants(args.prebuilt, [int(m) for m in args.ms.split(",")])
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": env_meta(**meta), "rows": rows}, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("libs", nargs="+", help="shared libraries built from csrc/w4a4_wgmma.cu variants")
    ap.add_argument("--ms", default="128,512,1024,4096")
    ap.add_argument("--json")
    args = ap.parse_args()
    builds = [(Path(path).stem, load_build(w4a4, path), None) for path in args.libs]
    rows = time_builds(builds, SHAPES, [int(m) for m in args.ms.split(",")], lambda line: print(line, flush=True))
    if args.json:
        Path(args.json).write_text(json.dumps({"meta": env_meta(libs=args.libs), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
