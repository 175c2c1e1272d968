from nibble.nn.quant_linear import QuantLinear

__all__ = ["QuantLinear"]
