import dataclasses
import functools
import re

import pytest
import torch

from conftest import tiny_model
from torch import nn
from nibble import QuantConfig, QuantLinear, quantize_model
from nibble.formats.gptq import to_gptq
from nibble.kernels.reference import dequantize
from nibble.quantize import calibrated_quantizers
from nibble.quantize.gptq import gptq_quantize_model, gptq_quantize_weight
from nibble.quantize.rtn import quantize_groups, round_to_codes, rtn_quantize, weighted_clip_search


def dense(w):
    return dequantize(w.qweight, w.scales, w.zeros, w.group_size)


def correlated_problem(K=256, N=64, T=2048, seed=0):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(T, K, generator=g) @ (torch.randn(K, K, generator=g) / K ** 0.5)
    X = X * (torch.rand(K, generator=g) * 3 + 0.1)  # uneven channel energies, like real activations
    W = torch.randn(N, K, generator=g) * 0.02
    return X, W, 2 * X.t() @ X / T


def output_error(X, W, Wq, perm=None):
    Xq = X if perm is None else X[:, perm]
    return ((Xq @ Wq.t() - X @ W.t()) ** 2).mean().item()


@pytest.mark.parametrize("G", [32, 64, -1])
@pytest.mark.parametrize("act_order,static", [(False, False), (True, True), (True, False)])
def test_gptq_lowers_the_output_error_of_rtn(G, act_order, static):
    X, W, H = correlated_problem()
    rtn = output_error(X, W, dense(rtn_quantize(W, G, clip_search=False)))
    res = gptq_quantize_weight(W, H, G, act_order=act_order, static_groups=static)
    err = output_error(X, W, dense(res.weight), res.perm)
    assert err < 0.8 * rtn
    assert (res.perm is not None) == (act_order and not static)


@pytest.mark.parametrize("G, symmetric", [(32, False), (-1, True)])
@pytest.mark.parametrize("act_order,static", [(False, False), (True, True), (True, False)])
def test_the_compensated_weights_round_to_the_codes_from_inside_their_bins(G, symmetric, act_order, static):
    X, W, H = correlated_problem()
    res = gptq_quantize_weight(W, H, G, symmetric=symmetric, clip_search=True, act_order=act_order,
                               static_groups=static, keep_compensated=True)
    per_column = G if G > 0 else W.shape[1]
    s, z = (t.float().t().repeat_interleave(per_column, dim=1) for t in (res.weight.scales, res.weight.zeros))
    assert torch.equal(round_to_codes(res.compensated, s, z), res.weight.codes().float())
    offset = (res.compensated - dense(res.weight)) / s  # where in its bin each weight lies, in steps
    assert offset[(offset.abs() < 0.5)].std() > 0.2  # spread over the bins, not at their centres
    assert gptq_quantize_weight(W, H, G, symmetric=symmetric).compensated is None


def textbook_gptq(W, H, G, act_order=False, percdamp=0.01, static_groups=False, clip=False):
    """GPTQ as the paper's Algorithm 1 and IST-DASLab's fasterquant state it, one column at a time with no lazy
    blocks: the dequantized weight [N, K] in processing order, and that order. Each group's (s, z) is RTN's min/max of
    the group's weights as they stand when the sweep reaches its first column (after the updates of the columns before
    it); ``static_groups``: of the group's original inputs g*G .. (g+1)*G - 1, all fixed before the sweep; ``clip``: by
    the clipping search scored by GPTQ's loss of each column j, (w_j - q_j)^2 / [H_F^-1]_jj with F the columns not yet
    quantized, [H_F^-1]_jj read off the inverse of the trailing block H[j:, j:] itself (not the Cholesky factor)."""
    W, H = W.clone().float(), H.clone().float()
    K = W.shape[1]
    dead = H.diag() == 0  # inputs never active: H_jj = 1, their weights 0
    H[dead, dead] = 1
    W[:, dead] = 0
    order = torch.argsort(H.diag(), descending=True) if act_order else torch.arange(K)
    W, H = W[:, order], H[order][:, order]
    H += percdamp * H.diag().mean() * torch.eye(K)
    U = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)  # H^-1 = U^T U
    loss_weight = torch.stack([1 / torch.linalg.inv(H[j:, j:].double())[0, 0] for j in range(K)]).float()

    def group(columns):
        if clip:
            loss = lambda dw: (dw ** 2 * loss_weight[columns]).sum(1, keepdim=True)  # noqa: E731
            _, s, z = weighted_clip_search(W[:, columns], loss)
        else:
            _, s, z = quantize_groups(W[:, columns], clip_search=False)
        return s[:, 0], z[:, 0]

    if static_groups:
        swept_at = torch.argsort(order)  # where the sweep meets each original input
        fixed = [group(swept_at[g * G:(g + 1) * G]) for g in range(K // G)]
    Q = torch.zeros_like(W)
    for j in range(K):
        if static_groups:
            s, z = fixed[int(order[j]) // G]
        elif j % G == 0:
            s, z = group(torch.arange(j, j + G))
        Q[:, j] = round_to_codes(W[:, j], s, z) * s + z
        err = (W[:, j] - Q[:, j]) / U[j, j]
        W[:, j:].addr_(err, U[j, j:], alpha=-1)  # spread the error over the columns not yet quantized
    return Q, order


@pytest.mark.parametrize("G", [32, -1])
@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_is_the_textbook_algorithm(G, act_order):
    """Every step against the reference: damping by mean(diag H), dead inputs, the Cholesky of H^-1, the error
    feedback, the group ranges taken as the sweep reaches them, act-order. The other GPTQ tests only compare errors,
    which a damping of max(diag H) or a dead input's weights kept left below their bounds."""
    _, W, H = correlated_problem(K=64, N=16)
    H[5, :], H[:, 5] = 0, 0  # input 5 never active in calibration
    res = gptq_quantize_weight(W, H, G, act_order=act_order)  # K <= blocksize: one block, the same sums
    Q, order = textbook_gptq(W, H, W.shape[1] if G == -1 else G, act_order)
    assert torch.equal(dense(res.weight), Q)
    assert torch.equal(res.perm, order) if act_order else res.perm is None


@pytest.mark.parametrize("act_order", [False, True])
def test_the_gptq_weighted_clipping_is_the_textbook_loss_of_each_column(act_order):
    """The clip objective weighs column j by 1 / [H_F^-1]_jj: a weight of U_jj^-1 for U_jj^-2 passed every test that
    compared errors."""
    _, W, H = correlated_problem(K=64, N=16)
    res = gptq_quantize_weight(W, H, 32, clip_search=True, act_order=act_order)
    Q, order = textbook_gptq(W, H, 32, act_order, clip=True)
    assert torch.equal(dense(res.weight), Q)
    assert torch.equal(res.perm, order) if act_order else res.perm is None


@pytest.mark.parametrize("clip", [False, True])
def test_static_groups_are_fixed_on_the_original_order_and_swept_in_act_order(clip):
    """gptq_quantize_model's default: each group's range from its original inputs, fixed before the sweep, and the
    clipping search weighing each of them by its own column's loss: with the column weights left in processing order
    (the groups' inputs permuted, their weights not) every other test still passed."""
    _, W, H = correlated_problem(K=64, N=16)
    H[5, :], H[:, 5] = 0, 0
    res = gptq_quantize_weight(W, H, 16, clip_search=clip, act_order=True, static_groups=True)
    Q, order = textbook_gptq(W, H, 16, act_order=True, static_groups=True, clip=clip)
    assert res.perm is None and torch.equal(res.g_idx, (torch.arange(64) // 16).to(torch.int32))
    assert torch.equal(dense(res.weight)[:, order], Q)


def test_with_uncorrelated_inputs_gptq_is_rtn():
    # H = I: no column can compensate another, so GPTQ must reduce to plain round-to-nearest
    W = torch.randn(48, 128) * 0.05
    res = gptq_quantize_weight(W, torch.eye(128) * 2, 32)
    ref = rtn_quantize(W, 32, clip_search=False)
    for name in ("qweight", "scales", "zeros"):
        assert torch.equal(getattr(res.weight, name), getattr(ref, name))


@pytest.mark.parametrize("objective", ["gptq", "weight"])
def test_with_uncorrelated_inputs_the_clip_search_is_rtns(objective):
    # equal column weights: the GPTQ-weighted clip objective ranks ratios like rtn's plain squared error
    W = torch.randn(48, 128) * 0.05
    res = gptq_quantize_weight(W, torch.eye(128) * 2, 32, clip_search=True, clip_objective=objective)
    ref = rtn_quantize(W, 32, clip_search=True)
    for name in ("qweight", "scales", "zeros"):
        assert torch.equal(getattr(res.weight, name), getattr(ref, name))


def test_gptq_weighted_clip_protects_columns_with_large_activations():
    X, W, H = correlated_problem(K=128, N=32, seed=4)
    X[:, 7] *= 30  # one massive input channel, as in SmolLM2's middle layers
    H = 2 * X.t() @ X / X.shape[0]
    errs = {obj: output_error(X, W, dense(gptq_quantize_weight(W, H, 64, clip_search=True, clip_objective=obj).weight))
            for obj in ("gptq", "weight")}
    assert errs["gptq"] < errs["weight"]


@pytest.mark.parametrize("act_order", [False, True])
def test_linears_sharing_an_input_can_be_quantized_stacked(act_order):
    # GPTQ is row-independent given H: the model quantizes q/k/v (gate/up) as one stacked weight
    X, W, H = correlated_problem(K=128, N=48)
    kw = dict(clip_search=True, act_order=act_order, static_groups=act_order)
    whole = gptq_quantize_weight(W, H, 32, **kw).weight
    for rows in (slice(0, 16), slice(16, 48)):
        part = gptq_quantize_weight(W[rows], H, 32, **kw).weight
        torch.testing.assert_close(dense(whole)[rows], dense(part), atol=1e-6, rtol=0)


@pytest.mark.parametrize("G,blocksize", [(32, 64), (48, 32), (96, 64), (-1, 32)])
def test_lazy_block_updates_equal_the_column_by_column_sweep(G, blocksize):
    # G=48 with blocks of 32: groups straddle blocks and must see the pending in-block updates
    X, W, H = correlated_problem(K=192, N=32)
    a = gptq_quantize_weight(W, H, G, blocksize=blocksize)
    b = gptq_quantize_weight(W, H, G, blocksize=192)  # one block: no lazy update at all
    same = (a.weight.codes() == b.weight.codes()).float().mean()
    assert same > 0.995  # float summation order may flip a rare rounding tie
    torch.testing.assert_close(dense(a.weight), dense(b.weight), atol=0.02 * W.abs().max().item(), rtol=0)


def test_act_order_g_idx_matches_the_gptq_checkpoint_convention():
    X, W, H = correlated_problem(K=128, N=16)
    res = gptq_quantize_weight(W, H, 32, act_order=True)
    assert res.perm is not None
    assert torch.equal(to_gptq(res.weight, res.perm)["g_idx"], res.g_idx)
    assert torch.equal(res.perm, torch.argsort(torch.diag(H), descending=True))


def test_dead_inputs_and_bad_hessians():
    X, W, H = correlated_problem(K=64, N=8)
    H[5, :], H[:, 5] = 0, 0  # input 5 never active in calibration
    res = gptq_quantize_weight(W, H, 32)
    s, z = (t.float()[0] for t in (res.weight.scales, res.weight.zeros))  # group 0's, which holds input 5
    zeroed = round_to_codes(torch.zeros(8), s, z) * s + z  # the level nearest 0
    assert torch.equal(dense(res.weight)[:, 5], zeroed)
    with pytest.raises(ValueError, match=r"Hessian must be \[64, 64\]"):
        gptq_quantize_weight(W, H[:32, :32], 32)


def correlated_tiny_model():
    """Tiny random Llama with low-rank token embeddings, so block inputs are correlated as in real
    models (with i.i.d. random embeddings every Hessian is ~isotropic and GPTQ has nothing to use)."""
    torch.manual_seed(0)
    model = tiny_model("llama")
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        e = torch.randn(256, 8, generator=g) @ torch.randn(8, 64, generator=g) / 8 ** 0.5
        model.model.embed_tokens.weight.copy_(e + 0.05 * torch.randn(256, 64, generator=g))
    return model


@pytest.mark.parametrize("act_order", [False, True])
def test_calibrated_methods_beat_rtn_on_the_calibration_data(act_order, monkeypatch):
    monkeypatch.setitem(calibrated_quantizers, "gptq", functools.partial(gptq_quantize_model, act_order=act_order))
    ids = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        ref = correlated_tiny_model()(ids).logits
    errors = {}
    for method in ("rtn", "gptq", "awq"):
        model = correlated_tiny_model()
        quantize_model(model, QuantConfig(group_size=32, method=method), progress=False,
                       calibration=None if method == "rtn" else ids)  # RTN refuses calibration
        with torch.no_grad():
            errors[method] = ((model(ids).logits - ref) ** 2).mean().item()
    assert errors["gptq"] < 0.2 * errors["rtn"]
    assert errors["awq"] < 0.6 * errors["rtn"]


def test_gptq_model_returns_every_decoder_linear_and_respects_skips():
    model = tiny_model("qwen2")
    cfg = QuantConfig(group_size=32, method="gptq", modules_to_not_convert=["lm_head", "mlp.down_proj"])
    out = gptq_quantize_model(model, cfg, torch.randint(0, 256, (4, 16)), progress=False)
    assert len(out) == 2 * 6 and not any(k.endswith("down_proj") for k in out)
    w = out["model.layers.1.self_attn.k_proj"]
    assert (w.in_features, w.out_features, w.group_size) == (64, 32, 32)
    # side effect: the float weight now holds the dequantized value
    torch.testing.assert_close(model.model.layers[1].self_attn.k_proj.weight, dense(w))
    compensated = {}
    again = gptq_quantize_model(tiny_model("qwen2"), cfg, torch.randint(0, 256, (4, 16)), progress=False,
                                compensated=compensated)
    assert compensated.keys() == again.keys()
    assert all(compensated[k].shape == (again[k].out_features, again[k].in_features) for k in again)


def test_gptq_model_defaults_to_act_order_and_clipping():
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(3))

    def run(**kw):
        torch.manual_seed(0)
        cfg = QuantConfig(group_size=32, method="gptq")
        return gptq_quantize_model(tiny_model("llama"), cfg, ids, progress=False, **kw)["model.layers.1.mlp.down_proj"]

    default = dense(run())
    assert torch.equal(default, dense(run(act_order=True, clip=True)))
    assert not torch.equal(default, dense(run(act_order=False)))
    assert not torch.equal(default, dense(run(clip=False)))


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_calibrated_model_quantizes_lm_head_with_rtn(method):
    """Calibration covers the decoder layers; an lm_head left out of modules_to_not_convert is RTN."""
    model = tiny_model("llama")
    head = model.lm_head.weight.detach().clone()
    cfg = QuantConfig(group_size=32, method=method, modules_to_not_convert=[])
    quantize_model(model, cfg, progress=False, calibration=torch.randint(0, 256, (4, 16)))
    assert isinstance(model.lm_head, QuantLinear)
    torch.testing.assert_close(dense(model.lm_head.weight_int4()), dense(rtn_quantize(head, 32, clip_search=False)),
                               rtol=0, atol=0)


@pytest.mark.parametrize("method", ["gptq", "awq"])
@pytest.mark.parametrize("clip_search", [True, False])
def test_rtns_clip_search_is_refused_where_no_layer_is_rtns_and_recorded_as_unset(method, clip_search):
    """clip_search=True and False gave GPTQ and AWQ bit-identical weights (each runs its own clipping search), and the
    checkpoint recorded the one given as applied; it is RTN's, for an lm_head quantized by RTN alone."""
    with pytest.raises(ValueError, match=rf"clip_search={clip_search} is RTN's clipping search, and RTN quantizes "
                                         rf"no layer of this config: method='{method}' runs its own"):
        QuantConfig(group_size=32, method=method, clip_search=clip_search)
    with pytest.raises(ValueError, match="give clip_search=None"):  # a copy of an RTN config holds RTN's value
        dataclasses.replace(QuantConfig(group_size=32, clip_search=clip_search), method=method)
    head_by_rtn = QuantConfig(group_size=32, method=method, modules_to_not_convert=[], clip_search=clip_search)
    assert head_by_rtn.clip_search is clip_search
    model = tiny_model("llama")
    quantize_model(model, QuantConfig(group_size=32, method=method), progress=False,
                   calibration=torch.randint(0, 256, (4, 16)))
    assert model.config.quantization_config["clip_search"] is None
    with pytest.raises(ValueError, match="from_linear quantizes by RTN, and this config of method"):
        QuantLinear.from_linear(nn.Linear(64, 16), QuantConfig(group_size=32, method=method))
    # saved before the refusal, with the value given: loads, the value dropped
    saved = {**QuantConfig(group_size=32, method=method).to_dict(), "clip_search": clip_search}
    assert QuantConfig.from_dict(saved) == QuantConfig(group_size=32, method=method)


@pytest.mark.parametrize("rotation", ["none", "hadamard"])
def test_w4a4_gptq_beats_rtn_on_the_calibration_data(rotation):
    """W4A4 weights by GPTQ (QuaRot's pairing with the rotation): per-channel symmetric, calibrated on
    16-bit activations; the model still quantizes its activations per token, which GPTQ does not model."""
    calib = torch.randint(0, 256, (32, 32), generator=torch.Generator().manual_seed(2))
    ids = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(9))  # held out
    with torch.no_grad():
        ref = correlated_tiny_model()(ids).logits  # a rotated model computes the same function
    errors = {}
    for method in ("rtn", "gptq"):
        model = correlated_tiny_model()
        quantize_model(model, QuantConfig(mode="w4a4", rotation=rotation, method=method), progress=False,
                       calibration=None if method == "rtn" else calib)
        with torch.no_grad():
            errors[method] = ((model(ids).logits - ref) ** 2).mean().item()
        down = model.model.layers[0].mlp.down_proj
        assert down.mode == "w4a4" and down.input_hadamard == (rotation == "hadamard")
    # measured 0.66x unrotated; rotated 0.56x, and 0.71x when the Hessian is of down_proj's unrotated input
    assert errors["gptq"] < {"none": 0.75, "hadamard": 0.65}[rotation] * errors["rtn"], errors


def test_a_rotated_down_projs_hessian_is_of_the_input_its_weight_multiplies():
    """A HadamardInputLinear (rotated W4A4 down_proj) rotates its input before its weight: GPTQ's
    Hessian must be of that rotated input, not of what the module is called with."""
    from nibble.kernels.hadamard import hadamard_transform_reference
    from nibble.nn.hadamard import HadamardInputLinear
    from nibble.quantize.calibration import forward_block

    g = torch.Generator().manual_seed(4)
    plain = torch.nn.Linear(64, 32)
    rotated = HadamardInputLinear.from_linear(plain)
    block = torch.nn.ModuleDict(dict(plain=plain, rotated=rotated))
    xs = [torch.randn(3, 5, 64, generator=g) * torch.linspace(0.1, 4, 64) for _ in range(2)]

    class Both(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.block = block

        def forward(self, x):
            return self.block["plain"](x) + self.block["rotated"](x)
    _, stats = forward_block(Both(), xs, [{}, {}], {"plain": plain, "rotated": rotated})
    X = torch.cat(xs).reshape(-1, 64)
    torch.testing.assert_close(stats["plain"].hessian, 2 * X.t() @ X / X.shape[0])
    Xr = hadamard_transform_reference(X.double()).float()
    torch.testing.assert_close(stats["rotated"].hessian, 2 * Xr.t() @ Xr / X.shape[0], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_weight_float16_cannot_scale_is_refused_with_its_layers_name(method):
    """RTN's refusal (rtn.ScaleOverflowError) named the layer; the calibrated methods quantize bare (stacked)
    weights and said only the magnitude."""
    from nibble.quantize.rtn import ScaleOverflowError
    model = tiny_model("llama")
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight[3, 5] = 1e6
    cfg = QuantConfig(group_size=32, method=method)
    name = r"^model\.layers\.1\.mlp\.down_proj: "
    with pytest.raises(ScaleOverflowError, match=name + r"weights up to \|w\| = 1(\.\d+)?e\+06"):  # AWQ's: scaled
        quantize_model(model, cfg, progress=False, calibration=torch.randint(0, 256, (4, 16)))


@pytest.mark.parametrize("kwargs, message", [
    (dict(blocksize=-1), "blocksize must be an integer >= 1, got -1"),  # returned a layer of zeros
    (dict(blocksize=0), "blocksize must be an integer >= 1, got 0"),
    (dict(blocksize=64.0), "blocksize must be an integer >= 1, got 64.0"),
    (dict(percdamp=0.0), r"percdamp must be a finite number > 0 \(the damping relative to mean\(diag H\); default "
                         r"0.01\), got 0.0"),
    (dict(percdamp=-0.5), "percdamp must be a finite number > 0"),
    (dict(percdamp=float("nan")), "percdamp must be a finite number > 0")])
def test_gptq_options_out_of_range_are_refused_by_name(kwargs, message):
    _, W, H = correlated_problem(K=64, N=16, T=256)
    with pytest.raises(ValueError, match=message):
        gptq_quantize_weight(W, H, 32, **kwargs)
    model = tiny_model("llama")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=message):  # before the calibration runs
        gptq_quantize_model(model, QuantConfig(group_size=32, method="gptq"), torch.randint(0, 256, (2, 8)),
                            progress=False, **kwargs)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_gptq_batch_size_below_one_is_refused_by_name():
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got 0"):  # was torch's split_size
        gptq_quantize_model(tiny_model("llama"), QuantConfig(group_size=32, method="gptq"),
                            torch.randint(0, 256, (2, 8)), progress=False, batch_size=0)


def test_a_hessian_damping_cannot_fix_is_said_with_the_damping_tried_and_the_layer():
    """It claimed '(1000x the default)' of any percdamp, and as a RuntimeError, which `naming` left unnamed."""
    X = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))  # rank 4: damping alone makes H definite
    with pytest.raises(ValueError, match=r"^GPTQ: the calibration Hessian is not positive definite even with 1e-09 "
                                         r"relative damping \(1000x percdamp=1e-12\); use more"):
        gptq_quantize_weight(torch.randn(16, 64), 2 * X.t() @ X / 4, 32, percdamp=1e-12)
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.self_attn\.q_proj, model\.layers\.0\.self_attn\.k_proj, "
                                         r"model\.layers\.0\.self_attn\.v_proj: GPTQ: the calibration Hessian"):
        gptq_quantize_model(tiny_model("llama"), QuantConfig(group_size=32, method="gptq"),
                            torch.randint(0, 256, (1, 4)), progress=False, percdamp=1e-12)


def test_a_hessian_that_needed_more_damping_is_said_at_the_callers_line():
    """The warning named gptq.py's own line (no stacklevel), not the call that gave the Hessian."""
    H = torch.eye(64)
    H[-1, -1] = -0.05  # below 0 by more than percdamp (0.01 of mean(diag H)) damps, less than 10x that
    with pytest.warns(UserWarning, match=r"^GPTQ: Hessian needed 0.1 relative damping") as record:
        gptq_quantize_weight(torch.randn(16, 64), H, 32)
    assert record[0].filename == __file__


def fp16_model_overflowing_at_down_proj():
    model = tiny_model("llama", dtype=torch.float16)
    with torch.no_grad():
        model.model.layers[0].post_attention_layernorm.weight.mul_(1e4)  # down_proj's input reaches inf
    return model


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_calibration_inputs_a_16_bit_model_overflows_on_are_said_with_the_layer(method):
    """GPTQ blamed the amount of calibration data (its damping), unnamed; AWQ the weights ('weights up to |w| = nan'),
    or raised None."""
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.mlp\.down_proj: the statistics of its calibration "
                                         r"inputs are not finite: .* calibrate it in bfloat16 or float32"):
        quantize_model(fp16_model_overflowing_at_down_proj(), QuantConfig(group_size=32, method=method),
                       progress=False, calibration=torch.randint(0, 256, (2, 16)))
    _, W, H = correlated_problem(K=64, N=16, T=256)
    H[3, 5] = float("inf")
    with pytest.raises(ValueError, match="the statistics of its calibration inputs are not finite"):
        gptq_quantize_weight(W, H, 32)


def test_the_damping_is_tried_up_to_1000x_percdamp_before_it_is_refused():
    """Four tries, x1 to x1000: a Hessian that only 1000x percdamp makes positive definite is quantized, with the
    warning that says so (the refusal claims 1000x was tried)."""
    g = torch.Generator().manual_seed(13)
    H = torch.eye(64)
    H[-1, -1] = -5.0  # mean(diag H) ~0.91: damping 0.009, 0.09, 0.9 leave it negative; 9.1 (1000x 0.01) does not
    W = torch.randn(16, 64, generator=g) * 0.02
    with pytest.warns(UserWarning, match=r"^GPTQ: Hessian needed 10 relative damping"):
        res = gptq_quantize_weight(W, H, 32)
    assert res.weight.codes().shape == (16, 64)


@pytest.mark.parametrize("shape", [(64, 32), (64, 64, 1), (64,)])
def test_a_hessian_of_the_right_height_but_wrong_shape_is_refused_by_its_shape(shape):
    """Only a [K, K] Hessian is one of this weight's inputs: one with K rows but other columns (or dims) got past a
    check of its first dim alone, to fail in torch's indexing or Cholesky."""
    g = torch.Generator().manual_seed(14)
    W = torch.randn(16, 64, generator=g) * 0.02
    H = torch.rand(shape, generator=g) + 0.5
    with pytest.raises(ValueError, match=rf"^Hessian must be \[64, 64\] for a weight with in_features=64, got "
                                         rf"{re.escape(str(tuple(shape)))}$"):
        gptq_quantize_weight(W, H, 32)


def test_gptq_model_refuses_its_options_before_running_the_model():
    """percdamp and blocksize are refused as the call starts, by name and with no layer's: not after the whole
    calibration ran up to the first linear, whose name the refusal then carried."""
    model = tiny_model("llama")
    calls = []
    model.model.embed_tokens.register_forward_hook(lambda *args: calls.append(1))
    ids = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(15))
    for kwargs, message in ((dict(percdamp=0.0), "percdamp must be a finite number > 0"),
                            (dict(blocksize=0), "blocksize must be an integer >= 1, got 0")):
        with pytest.raises(ValueError, match=f"^{message}"):
            gptq_quantize_model(model, QuantConfig(group_size=32, method="gptq"), ids, progress=False, **kwargs)
    assert calls == []


@pytest.mark.parametrize("act_order", [False, True])
def test_each_stacked_linears_compensated_weights_are_its_own_rows(act_order):
    """q/k/v (gate/up) are quantized as one stacked weight: each linear's compensated weights are its rows of the
    stack, which round to its own codes with its own scales (k_proj's were q_proj's first rows, of the right shape)."""
    compensated = {}
    ids = torch.randint(0, 256, (8, 32), generator=torch.Generator().manual_seed(16))
    out = gptq_quantize_model(correlated_tiny_model(), QuantConfig(group_size=32, method="gptq"), ids, progress=False,
                              act_order=act_order, compensated=compensated)
    for name in ("self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj"):
        w, c = out[f"model.layers.0.{name}"], compensated[f"model.layers.0.{name}"]
        s, z = (t.float().t().repeat_interleave(32, dim=1) for t in (w.scales, w.zeros))
        assert torch.equal(round_to_codes(c, s, z), w.codes().float()), name
