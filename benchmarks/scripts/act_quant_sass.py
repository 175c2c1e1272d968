"""SASS instruction counts of the fused rotate + quantize Triton kernel (`w4a4._act_quant_kernel` with its online
Hadamard, bfloat16 rows, even_odd codes) compiled for sm_90 on a machine without a GPU: what a change to it adds to
each program, before a GPU can time it. Run once per source tree (its ``nibble`` first on PYTHONPATH):

    PYTHONPATH=OLD_TREE python3 benchmarks/scripts/act_quant_sass.py > old.json
    PYTHONPATH=. python3 benchmarks/scripts/act_quant_sass.py > new.json

Per K: all instructions but NOPs, and the compares / selects / min-max / FFMA / FMUL among them.
"""
from __future__ import annotations

import argparse
import inspect
import json
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from nibble.kernels import hadamard, w4a4

KS = (4096, 11008, 14336)
COUNTED = ("FSETP", "FSEL", "SEL", "ISETP", "FMNMX", "FFMA", "FMUL")


def sass(cubin: bytes) -> list[str]:
    cuobjdump = next(Path(triton.__file__).parent.glob("backends/nvidia/bin/cuobjdump"))
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(cuobjdump), "-sass", f.name], capture_output=True, text=True, check=True).stdout
    ops = re.findall(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", text)
    return [op for op in ops if not op.startswith("NOP")]


def counts(K: int) -> dict:
    rows, block, warps, plan = w4a4._act_plan(K, True)
    terms_in, terms = hadamard.hadamard_dot_terms(torch.bfloat16)
    params = list(inspect.signature(w4a4._act_quant_kernel.fn).parameters)
    constexprs = dict(ROWS=rows, BLOCK=block, HADAMARD=True, ROTATED=True, EVEN_ODD=True, INTERPRET=False, PDL=False,
                      DENSE_PAD=plan.dense_pad, DENSE_CHUNK=plan.dense_chunk, HA=plan.a, HB=plan.b,
                      TERMS_IN=terms_in, TERMS=terms)
    constexprs = {k: v for k, v in constexprs.items() if k in params}  # a tree before ROTATED has no such flag
    types = {"x_ptr": "*bf16", "q_ptr": "*i8", "s_ptr": "*fp32", "dense_ptr": "*fp32", "M": "i32", "K": "i32",
             "stride_x": "i32", "stride_q": "i32", "had_scale": "fp32", "fmax": "fp32"}
    signature = {p: types.get(p, "constexpr") for p in params}
    aligned = ("x_ptr", "q_ptr", "s_ptr", "dense_ptr", "K", "stride_x", "stride_q")
    src = ASTSource(fn=w4a4._act_quant_kernel, signature=signature, constexprs=constexprs,
                    attrs={(params.index(p),): [["tt.divisibility", 16]] for p in aligned})
    ops = sass(triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps}).asm["cubin"])
    return {"instructions": len(ops), "rows": rows, "num_warps": warps,
            **{kind: sum(op.split(".")[0] == kind for op in ops) for kind in COUNTED}}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ks", default=",".join(map(str, KS)), help="row widths K, comma-separated")
    args = parser.parse_args()
    print(json.dumps({f"K={K}": counts(int(K)) for K in args.ks.split(",")}, indent=1))
