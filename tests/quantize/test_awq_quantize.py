import math

import pytest
import torch

from conftest import tiny_model
from nibble import QuantConfig, quantize_model
from nibble.kernels.reference import dequantize
from nibble.quantize.awq import awq_quantize_model, clip_quantize, search_scale
from nibble.quantize.rtn import rtn_quantize


def dense(w):
    return dequantize(w.qweight, w.scales, w.zeros, w.group_size)


def salient_problem(K=256, N=64, T=2048, seed=0):
    """Inputs where a few channels carry 20x larger activations (the AWQ setting)."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(T, K, generator=g)
    X[:, torch.randperm(K, generator=g)[:8]] *= 20
    W = torch.randn(N, K, generator=g) * 0.02
    return X, W, X.t() @ X / T


def output_error(X, W, Wq):
    return ((X @ Wq.t() - X @ W.t()) ** 2).mean().item()


def test_scale_search_skips_scalings_that_overflow_float16():
    """An alpha that scales a weight past float16's range is a candidate the layer cannot store: skipped (its error
    infinite), not a failure of the whole search; with every alpha overflowing, the overflow is said."""
    from nibble.quantize.rtn import ScaleOverflowError

    X, W, H = salient_problem()
    W[:, 0] = 3e4 * torch.sign(torch.randn(W.shape[0]))  # fits float16 unscaled, not scaled 100x
    x_mean = X.abs().mean(0)
    x_mean[0] = 1e4 * x_mean.max()
    s, alpha, errors = search_scale([W], H, x_mean, 64)
    assert errors[-1] == float("inf") and torch.isfinite(torch.tensor(errors[0]))
    assert errors[round(alpha * len(errors))] == min(errors) < float("inf")
    assert torch.isfinite(s).all() and (W * s).abs().max() < 57_000
    with pytest.raises(ScaleOverflowError, match="beyond float16's range"):
        search_scale([W * 10], H, x_mean, 64)


def test_scale_search_protects_salient_channels():
    X, W, H = salient_problem()
    s, alpha, errors = search_scale([W], H, X.abs().mean(0), 64)
    assert len(errors) == 20 and alpha > 0 and min(errors) == errors[int(round(alpha * 20))]
    # alpha = 0 is plain RTN (min-max): the search can only do better on its objective
    rtn = dense(rtn_quantize(W, 64, clip_search=False))
    assert errors[0] == pytest.approx(((W - rtn) @ H * (W - rtn)).sum().item(), rel=1e-4)
    scaled = dense(rtn_quantize(W * s, 64, clip_search=False)) / s
    assert output_error(X, W, scaled) < 0.7 * output_error(X, W, rtn)


def test_a_channel_calibration_never_saw_gets_the_floor_scale_not_zero():
    """mean |x| = 0 (an input never active) made s = 0^alpha = 0 for every alpha > 0 without AutoAWQ's clamp to 1e-4:
    w * 0 / 0 is NaN, so every alpha but 0 scored NaN and the search fell back to plain RTN without a word."""
    X, W, H = salient_problem(K=128, N=32)
    X[:, 0] = 0
    s, alpha, errors = search_scale([W], X.t() @ X / X.shape[0], X.abs().mean(0), 32)
    assert alpha > 0 and all(map(math.isfinite, errors))
    assert torch.isfinite(s).all() and (s > 0).all()


def test_activation_aware_clip_with_identity_hessian_is_rtns_clip_search():
    W = torch.randn(32, 128) * 0.05
    a = clip_quantize(W, torch.eye(128), 32)
    b = rtn_quantize(W, 32, clip_search=True)  # same grid, plain squared weight error
    for name in ("qweight", "scales", "zeros"):
        assert torch.equal(getattr(a, name), getattr(b, name))


def test_activation_aware_clip_beats_weight_space_clip_on_the_output():
    X, W, H = salient_problem(seed=1)
    aware = output_error(X, W, dense(clip_quantize(W, H, 32)))
    plain = output_error(X, W, dense(rtn_quantize(W, 32, clip_search=True)))
    assert aware < 0.6 * plain  # 0.38 here; equal would be the weight-space search itself


@pytest.mark.parametrize("arch,kv_heads", [("llama", 2), ("llama", 4), ("qwen2", 2), ("qwen2", 4)])
def test_folding_keeps_the_float_model_function(arch, kv_heads):
    # kv_heads == heads: v_proj and o_proj are square-compatible, so o_proj's scales fold into v_proj too, and
    # into Qwen2's v_proj bias (HF starts biases at 0, which hid a bias left unscaled: drawn at random here)
    model = tiny_model(arch, num_key_value_heads=kv_heads)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    ids = torch.randint(0, 256, (4, 16))
    with torch.no_grad():
        ref = model(ids).logits
    norm_before = model.model.layers[0].input_layernorm.weight.clone()
    v_before = model.model.layers[0].self_attn.v_proj.weight.clone()
    out = awq_quantize_model(model, QuantConfig(group_size=32, method="awq"), ids, progress=False)
    assert len(out) == 14
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, ref, rtol=1e-4, atol=1e-4)
    assert not torch.equal(model.model.layers[0].input_layernorm.weight, norm_before)
    # v_proj's columns carry the q/k/v input scale; its rows carry o_proj's only when that one folds
    ratio = model.model.layers[0].self_attn.v_proj.weight / v_before
    same_for_every_row = torch.allclose(ratio, ratio[:1].expand_as(ratio), rtol=1e-4)
    assert same_for_every_row == (kv_heads != 4)


def test_the_clip_search_scores_each_layer_on_its_scaled_inputs_and_never_clips_q_or_k(monkeypatch):
    """A scaled linear's weight is W * s and its input x / s in the folded model: the clip search must weigh the
    output error by that input's X^T X / n, not the unscaled one's. q/k_proj are left unclipped (AutoAWQ's choice:
    their error goes through the softmax, which the linear-output objective does not see). Only errors were
    compared before, and both slipped past them."""
    import nibble.quantize.awq as awq

    model = tiny_model("llama", num_key_value_heads=4)  # MHA: every fold AWQ makes, v_proj -> o_proj too
    names = {id(p): name.removesuffix(".weight") for name, p in model.named_parameters()}
    hessians = {}

    def recording_clip_quantize(weight, H, *args, **kwargs):
        hessians[names[id(weight)]] = H.clone()
        return clip_quantize(weight, H, *args, **kwargs)
    monkeypatch.setattr(awq, "clip_quantize", recording_clip_quantize)
    ids = torch.randint(0, 256, (8, 32))
    awq_quantize_model(model, QuantConfig(group_size=32, method="awq"), ids, progress=False)
    linears = {name: m for name, m in model.model.layers.named_modules(prefix="model.layers")
               if isinstance(m, torch.nn.Linear)}
    assert sorted(hessians) == sorted(n for n in linears if not n.endswith(("q_proj", "k_proj")))
    # the folded float model computes the function it computed before: its linears' inputs are the scaled ones
    xtx = {}

    def record(name):
        def hook(module, args):
            x = args[0].reshape(-1, args[0].shape[-1])
            xtx[name] = x.t() @ x / x.shape[0]
        return hook
    for name in hessians:
        linears[name].register_forward_pre_hook(record(name))
    with torch.no_grad():
        model(ids)
    for name, H in hessians.items():
        torch.testing.assert_close(H, xtx[name], rtol=1e-4, atol=1e-5 * xtx[name].abs().max().item(),
                                   msg=lambda m: f"{name}: {m}")


def test_awq_through_quantize_model_matches_its_returned_weights():
    import copy

    model = tiny_model("llama")
    ids = torch.randint(0, 256, (4, 16))
    with torch.no_grad():
        ref = model(ids).logits
    twin = copy.deepcopy(model)
    config = QuantConfig(group_size=32, method="awq")
    want = awq_quantize_model(twin, config, ids, progress=False)
    quantize_model(model, config, progress=False, calibration=ids)
    q = model.model.layers[1].mlp.down_proj
    assert q.group_size == 32 and q.qweight.shape == (192 // 8, 64)
    # every layer holds AWQ's own weights (not another method's), the norms its folded scales
    layers = dict(model.named_modules())
    assert len(want) == 14
    for name, w in want.items():
        for part in ("qweight", "scales", "zeros"):
            assert torch.equal(getattr(layers[name], part), getattr(w, part)), (name, part)
    folded = twin.model.layers[0].input_layernorm.weight
    assert torch.equal(model.model.layers[0].input_layernorm.weight, folded)
    with torch.no_grad():
        out = model(ids).logits
    cos = torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0)
    assert cos > 0.99


@pytest.mark.parametrize("kwargs, message", [(dict(n_grid=0), "n_grid must be an integer >= 1, got 0"),  # raise None
                                             (dict(n_grid=-2), "n_grid must be an integer >= 1, got -2"),
                                             (dict(batch_size=0), "batch_size must be an integer >= 1, got 0")])
def test_awq_options_out_of_range_are_refused_by_name(kwargs, message):
    model = tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):
        awq_quantize_model(model, QuantConfig(group_size=32, method="awq"), torch.randint(0, 256, (2, 8)),
                           progress=False, **kwargs)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    if "n_grid" in kwargs:
        X, W, H = salient_problem(K=64, N=16, T=256)
        with pytest.raises(ValueError, match=message):
            search_scale([W], H, X.abs().mean(0), 32, **kwargs)


def test_scale_search_says_what_is_not_finite_and_never_raises_none():
    """A NaN weight was blamed on its size ('weights up to |w| = nan need a scale'); non-finite statistics made every
    candidate's error NaN, so that no overflow was caught and `raise overflow` raised None (a TypeError)."""
    X, W, H = salient_problem(K=64, N=16, T=256)
    x_mean = X.abs().mean(0)
    bad = W.clone()
    bad[2, 3] = float("nan")
    with pytest.raises(ValueError, match="^weight contains NaN or Inf"):
        search_scale([bad], H, x_mean, 32)
    for h, m in ((H.clone().fill_diagonal_(float("inf")), x_mean), (H, x_mean.clone().fill_(float("inf")))):
        with pytest.raises(ValueError, match="^the statistics of its calibration inputs are not finite"):
            search_scale([W], h, m, 32)
    with pytest.raises(ValueError, match="^no scale gives a finite output error"):  # finite, but past float32
        search_scale([W * 1000], H / H.abs().max() * 1e38, x_mean, 32)
    with pytest.raises(ValueError, match="^the statistics of its calibration inputs are not finite"):
        clip_quantize(W, H.clone().fill_diagonal_(float("nan")), 32)


def test_the_scale_grid_is_alpha_r_over_n_grid_never_reaching_1():
    """errors[r] is the output error at alpha = r / n_grid, r < n_grid, as AutoAWQ's grid (alpha = 1 is never tried):
    the alpha returned is that of the smallest error, on that grid."""
    X, W, H = salient_problem(K=128, N=32, seed=2)
    for n_grid in (4, 20):
        s, alpha, errors = search_scale([W], H, X.abs().mean(0), 32, n_grid=n_grid)
        r = errors.index(min(errors))
        assert len(errors) == n_grid and r > 0 and alpha == r / n_grid
        want = X.abs().mean(0).pow(alpha)
        torch.testing.assert_close(s, want / (want.max() * want.min()).sqrt())


def test_awq_model_refuses_n_grid_before_running_the_model():
    """n_grid is refused as the call starts, without a layer's name: not once the calibration ran up to the first
    scale search (the model left as it was only because that search comes before any folding)."""
    model = tiny_model("llama")
    calls = []
    model.model.embed_tokens.register_forward_hook(lambda *args: calls.append(1))
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(17))
    with pytest.raises(ValueError, match="^n_grid must be an integer >= 1, got 0$"):
        awq_quantize_model(model, QuantConfig(group_size=32, method="awq"), ids, progress=False, n_grid=0)
    assert calls == []
