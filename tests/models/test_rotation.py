"""rotate_model and HadamardInputLinear: same function, spread outliers."""
import copy
import re

import pytest
import torch
from conftest import tiny_model
from torch import nn

from nibble.config import QuantConfig
from nibble.kernels.hadamard import hadamard_transform
from nibble.models.convert import quantize_model
from nibble.models.rotation import rotate_model
from nibble.nn.hadamard import HadamardInputLinear


def _randomize_norms_and_biases(model):
    """Norm weights of 1 and zero biases would let a wrong fold pass; make them arbitrary."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand_like(p) * 1.5 + 0.25)
            elif name.endswith("bias"):
                p.copy_(torch.randn_like(p))
    return model


def _with_outliers(model, channel=5, unit=7, factor=50.0):
    """A residual-stream outlier channel (embedding column) and an MLP one (an up_proj row)."""
    with torch.no_grad():
        model.model.embed_tokens.weight[:, channel] *= factor
        for layer in model.model.layers:
            layer.mlp.up_proj.weight[unit] *= factor
    return model


def _peak_to_rms(x):
    """max|x| / rms(x) per token, averaged: ~sqrt(2 ln n) for Gaussian rows, large with an outlier channel."""
    x = x.reshape(-1, x.shape[-1]).double()
    return (x.abs().amax(-1) / x.pow(2).mean(-1).sqrt()).mean().item()


def _quantizer_inputs(model, ids):
    """What per-token quantization of layer 1 would see: q_proj's input, and down_proj's after any online Hadamard."""
    layer, seen = model.model.layers[1], {}
    hooks = [layer.self_attn.q_proj.register_forward_hook(lambda m, i, o: seen.__setitem__("q_proj", i[0])),
             layer.mlp.down_proj.register_forward_hook(lambda m, i, o: seen.__setitem__(
                 "down_proj", hadamard_transform(i[0]) if getattr(m, "input_hadamard", False) else i[0]))]
    model(ids)
    for h in hooks:
        h.remove()
    return seen


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("hidden,heads", [(64, 4), (96, 4), (96, 6)])
@pytest.mark.parametrize("online_o_proj", [False, True])
def test_rotated_model_gives_the_same_logits(arch, hidden, heads, online_o_proj):
    model = _randomize_norms_and_biases(tiny_model(arch, hidden_size=hidden, num_attention_heads=heads,
                                                   intermediate_size=192))
    _check_rotation_keeps_logits(model, online_o_proj)
    assert isinstance(model.model.layers[0].self_attn.o_proj, HadamardInputLinear) == online_o_proj


@pytest.mark.parametrize("online_o_proj", [False, True])
def test_a_model_with_a_bias_on_every_linear_gives_the_same_logits_rotated(online_o_proj):
    """Qwen2's biases are on q/k/v, which read the stream; a Llama with attention_bias and mlp_bias has them on
    o_proj and down_proj too, which write to it, so theirs must turn with the stream (b -> b Q)."""
    model = _randomize_norms_and_biases(tiny_model("llama", attention_bias=True, mlp_bias=True))
    layer = model.model.layers[0]
    assert layer.self_attn.o_proj.bias is not None and layer.mlp.down_proj.bias is not None
    _check_rotation_keeps_logits(model, online_o_proj)


@pytest.mark.parametrize("arch,extra", [("llama", dict(tie_word_embeddings=False, attention_bias=True, mlp_bias=True)),
                                        ("qwen2", {}), ("qwen3", {}), ("mistral", {})])
@pytest.mark.parametrize("online_o_proj", [False, True])
def test_a_bfloat16_model_rotated_keeps_its_function_to_bfloat16_rounding(arch, extra, online_o_proj):
    """Against the float64 model: the rotation (float64 algebra, each weight rounded once) adds no more error
    than bfloat16 itself has, whichever seed, tied or untied, with biases on the stream's writers or readers."""
    base = _randomize_norms_and_biases(tiny_model(arch, hidden_size=96, num_attention_heads=6, intermediate_size=160,
                                                  **extra))
    ids = torch.randint(0, 256, (2, 17))
    with torch.no_grad():
        exact = copy.deepcopy(base).double()(ids).logits
        own = (copy.deepcopy(base).bfloat16()(ids).logits.double() - exact).abs().max().item()
        for seed in (0, 7):
            rotated = rotate_model(copy.deepcopy(base).bfloat16(), seed=seed, online_o_proj=online_o_proj)
            assert (rotated(ids).logits.double() - exact).abs().max().item() <= 3 * own


def _check_rotation_keeps_logits(model, online_o_proj):
    ids = torch.randint(0, 256, (3, 21))
    with torch.no_grad():
        want = model(ids).logits
        rotate_model(model, seed=1, online_o_proj=online_o_proj)
        got = model(ids).logits
    assert (got - want).abs().max() <= 1e-4 * max(1.0, want.abs().max().item())


def test_rotation_folds_norms_unties_embeddings_and_swaps_down_proj():
    model = _randomize_norms_and_biases(tiny_model("qwen2"))
    assert model.lm_head.weight is model.model.embed_tokens.weight
    rotate_model(model)
    norms = [m for n, m in model.named_modules() if n.endswith("norm")]
    assert len(norms) == 5 and all(torch.equal(m.weight, torch.ones_like(m.weight)) for m in norms)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert not model.config.tie_word_embeddings
    model.tie_weights()  # what loading or saving does: must not re-tie them
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert all(layer.mlp.down_proj.input_hadamard for layer in model.model.layers)


def test_rotation_spreads_outlier_channels():
    model = _with_outliers(tiny_model("llama"))
    ids = torch.randint(0, 256, (2, 33))
    with torch.no_grad():
        before = _quantizer_inputs(model, ids)
        after = _quantizer_inputs(rotate_model(model), ids)
    for name in ("q_proj", "down_proj"):
        assert _peak_to_rms(before[name]) > 6, name  # the outlier dominates its token
        assert _peak_to_rms(after[name]) < _peak_to_rms(before[name]) / 2.5, name


def test_rotation_makes_w4a4_more_accurate_on_outliers():
    model = _with_outliers(tiny_model("llama"))
    ids = torch.randint(0, 256, (2, 33))
    with torch.no_grad():
        want = model(ids).logits
        plain = quantize_model(copy.deepcopy(model), QuantConfig(mode="w4a4"), progress=False)(ids).logits
        rotated = quantize_model(model, QuantConfig(mode="w4a4", rotation="hadamard"), progress=False)(ids).logits
    assert model.model.layers[0].mlp.down_proj.input_hadamard
    assert (rotated - want).norm() < (plain - want).norm() / 2


def test_rotation_depends_on_the_seed_only():
    base = tiny_model("mistral")
    a, b, c = (rotate_model(copy.deepcopy(base), seed=s) for s in (3, 3, 4))
    assert torch.equal(a.model.embed_tokens.weight, b.model.embed_tokens.weight)
    assert not torch.equal(a.model.embed_tokens.weight, c.model.embed_tokens.weight)


@pytest.mark.parametrize("seed", [1.5, "3", None, True, 2**64, -2**63 - 1])
def test_a_seed_torch_cannot_take_is_refused_before_the_model_is_touched(seed):
    """QuantConfig took any rotation_seed, and quantize_model failed in torch ("manual_seed expected a long, but got
    float", "Overflow when unpacking long long") after the rotation had untied the model's head; rotate_model's
    seed was refused by torch's own words, which named no option (QuantConfig's check is the one both run)."""
    in_range = rf"must be an integer from -2\*\*63 to 2\*\*64 - 1, got {re.escape(repr(seed))}"
    with pytest.raises(ValueError, match="rotation_seed " + in_range):
        QuantConfig(mode="w4a4", rotation="hadamard", rotation_seed=seed)
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="seed " + in_range):
        rotate_model(model, seed=seed)
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert QuantConfig(mode="w4a4", rotation="hadamard", rotation_seed=2**64 - 1).rotation_seed == 2**64 - 1


def test_a_seed_without_the_rotation_is_refused_and_configs_saved_with_one_still_load():
    """QuantConfig(mode='w4a4', rotation_seed=5) quantized the model unrotated without a word (W4A4 of SmolLM2 at
    chance), and a seed given beside rotate_model's was dropped. PE-QAT exports of the per-token recipe saved the
    run's unused seed: they load."""
    with pytest.raises(ValueError, match=r"rotation_seed=5 seeds rotation='hadamard', and rotation='none' rotates "
                                         r"nothing: set rotation='hadamard' too"):
        QuantConfig(mode="w4a4", rotation_seed=5)
    saved = {**QuantConfig(mode="w4a4").to_dict(), "rotation_seed": 5}
    assert QuantConfig.from_dict(saved) == QuantConfig(mode="w4a4")


@pytest.mark.parametrize("device,message", [("gpu", "is not a device torch knows"), ("meta", "is not one nibble runs on")]
                         + [("cuda", "no CUDA GPU is visible")] * (not torch.cuda.is_available()))
def test_a_device_the_rotation_cannot_run_on_is_refused_before_the_model_is_touched(device, message):
    """It failed in the first weight's move, after the head was untied and the model marked rotated: rotate_model
    again said "rotated already", and quantize_model recorded a rotation the weights never had."""
    from nibble.models.rotation import rotation_seed
    model = tiny_model("llama")
    with pytest.raises(ValueError, match=message):
        rotate_model(model, seed=3, device=device)
    assert rotation_seed(model) is None and model.lm_head.weight is model.model.embed_tokens.weight
    rotate_model(model, seed=3)


def test_a_model_built_empty_is_refused_before_it_is_touched():
    """rotate_model took a model on the meta device: nothing was rotated (its tensors hold no values), yet the head
    was untied, the down_projs given online Hadamards and the model marked rotated, so the weights loaded into it
    ran another function, and quantize_model recorded a rotation they never had."""
    from nibble.models.rotation import rotation_seed
    with torch.device("meta"):
        empty = tiny_model("llama")
    with pytest.raises(ValueError, match="on the meta device .* load its weights first"):
        rotate_model(empty)
    assert rotation_seed(empty) is None and empty.lm_head.weight is empty.model.embed_tokens.weight
    assert not any(isinstance(layer.mlp.down_proj, HadamardInputLinear) for layer in empty.model.layers)


def _without_weight(norm):
    norm.weight = None
    return norm


@pytest.mark.parametrize("path,norm,problem", [
    ("model.layers.1.post_attention_layernorm", lambda n: nn.LayerNorm(64), "is a LayerNorm"),
    ("model.norm", lambda n: n.register_parameter("bias", nn.Parameter(torch.randn(64))) or n,
     r"\(LlamaRMSNorm\) has a bias"),
    ("model.layers.0.input_layernorm", _without_weight, r"\(LlamaRMSNorm\) has no weight of shape \(64,\)"),
    ("model.norm", lambda n: nn.RMSNorm(64, elementwise_affine=False), r"\(RMSNorm\) has no weight"),
    # a weight of another width failed in the fold, after the embedding was rotated and lm_head untied
    ("model.layers.1.input_layernorm", lambda n: nn.RMSNorm(32), r"\(RMSNorm\) has no weight of shape \(64,\)"),
], ids=["layernorm", "rmsnorm_bias", "no_weight", "torch_rmsnorm_unscaled", "rmsnorm_of_another_width"])
def test_a_norm_the_rotation_cannot_fold_is_refused_by_name_before_the_model_is_touched(path, norm, problem):
    """An RMSNorm with a bias was refused as "found LlamaRMSNorm", which named no fault; one without a weight failed
    on 'NoneType' object has no attribute 'detach' with the embedding rotated and lm_head untied."""
    model = tiny_model("llama")
    parent, _, name = path.rpartition(".")
    setattr(model.get_submodule(parent), name, norm(model.get_submodule(path)))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=rf"cannot rotate this model: rotation folds the weight w of each RMSNorm "
                                         rf"\(x / rms\(x\) \* w, without bias\) .* and {re.escape(path)} {problem}"):
        rotate_model(model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied


def test_rotation_keeps_dtypes():
    model = tiny_model("llama", dtype=torch.bfloat16)
    rotate_model(model)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_rotating_twice_is_an_error():
    model = rotate_model(tiny_model("llama"))
    with pytest.raises(ValueError, match="this model is rotated already"):
        rotate_model(model)
    with pytest.raises(ValueError, match="this model is rotated already"):
        rotate_model(copy.deepcopy(model))  # the copy keeps the record of the rotation


@pytest.mark.parametrize("mode,kept", [("w4a4", ["lm_head"]), ("w4a4", []), ("w4a16", ["lm_head", "down_proj"])])
def test_a_model_rotated_first_is_recorded_as_quantize_model_rotating_it_would_be(mode, kept):
    """rotate_model then quantize_model recorded rotation 'none': the config the model ends with, and every
    checkpoint of it, said another model than the one quantize_model(rotation='hadamard') makes, bit for bit the
    same. W4A16 keeps its down_projs (online Hadamard) in 16 bits, either way; it was refused rotation='hadamard'.
    The tiny llama's head is tied: quantized, it was recorded as tied (lm_head_was_tied, the bytes saved) only where
    quantize_model untied it, as if rotate_model's model had held the head's table twice in 16 bits."""
    base = tiny_model("llama")
    config = dict(mode=mode, group_size=32 if mode == "w4a16" else None, modules_to_not_convert=kept)
    rotated_first = quantize_model(rotate_model(copy.deepcopy(base), seed=3), QuantConfig(**config), progress=False)
    rotated_by_quantize = quantize_model(copy.deepcopy(base), QuantConfig(**config, rotation="hadamard",
                                                                          rotation_seed=3), progress=False)
    recorded = rotated_first.config.quantization_config
    assert (recorded["rotation"], recorded["rotation_seed"]) == ("hadamard", 3)
    assert recorded == rotated_by_quantize.config.quantization_config
    theirs = rotated_by_quantize.state_dict()
    assert all(torch.equal(v, theirs[k]) for k, v in rotated_first.state_dict().items())


def test_a_rotation_w4a16_cannot_run_is_refused_before_the_model_is_touched():
    model = tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=re.escape(
            "model.layers.0.mlp.down_proj rotates its input online in a rotated model (rotate_model, or "
            "rotation='hadamard'), which only w4a4 runs: quantize the model with mode='w4a4', or keep those layers "
            "in 16 bits (modules_to_not_convert=['lm_head', 'down_proj'])")):
        quantize_model(model, QuantConfig(group_size=32, rotation="hadamard"), progress=False)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_quantize_model_refuses_to_rotate_a_rotated_model_again_before_touching_it(monkeypatch):
    """The refusal came from the rotation itself, after the model had moved to the device asked for."""
    from nibble.models import convert
    model = rotate_model(tiny_model("llama"), seed=3)
    monkeypatch.setattr(convert, "move_all_but_layers", lambda *a: pytest.fail("moved the model before refusing it"))
    for seed in (3, 4):  # the same seed too: a second rotation, not the first recorded
        with pytest.raises(ValueError, match=r"this model is rotated already .* take it as it is \(quantize_model "
                                             r"with rotation='none', the default, or PE-QAT's per-token recipe"):
            quantize_model(model, QuantConfig(mode="w4a4", rotation="hadamard", rotation_seed=seed), progress=False,
                           device="cpu")
    assert not getattr(model.config, "quantization_config", None)


@pytest.mark.parametrize("config", [QuantConfig(group_size=32), QuantConfig(mode="w4a4", rotation="hadamard")])
def test_rotating_a_quantized_model_is_refused_before_it_is_touched(config):
    """Rotation rewrites float weights: a quantized model failed on "'QuantLinear' object has no attribute 'weight'"
    after its embedding was rotated (a rotated W4A4 model's QuantLinear down_proj passed the already-rotated check)."""
    model = quantize_model(tiny_model("llama"), config, progress=False)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="the model is quantized already: 14 of its linears are QuantLinear .* "
                                         "rotate_model takes a 16-bit model"):
        rotate_model(model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_a_rotated_model_refuses_save_pretrained_which_would_drop_its_online_hadamard(tmp_path):
    """transformers loads a saved rotated model's down_proj as a plain nn.Linear, without the online Hadamard its
    weight was folded for: it saved without a word and came back as another function (logits 0.2 apart)."""
    model = rotate_model(tiny_model("llama"))
    for m in (model, copy.deepcopy(model)):
        with pytest.raises(ValueError, match=r"a rotated model's down_proj .* quantize it .* nibble\.save_quantized"):
            m.save_pretrained(tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
    quantize_model(model, QuantConfig(mode="w4a4"), progress=False)
    with pytest.raises(ValueError, match=r"nibble\.save_quantized\(model, directory, tokenizer\)"):
        model.save_pretrained(tmp_path / "hf")


def test_unsupported_sizes_are_a_clear_error():
    with pytest.raises(ValueError, match="hidden_size is 100.*Paley"):
        rotate_model(tiny_model("llama", hidden_size=100, num_attention_heads=4))
    with pytest.raises(ValueError, match="unknown model architecture"):
        rotate_model(nn.Linear(4, 4))


# ---- HadamardInputLinear ------------------------------------------------------------------------

@pytest.mark.parametrize("in_features,bias", [(192, True), (64, False), (172, True)])
def test_hadamard_input_linear_computes_the_original_linear(in_features, bias):
    lin = nn.Linear(in_features, 48, bias=bias)
    had = HadamardInputLinear.from_linear(lin)
    x = torch.randn(2, 5, in_features)
    assert had.input_hadamard and isinstance(had, nn.Linear)
    assert torch.allclose(had(x), lin(x), atol=1e-5)
    assert had.bias is lin.bias


def test_hadamard_input_linear_backpropagates_like_the_original():
    lin = nn.Linear(96, 16)
    had = HadamardInputLinear.from_linear(lin)
    x1 = torch.randn(4, 96, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_()
    lin(x1).square().sum().backward()
    had(x2).square().sum().backward()
    assert torch.allclose(x1.grad, x2.grad, atol=1e-5)


def test_hadamard_input_linear_refuses_a_second_fold_and_bad_weights():
    had = HadamardInputLinear.from_linear(nn.Linear(64, 8))
    with pytest.raises(ValueError, match="already has an online Hadamard"):
        HadamardInputLinear.from_linear(had)
    with pytest.raises(ValueError, match="shape"):
        HadamardInputLinear.from_linear(nn.Linear(64, 8), weight=torch.zeros(8, 32))


def test_an_intermediate_size_without_a_hadamard_matrix_is_refused_before_the_model_is_touched():
    """down_proj's online Hadamard runs over the intermediate size: one it has no matrix for was said only when
    down_proj was rebuilt, after the embedding was rotated and lm_head untied."""
    model = tiny_model("llama", intermediate_size=100)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="cannot rotate this model: its intermediate_size is 100.*Paley"):
        rotate_model(model)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_o_proj_width_is_checked_only_where_o_proj_is_rotated_online():
    """o_proj's input (heads * head_dim, here 4 * 46) needs a Hadamard matrix with online_o_proj alone: refused
    there before the model is touched, and no reason to refuse the rotation without it."""
    base = _randomize_norms_and_biases(tiny_model("llama", head_dim=46))
    model = copy.deepcopy(base)
    with pytest.raises(ValueError, match="cannot rotate this model: its o_proj in_features is 184"):
        rotate_model(model, online_o_proj=True)
    assert all(torch.equal(v, base.state_dict()[k]) for k, v in model.state_dict().items())
    _check_rotation_keeps_logits(model, online_o_proj=False)


def test_a_float32_rotation_is_its_float64_rotation_rounded_once():
    """All the algebra runs in float64 and each weight is rounded once: a weight rotated in its own dtype (the
    embedding's rows read without widening them) differs from the float64 model's rotation in its last bits."""
    base = _randomize_norms_and_biases(tiny_model("llama", hidden_size=96, num_attention_heads=6, intermediate_size=160,
                                                  attention_bias=True, mlp_bias=True))
    wide = rotate_model(copy.deepcopy(base).double(), seed=5, online_o_proj=True).state_dict()
    for name, value in rotate_model(copy.deepcopy(base), seed=5, online_o_proj=True).state_dict().items():
        assert torch.equal(value, wide[name].to(value.dtype)), name


def test_the_rotation_writes_new_storage_never_into_the_weights_it_was_given():
    """On the CPU each rotated weight is new storage (`_set`, `_rotate_rows`): written in place, the pages of a model
    transformers mapped from its safetensors files were copied into process memory for good (copy-on-write), and
    any other holder of those tensors saw them rotated."""
    model = _randomize_norms_and_biases(tiny_model("llama", tie_word_embeddings=False))
    held = {name: p.data for name, p in model.named_parameters() if "norm" not in name}  # norms: filled with 1
    copies = {name: t.clone() for name, t in held.items()}
    rotate_model(model)
    assert all(torch.equal(held[name], copies[name]) for name in held)


def test_a_quantization_interrupted_after_the_rotation_began_is_not_rotated_again(monkeypatch):
    """quantize_model rotates the embedding and lm_head first, then each decoder layer at its turn: stopped before
    the first (Ctrl-C during calibration), no down_proj has its online Hadamard yet, and only the seed the model
    records tells that a second rotation would rotate the embedding twice."""
    from nibble.models import convert

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setitem(convert.calibrated_quantizers, "gptq", interrupted)
    model = tiny_model("llama")
    with pytest.raises(KeyboardInterrupt):
        quantize_model(model, QuantConfig(mode="w4a4", rotation="hadamard", method="gptq"), progress=False,
                       calibration=torch.randint(0, 256, (2, 16)))
    with pytest.raises(ValueError, match="this model is rotated already"):
        rotate_model(model)
