"""Export a PE-QAT model to the deployed W4A4 format.

For every fake-quantized linear: merge the LoRA adapter into the weight (``W + s B A``, float32),
take the grid the training forward used (`fake_quant.weight_grid`, learned or fixed clip ratio
folded into the per-channel scales), and store it as a QuantLinear "w4a4" (symmetric per-channel
INT4 codes, ``input_hadamard`` where the rotation put an online Hadamard). The result is exactly the
weights the fake-quant forward multiplied by, so `load_quantized` of the saved directory reproduces
the fake-quant model's logits up to float rounding, each layer alone (its outputs ~1e-7 apart on the same input; the
test checks a tiny model's logits). Through a whole model a rounding-sized difference moves some activations across
an INT4 step, which later layers carry on and grow. With the Hadamard recipe on SmolLM2-135M (tester 65b: 8 x 256
WikiText-2 tokens, CPU float32, at step 0 and after 3 steps) the export and the merged fake-quant model are max
|dlogit| ~20-30 apart (mean ~2), their greedy tokens equal at about half the positions; the export against itself
with its input embeddings scaled by 1 + 1e-7 noise is as far apart (max ~24, mean ~2, half its greedy tokens
changed). So this is INT4 rounding, not the export: under any rounding-sized change, W4A4 SmolLM2 picks other tokens
about half the time, while its perplexity moves by a few percent (262 vs 276 at step 0).
"""
from __future__ import annotations

import torch
from torch import nn

from nibble.config import QuantConfig
from nibble.formats.int4 import Int4Weight
from nibble.models.convert import mark_quantized, rotation_recorded
from nibble.nn.quant_linear import QuantLinear
from nibble.qat.fake_quant import FakeQuantLinear, FakeQuantLoraLinear, weight_grid


@torch.no_grad()
def export_linear(layer: FakeQuantLoraLinear | FakeQuantLinear) -> QuantLinear:
    """One fake-quantized (LoRA) linear -> QuantLinear "w4a4" with the same INT4 weights."""
    if isinstance(layer, FakeQuantLoraLinear):
        base, delta = layer.get_base_layer(), layer.lora_delta()
    else:
        base, delta = layer, None
    if base.act != "token":
        raise ValueError("per-channel activation scales cannot be exported: the W4A4 kernel applies one scale per "
                         "token after the integer sum. Train with recipe 'per-token' or 'hadamard' to deploy")
    w = base.effective_weight(delta)
    ratio = base.weight_clip_ratio()
    codes, s, z = weight_grid(w, None if ratio is None else ratio.detach())
    int4 = Int4Weight.from_codes(codes.to(torch.uint8), s, z, group_size=w.shape[1])
    return QuantLinear.from_weight(int4, base.bias, mode="w4a4", input_hadamard=base.input_hadamard,
                                   dtype=base.weight.dtype)


def export(model: nn.Module, out_dir=None, tokenizer=None) -> nn.Module:
    """Turn the PeftModel from `run_qat` into a plain HF model with QuantLinear "w4a4" layers.

    The QAT model is consumed (its layers are replaced in place). With ``out_dir`` the result is also
    written by `save_quantized` (with ``tokenizer`` if given). Returns the quantized model, eval mode. Its
    ``quantization_config`` is that of the model the training started from (``method`` the run's ``init``, with
    the clip search rtn's start ran; ``rotation``), and under ``"qat"`` the run's settings and losses.
    """
    meta = dict(getattr(model, "qat_meta", {}) or {})
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = [(n, m) for n, m in base.named_modules() if isinstance(m, FakeQuantLoraLinear)]
    layers += [(n, m) for n, m in base.named_modules()
               if isinstance(m, FakeQuantLinear) and not any(n.startswith(ln + ".") for ln, _ in layers)]
    if not layers:
        recorded = getattr(base.config, "quantization_config", None)
        if isinstance(recorded, dict) and "qat" in recorded:  # what the export marks: this model is one (a copy too)
            raise ValueError("this model was exported already (export replaces its PE-QAT layers in place, so a second "
                             "export finds none): it is the W4A4 model, which nibble.save_quantized saves; to export "
                             "the training again, rebuild it with run_qat(..., out_dir=<the run's>, resume=True)")
        raise ValueError("no PE-QAT layers in this model: pass the model returned by nibble.qat.train.run_qat")
    for name, layer in layers:
        base.set_submodule(name, export_linear(layer))
    for attr in ("peft_config", "_hf_peft_config_loaded"):
        if attr in base.__dict__:
            delattr(base, attr)
    for p in base.parameters():
        p.requires_grad_(False)
    # the post-training quantization the weights started from, as quantize_model records it (step 0 is that model:
    # `init` rtn with its clip search, or gptq, whose own search leaves clip_search None), with the rotation the model
    # holds, the Hadamard recipe's or one made before PE-QAT (rotate_model, recorded on the model); "qat" below records
    # the training that moved them on
    qc = rotation_recorded(base, QuantConfig(mode="w4a4", method=meta.get("init", "rtn")))
    # the run's settings and losses, not what this process did (its wall-clock time, its tokens: 0 for a finished run
    # resumed to export it again, a part after an interrupt; tokens_total is the run's): the same run exports the same
    # config.json
    recorded = {k: v for k, v in meta.items()
                if isinstance(v, (int, float, str, list)) and k not in ("seconds_this_run", "tokens_this_run")}
    mark_quantized(base, {**qc.to_dict(), "qat": recorded})
    base.eval()
    if out_dir is not None:
        from nibble.models.serialization import save_quantized
        save_quantized(base, out_dir, tokenizer)
    return base
