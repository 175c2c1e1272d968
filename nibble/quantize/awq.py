"""AWQ: activation-aware weight quantization (Lin et al., 2023), folded into the model.

A few input channels of each linear carry much larger activations than the rest; their weights
matter more. AWQ scales those weight columns up by s (so they get finer quantization steps) and
the input down by s, which is free when the division folds into the op that produces the input:

    input_layernorm.weight  /= s   for q/k/v_proj        (weights *= s per input channel)
    v_proj rows             /= s   for o_proj            (only when v_proj and o_proj are square-
                                                          compatible, i.e. no grouped-query attention)
    post_attention_layernorm /= s  for gate/up_proj
    up_proj rows            /= s   for down_proj

s = mean|x|^alpha (normalised by sqrt(max * min)), alpha from a grid of 20 points in [0, 1); alpha = 0
is plain RTN, so the search never does worse than RTN on its own objective. Then a clipping
search picks, per group, the range shrink ratio that minimises the *output* error.

Objective: nibble measures both searches on the linear outputs over all calibration tokens,
||X W^T - X Q(W)^T||^2 = sum_n dW_n H dW_n^T with H = X^T X, computed from the K x K input Gram
matrix collected block by block (no activations are stored, and no extra forward pass per grid
point). AutoAWQ measures the q/k/v and gate/up scale searches on the whole attention / MLP output
instead; the linear-output proxy is what it uses for o_proj and down_proj.
"""
from __future__ import annotations

import torch
from torch import nn

from nibble.config import check_count
from nibble.formats.int4 import Int4Weight
from nibble.quantize.calibration import check_statistics, forward_block, quantize_blocks
from nibble.quantize.rtn import (ScaleOverflowError, check_weight, naming, quantize_groups, rtn_quantize,
                                 weighted_clip_search)

N_GRID = 20
# AutoAWQ leaves q/k unclipped: their errors go through the softmax, which the linear-output
# objective does not see.
NO_CLIP = ("q_proj", "k_proj")


def _fake_quant(w: torch.Tensor, G: int, symmetric: bool, zero_point: str) -> torch.Tensor:
    codes, s, z = quantize_groups(w.reshape(-1, G), symmetric, zero_point, clip_search=False)
    return (codes * s + z).reshape(w.shape)


def _output_error(dw: torch.Tensor, H: torch.Tensor) -> torch.Tensor:
    """sum_n dw_n H dw_n^T: squared linear-output error over the calibration tokens (H = X^T X / n)."""
    return ((dw @ H) * dw).sum()


@torch.no_grad()
def search_scale(weights: list, H: torch.Tensor, x_mean: torch.Tensor, group_size: int, symmetric: bool = False,
                 zero_point: str = "int", n_grid: int = N_GRID):
    """Best per-input-channel scale s [K] for linears sharing one input (weights [N_j, K]).

    Returns ``(s, alpha, errors)``; ``errors[r]`` is the output error at alpha = r / n_grid.
    """
    check_count("n_grid", n_grid)
    K = H.shape[0]
    G = K if group_size == -1 else group_size
    for w in weights:  # a NaN weight made every candidate's scale NaN, and the refusal blamed its size
        check_weight(w, G)
    check_statistics(H, x_mean)
    x_mean = x_mean.float()
    errors, best, overflow = [], (float("inf"), None, None), None
    for r in range(n_grid):
        alpha = r / n_grid
        s = x_mean.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        try:
            err = sum(float(_output_error(w.float() - _fake_quant(w.float() * s, G, symmetric, zero_point) / s, H))
                      for w in weights)
        except ScaleOverflowError as e:  # this alpha scales some weights past float16: a candidate the layer cannot store
            err, overflow = float("inf"), e
        errors.append(err)
        if err < best[0]:
            best = (err, s, alpha)
    if best[1] is None:
        raise overflow or ValueError("no scale gives a finite output error: the calibration inputs are so large that "
                                     "the error of each candidate overflows float32")
    return best[1], best[2], errors


@torch.no_grad()
def clip_quantize(weight: torch.Tensor, H: torch.Tensor, group_size: int, symmetric: bool = False,
                  zero_point: str = "int", grid: int = N_GRID, min_shrink: float = 0.5) -> Int4Weight:
    """RTN with an activation-aware clipping search: per group, the range shrink ratio (1 down to
    ``min_shrink``, ``grid`` steps, as rtn's search) with the smallest output error dW H_gg dW^T."""
    N, K = weight.shape
    G = K if group_size == -1 else group_size
    check_weight(weight, G)
    check_statistics(H)
    ng = K // G
    w = weight.float().reshape(N * ng, G)  # row n * ng + g: group g of output n (rtn's order)
    Hb = torch.stack([H[g * G:(g + 1) * G, g * G:(g + 1) * G] for g in range(ng)]).float()  # [ng, G, G]

    def error(dw):
        dw = dw.reshape(N, ng, G).transpose(0, 1)  # [ng, N, G]
        return ((dw @ Hb) * dw).sum(-1).transpose(0, 1).reshape(N * ng, 1)

    codes, s, z = weighted_clip_search(w, error, symmetric, zero_point, grid, min_shrink)
    return Int4Weight.from_codes(codes.to(torch.uint8).reshape(N, K), s.reshape(N, ng), z.reshape(N, ng), G)


def _scale_groups(block: nn.Module, linears: dict) -> list:
    """(previous op name, [linear names]) pairs whose scales fold exactly into the previous op."""
    def has(*names):
        return all(n in linears for n in names)

    groups = []
    if has("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj") and hasattr(block, "input_layernorm"):
        groups.append(("input_layernorm", ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"]))
    if has("self_attn.v_proj", "self_attn.o_proj") and \
            linears["self_attn.v_proj"].weight.shape == linears["self_attn.o_proj"].weight.shape:
        groups.append(("self_attn.v_proj", ["self_attn.o_proj"]))
    if has("mlp.gate_proj", "mlp.up_proj") and hasattr(block, "post_attention_layernorm"):
        groups.append(("post_attention_layernorm", ["mlp.gate_proj", "mlp.up_proj"]))
    if has("mlp.up_proj", "mlp.down_proj"):
        groups.append(("mlp.up_proj", ["mlp.down_proj"]))
    return groups


@torch.no_grad()
def _fold(prev: nn.Module, s: torch.Tensor) -> None:
    """Divide the output channels of ``prev`` (a norm's weight, or a linear's rows) by s."""
    if isinstance(prev, nn.Linear):
        prev.weight.div_(s.to(prev.weight.dtype).unsqueeze(1))
    else:
        prev.weight.div_(s.to(prev.weight.dtype))
    if getattr(prev, "bias", None) is not None:
        prev.bias.div_(s.to(prev.bias.dtype))


@torch.no_grad()
def awq_quantize_model(model: nn.Module, config, calib, *, batch_size: int = 8, n_grid: int = N_GRID,
                       clip: bool = True, progress: bool = True, onload=None) -> dict[str, Int4Weight]:
    """AWQ every nn.Linear of the decoder blocks; returns ``{"model.layers.{i}.{name}": Int4Weight}``.

    ``config`` is a QuantConfig (group_size, symmetric, zero_point). ``calib``: token ids,
    LongTensor [n_samples, seq_len], checked as in ``gptq_quantize_model``. ``config.clip_search`` (rtn's
    weight-space search, None unless lm_head is RTN's) is not used: AWQ's own activation-aware clipping search is
    part of the method (``clip=False`` turns it off; q/k_proj are never clipped, as in AutoAWQ).

    Side effect, by design: the scales are folded into the model in place (norm weights, v_proj and
    up_proj rows divided by s; the float weights of the scaled linears multiplied by s). The model
    computes the same function as before in float, and the returned weights are the quantized
    *scaled* weights: they are only valid for this modified model. Statistics are collected on the
    float model, one block at a time (block i+1 sees the float outputs of block i, as in AutoAWQ).
    ``onload``: how each block is reached, as in ``gptq_quantize_model``.
    """
    check_count("n_grid", n_grid)  # before the calibration runs
    qargs = dict(symmetric=config.symmetric, zero_point=config.zero_point)

    def quantize_block(prefix, block, linears, groups, inputs, kwargs, block_results):
        outputs, stats = forward_block(block, inputs, kwargs, {g[0]: linears[g[0]] for g in groups})
        stats = {name: stats[g[0]] for g in groups for name in g}  # one set of statistics per shared input
        input_scale = {}
        for prev_name, names in _scale_groups(block, linears):
            st = stats[names[0]]
            H = st.hessian / 2  # X^T X / n
            with naming(", ".join(f"{prefix}.{n}" for n in names)):
                s, _, _ = search_scale([linears[n].weight for n in names], H, st.mean_abs, config.group_size,
                                       n_grid=n_grid, **qargs)
            _fold(block.get_submodule(prev_name), s)
            for n in names:
                linears[n].weight.mul_(s.to(linears[n].weight.dtype))
                input_scale[n] = s
        for name, layer in linears.items():
            H = stats[name].hessian / 2
            if name in input_scale:
                s = input_scale[name]
                H = H / (s.unsqueeze(0) * s.unsqueeze(1))
            with naming(f"{prefix}.{name}"):
                if clip and not name.endswith(NO_CLIP):
                    w = clip_quantize(layer.weight, H, config.group_size, **qargs)
                else:
                    w = rtn_quantize(layer.weight.detach(), config.group_size, clip_search=False, **qargs)
            block_results[f"{prefix}.{name}"] = w
        return outputs  # the float block's, taken before its scales were searched

    return quantize_blocks(model, config, calib, quantize_block, "AWQ", batch_size=batch_size, progress=progress,
                           onload=onload)
