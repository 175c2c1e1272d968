"""HadamardInputLinear (`nibble.nn.hadamard`): the rotated twin of an nn.Linear, against explicit Hadamard matrices.

192 = 12 * 16 has a Paley factor, whose H is not symmetric: a power-of-two size (Sylvester's H = H.T) cannot tell
H from H.T, the rotation from its inverse."""
import pytest
import torch
from torch import nn

from nibble.kernels.hadamard import hadamard_matrix
from nibble.nn.hadamard import HadamardInputLinear

N_IN = 192


def _linear(bias=True):
    torch.manual_seed(41)
    return nn.Linear(N_IN, 24, bias=bias)


def test_the_folded_weight_is_w_times_h_transposed_rounded_once():
    lin = _linear()
    h = hadamard_matrix(N_IN, torch.float64)
    assert not torch.equal(h, h.T)
    layer = HadamardInputLinear.from_linear(lin)
    # float64 then one rounding to float32: a float32 fold is a few ulps off on many entries
    assert layer.weight.dtype == torch.float32 and torch.equal(layer.weight, (lin.weight.double() @ h.T).float())
    assert layer.bias is lin.bias and layer.weight.requires_grad and layer.input_hadamard


@pytest.mark.parametrize("bias", [True, False])
def test_the_rotated_layer_computes_what_the_linear_did(bias):
    """(x @ H.T) @ (W @ H.T).T + b = x @ W.T + b, written out with the matrix."""
    lin = _linear(bias)
    layer = HadamardInputLinear.from_linear(lin)
    x = torch.randn(5, N_IN, dtype=torch.float64)
    h = hadamard_matrix(N_IN, torch.float64)
    with torch.no_grad():
        rotated = (x @ h.T) @ layer.weight.double().T + (layer.bias.double() if bias else 0)
        y = layer.double()(x)
        torch.testing.assert_close(y, rotated, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(y, lin.double()(x), rtol=1e-6, atol=1e-6)


def test_a_given_float64_weight_is_the_one_folded():
    lin = _linear()
    w = torch.randn(24, N_IN, dtype=torch.float64)
    layer = HadamardInputLinear.from_linear(lin, w)
    assert torch.equal(layer.weight, (w @ hadamard_matrix(N_IN, torch.float64).T).float())


def test_what_the_fold_cannot_take_is_refused():
    lin = _linear()
    with pytest.raises(ValueError, match="already has an online Hadamard"):
        HadamardInputLinear.from_linear(HadamardInputLinear.from_linear(lin))
    with pytest.raises(ValueError, match=r"weight has shape \(24, 96\), the linear \(24, 192\)"):
        HadamardInputLinear.from_linear(lin, torch.randn(24, 96, dtype=torch.float64))
    lin.weight.requires_grad_(False)  # a frozen weight stays frozen
    assert not HadamardInputLinear.from_linear(lin).weight.requires_grad


def test_the_folded_weight_stays_on_the_linears_device():
    """rotate_model folds each down_proj where the model is (a GPU); the meta device stands in for another device than
    the CPU here: a weight moved elsewhere would meet its input on another device."""
    with torch.device("meta"):
        lin = nn.Linear(N_IN, 24)
    layer = HadamardInputLinear.from_linear(lin)
    assert layer.weight.device.type == "meta" and layer.weight.shape == (24, N_IN)
