"""nibble: 4-bit LLM inference (W4A16 and W4A4) with hand-built GPU kernels."""
from nibble.config import QuantConfig
from nibble.eval.engine import Engine
from nibble.models.convert import quantize_model
from nibble.models.serialization import load_quantized, save_quantized
from nibble.nn.quant_linear import QuantLinear

__version__ = "0.1.0"
__all__ = ["QuantConfig", "QuantLinear", "quantize_model", "save_quantized", "load_quantized", "Engine", "__version__"]
