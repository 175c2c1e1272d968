"""GPTQ: INT4 weights with Hessian-based error compensation (Frantar et al., 2022).

For a linear y = x W^T with calibration inputs X, GPTQ quantizes W column by column (input feature
by input feature) and, after each column, spreads that column's rounding error over the columns
not yet quantized so the layer output X W^T changes as little as possible. The second-order
information is H = 2/n X^T X (K x K); with the upper Cholesky factor U of H^-1, quantizing column j
with error e = (w_j - q_j) / U[j, j] updates the rest by w_{j:} -= e * U[j, j:].

Details, as in the reference implementation:
- damping: H += percdamp * mean(diag H) * I (percdamp 0.01), retried x10 if Cholesky still fails;
  inputs never active in calibration (diag H = 0) get H_jj = 1 and their weights zeroed;
- lazy block updates: columns are processed in blocks of 128; inside a block the update is
  applied to the block only, the rest of W gets one matrix product per block;
- groups: a group's scale and zero are found when the sweep reaches its first column, from the
  *updated* weights, with rtn's ``quantize_groups`` (min/max);
- act-order (``act_order=True``): columns are processed by decreasing H_jj, the inputs with most
  activation energy first. With ``static_groups=True`` the group parameters are fixed beforehand on
  the original column order, so groups stay contiguous and no input permutation is needed (this
  is what ``gptq_quantize_model`` uses); otherwise groups are formed in processing order and the
  result carries ``perm`` (canonical row j = input feature perm[j]) and the GPTQ ``g_idx``.

Beyond the reference: ``clip_search`` shrinks each group's range by rtn's grid, scoring each ratio by
GPTQ's own objective, sum_j (w_j - q_j)^2 / U_jj^2 (``clip_objective="gptq"``), rather than by the
plain weight error (``"weight"``, rtn's), which would clip the weights of the few inputs with huge
activations as readily as any other. The plain search made RTN worse on SmolLM2; this one is on in
``gptq_quantize_model``.

Why act-order and clipping are on by default in ``gptq_quantize_model``: SmolLM2's down_proj inputs
carry "massive activations" (a few attention-sink tokens with |x| thousands of times the median),
so H is dominated by a handful of columns. Quantized late, their errors are compensated by bending
every other column, which helps those few tokens and hurts all the rest; quantized first, the
other columns absorb their error instead. SmolLM2-135M W4A16 g64, WikiText-2 (docs/RESULTS.md, PTQ table):
reference GPTQ was worse than RTN (28.17 vs 27.57, 32 x 512 calibration tokens) and act-order brought
it to 25.14; with the CLI's 128 x 512 tokens act-order gives 24.81, and with the GPTQ-weighted
clipping 23.86 (16-bit: 20.97).
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch
from torch import nn

from nibble.config import check_count
from nibble.formats.int4 import Int4Weight
from nibble.kernels.reference import dequantize
from nibble.quantize.calibration import check_statistics, forward_block, quantize_blocks
from nibble.quantize.rtn import check_weight, naming, quantize_groups, round_to_codes, weighted_clip_search
from nibble.warn import warn

DEFAULT_PERCDAMP = 0.01
DEFAULT_BLOCKSIZE = 128


@dataclass
class GPTQResult:
    weight: Int4Weight           # canonical; rows in permuted input order when ``perm`` is not None
    perm: torch.Tensor | None    # the layer computes x[..., perm] @ W.T; None: natural order
    g_idx: torch.Tensor          # GPTQ-checkpoint g_idx (int32 [K]) over the original input order
    # With keep_compensated: each column as GPTQ rounded it, after the error feedback of the columns before
    # it (float32 [N, K], the codes' order); rtn's round_to_codes of it with the result's scales are the codes.
    compensated: torch.Tensor | None = None


def _check_options(percdamp: float, blocksize: int) -> None:
    check_count("blocksize", blocksize)
    # 0 retried "x10" from 0; a negative or NaN damping reached the Cholesky
    if not (isinstance(percdamp, numbers.Real) and 0 < percdamp < math.inf):
        raise ValueError(f"percdamp must be a finite number > 0 (the damping relative to mean(diag H); default "
                         f"{DEFAULT_PERCDAMP}), got {percdamp!r}")


def _inverse_cholesky(H: torch.Tensor, percdamp: float) -> torch.Tensor:
    """Upper Cholesky factor of (H + damp I)^-1; damping grows x10 (up to 4 tries) if H is not PD."""
    damp = percdamp * torch.diag(H).mean()
    idx = torch.arange(H.shape[0], device=H.device)
    for attempt in range(4):
        Hd = H.clone()
        Hd[idx, idx] += damp
        L, info = torch.linalg.cholesky_ex(Hd)
        if info == 0:
            Hinv = torch.cholesky_inverse(L)
            U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
            if info == 0:
                if attempt:
                    warn(f"GPTQ: Hessian needed {percdamp * 10 ** attempt:g} relative damping to be positive "
                         "definite (more calibration data would help)")
                return U
        damp = damp * 10
    raise ValueError(f"GPTQ: the calibration Hessian is not positive definite even with {percdamp * 1000:g} "
                     f"relative damping (1000x percdamp={percdamp:g}); use more (or more varied) calibration samples, "
                     "or a larger percdamp")


@torch.no_grad()
def gptq_quantize_weight(weight: torch.Tensor, hessian: torch.Tensor, group_size: int = 128,
                         symmetric: bool = False, zero_point: str = "int", clip_search: bool = False,
                         percdamp: float = DEFAULT_PERCDAMP, blocksize: int = DEFAULT_BLOCKSIZE,
                         act_order: bool = False, static_groups: bool = False,
                         clip_objective: str = "gptq", keep_compensated: bool = False) -> GPTQResult:
    """GPTQ-quantize an nn.Linear weight [N, K] given the Hessian H = 2/n X^T X [K, K] of its inputs.

    ``group_size=-1``: per output channel. Runs on the weight's device, in float32. Rows are
    independent given H, so linears that share an input can be quantized as one stacked weight.
    ``keep_compensated``: also return the weights as GPTQ rounded them (`GPTQResult.compensated`).
    """
    if clip_objective not in ("gptq", "weight"):
        raise ValueError(f"clip_objective must be 'gptq' or 'weight', got {clip_objective!r}")
    _check_options(percdamp, blocksize)
    W = weight.detach().float().clone()
    N, K = W.shape
    G = K if group_size == -1 else group_size
    check_weight(W, G)
    if hessian.shape != (K, K):
        raise ValueError(f"Hessian must be [{K}, {K}] for a weight with in_features={K}, got {tuple(hessian.shape)}")
    check_statistics(hessian)
    n_groups = K // G
    H = hessian.detach().float().to(W.device).clone()
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0

    perm = None
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True)
        W, H = W[:, perm], H[perm][:, perm]
    U = _inverse_cholesky(H, percdamp)
    del H
    # GPTQ's loss for quantizing column j is (w_j - q_j)^2 / [H_F^-1]_jj with F the columns not yet
    # quantized, and [H_F^-1]_jj = U_jj^2: the weight of column j in the "gptq" clip objective
    col_weight = U.diagonal() ** -2

    def group_params(cur, weight):
        """(s, z) [R, 1] for rows of the group ``cur`` [R, G]; ``weight`` [G]: each column's GPTQ weight."""
        if not clip_search or clip_objective == "weight":
            _, s, z = quantize_groups(cur, symmetric, zero_point, clip_search)
            return s, z
        _, s, z = weighted_clip_search(cur, lambda dw: (dw ** 2 * weight).sum(1, keepdim=True), symmetric, zero_point)
        return s, z

    S = torch.zeros(N, n_groups, device=W.device)
    Z = torch.zeros(N, n_groups, device=W.device)
    if static_groups:  # fixed beforehand on the original column order
        inv = torch.argsort(perm) if perm is not None else torch.arange(K, device=W.device)
        Wo, cw = W[:, inv], col_weight[inv]
        for g in range(n_groups):
            S[:, g:g + 1], Z[:, g:g + 1] = group_params(Wo[:, g * G:(g + 1) * G], cw[g * G:(g + 1) * G])
        del Wo
        # per-column (s, z) in processing order, gathered once: no device-to-host read per column
        col_group = (perm if perm is not None else torch.arange(K, device=W.device)) // G
        S_col, Z_col = S[:, col_group], Z[:, col_group]

    codes = torch.zeros(N, K, dtype=torch.uint8, device=W.device)
    compensated = torch.empty_like(W) if keep_compensated else None
    for i1 in range(0, K, blocksize):
        i2 = min(i1 + blocksize, K)
        W1 = W[:, i1:i2].clone()
        Q1 = torch.zeros_like(W1)
        Err1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        if static_groups:
            S1, Z1 = S_col[:, i1:i2], Z_col[:, i1:i2]
        else:
            S1, Z1 = torch.zeros_like(W1), torch.zeros_like(W1)
        for i in range(i2 - i1):
            col = i1 + i
            if not static_groups:
                if col % G == 0:
                    # the group's current weights: updated in-block columns, plus later columns with
                    # this block's pending (lazy) updates applied
                    end = col + G
                    cur = W1[:, i:min(end, i2) - i1]
                    if end > i2:
                        rest = W[:, i2:end] - Err1[:, :i] @ U[i1:col, i2:end]
                        cur = torch.cat([cur, rest], dim=1)
                    s, z = group_params(cur, col_weight[col:end])
                    S[:, col // G], Z[:, col // G] = s[:, 0], z[:, 0]
                S1[:, i], Z1[:, i] = S[:, col // G], Z[:, col // G]
            w, s, z = W1[:, i], S1[:, i], Z1[:, i]
            q = round_to_codes(w, s, z)
            Q1[:, i] = q
            if compensated is not None:
                compensated[:, col] = w  # before the update below turns column i into q * s + z
            err = (w - (q * s + z)) / U1[i, i]
            W1[:, i:].addr_(err, U1[i, i:], alpha=-1)
            Err1[:, i] = err
        codes[:, i1:i2] = Q1.to(torch.uint8)
        W[:, i2:] -= Err1 @ U[i1:i2, i2:]

    trivial = (torch.arange(K, device=W.device) // G).to(torch.int32)
    if perm is None:
        return GPTQResult(Int4Weight.from_codes(codes, S, Z, G), None, trivial, compensated)
    if static_groups:  # groups were fixed on the original order: undo the processing order
        original = torch.empty_like(codes)
        original[:, perm] = codes
        if compensated is not None:
            compensated[:, perm] = compensated.clone()
        return GPTQResult(Int4Weight.from_codes(original, S, Z, G), None, trivial, compensated)
    g_idx = torch.empty_like(trivial)
    g_idx[perm] = trivial
    return GPTQResult(Int4Weight.from_codes(codes, S, Z, G), perm, g_idx, compensated)


def _output_rows(w: Int4Weight, start: int, stop: int) -> Int4Weight:
    """Rows [start, stop) of a stacked weight (N is the last dim of every canonical tensor)."""
    return Int4Weight(*(t[:, start:stop].contiguous() for t in (w.qweight, w.scales, w.zeros)), w.group_size)


@torch.no_grad()
def gptq_quantize_model(model: nn.Module, config, calib, *, batch_size: int = 8, blocksize: int = DEFAULT_BLOCKSIZE,
                        clip: bool = True, act_order: bool = True, percdamp: float = DEFAULT_PERCDAMP,
                        progress: bool = True, compensated: dict | None = None, onload=None) -> dict[str, Int4Weight]:
    """GPTQ every nn.Linear of the decoder blocks; returns ``{"model.layers.{i}.{name}": Int4Weight}``.

    ``config`` is a QuantConfig: group_size, symmetric, zero_point as RTN uses them.
    ``config.clip_search`` (rtn's weight-space search, None unless lm_head is RTN's) is not used: each group's
    range comes from the GPTQ-weighted clipping search (``clip=False``: plain min/max, as the reference GPTQ).
    ``act_order``: columns by decreasing activation energy, with static groups so the result needs no input
    permutation (why act-order and clipping are the defaults: module doc); ``percdamp``: the damping, relative
    to mean(diag H). Like ``blocksize`` and ``clip`` (and AWQ's ``n_grid``) they are arguments here, not QuantConfig
    fields: the config holds what quantize_model and the CLI take and the checkpoint records, and each
    calibrated method's own search settings stay its function's.
    ``calib``: token ids, LongTensor [n_samples, seq_len] (see ``calibration_batches``), checked as quantize_model
    checks them (`nibble.models.architecture.check_calibration`).

    Blocks are processed one at a time: block i is calibrated on the outputs of the already
    quantized blocks 0..i-1, and each of its linear groups (q/k/v, o, gate/up, down) on inputs
    produced by its already-quantized predecessors. Linears sharing an
    input (q/k/v, gate/up) share one Hessian and are quantized as one stacked weight (one sweep
    over the columns instead of three / two).

    Side effect: the float weight of every quantized linear is overwritten with its dequantized
    value (that is how later blocks see the quantization error). Modules in
    ``config.modules_to_not_convert`` are left alone. ``compensated``: a dict that receives each
    linear's weight as GPTQ rounded it (`GPTQResult.compensated`), by the same names.

    ``onload(i, layer)``: a context manager giving block i to work on and the dict its results go to
    (``calibration.in_place``, the default: the block where it is); ``quantize_model``'s moves each block to
    its device, rotates it, and converts it when GPTQ is done with it, taking the block's results out of the
    dict (each QuantLinear holds its own copy), so that the dict returned is then empty.
    """
    _check_options(percdamp, blocksize)  # before the calibration runs

    def quantize_block(prefix, block, linears, groups, inputs, kwargs, block_results):
        for group in groups:  # each on inputs of the groups before it, quantized already
            _, stats = forward_block(block, inputs, kwargs, {group[0]: linears[group[0]]}, keep_outputs=False)
            H = stats.pop(group[0]).hessian  # linears sharing one input share one Hessian
            stacked = torch.cat([linears[name].weight for name in group])
            with naming(", ".join(f"{prefix}.{name}" for name in group)):
                res = gptq_quantize_weight(stacked, H, config.group_size, config.symmetric,
                                           config.zero_point, clip, percdamp, blocksize, act_order,
                                           static_groups=act_order, keep_compensated=compensated is not None)
            del stacked, H
            start = 0
            for name in group:
                layer = linears[name]
                stop = start + layer.out_features
                w = _output_rows(res.weight, start, stop)
                # new storage, not written in place (rotation._set says why)
                layer.weight.data = dequantize(w.qweight, w.scales, w.zeros, w.group_size).to(layer.weight.dtype)
                block_results[f"{prefix}.{name}"] = w
                if compensated is not None:
                    compensated[f"{prefix}.{name}"] = res.compensated[start:stop].clone()
                start = stop
        return forward_block(block, inputs, kwargs)[0]  # the next block sees this one quantized

    return quantize_blocks(model, config, calib, quantize_block, "GPTQ", batch_size=batch_size, progress=progress,
                           onload=onload)
