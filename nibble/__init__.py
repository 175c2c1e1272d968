"""nibble: 4-bit LLM inference (W4A16 and W4A4) with hand-built GPU kernels."""
import importlib

__version__ = "0.1.0"

# The public names and the module each lives in, imported on first use (PEP 562): importing them here pulled in torch,
# transformers and accelerate (~4 s) before `nibble --help` could print, and before the command's Ctrl-C handler was
# in place. `from nibble import Engine` and `nibble.Engine` work as before.
_LAZY = {"QuantConfig": "nibble.config", "QuantLinear": "nibble.nn.quant_linear",
         "quantize_model": "nibble.models.convert", "save_quantized": "nibble.models.serialization",
         "load_quantized": "nibble.models.serialization", "register_hf_quantizer": "nibble.models.serialization",
         "Engine": "nibble.eval.engine"}

__all__ = ["QuantConfig", "QuantLinear", "quantize_model", "save_quantized", "load_quantized", "register_hf_quantizer",
           "Engine", "__version__"]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'nibble' has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups find it without this call
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
