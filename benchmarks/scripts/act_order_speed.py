"""What GPTQ act-order costs nibble's engine: the same W4A16 model with and without input permutations.

A GPTQ checkpoint quantized with ``desc_act`` imports as `PermutedInputQuantLinear` layers, which take
x in their stored input order: the engine's RMSNorm kernel writes q/k/v's and gate/up's input in their
order (`shared_input_perm`), o_proj's is gathered (`gather_columns`), and down_proj's order is folded
into gate/up's outputs at import (`fold_mlp_input_orders`). This builds a random-weight model, quantizes
it to W4A16 (g128), copies it with every decoder linear permuted (random orders, shared within q/k/v and
gate/up as GPTQ finds them), "act-order" as the import was before the fold (down_proj gathers too) and
"folded" as imported now, and times decode steps and prefills of all in alternating rounds (H200; the
values differ, the work does not; tests/models/test_hf_import.py checks the permuted layers' outputs,
the fold and the engine's logits).

    PYTHONPATH=. python3 benchmarks/scripts/act_order_speed.py --json $OUT/act-order.json
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from nibble import Engine, QuantConfig  # noqa: E402
from nibble.bench.timing import env_meta, shape_list  # noqa: E402
from nibble.eval import speed  # noqa: E402
from nibble.models.hf_import import fold_mlp_input_orders  # noqa: E402
from nibble.nn.quant_linear import PermutedInputQuantLinear  # noqa: E402

GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
          ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))


def permuted_copy(model):
    """``model`` with every decoder linear a PermutedInputQuantLinear whose codes are the original's, its
    input order a random permutation p shared by its group: y = x[..., p] @ W.T, so the copy computes the
    original model with each linear's input columns permuted (a different model, the same work)."""
    other = copy.deepcopy(model)
    g = torch.Generator().manual_seed(0)
    for layer in other.model.layers:
        for group in GROUPS:
            perm = None
            for name in group:
                m = layer.get_submodule(name)
                perm = torch.randperm(m.in_features, generator=g) if perm is None else perm
                p = PermutedInputQuantLinear.from_weight(m.weight_int4(), m.bias, "w4a16", dtype=torch.bfloat16)
                p.set_input_perm(perm)
                parent, _, child = name.rpartition(".")
                setattr(layer.get_submodule(parent), child, p)
    return other


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="*", default=["llama-2-7b"], choices=list(speed.SPEED_MODELS))
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prefills", default="1x128,1x512")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--json")
    args = ap.parse_args()
    speed.require_cuda("act_order_speed")
    rows = []
    for model_name in args.models:
        model = speed.random_model(model_name)
        speed.quantize_in_place(model, QuantConfig(mode="w4a16", group_size=128))
        permuted = permuted_copy(model)
        folded = copy.deepcopy(permuted)
        fold_mlp_input_orders(folded)
        models = {"plain": model, "act-order": permuted, "folded": folded}
        for batch in (int(b) for b in args.batches.split(",")):
            engines = {name: Engine(m, max_batch=batch, max_seq_len=args.prompt + 160) for name, m in models.items()}
            times = speed.alternating_decodes(engines, batch, args.prompt, 128, args.rounds)
            base = statistics.median(times["plain"])
            for name, t in times.items():
                ms = statistics.median(t)
                rows.append(dict(model=model_name, phase="decode", batch=batch, prompt=args.prompt, way=name,
                                 ms=ms, rounds=t, vs_plain=base / ms))
                print(f"{model_name} decode b={batch} {name:9s} {ms:.4f} ms/step ({base / ms:.3f}x plain)", flush=True)
            for e in engines.values():
                e.close()
            speed.release()
        shapes = shape_list(args.prefills)
        engines = {name: Engine(m, max_batch=max(b for b, _ in shapes), max_seq_len=max(t for _, t in shapes) + 16)
                   for name, m in models.items()}
        times = speed.alternating_prefills(engines, shapes, args.rounds)
        for shape in shapes:
            base = statistics.median(times["plain", shape])
            for name in engines:
                ms = statistics.median(times[name, shape])
                rows.append(dict(model=model_name, phase="prefill", batch=shape[0], prompt=shape[1], way=name, ms=ms,
                                 rounds=times[name, shape], vs_plain=base / ms))
                print(f"{model_name} prefill {shape[0]}x{shape[1]} {name:9s} {ms:.3f} ms ({base / ms:.3f}x plain)",
                      flush=True)
        for e in engines.values():
            e.close()
        speed.release(model, permuted, folded)
        if args.json:
            Path(args.json).write_text(json.dumps({"meta": env_meta(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
