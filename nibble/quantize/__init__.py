"""Quantization algorithms: round-to-nearest (`rtn`), GPTQ (`gptq`), AWQ (`awq`), calibration text (`calibration`)."""
from nibble.quantize.awq import awq_quantize_model
from nibble.quantize.gptq import gptq_quantize_model

# QuantConfig.method -> fn(model, config, calibration) -> {module name: Int4Weight}; used by quantize_model.
calibrated_quantizers = {"gptq": gptq_quantize_model, "awq": awq_quantize_model}
