"""Calibrated PTQ on SmolLM2-135M: WikiText-2 perplexity of 16-bit, RTN, AWQ and GPTQ, as JSON.

    python benchmarks/scripts/ptq_smollm2.py --json benchmarks/results/ptq-smollm2-cpu.json
    python benchmarks/scripts/ptq_smollm2.py --mode w4a4-hadamard --rows "16bit;rtn;gptq" --json ...

``--mode``: W4A16 (groups of ``--group-size``), or W4A4 (per-channel weights, per-token activations),
``w4a4-hadamard`` after the fixed Hadamard rotation (AWQ is W4A16 only).

Rows are separated by ";", each ``method[:key=value,...]``: method ``16bit`` | ``rtn`` | ``awq`` |
``gptq``; keys ``zero`` (int | float), ``clip`` (0 | 1: rtn's weight-MSE search for rtn, the method's
own search for awq / gptq), ``act_order`` (0 | 1) and ``damp`` (gptq). A key left out keeps what
``quantize_model`` / ``nibble quantize --method ...`` does by default, so ``gptq`` is the shipped GPTQ.

Protocol: every quantized row goes through ``quantize_model`` (the deployed QuantLinear, CPU
reference path) and ``wikitext2_perplexity`` on the first ``--max-tokens`` tokens of the test
split in ``--seq-len`` windows. Calibration: ``calibration_batches`` on the C4 excerpt (never
WikiText-2), the same windows for every method. ``gap_closed`` is the fraction of the 16-bit /
RTN perplexity gap a row removes, against the RTN row with the same zero-point mode.
"""
from __future__ import annotations

import argparse
import copy
import functools
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble.config import QuantConfig  # noqa: E402
from nibble.eval.perplexity import wikitext2_perplexity  # noqa: E402
from nibble.eval.tasks import evaluate_tasks  # noqa: E402
from nibble.models.convert import quantize_model  # noqa: E402
from nibble.models.loading import load_model  # noqa: E402
from nibble.quantize import calibrated_quantizers  # noqa: E402
from nibble.quantize.calibration import calibration_batches  # noqa: E402

DEFAULT_ROWS = "16bit;rtn;gptq;rtn:clip=1;awq;gptq:clip=0;rtn:zero=float;gptq:zero=float"


def parse_row(spec: str) -> tuple[str, dict]:
    method, _, rest = spec.partition(":")
    opts = dict(kv.split("=", 1) for kv in rest.split(",") if kv)
    unknown = set(opts) - {"zero", "clip", "act_order", "damp"}
    if method not in ("16bit", "rtn", "awq", "gptq") or unknown:
        raise SystemExit(f"bad row {spec!r}")
    return method, opts


def quantize(model, mode: str, method: str, opts: dict, group_size: int, calib) -> None:
    if mode == "w4a16":
        cfg = QuantConfig(mode="w4a16", group_size=group_size, method=method, zero_point=opts.get("zero", "int"),
                          clip_search=opts.get("clip") == "1" if method == "rtn" else None)
    else:  # RTN's clipping search on by default, as for every W4A4 model
        cfg = QuantConfig(mode="w4a4", rotation="hadamard" if mode == "w4a4-hadamard" else "none", method=method,
                          clip_search=opts.get("clip", "1") == "1" if method == "rtn" else None)
    # quantize_model passes no per-method options, so this row's go in through the registry
    kwargs = {name: parse(opts[key]) for key, name, parse in (("clip", "clip", "1".__eq__),
                                                              ("act_order", "act_order", "1".__eq__),
                                                              ("damp", "percdamp", float)) if key in opts}
    quantizers = dict(calibrated_quantizers)
    if method != "rtn" and kwargs:
        calibrated_quantizers[method] = functools.partial(quantizers[method], **kwargs)
    try:
        quantize_model(model, cfg, progress=False, calibration=None if method == "rtn" else calib)
    finally:
        calibrated_quantizers.update(quantizers)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    ap.add_argument("--mode", choices=["w4a16", "w4a4", "w4a4-hadamard"], default="w4a16")
    ap.add_argument("--rows", default=DEFAULT_ROWS)
    ap.add_argument("--group-size", type=int, default=64, help="w4a16's (w4a4: per channel)")
    ap.add_argument("--device", default="cpu", help="where the model is quantized and evaluated")
    ap.add_argument("--max-tokens", type=int, default=40960, help="0: the whole test split")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--calib-samples", type=int, default=128)
    ap.add_argument("--calib-len", type=int, default=512)
    ap.add_argument("--tasks", action="store_true", help="also the seven zero-shot tasks (acc) of every row")
    ap.add_argument("--tasks-limit", type=int, default=None, help="with --tasks: the first N documents of each")
    ap.add_argument("--batch-size", type=int, default=1, help="of the perplexity windows and the task scoring")
    ap.add_argument("--json", default=None)
    ap.add_argument("--append", action="store_true", help="keep the rows already in --json (same protocol only)")
    args = ap.parse_args()

    model, tok = load_model(args.model, device=args.device)
    calib = calibration_batches(tok, args.calib_samples, args.calib_len, "c4")
    out = dict(model=args.model or "SmolLM2-135M-Instruct (embedded GGUF)", mode=args.mode,
               group_size=args.group_size if args.mode == "w4a16" else -1, device=args.device,
               eval=dict(dataset="wikitext2 test", max_tokens=args.max_tokens or None, seq_len=args.seq_len),
               calibration=dict(source="c4 excerpt", n_samples=args.calib_samples, seq_len=args.calib_len, seed=0),
               torch=torch.__version__, host=platform.processor() or platform.machine(),
               threads=torch.get_num_threads(), rows=[])
    if args.append and args.json and Path(args.json).exists():
        old = json.loads(Path(args.json).read_text())
        old = {"mode": "w4a16", **old}  # files from before --mode were all W4A16
        if any(old[k] != out[k] for k in ("model", "mode", "group_size", "eval", "calibration")):
            raise SystemExit(f"{args.json} was measured with another protocol; not appending to it")
        out["rows"] = old["rows"]
    for spec in args.rows.split(";"):
        method, opts = parse_row(spec)
        m = model if method == "16bit" else copy.deepcopy(model)
        t0 = time.time()
        if method != "16bit":
            quantize(m, args.mode, method, opts, args.group_size, calib)
        t1 = time.time()
        r = wikitext2_perplexity(m, tok, seq_len=args.seq_len, max_tokens=args.max_tokens or None,
                                 batch_size=args.batch_size, progress=False)
        out["rows"].append(dict(row=spec, method=method, options=opts, ppl=r["ppl"], tokens=r["tokens"],
                                quantize_s=round(t1 - t0, 1), eval_s=round(time.time() - t1, 1)))
        if args.tasks:
            tasks = evaluate_tasks(m, tok, limit=args.tasks_limit, batch_size=max(args.batch_size, 16), progress=False)
            out["rows"][-1]["tasks"] = {k: v["acc"] for k, v in tasks.items()}
            out["rows"][-1]["tasks_limit"] = args.tasks_limit
        acc = f", seven-task acc {tasks['average']['acc']:.3f}" if args.tasks else ""
        print(f"{spec:40s} ppl {r['ppl']:.3f}{acc}  (quantize {t1 - t0:.0f}s, eval {time.time() - t1:.0f}s)", flush=True)
        del m
        add_gap_closed(out["rows"])
        if args.json:  # after every row, so a long run that is cut short still leaves its numbers
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    for r in out["rows"]:
        if "gap_closed" in r:
            print(f"{r['row']:40s} closes {100 * r['gap_closed']:.0f}% of RTN's gap to 16-bit")


def add_gap_closed(rows: list) -> None:
    fp16 = next((r["ppl"] for r in rows if r["method"] == "16bit"), None)
    rtn = {r["options"].get("zero", "int"): r["ppl"] for r in rows
           if r["method"] == "rtn" and r["options"].get("clip", "0") == "0"}
    for r in rows:
        base = rtn.get(r["options"].get("zero", "int"))
        if fp16 is not None and base is not None and r["method"] != "16bit":
            r["gap_closed"] = (base - r["ppl"]) / (base - fp16)


if __name__ == "__main__":
    main()
