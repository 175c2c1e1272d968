from nibble.nn.quant_linear import QuantLinear, shared_input_forward, stack_weights

__all__ = ["QuantLinear", "shared_input_forward", "stack_weights"]
