"""PE-QAT: LoRA + fake-quant training for W4A4, and export to the deployed format.

    from nibble.qat.train import run_qat, export
    qat = run_qat(model, tokenizer, "hadamard", steps=200, out_dir="out")
    qmodel = export(qat, "out", tokenizer)      # a nibble W4A4 checkpoint, load with load_quantized
    run_qat(model, tokenizer, "hadamard", steps=50, init="gptq")   # trained on from GPTQ's weights

`fake_quant.py` holds the quantizers and layers, `train.py` the recipes and loop, `export.py` the conversion to
QuantLinear "w4a4", `command.py` the command line.
"""

RECIPES = ("per-token", "hadamard", "per-channel")
INITS = ("rtn", "gptq")
OBJECTIVES = ("kl", "ce", "ce+kl")
DEFAULT_SOURCES = ("c4", "gutenberg")
