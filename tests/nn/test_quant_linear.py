import pytest
import torch
from torch import nn

from nibble.config import QuantConfig
from nibble.kernels import KernelUnavailableError, reference
from nibble import kernels
from nibble.nn import QuantLinear, shared_input_forward


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(5, 128), (2, 3, 128), (1, 128)])
def test_w4a16_quantlinear_equals_dequantize_then_matmul(dtype, shape):
    lin = nn.Linear(128, 40, bias=True)
    q = QuantLinear.from_linear(lin, QuantConfig(group_size=32))
    x = torch.randn(shape).to(dtype)
    w = reference.dequantize(q.qweight, q.scales, q.zeros, 32)
    expected = (x.float() @ w.t() + lin.bias.detach().float()).to(dtype)
    y = q(x)
    assert y.shape == (*shape[:-1], 40) and y.dtype == dtype
    assert torch.allclose(y.float(), expected.float(), rtol=0, atol=1e-5 if dtype == torch.float32 else 1e-2)


def test_w4a4_quantlinear_matches_reference_and_approximates_float():
    lin = nn.Linear(256, 64, bias=False)
    q = QuantLinear.from_linear(lin, QuantConfig(mode="w4a4"))
    x = torch.randn(6, 256)
    y = q(x)
    assert torch.equal(y, reference.w4a4_linear(x, q.qweight, q.scales[0]))
    assert nn.functional.cosine_similarity(y.flatten(), lin(x).detach().flatten(), dim=0) > 0.95


def test_shared_input_forward_quantizes_once_for_w4a4_layers_and_matches_each_layer(monkeypatch):
    torch.manual_seed(0)
    w4a4 = [QuantLinear.from_linear(nn.Linear(128, n), QuantConfig(mode="w4a4")) for n in (64, 32, 32)]
    x = torch.randn(2, 3, 128)
    calls = []  # layers per call of the shared-input kernels (a lone W4A4 layer is a call with one)
    shared = kernels.w4a4_linears
    monkeypatch.setattr(kernels, "w4a4_linears", lambda x, layers, *a, **k: calls.append(len(layers)) or
                        shared(x, layers, *a, **k))
    ys = shared_input_forward(w4a4, x)
    assert calls == [3]
    for y, m in zip(ys, w4a4):
        assert torch.equal(y, m(x))
    # anything else (W4A16, nn.Linear, mixed rotation settings) runs layer by layer
    calls.clear()
    mixed = [w4a4[0], QuantLinear.from_linear(nn.Linear(128, 16), QuantConfig(group_size=32)), nn.Linear(128, 8)]
    ys = shared_input_forward(mixed, x)
    assert calls == [1] and [tuple(y.shape) for y in ys] == [(2, 3, 64), (2, 3, 16), (2, 3, 8)]
    with pytest.raises(ValueError, match="expects 128"):
        shared_input_forward(w4a4, torch.randn(2, 127))


def test_bad_inputs_give_clear_errors():
    q = QuantLinear.from_linear(nn.Linear(64, 16), QuantConfig(group_size=32))
    with pytest.raises(ValueError, match="expects 64"):
        q(torch.randn(2, 63))
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        q(torch.randn(2, 64, dtype=torch.float64))
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        q(torch.ones(2, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="divisible"):
        QuantLinear.from_linear(nn.Linear(96, 16), QuantConfig(group_size=64))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_asking_for_the_gpu_kernel_without_a_gpu_is_a_clear_error():
    q = QuantLinear.from_linear(nn.Linear(64, 16), QuantConfig(group_size=32))
    q.backend = "triton"
    with pytest.raises(KernelUnavailableError, match="need a CUDA GPU"):
        q(torch.randn(2, 64))


def test_config_validation():
    with pytest.raises(ValueError, match="symmetric per-channel"):
        QuantConfig(mode="w4a4", group_size=128)
    with pytest.raises(ValueError, match="rotation"):
        QuantConfig(mode="w4a16", rotation="hadamard")
    with pytest.raises(ValueError, match="mode"):
        QuantConfig(mode="w8a8")
    assert QuantConfig.from_dict(QuantConfig(mode="w4a4").to_dict()) == QuantConfig(mode="w4a4")
