import copy
import dataclasses
import pickle

import pytest
import torch
from torch import nn

from nibble.config import QuantConfig
from nibble.kernels import KernelUnavailableError, reference
from nibble import kernels
from nibble.nn import QuantLinear, shared_input_forward, stack_weights


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


def _count_layers_per_call(monkeypatch, op: str) -> list:
    """The layers each call of ``kernels.<op>`` receives, recorded as the tests run."""
    calls, shared = [], getattr(kernels, op)
    monkeypatch.setattr(kernels, op, lambda x, layers, *a, **k: calls.append(len(layers)) or shared(x, layers, *a, **k))
    return calls


def test_shared_input_forward_quantizes_once_for_w4a4_layers_and_matches_each_layer(monkeypatch):
    torch.manual_seed(0)
    w4a4 = [QuantLinear.from_linear(nn.Linear(128, n), QuantConfig(mode="w4a4")) for n in (64, 32, 32)]
    x = torch.randn(2, 3, 128)
    calls = _count_layers_per_call(monkeypatch, "_w4a4_linears")  # a lone W4A4 layer is a call with one
    ys = shared_input_forward(w4a4, x)
    assert calls == [3]
    for y, m in zip(ys, w4a4):
        assert torch.equal(y, m(x))
    # anything else (mixed modes, nn.Linear, mixed rotation settings) runs layer by layer
    calls.clear()
    mixed = [w4a4[0], QuantLinear.from_linear(nn.Linear(128, 16), QuantConfig(group_size=32)), nn.Linear(128, 8)]
    ys = shared_input_forward(mixed, x)
    assert calls == [1] and [tuple(y.shape) for y in ys] == [(2, 3, 64), (2, 3, 16), (2, 3, 8)]
    with pytest.raises(ValueError, match="expects 128"):
        shared_input_forward(w4a4, torch.randn(2, 127))


def test_shared_input_forward_runs_w4a16_layers_as_one_call(monkeypatch):
    torch.manual_seed(0)
    layers = [QuantLinear.from_linear(nn.Linear(128, n, bias=n == 32), QuantConfig(group_size=64)) for n in (64, 32)]
    x = torch.randn(2, 3, 128)
    calls = _count_layers_per_call(monkeypatch, "_w4a16_linears")
    ys = shared_input_forward(layers, x)
    assert calls == [2]
    for y, m in zip(ys, layers):
        assert torch.equal(y, m(x))
    calls.clear()  # different group sizes: layer by layer
    shared_input_forward([layers[0], QuantLinear.from_linear(nn.Linear(128, 8), QuantConfig(group_size=32))], x)
    assert calls == []


@pytest.mark.parametrize("bias", [False, True])
def test_stack_weights_makes_one_matmul_of_dense_layers_in_the_same_memory(bias):
    torch.manual_seed(0)
    layers = [nn.Linear(64, n, bias=bias) for n in (64, 16, 16)]
    x = torch.randn(2, 5, 64)
    expected = [m(x).detach() for m in layers]
    params = [[p.detach().clone() for p in m.parameters()] for m in layers]
    optimizer = torch.optim.SGD([p for m in layers for p in m.parameters()], lr=0.5)  # built before the stacking
    stack_weights(layers)
    for m, before in zip(layers, params):  # same values, now views of one stack
        for p, b in zip(m.parameters(), before):
            assert isinstance(p, nn.Parameter) and torch.equal(p, b)
    sum(m(x).square().sum() for m in layers).backward()
    optimizer.step()  # still trains the layers' parameters, through the stack
    for m, before in zip(layers, params):
        assert not torch.equal(m.weight, before[0])
    expected = [m(x).detach() for m in layers]
    storages = {m.weight.untyped_storage().data_ptr() for m in layers}
    assert len(storages) == 1 and layers[0].weight.untyped_storage().nbytes() == 96 * 64 * 4
    calls = []
    monkeypatch = pytest.MonkeyPatch()
    linear = nn.functional.linear
    monkeypatch.setattr(nn.functional, "linear", lambda *a: calls.append(a[1].shape) or linear(*a))
    with torch.no_grad():
        ys = shared_input_forward(layers, x)
    monkeypatch.undo()
    assert calls == [(96, 64)]
    for y, e, m in zip(ys, expected, layers):
        torch.testing.assert_close(y, e)
        torch.testing.assert_close(m(x), e)  # each layer still works alone
    stack_weights(layers)  # already stacked: unchanged
    assert layers[0].weight.untyped_storage().nbytes() == 96 * 64 * 4


def test_stack_weights_leaves_layers_it_cannot_stack():
    mixed = [nn.Linear(64, 8), nn.Linear(32, 8)]  # different inputs
    half = [nn.Linear(64, 8), nn.Linear(64, 8).half()]
    some_bias = [nn.Linear(64, 8), nn.Linear(64, 8, bias=False)]
    for layers in (mixed, half, some_bias):
        ptrs = [m.weight.data_ptr() for m in layers]
        stack_weights(layers)
        assert [m.weight.data_ptr() for m in layers] == ptrs


def _back_to_back_weights(how: str) -> list:
    """Two [16, 64] weights at consecutive addresses that are not rows of one tensor: numpy slices of one array, each
    its own storage (as a file's tensors are), or transposes of consecutive [64, 16] blocks (strides (1, 16))."""
    if how == "separate storages":
        return list(map(torch.from_numpy, torch.randn(2, 16, 64).numpy()))
    return [block.t() for block in torch.randn(2, 64, 16)]


@pytest.mark.parametrize("how", ["separate storages", "transposed"])
def test_weights_at_consecutive_addresses_that_are_no_stack_run_each_alone(how):
    """One matmul needs one view over both weights: over two storages it reached past the first one's (as_strided
    refused it), and over transposed blocks its rows would be the first block's elements again, other weights."""
    torch.manual_seed(34)
    weights = _back_to_back_weights(how)
    assert weights[1].data_ptr() == weights[0].data_ptr() + weights[0].numel() * weights[0].element_size()
    layers = [nn.Linear(64, 16, bias=False) for _ in weights]
    for m, w in zip(layers, weights):
        m.weight = nn.Parameter(w)
    x = torch.randn(3, 64)
    with torch.no_grad():
        for y, m in zip(shared_input_forward(layers, x), layers):
            assert torch.equal(y, m(x))


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_quantized_layers_trace_into_one_graph(monkeypatch, mode):
    """Under torch.compile a QuantLinear, alone or with the layers that share its input, is nibble's
    custom op in the graph with nothing around it that breaks the graph (fullgraph=True fails at a
    break; an import in the dispatch once broke it at every layer, and transformers' static-cache
    generate then recompiled per layer). On the CPU the kernel dispatch is forced, so the op (whose
    CPU body is the reference) is what gets traced."""
    monkeypatch.setattr(kernels, "_use_kernel", lambda x, backend: True)
    layers = [QuantLinear.from_linear(nn.Linear(256, n, dtype=torch.bfloat16), QuantConfig(mode=mode))
              for n in (64, 32, 32)]
    x = torch.randn(3, 5, 256, dtype=torch.bfloat16)
    torch._dynamo.reset()
    one = torch.compile(layers[0], fullgraph=True, backend="eager")
    torch.testing.assert_close(one(x), layers[0](x))
    shared = torch.compile(lambda t: shared_input_forward(layers, t), fullgraph=True, backend="eager")
    for y, layer in zip(shared(x), layers):
        torch.testing.assert_close(y, layer(x))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_compiled_w4a4_hadamard_layer_on_the_cpu_is_the_eager_one(dtype):
    """Inductor fused the reference's rounding of the rotated activations away (a float32 -> 16-bit -> float32 round
    trip): every token quantized with another scale, outputs up to 5% off eager's."""
    layer = QuantLinear.from_linear(nn.Linear(64, 48, dtype=dtype), QuantConfig(mode="w4a4"))
    layer.input_hadamard = True
    x = torch.randn(64, 64, dtype=dtype)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(layer, fullgraph=True)(x), layer(x))


def test_module_type_casts_keep_the_packed_words():
    """module.type(torch.float16) cast the int32 words to float16, destroying them (the layer failed at its next
    forward); like .half(), it casts the bias and leaves the format's buffers alone."""
    layer = QuantLinear.from_linear(nn.Linear(64, 16), QuantConfig(group_size=32))
    words, x = layer.qweight.clone(), torch.randn(3, 64)
    want = layer(x)
    layer.type(torch.float16)
    assert layer.qweight.dtype == torch.int32 and torch.equal(layer.qweight, words)
    assert layer.scales.dtype == torch.float16 and layer.bias.dtype == torch.float16
    torch.testing.assert_close(layer.type(torch.float32)(x), want, rtol=0, atol=1e-3)  # the bias went through fp16


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_compiled_w4a16_layer_with_a_bias_is_the_eager_one_on_the_op_path(monkeypatch, dtype):
    """On the op path (what CUDA runs) the bias was added in the kernel's dtype and the sum rounded again to x's:
    Inductor fused the two roundings into one, an ulp off eager (on every element for float32 x)."""
    monkeypatch.setattr(kernels, "_use_kernel", lambda x, backend: True)
    layer = QuantLinear.from_linear(nn.Linear(128, 48), QuantConfig(group_size=32))  # a float32 bias
    x = torch.randn(33, 128, dtype=dtype)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(layer, fullgraph=True)(x), layer(x))


def test_the_kernels_linear_functions_refuse_to_lose_a_gradient():
    """On a GPU their outputs carried no gradient, without a word; a QuantLinear gives it."""
    layer = QuantLinear.from_linear(nn.Linear(64, 16), QuantConfig(mode="w4a4"))
    x = torch.randn(2, 64, requires_grad=True)
    for call in (lambda: kernels.w4a4_linear(x, layer.qweight, layer.scales[0]),
                 lambda: kernels.w4a16_linear(x, layer.qweight, layer.scales, layer.zeros, 64),
                 lambda: kernels.w4a16_linears(x, [(layer.qweight, layer.scales, layer.zeros, None)], 64)):
        with pytest.raises(ValueError, match="give no gradient: call the layer"):
            call()
        with torch.no_grad():
            call()
    layer(x).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0


def test_the_kernels_linear_functions_refuse_a_bias_that_wants_a_gradient():
    """A trainable bias (x itself needing none) lost its gradient the same way."""
    layer = QuantLinear.from_linear(nn.Linear(64, 16), QuantConfig(mode="w4a4"))
    x, bias = torch.randn(2, 64), torch.randn(16, requires_grad=True)
    for call in (lambda: kernels.w4a4_linear(x, layer.qweight, layer.scales[0], bias),
                 lambda: kernels.w4a16_linear(x, layer.qweight, layer.scales, layer.zeros, 64, bias),
                 lambda: kernels.w4a16_linears(x, [(layer.qweight, layer.scales, layer.zeros, bias)], 64)):
        with pytest.raises(ValueError, match="give no gradient: call the layer"):
            call()
        with torch.no_grad():
            call()


def test_the_activations_are_checked_once_a_call_on_every_entry(monkeypatch):
    """A QuantLinear checked its input, then the kernels' function it called checked it again (a shared-input call
    once per layer and once more): two checks of every layer's input in each eager decode step."""
    from nibble.nn.quant_linear import PermutedInputQuantLinear
    w4a16 = [QuantLinear.from_linear(nn.Linear(64, 16), QuantConfig(group_size=32)) for _ in range(2)]
    w4a4 = [QuantLinear.from_linear(nn.Linear(64, 16), QuantConfig(mode="w4a4")) for _ in range(2)]
    permuted = PermutedInputQuantLinear.from_weight(w4a16[0].weight_int4())
    permuted.set_input_perm(torch.randperm(64))
    x, checked, check = torch.randn(3, 64), [], kernels.check_activations
    monkeypatch.setattr(kernels, "check_activations", lambda t: checked.append(t) or check(t))
    calls = [lambda: w4a16[0](x), lambda: w4a4[0](x), lambda: permuted(x), lambda: permuted.forward_in_order(x),
             lambda: shared_input_forward(w4a16, x), lambda: shared_input_forward(w4a4, x),
             lambda: kernels.w4a16_linear(x, w4a16[0].qweight, w4a16[0].scales, w4a16[0].zeros, 32),
             lambda: kernels.w4a16_linears(x, [(m.qweight, m.scales, m.zeros, m.bias) for m in w4a16], 32),
             lambda: kernels.w4a4_linear(x, w4a4[0].qweight, w4a4[0].scales[0]),
             lambda: kernels.w4a4_linears(x, [(m.qweight, m.scales[0], m.bias) for m in w4a4])]
    for call in calls:
        checked.clear()
        call()
        assert len(checked) == 1
    x = x.double()
    for call in calls:
        with pytest.raises(TypeError, match="activations must be float16, bfloat16 or float32, got torch.float64"):
            call()
    x = x.float().numpy()  # its float32 was refused as "not float32"
    for call in calls:
        with pytest.raises(TypeError, match="activations must be a torch.Tensor, got ndarray"):
            call()


def test_a_flag_or_dtype_of_another_type_is_refused_not_read_as_true():
    """input_hadamard="false" is true: the layer, and the kernels' w4a4_linear(s), rotated without a word. An
    integer bias dtype failed only at the first forward."""
    for flag in ("false", 1, None):
        with pytest.raises(TypeError, match=f"input_hadamard must be True or False, got {flag!r}"):
            QuantLinear(64, 16, mode="w4a4", input_hadamard=flag)
    w4a4 = QuantLinear.from_linear(nn.Linear(64, 16), QuantConfig(mode="w4a4"))
    for call in (kernels.w4a4_linear, lambda *a, **k: kernels.w4a4_linears(a[0], [a[1:] + (None,)], **k)):
        with pytest.raises(TypeError, match="input_hadamard must be True or False, got 'no'"):
            call(torch.randn(2, 64), w4a4.qweight, w4a4.scales[0], input_hadamard="no")
    with pytest.raises(TypeError, match=r"dtype \(the bias's\) must be one of .* got torch.int32"):
        QuantLinear(64, 16, group_size=32, dtype=torch.int32)


def test_the_w4a16_reference_refuses_weights_on_another_device_as_w4a4_does():
    """It moved them to x's device: a GPU model's weights to a CPU input's, without a word; meta weights failed inside
    torch ("Cannot copy out of meta tensor")."""
    q = QuantLinear.from_linear(nn.Linear(64, 16), QuantConfig(group_size=32))
    x = torch.randn(2, 64)
    for moved in ("qweight", "scales", "zeros", "bias"):
        weight = {name: getattr(q, name) for name in ("qweight", "scales", "zeros", "bias")}
        weight[moved] = weight[moved].to("meta")
        with pytest.raises(ValueError, match=r"must be on one device, got \['cpu', 'meta'\]"):
            kernels.w4a16_linear(x, weight["qweight"], weight["scales"], weight["zeros"], 32, weight["bias"])
    with pytest.raises(ValueError, match="at least one"):
        kernels.w4a16_linears(x, [], 32)


def test_bad_inputs_give_clear_errors():
    q = QuantLinear.from_linear(nn.Linear(64, 16), QuantConfig(group_size=32))
    with pytest.raises(ValueError, match="expects 64"):
        q(torch.randn(2, 63))
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        q(torch.randn(2, 64, dtype=torch.float64))
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        q(torch.ones(2, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="at least one dimension"):
        q(torch.tensor(0.5))
    with pytest.raises(ValueError, match="divisible"):
        QuantLinear.from_linear(nn.Linear(96, 16), QuantConfig(group_size=64))


def test_an_act_order_layer_refuses_a_wider_input_before_its_gather():
    """Only a narrower input was tested: a wider one passed a check of "fewer features" and the act-order layer's
    gather of x[..., perm] dropped the extra columns silently, an output of the wrong input."""
    q = _layer("permuted", "cpu", dtype=torch.float32)
    for x in (torch.randn(2, 264), torch.randn(2, 255)):
        with pytest.raises(ValueError, match=f"input has {x.shape[-1]} features .* expects 256"):
            q(x)


def test_an_online_rotation_is_refused_on_a_w4a16_layer():
    """A w4a16 layer made with input_hadamard=True would skip the rotation in its forward (only the w4a4 path
    rotates) while its input gradient applied the inverse one: gradients of another layer than the one run."""
    with pytest.raises(ValueError, match="input_hadamard is part of the w4a4 path"):
        QuantLinear(64, 32, group_size=64, mode="w4a16", input_hadamard=True)


def test_an_unknown_backend_is_refused_when_set_naming_the_valid_ones():
    """`layer.backend = "bogus"` was taken, and the next forward failed far from the line that set it."""
    q = QuantLinear.from_linear(nn.Linear(64, 16), QuantConfig(group_size=32))
    with pytest.raises(ValueError, match=r"^backend must be one of \('auto', 'reference', 'triton'\), got 'bogus'$"):
        q.backend = "bogus"
    assert q.backend == "auto"  # untouched
    q.backend = "reference"
    assert q.backend == "reference" and copy.deepcopy(q).backend == "reference"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_asking_for_the_gpu_kernel_without_a_gpu_is_a_clear_error():
    q = QuantLinear.from_linear(nn.Linear(64, 16), QuantConfig(group_size=32))
    q.backend = "triton"
    with pytest.raises(KernelUnavailableError, match="need a CUDA GPU"):
        q(torch.randn(2, 64))


def test_config_validation():
    with pytest.raises(ValueError, match="symmetric per-channel"):
        QuantConfig(mode="w4a4", group_size=128)
    with pytest.raises(ValueError, match="mode"):
        QuantConfig(mode="w8a8")
    assert QuantConfig.from_dict(QuantConfig(mode="w4a4").to_dict()) == QuantConfig(mode="w4a4")
    # a file without the config digest (saved before session 56, or written elsewhere) loaded 8-bit as 4-bit
    with pytest.raises(ValueError, match="bits=8: nibble's checkpoints hold 4-bit weights"):
        QuantConfig.from_dict({**QuantConfig().to_dict(), "bits": 8})
    with pytest.raises(ValueError, match="activation_bits=4 does not go with mode='w4a16'"):
        QuantConfig.from_dict({**QuantConfig().to_dict(), "activation_bits": 4})


@pytest.mark.parametrize("kwargs,match", [
    (dict(zero_point="bogus"), r"zero_point must be one of \('int', 'float'\), got 'bogus'"),
    (dict(group_size="64"), "group_size must be an int.*got '64'"),
    (dict(group_size=64.0), "group_size must be an int"),
    (dict(group_size=True), "group_size must be an int"),
    (dict(group_size=0), "positive multiple of 8.*got 0"),
    (dict(group_size=-2), "-1 \\(one group per output channel\\) or a positive multiple of 8.*got -2"),
    (dict(group_size=4), "32, 64 or 128.*got 4"),
    (dict(group_size=12), "multiple of 8.*got 12"),
    (dict(symmetric="yes"), "symmetric must be True, False or None"),
    (dict(symmetric=1), "symmetric must be True, False or None"),
    (dict(clip_search="no"), "clip_search must be True, False or None"),
    (dict(modules_to_not_convert=["lm_head", 3]), "modules_to_not_convert must be a list of module names"),
    (dict(modules_to_not_convert=None), "modules_to_not_convert must be a list of module names"),
])
def test_config_refuses_bad_fields_when_made(kwargs, match):
    with pytest.raises(ValueError, match=match):
        QuantConfig(**kwargs)


def test_config_takes_one_module_name_as_a_list_of_one():
    assert QuantConfig(modules_to_not_convert="lm_head").modules_to_not_convert == ("lm_head",)
    assert QuantConfig(modules_to_not_convert=["lm_head", "mlp.down_proj"]).modules_to_not_convert == \
        ("lm_head", "mlp.down_proj")
    config = QuantConfig(modules_to_not_convert="mlp.down_proj", group_size=48)
    assert config.to_dict()["modules_to_not_convert"] == ["mlp.down_proj"]  # as the checkpoint's JSON holds it
    assert QuantConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("field, value", [("mode", "w4a4"), ("group_size", None), ("group_size", 12),
                                          ("modules_to_not_convert", "down_proj"), ("method", "gptq")])
def test_a_config_cannot_be_changed_and_its_changed_copies_are_checked_again(field, value):
    """A field set after the config was made slipped past its checks: mode='w4a4' kept W4A16's 128 and asymmetric
    weights (refused at the first layer's turn), group_size=None failed as a TypeError in the width check, and
    modules_to_not_convert='down_proj' was read as its characters, which quantized lm_head without a word."""
    config = QuantConfig()
    with pytest.raises(dataclasses.FrozenInstanceError, match=rf"dataclasses.replace\(config, {field}=...\)"):
        setattr(config, field, value)
    with pytest.raises(AttributeError):
        config.modules_to_not_convert.append("down_proj")
    assert config == QuantConfig() and hash(config) == hash(QuantConfig())
    assert copy.deepcopy(config) == config and pickle.loads(pickle.dumps(config)) == config


def test_replace_checks_the_copy_as_the_constructor_does():
    config = QuantConfig(group_size=64)
    assert dataclasses.replace(config, group_size=None).group_size == 128  # the mode's default, resolved again
    assert dataclasses.replace(config, modules_to_not_convert="down_proj").modules_to_not_convert == ("down_proj",)
    with pytest.raises(ValueError, match="multiple of 8.*got 12"):
        dataclasses.replace(config, group_size=12)
    # the copy keeps the defaults resolved for W4A16 (replace cannot tell them from values set), and says what to do
    with pytest.raises(ValueError, match=r"w4a4 needs symmetric per-channel weights \(symmetric=True, group_size=-1\), "
                                         r"got symmetric=False, group_size=128.*a dataclasses.replace copy of a w4a16 "
                                         r"config holds the values resolved for w4a16: build QuantConfig\(mode='w4a4', "
                                         r"\.\.\.\) instead"):
        dataclasses.replace(QuantConfig(), mode="w4a4")
    assert dataclasses.replace(QuantConfig(), mode="w4a4", group_size=-1, symmetric=True).mode == "w4a4"


@pytest.mark.parametrize("kwargs,match", [
    (dict(method="bogus"), r"^method must be one of \('rtn', 'gptq', 'awq'\), got 'bogus'$"),
    (dict(rotation="bogus"), r"^rotation must be one of \('none', 'hadamard'\), got 'bogus'$"),
    (dict(mode="w4a4", method="awq"), "^w4a4 supports method='rtn' or 'gptq'"),
    (dict(symmetric=True, zero_point="float"), r"^zero_point='float' \(CLI --float-zero"),
    (dict(rotation_seed=3), "^rotation_seed=3 seeds rotation='hadamard'"),
])
def test_config_refuses_what_it_cannot_quantize_by_each_fields_own_check(kwargs, match):
    """Each check alone: a config of an unknown method or rotation was taken (and quantized by none, or unrotated)."""
    with pytest.raises(ValueError, match=match):
        QuantConfig(**kwargs)


@pytest.mark.parametrize("mode, bits", [("w4a16", 16), ("w4a4", 4)])
def test_config_dict_records_the_formats_constants_and_from_dict_reads_a_minimal_one(mode, bits):
    """to_dict's activation_bits is the mode's, and from_dict takes a dict without bits or mode (their defaults)."""
    from nibble.formats.int4 import FORMAT_VERSION
    saved = QuantConfig(mode=mode).to_dict()
    assert {k: saved[k] for k in ("quant_method", "format_version", "bits", "activation_bits")} == \
        dict(quant_method="nibble", format_version=FORMAT_VERSION, bits=4, activation_bits=bits)
    assert QuantConfig.from_dict(saved) == QuantConfig(mode=mode)
    minimal = dict(quant_method="nibble", format_version=FORMAT_VERSION)
    assert QuantConfig.from_dict({**minimal, "activation_bits": 16}) == QuantConfig()
    with pytest.raises(ValueError, match="^not a nibble quantization_config"):
        QuantConfig.from_dict({**saved, "quant_method": "awq"})
    with pytest.raises(ValueError, match="^checkpoint format_version 99 is not supported"):
        QuantConfig.from_dict({**saved, "format_version": 99})


def test_token_ids_are_checked_against_the_vocabulary_at_both_ends():
    """Ids from 0 to vocab - 1 pass; vocab itself (one past the embedding) and -1 are refused: a test of ids far
    past the vocabulary let `high > vocab` through."""
    from conftest import tiny_model

    from nibble.config import check_token_ids
    model = tiny_model()  # 256 tokens
    check_token_ids(model, torch.tensor([[0, 255]]), "the", "fix")
    for bad in (256, -1):
        with pytest.raises(ValueError, match=rf"^the token ids run from {min(bad, 0)} to {max(bad, 0)}, but the "
                                             r"model's vocabulary has 256 tokens: fix$"):
            check_token_ids(model, torch.tensor([[0, bad]]), "the", "fix")


def test_seeds_and_counts_are_refused_outside_their_range_by_name():
    """checked_seed: -2**63 and 2**64 - 1 pass (torch's range), one past either does not, a bool neither, and a numpy
    integer comes back an int (a checkpoint's JSON holds it); check_count: `least` passes, a bool does not."""
    import numpy as np

    from nibble.config import check_count, checked_seed
    assert checked_seed("s", -2**63) == -2**63 and checked_seed("s", 2**64 - 1) == 2**64 - 1
    assert type(checked_seed("s", np.int64(5))) is int
    for bad in (2**64, -2**63 - 1, True):
        with pytest.raises(ValueError, match=r"^s must be an integer from -2\*\*63 to 2\*\*64 - 1"):
            checked_seed("s", bad)
    check_count("n", 1)
    check_count("n", 0, least=0)
    for bad in (0, True, 1.0):
        with pytest.raises(ValueError, match=r"^n must be an integer >= 1, got "):
            check_count("n", bad)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_devices_and_dtypes_are_resolved_by_name():
    """An int is torch's spelling of cuda:N; 'torch.float16' is transformers' name of a dtype; float64 is none nibble
    runs; a GPU model defaults to bfloat16."""
    from nibble.config import default_dtype, resolve_device, resolve_dtype
    with pytest.raises(ValueError, match=r"^device 'cuda:1' asked for, but no CUDA GPU is visible"):
        resolve_device(1)
    with pytest.raises(ValueError, match="^device 'meta' is not one nibble runs on"):
        resolve_device("meta")
    assert resolve_dtype("torch.float16") is torch.float16 and resolve_dtype("bfloat16") is torch.bfloat16
    for bad in (torch.float64, "float64"):
        with pytest.raises(ValueError, match="is not one nibble runs a model in"):
            resolve_dtype(bad)
    assert default_dtype(torch.device("cuda")) is torch.bfloat16 and default_dtype(torch.device("cpu")) is torch.float32


def test_a_cast_refuses_finite_values_beyond_the_dtype_and_check_finite_refuses_inf():
    """checked_cast refuses what becomes Inf, not an Inf already there (check_finite's, which refuses Inf as NaN)."""
    from nibble.config import check_finite, checked_cast
    with pytest.raises(ValueError, match=r"^w holds 1 value\(s\) beyond torch.float16's range \(e.g. 100000\)"):
        checked_cast(torch.tensor([1.0, 1e5]), torch.float16, "w")
    inf = torch.tensor([1.0, float("inf")])
    assert torch.equal(checked_cast(inf, torch.float16, "w"), inf.half())
    for bad in (float("inf"), float("-inf"), float("nan")):
        with pytest.raises(ValueError, match=r"^w holds 1 NaN or Inf value\(s\)"):
            check_finite(torch.tensor([1.0, bad]), "w")


def test_a_missing_submodule_of_an_optional_package_is_said_as_the_package_missing():
    """`from peft.tuners import x` without peft fails with e.name 'peft.tuners': that was re-raised as it was."""
    from nibble.config import optional_dependency
    with pytest.raises(ModuleNotFoundError, match=r"^it needs peft, which is not installed: pip install 'nibble\[qat\]'$"):
        with optional_dependency("peft", "qat", "it"):
            raise ModuleNotFoundError("No module named 'peft.tuners'", name="peft.tuners")
    with pytest.raises(ModuleNotFoundError, match="^No module named 'other'$"):
        with optional_dependency("peft", "qat", "it"):
            raise ModuleNotFoundError("No module named 'other'", name="other")


def test_a_width_narrower_than_one_packed_word_is_refused():
    """INT4 packs 8 codes a 32-bit word: in_features 4 is not a multiple of 8 even though it is below it."""
    from nibble.config import width_error
    assert width_error(4, -1).startswith("in_features=4 is not a multiple of 8")
    assert width_error(8, -1) is None and width_error(0, -1).startswith("in_features=0: a layer without inputs")


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_quantlinear_default_group_size_follows_the_mode_as_quantconfigs_does(mode):
    """QuantLinear(256, 64, mode="w4a4") was refused: its default group_size of 128 was W4A16's whatever the mode,
    and W4A4 takes per-channel weights only (it ran for in_features=128 by coincidence)."""
    layer = QuantLinear(256, 64, mode=mode)
    default = QuantConfig(mode=mode).group_size
    assert layer.group_size == (256 if default == -1 else default) == {"w4a16": 128, "w4a4": 256}[mode]


@pytest.mark.parametrize("group_size", [0, -5, 4, 2, "64"])
def test_quantlinear_refuses_group_sizes_no_kernel_runs(group_size):
    """group_size=0 once raised ZeroDivisionError and -5 said "divisible by -5"; 1-7 ran on the CPU only."""
    with pytest.raises(ValueError, match="group_size must be"):
        QuantLinear(256, 64, group_size=group_size)


def test_a_group_size_that_does_not_divide_is_told_the_cuda_kernel_sizes_first():
    """SmolLM2's 576 was told "96, 72, 64 do": the first two run on Triton only, never on the CUDA kernels."""
    with pytest.raises(ValueError, match=r"divides it: 64 or 32 \(CUDA kernels\), 96 \(Triton\), or -1"):
        QuantLinear(576, 64, group_size=128)


@pytest.mark.parametrize("group_size", [16, 48])
def test_groups_of_other_multiples_of_8_run(group_size):
    """Multiples of 8 other than 32 / 64 / 128 have GPU kernels too (Triton, dequantize + cuBLAS), so they stay."""
    lin = nn.Linear(192, 24)
    q = QuantLinear.from_linear(lin, QuantConfig(group_size=group_size))
    x = torch.randn(3, 192)
    w = reference.dequantize(q.qweight, q.scales, q.zeros, group_size)
    torch.testing.assert_close(q(x), x @ w.t() + lin.bias.detach(), rtol=0, atol=1e-5)
    with torch.no_grad():
        assert nn.functional.cosine_similarity(q(x).flatten(), lin(x).flatten(), dim=0) > 0.99


_DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                    reason="needs CUDA")])]


def _layer(kind: str, device: str, dtype=torch.bfloat16) -> QuantLinear:
    from nibble.nn.quant_linear import PermutedInputQuantLinear
    lin = nn.Linear(256, 48, dtype=torch.float32)
    mode = "w4a16" if kind in ("w4a16", "permuted") else "w4a4"
    q = QuantLinear.from_linear(lin, QuantConfig(mode=mode, group_size=64 if mode == "w4a16" else None))
    if kind == "permuted":
        p = PermutedInputQuantLinear(256, 48, True, 64, "w4a16", dtype=torch.float32)
        p.load_state_dict({**q.state_dict(), "input_perm": torch.randperm(256)})
        q = p
    q.input_hadamard = kind == "w4a4-hadamard"
    return q.to(device=device, dtype=dtype)


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("kind", ["w4a16", "permuted", "w4a4", "w4a4-hadamard"])
def test_the_input_gradient_is_that_of_the_dequantized_weight(kind, device):
    """dL/dx = dL/dy @ W (W dequantized; W4A4: straight through the activations' rounding, and through the
    Hadamard's transpose). Before, the GPU kernels passed no gradient at all and the CPU's W4A4 one only
    through each token's scale (one non-zero entry a token)."""
    from nibble.kernels.hadamard import hadamard_transform_reference
    q = _layer(kind, device)
    x = torch.randn(3, 5, 256, device=device, dtype=torch.bfloat16, requires_grad=True)
    r = torch.randn(3, 5, 48, device=device, dtype=torch.bfloat16)
    y = q(x)
    with torch.no_grad():
        assert torch.equal(y, q(x))  # the same product with or without the gradient
    (y.float() * r.float()).sum().backward()
    w = reference.dequantize(q.qweight, q.scales, q.zeros, q.group_size).cpu()  # [48, 256], stored input order
    expected = r.float().cpu() @ w
    if kind == "w4a4-hadamard":
        expected = hadamard_transform_reference(expected.bfloat16(), inverse=True)  # rotates the 16-bit gradient
    if kind == "permuted":
        expected = torch.empty_like(expected).index_copy_(-1, q.input_perm.cpu(), expected)
    assert x.grad.dtype == torch.bfloat16 and x.grad.shape == x.shape
    torch.testing.assert_close(x.grad.float().cpu(), expected.bfloat16().float(), rtol=2 ** -7, atol=1e-3)


def test_a_quantized_models_gradient_is_its_dequantized_twins():
    """Gradients through a whole W4A16 model (LoRA-style training on the quantized base) equal those of the
    dense model holding the dequantized weights."""
    from conftest import tiny_model
    from nibble import quantize_model
    from nibble.models.convert import quantized_linears
    model = tiny_model("llama")
    twin = tiny_model("llama")
    twin.load_state_dict(model.state_dict())
    quantize_model(model, QuantConfig(group_size=32), progress=False)
    for name, m in quantized_linears(model):
        twin.get_submodule(name).weight.data = reference.dequantize(m.qweight, m.scales, m.zeros, m.group_size)
    ids = torch.randint(0, 256, (2, 7))
    for net in (model, twin):
        net.model.embed_tokens.weight.grad = None
        net(ids, labels=ids).loss.backward()
    g, g_twin = model.model.embed_tokens.weight.grad, twin.model.embed_tokens.weight.grad
    assert g.abs().sum() > 0 and torch.allclose(g, g_twin, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("kind", ["w4a16", "w4a4", "w4a4-hadamard"])
def test_casting_a_layer_keeps_its_float16_scales(kind, device):
    """``module.to(torch.bfloat16)`` cast the format's float16 scales and zeros too: other weights, a
    checkpoint off the format, and a GPU op that refuses them. They follow the device, not the dtype."""
    q = _layer(kind, "cpu", dtype=torch.float32)
    scales, zeros = q.scales.clone(), q.zeros.clone()
    for cast in (lambda m: m.to(device=device, dtype=torch.bfloat16), lambda m: m.half(), lambda m: m.float(),
                 lambda m: m.to(device)):
        q = cast(q)
        assert q.scales.dtype == q.zeros.dtype == torch.float16 and q.qweight.dtype == torch.int32
        assert torch.equal(q.scales.cpu(), scales) and torch.equal(q.zeros.cpu(), zeros)
        assert q.scales.device.type == q.qweight.device.type == q.bias.device.type
    q = q.to(device=device, dtype=torch.bfloat16)
    assert q.bias.dtype == torch.bfloat16
    fresh = QuantLinear.from_weight(q.weight_int4(), q.bias, q.mode, q.input_hadamard, dtype=torch.bfloat16)
    x = torch.randn(4, 256, device=device, dtype=torch.bfloat16)
    assert torch.equal(q(x), fresh(x))


@pytest.mark.parametrize("cast", [lambda m: m.to(torch.float64), lambda m: m.double(), lambda m: m.type(torch.float64),
                                  lambda m: m.to("cpu", torch.complex64)])
def test_a_cast_to_a_dtype_the_layer_cannot_run_in_is_refused_before_it_is_made(cast):
    """``layer.to(torch.float64)`` went through, and the layer failed at its next forward."""
    q = _layer("w4a16", "cpu", dtype=torch.float32)
    before = {k: t.clone() for k, t in q.state_dict().items()}
    with pytest.raises(TypeError, match=r"^a quantized model runs in torch\.float16, torch\.bfloat16 or "
                                        r"torch\.float32 \(its QuantLinears' activations; .*\), not "
                                        r"torch\.(float64|complex64): cast it"):
        cast(q)
    assert all(t.dtype == before[k].dtype and torch.equal(t, before[k]) for k, t in q.state_dict().items())


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("kind", ["w4a16", "permuted", "w4a4", "w4a4-hadamard"])
def test_no_tokens_give_an_empty_output(kind, device):
    """W4A4 raised reshape's "cannot reshape tensor of 0 elements"; nn.Linear returns [..., 0, N]."""
    q = _layer(kind, device)
    for shape in ((0, 256), (2, 0, 256)):
        y = q(torch.randn(shape, device=device, dtype=torch.bfloat16))
        assert y.shape == (*shape[:-1], 48) and y.dtype == torch.bfloat16


def test_a_w4a4_layer_refuses_weights_with_zero_points():
    """W4A4's product reads (q - 8) * s and never the zeros: an asymmetric weight was taken without a word and
    the layer computed another function (45% relative error against the weight it held)."""
    from nibble.quantize.rtn import rtn_quantize
    w = torch.randn(32, 64) + 0.5  # rows not centred on 0: their zero points are not 8
    asymmetric = rtn_quantize(w, -1, symmetric=False)
    with pytest.raises(ValueError, match="symmetric weights"):
        QuantLinear.from_weight(asymmetric, mode="w4a4")
    layer = QuantLinear.from_weight(rtn_quantize(w, -1, symmetric=True), mode="w4a4")
    before = layer.state_dict()
    with pytest.raises(ValueError, match="symmetric weights"):
        layer.load_state_dict(QuantLinear.from_weight(asymmetric, mode="w4a16").state_dict())
    assert all(torch.equal(t, before[k]) for k, t in layer.state_dict().items())  # refused before the copy


def test_a_state_dict_off_the_formats_dtypes_is_refused_before_the_copy():
    """A qweight cast to a float (``{k: v.half() for ...}``) loaded without a word: copy_ rounded its packed words
    into other weights (outputs off by 3 where |y| ~ 1); assign=True kept float32 scales, which the GPU kernels
    refuse and a save writes off the format. One rule for both: the format's dtypes (Int4Weight's check)."""
    q = QuantLinear.from_linear(nn.Linear(64, 16), QuantConfig(group_size=32))
    sd = {f"0.{k}": t for k, t in q.state_dict().items()}
    for name, cast in (("qweight", torch.float16), ("qweight", torch.float32), ("qweight", torch.int64),
                       ("scales", torch.float32), ("zeros", torch.bfloat16)):
        cast_sd = {**sd, f"0.{name}": sd[f"0.{name}"].to(cast)}
        for device, assign in (("cpu", False), ("meta", True)):
            fresh = nn.Sequential(QuantLinear(64, 16, group_size=32, device=device))
            with pytest.raises(ValueError, match=rf"^0\.{name} must be .*{cast}.* the INT4 format keeps int32 words"):
                fresh.load_state_dict(cast_sd, assign=assign)
            assert fresh[0].qweight.dtype == torch.int32 and fresh[0].scales.dtype == torch.float16
            assert device == "meta" or not fresh[0].qweight.any()  # refused before the copy
    fresh = QuantLinear(64, 16, group_size=32)
    with pytest.raises(ValueError, match="^scales must be float16, got torch.float32"):  # a partial load too
        fresh.load_state_dict({"scales": sd["0.scales"].float()}, strict=False)
    fresh = QuantLinear(64, 16, group_size=32, device="meta")
    fresh.load_state_dict(q.state_dict(), assign=True)
    x = torch.randn(3, 64)
    assert torch.equal(fresh(x), q(x))


def test_from_weight_refuses_a_bias_that_is_not_one_float_per_output():
    """A [1] bias was broadcast over every output, an [N + 1] one met torch's bare size error, an int64 one became
    the layer's and was refused only at the first call."""
    w = QuantLinear.from_linear(nn.Linear(64, 16), QuantConfig(group_size=32)).weight_int4()
    for bias in (torch.tensor([0.5]), torch.zeros(17), torch.zeros(16, dtype=torch.long), torch.zeros(16, 1)):
        with pytest.raises(ValueError, match=r"bias must be a float tensor of shape \[16\]"):
            QuantLinear.from_weight(w, bias)


def _jacobian(q: QuantLinear) -> torch.Tensor:
    """dy/dx [N, K] of a float32 layer as its gradient defines it: the dequantized weight (straight through W4A4's
    rounding), after the Hadamard and in the input order the layer reads."""
    from nibble.kernels.hadamard import hadamard_matrix
    w = reference.dequantize(q.qweight, q.scales, q.zeros, q.group_size)
    if q.input_hadamard:
        w = w @ hadamard_matrix(q.in_features)
    if hasattr(q, "input_perm"):
        w = torch.empty_like(w).index_copy_(-1, q.input_perm, w)
    return w


@pytest.mark.parametrize("kind", ["w4a16", "permuted", "w4a4", "w4a4-hadamard"])
def test_torch_func_transforms_agree_with_backward(kind):
    """torch.func.grad / jacrev raised "must override the setup_context staticmethod", and forward mode (jvp,
    jacfwd) skipped the straight-through gradient: W4A4's Jacobian came out of the reference's rounding."""
    q = _layer(kind, "cpu", dtype=torch.float32)
    x = torch.randn(256)
    expected = _jacobian(q)
    for jacobian in (torch.func.jacrev, torch.func.jacfwd):
        torch.testing.assert_close(jacobian(q)(x), expected, rtol=1e-5, atol=1e-6)
    r = torch.randn(48)
    xs = torch.randn(5, 256)
    grads = torch.func.vmap(torch.func.grad(lambda v: (q(v) * r).sum()))(xs)
    torch.testing.assert_close(grads, (r @ expected).expand(5, -1), rtol=1e-5, atol=1e-6)
    _, tangent = torch.func.jvp(q, (xs,), (xs.flip(0),))
    torch.testing.assert_close(tangent, xs.flip(0) @ expected.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["w4a16", "permuted", "w4a4", "w4a4-hadamard"])
def test_composed_torch_func_transforms_are_the_dequantized_weights(kind):
    """hessian and jacfwd(jacrev(f)) raised "You must implement the jvp function": the input wants a gradient at the
    inner level and carries its tangent at the outer one, which it does not show, so the jvp-less Function ran.
    jvp(grad(f)) did the same, and jacfwd(vmap(q)) failed in unpack_dual of a batched tensor. Each now gives what the
    same transforms give on a float layer holding the dequantized weight (W4A4's straight-through Jacobian)."""
    F = torch.func
    q = _layer(kind, "cpu", dtype=torch.float32)
    w, b = _jacobian(q), q.bias
    dense = lambda v: nn.functional.linear(v, w, b)  # noqa: E731
    x, tangent = torch.randn(256), torch.randn(256)
    for second_derivative in (F.hessian, lambda f: F.jacfwd(F.jacrev(f)), lambda f: F.jacrev(F.jacfwd(f))):
        got, expected = (second_derivative(lambda v: layer(v).square().sum())(x) for layer in (q, dense))
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    r = torch.randn(48)
    (_, got), (_, expected) = (F.jvp(F.grad(lambda v: (layer(v) * r).sum()), (x,), (tangent,)) for layer in (q, dense))
    torch.testing.assert_close(got, expected)  # the second derivative of a product that is linear in y: zero
    xs = torch.randn(3, 256)
    torch.testing.assert_close(F.jacfwd(F.vmap(q))(xs), F.jacfwd(F.vmap(dense))(xs), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["w4a16", "permuted", "w4a4"])
def test_forward_mode_carries_the_bias_tangent(kind):
    """The tests gave only x a tangent; one on the bias (a trainable buffer, as in BitFit) must reach the output
    as it does through F.linear: d y / d bias is the identity on every row."""
    q = _layer(kind, "cpu", dtype=torch.float32)
    x, bias_tangent = torch.randn(3, 256), torch.randn(48)
    _, got = torch.func.jvp(lambda b: torch.func.functional_call(q, {"bias": b}, (x,)), (q.bias,), (bias_tangent,))
    torch.testing.assert_close(got, bias_tangent.expand(3, -1))


@pytest.mark.parametrize("kind", ["w4a16", "permuted", "w4a4"])
def test_a_trainable_bias_gets_its_gradient_whether_or_not_x_wants_one(kind):
    """The bias is a buffer a user may train (BitFit); its gradient was lost whenever x required grad (every layer
    after the first trainable one), since the autograd.Function returned none for it."""
    q = _layer(kind, "cpu", dtype=torch.float32)
    q.bias.requires_grad_(True)
    r = torch.randn(3, 5, 48)
    for x in (torch.randn(3, 5, 256), torch.randn(3, 5, 256, requires_grad=True)):
        q.bias.grad = None
        (q(x) * r).sum().backward()
        torch.testing.assert_close(q.bias.grad, r.sum((0, 1)))
        if x.requires_grad:
            torch.testing.assert_close(x.grad, r @ _jacobian(q), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["w4a16", "w4a4"])
def test_shared_input_forward_gives_each_layers_gradient(mode):
    """shared_input_forward ran the one-launch op for layers that want a gradient: none reached x on the GPU,
    and on the CPU W4A4's went through the rounding (zero) instead of straight through."""
    layers = [QuantLinear.from_linear(nn.Linear(128, n), QuantConfig(mode=mode, group_size=None if mode == "w4a4"
                                                                      else 64)) for n in (64, 32)]
    x = torch.randn(2, 3, 128, requires_grad=True)
    rs = [torch.randn(2, 3, m.out_features) for m in layers]
    sum((y * r).sum() for y, r in zip(shared_input_forward(layers, x), rs)).backward()
    expected = sum(r @ reference.dequantize(m.qweight, m.scales, m.zeros, m.group_size) for m, r in zip(layers, rs))
    torch.testing.assert_close(x.grad, expected, rtol=1e-5, atol=1e-5)


def _permuted_layers(perm: torch.Tensor, outs) -> list:
    """W4A16 act-order layers of 128 inputs, one of each of ``outs`` outputs, all in input order ``perm``."""
    from nibble.nn.quant_linear import PermutedInputQuantLinear
    layers = []
    for n in outs:
        q = QuantLinear.from_linear(nn.Linear(128, n), QuantConfig(group_size=64))
        p = PermutedInputQuantLinear(128, n, True, 64, "w4a16", dtype=torch.float32)
        p.load_state_dict({**q.state_dict(), "input_perm": perm})
        layers.append(p)
    return layers


def test_shared_input_forward_refuses_a_gradient_of_x_in_stored_order():
    perm = torch.randperm(128)
    layers = _permuted_layers(perm, (64, 32))
    x = torch.randn(3, 128)
    with torch.no_grad():
        ys = shared_input_forward(layers, x[:, perm], x_in_order=True)
    assert all(torch.equal(y, m(x)) for y, m in zip(ys, layers))
    with pytest.raises(ValueError, match="x_in_order=True is for inference"):
        shared_input_forward(layers, x[:, perm].requires_grad_(), x_in_order=True)


def test_a_lone_act_order_layer_has_no_shared_input_order():
    """A single layer runs as itself and gathers x in its own forward: taking x already in its order (as one launch
    of several does) would gather it a second time, an output of the wrong input."""
    from nibble.nn.quant_linear import shared_input_perm
    q = _layer("permuted", "cpu", dtype=torch.float32)
    assert shared_input_perm([q]) is None
    with pytest.raises(ValueError, match="x_in_order=True is for layers of one input permutation"):
        shared_input_forward([q], torch.randn(3, 256)[:, q.input_perm], x_in_order=True)


def test_w4a4_operands_hand_the_bias_in_the_activations_dtype():
    """The engine's fused RMSNorm passes these to the W4A4 kernels, which add the bias in the activations' dtype."""
    from nibble.nn.quant_linear import w4a4_operands
    layers = [QuantLinear(64, 16, mode="w4a4", dtype=torch.float32), QuantLinear(64, 8, False, mode="w4a4")]
    (_, _, bias), (_, _, no_bias) = w4a4_operands(layers, torch.bfloat16)
    assert bias.dtype == torch.bfloat16 and no_bias is None


def test_a_refused_input_perm_leaves_the_layer_as_it_was():
    """The permutation was checked after nn.Module had copied it in: after the ValueError the layer gathered
    the corrupt order's inputs."""
    q = _layer("permuted", "cpu", dtype=torch.float32)
    x = torch.randn(3, 256)
    before, perm = q(x), q.input_perm.clone()
    corrupt = {**q.state_dict(), "input_perm": torch.randint(0, 256, (256,))}
    with pytest.raises(ValueError, match="input_perm must be a permutation"):
        q.load_state_dict(corrupt)
    assert torch.equal(q.input_perm, perm) and torch.equal(q(x), before)


def test_a_layer_without_inputs_or_outputs_is_refused_when_made():
    """QuantLinear(64, 0) was made and failed at its first call (reshape's "-1 is ambiguous"), from_linear of an
    nn.Linear(64, 0) in torch.cat, and QuantLinear(0, 8, group_size=-1) with a ZeroDivisionError."""
    with pytest.raises(ValueError, match="out_features=0: a layer without outputs"):
        QuantLinear(64, 0)
    with pytest.raises(ValueError, match=r"an empty weight \(0, 64\) has nothing to quantize"):
        QuantLinear.from_linear(nn.Linear(64, 0), QuantConfig(group_size=32))
    with pytest.raises(ValueError, match="in_features=0: a layer without inputs"):
        QuantLinear(0, 8, group_size=-1)


def test_from_linear_of_a_meta_linear_says_to_load_its_weights():
    """It failed in rtn with "Tensor.item() cannot be called on meta tensors", where quantize_model says what to do."""
    with pytest.raises(ValueError, match="the weight is on the meta device .* load its values first"):
        QuantLinear.from_linear(nn.Linear(256, 64, device="meta"), QuantConfig(group_size=64))


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_from_linear_refuses_a_config_that_quantizes_no_layer_by_rtn(method):
    """from_linear is RTN: a gptq / awq config (lm_head kept in 16 bits) holds clip_search=None, which rtn would have
    read as "no search", quantizing by another recipe than any the config names, without a word."""
    with pytest.raises(ValueError, match=f"config of method='{method}' quantizes no layer by RTN .* method='rtn'"):
        QuantLinear.from_linear(nn.Linear(64, 16), QuantConfig(method=method, group_size=32))


def test_a_layer_made_by_its_constructor_is_zero_and_keeps_a_float32_bias():
    """The bias defaulted to float16, so a state dict of from_linear(float32 Linear) loaded "All keys matched" and
    rounded its bias; before a load, the buffers held whatever torch.empty found (NaN, 1e4, ...)."""
    fresh = QuantLinear(64, 16, group_size=32)
    assert fresh.bias.dtype == torch.get_default_dtype()
    assert torch.equal(fresh(torch.randn(3, 64)), torch.zeros(3, 16))
    q = QuantLinear.from_linear(nn.Linear(64, 16), QuantConfig(group_size=32))
    fresh.load_state_dict(q.state_dict())
    x = torch.randn(3, 64)
    assert torch.equal(fresh(x), q(x))


def _explicit_w4a16(q: QuantLinear, x: torch.Tensor) -> torch.Tensor:
    """x @ W.T + b in float64 with W written out code by code from the packed words (the nibble order of the
    canonical format: code k of a column in bits 4 (k % 8) of word k // 8), in the layer's stored input order."""
    words = q.qweight.long() & 0xFFFFFFFF
    codes = torch.stack([(words >> (4 * i)) & 15 for i in range(8)], dim=1).reshape(q.in_features, q.out_features)
    group = torch.arange(q.in_features) // q.group_size
    w = codes.double() * q.scales.double()[group] + q.zeros.double()[group]  # [K, N]
    return x.double() @ w + (0 if q.bias is None else q.bias.double())


def test_permute_outputs_moves_each_channel_with_its_codes_scales_zeros_and_bias():
    """Output channel i becomes the old channel perm[i], its group scales, zeros and bias with it."""
    torch.manual_seed(21)
    for mode, group_size in (("w4a16", 32), ("w4a4", None)):
        q = QuantLinear.from_linear(nn.Linear(64, 24), QuantConfig(mode=mode, group_size=group_size))
        x, perm = torch.randn(5, 64), torch.randperm(24)
        want = q(x)[:, perm]
        q.permute_outputs(perm)
        assert torch.equal(q(x), want)
        if mode == "w4a16":
            torch.testing.assert_close(q(x).double(), _explicit_w4a16(q, x), rtol=1e-5, atol=1e-5)


def _permuted(q: QuantLinear, perm: torch.Tensor, how: str):
    from nibble.nn.quant_linear import PermutedInputQuantLinear
    p = PermutedInputQuantLinear(q.in_features, q.out_features, True, q.group_size, q.mode, dtype=torch.float32)
    if how == "set":
        p.load_state_dict({**q.state_dict(), "input_perm": torch.arange(q.in_features)})
        p.set_input_perm(perm)
    else:
        p.load_state_dict({**q.state_dict(), "input_perm": perm})
    return p


@pytest.mark.parametrize("how", ["set", "load"])
def test_act_order_layers_of_other_input_orders_never_share_one_gather(how):
    """Layers whose input orders differ run alone, each on x in its own order; ones of one order share it. The
    order's digest (input_order) is what tells them apart, so it must follow set_input_perm and a load."""
    from nibble.nn.quant_linear import shared_input_perm
    torch.manual_seed(22)
    qs = [QuantLinear.from_linear(nn.Linear(128, n), QuantConfig(group_size=32)) for n in (24, 16, 8)]
    p1, p2 = torch.randperm(128), torch.randperm(128)
    layers = [_permuted(qs[0], p1, how), _permuted(qs[1], p2, how), _permuted(qs[2], p1, how)]
    x = torch.randn(3, 128)
    for m, perm, y in zip(layers, (p1, p2, p1), shared_input_forward(layers, x)):
        torch.testing.assert_close(y.double(), _explicit_w4a16(m, x[:, perm]), rtol=1e-5, atol=1e-5)
    assert shared_input_perm(layers) is None and torch.equal(shared_input_perm(layers[::2]), p1)


def test_set_input_perm_refuses_a_permutation_of_another_length():
    """A permutation of 0 (one index) broadcast by copy_ over every entry: every input read column 0."""
    q = _layer("permuted", "cpu", dtype=torch.float32)
    perm, x = q.input_perm.clone(), torch.randn(3, 256)
    before = q(x)
    for bad in (torch.tensor([0]), torch.randperm(128)):
        with pytest.raises(ValueError, match=rf"input_perm must hold 256 indices \(in_features\), got shape "
                                             rf"\({bad.numel()},\)"):
            q.set_input_perm(bad)
        assert torch.equal(q.input_perm, perm) and torch.equal(q(x), before)


def test_an_act_order_layer_in_its_stored_order_and_without_its_perm_is_the_same_layer():
    """forward_in_order takes x already gathered (it must not gather again), and without_input_perm is the layer on
    that x, its backend kept."""
    q = _layer("permuted", "cpu", dtype=torch.float32)
    q.backend = "reference"
    x = torch.randn(3, 256)
    gathered = x[:, q.input_perm]
    want = _explicit_w4a16(q, gathered)
    torch.testing.assert_close(q(x).double(), want, rtol=1e-5, atol=1e-5)
    assert torch.equal(q.forward_in_order(gathered), q(x))
    plain = q.without_input_perm()
    assert plain.backend == "reference" and torch.equal(plain(gathered), q(x))


def test_shared_input_forward_keeps_each_layers_rotation_and_backend(monkeypatch):
    """W4A4 layers with and without the online Hadamard, or of other backends, quantize x differently (or run other
    kernels): they never share one launch."""
    torch.manual_seed(23)
    layers = [QuantLinear.from_linear(nn.Linear(128, n), QuantConfig(mode="w4a4")) for n in (32, 16)]
    layers[1].input_hadamard = True
    calls = _count_layers_per_call(monkeypatch, "_w4a4_linears")
    x = torch.randn(4, 128)
    ys = shared_input_forward(layers, x)
    assert calls == [1, 1]
    from nibble.kernels.hadamard import hadamard_matrix
    rotated = reference.w4a4_linear(x @ hadamard_matrix(128).t(), layers[1].qweight, layers[1].scales[0], layers[1].bias)
    assert torch.equal(ys[0], layers[0](x)) and torch.equal(ys[1], layers[1](x))
    assert nn.functional.cosine_similarity(ys[1].flatten(), rotated.flatten(), dim=0) > 0.99
    calls.clear()
    layers[1].input_hadamard = False
    layers[1].backend = "reference"
    shared_input_forward(layers, x)
    assert calls == [1, 1]


def test_w4a4_operands_are_only_for_layers_that_quantize_one_input_alike():
    """The engine hands these layers x quantized once, unrotated, by the default kernels: a layer with the online
    Hadamard, another backend or another width would get the wrong codes."""
    from nibble.nn.quant_linear import w4a4_operands
    base = lambda: QuantLinear(64, 16, mode="w4a4")  # noqa: E731
    assert w4a4_operands([base(), base()], torch.float32) is not None
    rotated, other_backend = base(), base()
    rotated.input_hadamard = True
    other_backend.backend = "reference"
    for odd in (rotated, other_backend, QuantLinear(128, 16, mode="w4a4")):
        assert w4a4_operands([base(), odd], torch.float32) is None


def test_shared_input_forward_adds_every_bias_once_the_stacked_biases_part():
    """Weights stacked by stack_weights whose biases no longer lie back to back (one replaced) run layer by layer:
    the stacked matmul had no bias to add, and dropped them all."""
    torch.manual_seed(24)
    layers = [nn.Linear(32, n) for n in (16, 8)]
    stack_weights(layers)
    layers[1].bias = nn.Parameter(torch.randn(8))
    x = torch.randn(3, 32)
    with torch.no_grad():
        for y, m in zip(shared_input_forward(layers, x), layers):
            torch.testing.assert_close(y, x @ m.weight.t() + m.bias)


def test_a_w4a4_layer_of_groups_is_refused_when_made():
    with pytest.raises(ValueError, match=r"w4a4 QuantLinear needs per-channel weights \(group_size = in_features\)"):
        QuantLinear(256, 64, group_size=64, mode="w4a4")


def test_from_weight_keeps_the_biases_dtype():
    """The layer's bias buffer is the bias given, in its dtype (a bfloat16 bias saved as bfloat16), whatever the
    default dtype."""
    w = QuantLinear.from_linear(nn.Linear(64, 16), QuantConfig(group_size=32)).weight_int4()
    bias = torch.randn(16).bfloat16()
    q = QuantLinear.from_weight(w, bias)
    assert q.bias.dtype == torch.bfloat16 and torch.equal(q.bias, bias)


def test_from_linear_keeps_the_online_hadamard_of_a_rotated_linear():
    """A HadamardInputLinear holds W @ H.T and rotates its input: its W4A4 QuantLinear must rotate too (the weight
    without its rotation computes another function)."""
    from nibble.nn.hadamard import HadamardInputLinear
    torch.manual_seed(25)
    lin = nn.Linear(192, 32)  # 192 = 12 * 16: a Paley factor, H not symmetric
    q = QuantLinear.from_linear(HadamardInputLinear.from_linear(lin), QuantConfig(mode="w4a4"))
    x = torch.randn(6, 192)
    assert q.input_hadamard
    with torch.no_grad():
        assert nn.functional.cosine_similarity(q(x).flatten(), lin(x).flatten(), dim=0) > 0.95


def test_the_gradients_of_a_rotated_layer_go_through_the_inverse_rotation():
    """dy/dx = W @ H for y = q(x @ H.T) @ W.T: H's transpose, which the tests' power-of-two sizes (a symmetric H)
    did not tell from H. 192 = 12 * 16 has a Paley factor, H.T != H; backward and forward mode both."""
    torch.manual_seed(26)
    q = QuantLinear.from_linear(nn.Linear(192, 24), QuantConfig(mode="w4a4"))
    q.input_hadamard = True
    from nibble.kernels.hadamard import hadamard_matrix
    h = hadamard_matrix(192, torch.float64)
    assert not torch.equal(h, h.t())
    expected = (_explicit_w4a16(q, torch.eye(192)) - q.bias.double()).t() @ h  # [N, K]: the dequantized W, then H
    x = torch.randn(192)
    for jacobian in (torch.func.jacrev, torch.func.jacfwd):
        torch.testing.assert_close(jacobian(q)(x).double(), expected, rtol=1e-5, atol=1e-5)
    xs = torch.randn(3, 192, requires_grad=True)
    r = torch.randn(3, 24)
    (q(xs) * r).sum().backward()
    torch.testing.assert_close(xs.grad.double(), r.double() @ expected, rtol=1e-5, atol=1e-5)


def test_x_in_stored_order_that_wants_a_gradient_runs_under_no_grad():
    """The refusal says "or run under torch.no_grad()": there no gradient is taken, whatever x.requires_grad says."""
    perm = torch.randperm(128)
    layers = _permuted_layers(perm, (32, 16))
    x = torch.randn(3, 128)
    with torch.no_grad():
        ys = shared_input_forward(layers, x[:, perm].requires_grad_(), x_in_order=True)
    for y, m in zip(ys, layers):
        torch.testing.assert_close(y.double(), _explicit_w4a16(m, x[:, perm]), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device", _DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["w4a16", "w4a4"])
def test_a_compiled_layer_gives_the_eager_gradient(kind, dtype, device):
    """Training under torch.compile: the Function without a jvp is the one traced (Dynamo refuses a Function that
    defines one), and the gradient is the dequantized weight's. Under torch 2.11 it was zero wherever the product
    came out in x's dtype already (float32 on the CPU, bfloat16 on the GPU): `_WithInputGradient.forward` says why."""
    q = _layer(kind, device, dtype=dtype)
    x = torch.randn(3, 256, device=device, dtype=dtype, requires_grad=True)
    r = torch.randn(3, 48, device=device, dtype=dtype)
    torch._dynamo.reset()
    (torch.compile(q, fullgraph=True, backend="eager")(x) * r).sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: the gradient's one rounding
    torch.testing.assert_close(x.grad.double(), r.double() @ _jacobian(q).double(), rtol=tol, atol=tol)


def test_a_w4a4_layer_on_the_meta_device_loads_a_meta_state_dict():
    """Skeletons are built on the meta device (checkpoint loading): meta scales and zeros hold no values to check."""
    layer = QuantLinear(64, 16, mode="w4a4", device="meta")
    layer.load_state_dict(QuantLinear(64, 16, mode="w4a4", device="meta").state_dict(), assign=True)
    assert layer.scales.is_meta and layer.qweight.shape == (8, 16)
