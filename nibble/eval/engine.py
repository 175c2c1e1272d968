"""A minimal fast decode engine for the causal LMs nibble converts (Llama, Qwen2, Qwen3, Mistral).

gpt-fast's recipe on top of a Hugging Face model: the model supplies its modules (embeddings,
norms, the attention and MLP projections, whatever they are: ``nn.Linear`` or ``QuantLinear``),
this file supplies the rest of the forward pass:

- a static KV cache ``[layers, batch, kv_heads, capacity, head_dim]``;
- prefill: causal SDPA over the prompt itself (cuDNN's attention where it runs, else flash: on the
  H200 13 against 20 us a layer of Llama-2-7B at 512 tokens), logits of each prompt's last token only.
  Prompts of different lengths are padded at the end: causal attention keeps the pads out of every
  real token's result, and a sequence's decode overwrites its pads' cache slots before it reads them;
- decode: one token per sequence, each at its own position; grouped query heads are folded into the
  query length (no K/V copies); on CUDA a split-K (flash-decoding) Triton kernel reads each sequence's
  keys up to its position and spreads them over many programs, elsewhere SDPA runs over the whole static
  cache with an additive ``position <= pos`` mask built once per step;
- on CUDA, each prefill shape and each decode batch is one CUDA graph (static input buffers; the
  decode step advances its own position and writes its next token back into its input);
- the next token is the greedy one, or sampled (`Sampling`: temperature, top-k, top-p) on the device
  inside the step's graph, without a host sync (gpt-fast's exponential race in place of
  ``torch.multinomial``); on CUDA Triton programs over chunks of each row find the race's winner in
  the top-p nucleus by rejection, where a sort of the vocabulary took ~0.1 ms a step;
- the glue between the matmuls is three fused Triton kernels on CUDA: residual add + RMSNorm,
  RoPE + KV-cache write (Qwen3's per-head q / k RMSNorms first, in the same kernel), SiLU(gate) * up,
  so a decode step runs about 13 kernels a layer instead of about 43. In a CUDA graph each small
  kernel still costs a few microseconds, and at 32 layers the unfused glue cost more than streaming
  4-bit weights: bf16 Llama-2-7B decoded at 7.4 ms/step (W4A16 at 8.3) against 3.2 ms for its bf16
  weights at the copy roofline (H200, before fusion);
- the projections that read one input (q/k/v, gate/up) go through ``shared_input_forward``, so
  each group is one kernel launch where it can be: 16-bit layers have their weights stacked into one
  tensor (``stack_weights``, in place, same memory) and run as one matmul; W4A16 layers run as one
  launch of the skinny kernel at decode sizes and of the Hopper GEMM at prefill sizes; W4A4 layers
  quantize that input once, then run as one launch too. 16-bit and 4-bit layers both gain from the
  grouping: at batch 1, Llama-2-7B's q, k and v take 39.9 us in bf16 and 16.9 us in W4A16 as three
  launches, 27.6 and 10.5 us as one (H200); at 128 tokens 41.7 us in bf16, 73.0 in W4A16 and 55.1 in
  W4A4 as three, 28.3, 35.5 and 20.8 as one. The glue kernels read the slices of a stacked output in
  place (any row stride). W4A4 goes one step further on CUDA: the RMSNorm kernel quantizes its output
  for the q/k/v and gate/up projections itself (`add_rmsnorm_quantize`): their 16-bit input is never
  written and read back, and two launches a layer go. From 512 tokens on Hopper the gate and up
  products are one GEMM whose epilogue computes SiLU(gate) * up (`w4a4.w4a4_wgmma_silu_mul`): their
  2N-wide output is never written (Llama-2-7B prefill 1.4% faster at 1 x 512, 3.5% at 8 x 512; at
  128 tokens the epilogue costs more than it saves).

The kernels reproduce the Hugging Face modules' bf16 rounding step for step (they round where
PyTorch rounds), so greedy tokens match ``model.generate``; on the CPU the same functions run as
plain PyTorch. Only the linears differ between bf16 and nibble models.
"""
from __future__ import annotations

import math
import numbers
import os
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from nibble.bench.timing import capture_graph
from nibble.config import check_token_ids
from nibble.eval.memory import format_bytes, memory_bound
from nibble.kernels import w4a4
from nibble.kernels.early_launch import early_launch
from nibble.kernels.launch import num_sms
from nibble.models.architecture import check_architecture, decoder_layers
from nibble.models.convert import check_weights_loaded
from nibble.nn.quant_linear import (PermutedInputQuantLinear, shared_input_forward, shared_input_perm, stack_weights,
                                    w4a4_operands)
from nibble.warn import warn

try:  # the engine runs without triton (CPU): the glue then runs as plain PyTorch
    import triton
    import triton.language as tl
    from nibble.kernels.early_launch import after_prior_grids
    from nibble.kernels.w4a4 import store_int4_rows
except Exception:  # pragma: no cover
    triton = None

# SDPA's backends for the engine's attention (prefill, and the masked decode where the Triton kernel
# does not run), in this order of preference: cuDNN's (Hopper-tuned), flash (also the CPU's, masked or
# not), memory-efficient (a masked decode on CUDA), math (the last resort).
_SDPA_BACKENDS = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                  SDPBackend.MATH]
_SILU_ACTS = ("silu", "swish")
# The decode attention's launch: keys a block, warps a program, and programs an SM that the split count aims at
# (benchmarks/scripts/decode_attention_sweep.py times other values).
DECODE_ATTENTION_BLOCK, DECODE_ATTENTION_WARPS, DECODE_ATTENTION_PROGRAMS_PER_SM = 64, 4, 2


_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter (kernel tests)


def _use_triton(x: torch.Tensor) -> bool:
    return triton is not None and (x.is_cuda or _INTERPRET)


def _early(x: torch.Tensor, tokens: int) -> dict:
    """The launch options of a glue kernel over ``tokens`` tokens on ``x``'s device: whether it
    launches early, and its ``PDL`` argument to match (``nibble.kernels.early_launch``)."""
    on = not _INTERPRET and early_launch(x.device, tokens)
    return dict(PDL=on, launch_pdl=on)


# ---- fused glue: Triton kernels ----------------------------------------------------------------
if triton is not None:
    @triton.jit
    def _round(x, like_ptr):
        """Round float32 to the activation dtype (``like_ptr``'s) and back: where PyTorch rounds a 16-bit op."""
        return x.to(like_ptr.dtype.element_ty).to(tl.float32)

    _INTERPRETED = tl.constexpr(_INTERPRET)

    @triton.jit
    def _add_unfused(a, b):
        """a + b (float32) kept apart from the products that feed it. LLVM narrows a rounded product
        of two 16-bit values to a 16-bit multiply and then contracts multiply + add into one fma,
        which skips the rounding of the product that PyTorch does (RoPE came out one ulp off on a
        quarter of the elements, H200). An add in inline PTX cannot be contracted."""
        if _INTERPRETED:  # no PTX in the CPU interpreter, and numpy never contracts
            return a + b
        return tl.inline_asm_elementwise("add.rn.f32 $0, $1, $2;", "=f,f,f", [a, b], dtype=tl.float32,
                                         is_pure=True, pack=1)

    @triton.jit
    def _add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, scale_ptr, columns_ptr, N, eps, fmax,
                            HAS_RES: tl.constexpr, QUANT: tl.constexpr, EVEN_ODD: tl.constexpr,
                            GATHER: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """One row: h = x (+ res); out = w * (h * rsqrt(mean(h^2) + eps)), HF's LlamaRMSNorm roundings.
        QUANT: out is not written in 16 bits but quantized for W4A4 projections (int8 codes to
        out_ptr, the token's scale to scale_ptr), exactly as the act-quant kernel quantizes it.
        GATHER: out's column j is column columns[j] (GPTQ act-order layers' input order), permuted
        inside the program, so the stores stay coalesced (scattered stores of a row cost more than a
        gather kernel: benchmarks/notes-w4a16.md, session 52)."""
        cols = tl.arange(0, BLOCK)
        m = cols < N
        if GATHER:  # no kernel writes the permutation: read it before the wait
            src = tl.load(columns_ptr + cols, mask=m, other=0)
        after_prior_grids(PDL)
        row = tl.program_id(0).to(tl.int64)
        h = tl.load(x_ptr + row * N + cols, mask=m, other=0.0).to(tl.float32)
        if HAS_RES:
            h = _round(h + tl.load(res_ptr + row * N + cols, mask=m, other=0.0).to(tl.float32), res_out_ptr)
            tl.store(res_out_ptr + row * N + cols, h.to(res_out_ptr.dtype.element_ty), mask=m)
        var = tl.sum(h * h, axis=0) / N
        y = _round(h * tl.rsqrt(var + eps), res_out_ptr)
        w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
        if QUANT:
            y = _round(w * y, res_out_ptr)
            one = tl.arange(0, 1)
            store_int4_rows(y[None, :], out_ptr + row * N + cols[None, :], m[None, :], scale_ptr + row + one,
                            one < 1, fmax, EVEN_ODD, _INTERPRETED)
        else:
            out = (w * y).to(out_ptr.dtype.element_ty)
            if GATHER:
                out = tl.gather(out, src, 0)
            tl.store(out_ptr + row * N + cols, out, mask=m)

    @triton.jit
    def _rope_cache_kernel(q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, q_out_ptr, kc_ptr, vc_ptr,
                           q_norm_ptr, k_norm_ptr, q_eps, k_eps,
                           T, HQ, HKV, S, q_row, k_row, v_row, pos_row, D: tl.constexpr, HALF: tl.constexpr,
                           HEADS: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
        """Program (token, block of HEADS heads): the first blocks rotate q heads into q_out, the
        rest rotate k heads and copy v into the cache at the token's position (sequence b's positions
        are ``pos_row`` elements apart: 0 where every sequence has the same). q, k and v rows (tokens)
        are ``*_row`` elements apart: views of one stacked q/k/v output. (One program per head and
        token moved 256 bytes each: 21 us a layer for 512 tokens of Llama-2-7B, 3.5x the memory time; H200.)
        NORM (Qwen3): each q and k head is first RMS-normed over its D dims, with weights q_norm / k_norm,
        HF's roundings; a head is whole in its program, so the norm costs no extra pass over memory."""
        after_prior_grids(PDL)
        tok = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1)
        q_blocks = tl.cdiv(HQ, HEADS)
        b, t = tok // T, tok % T
        p = tl.load(pos_ptr + b * pos_row + t).to(tl.int64)
        offs = tl.arange(0, HALF)[None, :]
        c1 = tl.load(cos_ptr + p * D + offs).to(tl.float32)
        c2 = tl.load(cos_ptr + p * D + HALF + offs).to(tl.float32)
        s1 = tl.load(sin_ptr + p * D + offs).to(tl.float32)
        s2 = tl.load(sin_ptr + p * D + HALF + offs).to(tl.float32)
        if blk < q_blocks:
            h = (blk * HEADS + tl.arange(0, HEADS))[:, None]
            m = h < HQ
            src = q_ptr + tok * q_row + h * D
            dst = q_out_ptr + tok * HQ * D + h * D
            norm_ptr, eps = q_norm_ptr, q_eps
        else:
            h = ((blk - q_blocks) * HEADS + tl.arange(0, HEADS))[:, None]
            m = h < HKV
            src = k_ptr + tok * k_row + h * D
            dst = kc_ptr + ((b * HKV + h) * S + p) * D
            d = tl.arange(0, D)[None, :]
            vals = tl.load(v_ptr + tok * v_row + h * D + d, mask=m)
            tl.store(vc_ptr + ((b * HKV + h) * S + p) * D + d, vals, mask=m)
            norm_ptr, eps = k_norm_ptr, k_eps
        x1 = tl.load(src + offs, mask=m).to(tl.float32)
        x2 = tl.load(src + HALF + offs, mask=m).to(tl.float32)
        if NORM:  # w * round(x * rsqrt(mean(x^2) + eps)), rounded: HF's Qwen3RMSNorm over each head
            rstd = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps)[:, None]
            w1 = tl.load(norm_ptr + offs).to(tl.float32)
            w2 = tl.load(norm_ptr + HALF + offs).to(tl.float32)
            x1 = _round(w1 * _round(x1 * rstd, q_out_ptr), q_out_ptr)
            x2 = _round(w2 * _round(x2 * rstd, q_out_ptr), q_out_ptr)
        # HF: q * cos + rotate_half(q) * sin, each product and the sum rounded to the dtype
        o1 = _add_unfused(_round(x1 * c1, q_out_ptr), _round(-x2 * s1, q_out_ptr))
        o2 = _add_unfused(_round(x2 * c2, q_out_ptr), _round(x1 * s2, q_out_ptr))
        tl.store(dst + offs, o1.to(q_out_ptr.dtype.element_ty), mask=m)
        tl.store(dst + HALF + offs, o2.to(q_out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, g_row, u_row, BLOCK: tl.constexpr, PDL: tl.constexpr):
        """Program (row, block of n columns); g and u rows ``*_row`` elements apart (views of one
        stacked gate/up output), out contiguous."""
        after_prior_grids(PDL)
        row = tl.program_id(0).to(tl.int64)
        i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = i < n
        g = tl.load(g_ptr + row * g_row + i, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row * u_row + i, mask=m, other=0.0).to(tl.float32)
        s = _round(g / (1.0 + tl.exp(-g)), out_ptr)
        tl.store(out_ptr + row * n + i, (s * u).to(out_ptr.dtype.element_ty), mask=m)


    @triton.jit
    def _decode_attention_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, part_ptr, ml_ptr, S, HKV, scale,
                                 REP: tl.constexpr, REP_P: tl.constexpr, D: tl.constexpr, BLOCK_S: tl.constexpr,
                                 IEEE: tl.constexpr, PDL: tl.constexpr):
        """Program (sequence x kv head, split): online softmax over the split's share of the keys <= the
        sequence's pos, for the REP query heads that share this kv head; partial acc, max and sum out (fp32).
        The shares are cut from the sequence's length, not from the cache's capacity S: the grid is fixed
        when a CUDA graph captures it, and chunks of S / splits would leave a short context in a long
        cache to its first split or few."""
        after_prior_grids(PDL)
        bh = tl.program_id(0).to(tl.int64)
        split = tl.program_id(1)
        n_splits = tl.num_programs(1)
        length = tl.load(pos_ptr + bh // HKV).to(tl.int32) + 1
        rows = tl.arange(0, REP_P)
        cols = tl.arange(0, D)
        q = tl.load(q_ptr + bh * REP * D + rows[:, None] * D + cols[None, :], mask=rows[:, None] < REP, other=0.0)
        m = tl.full([REP_P], float("-inf"), tl.float32)
        l = tl.zeros([REP_P], tl.float32)
        acc = tl.zeros([REP_P, D], tl.float32)
        chunk = tl.cdiv(tl.cdiv(length, n_splits), BLOCK_S) * BLOCK_S
        start = split * chunk
        end = tl.minimum(start + chunk, length)
        for s0 in range(start, end, BLOCK_S):
            offs = s0 + tl.arange(0, BLOCK_S)
            valid = offs < end
            kv_off = bh * S * D + offs[:, None].to(tl.int64) * D + cols[None, :]
            k = tl.load(k_ptr + kv_off, mask=valid[:, None], other=0.0)
            v = tl.load(v_ptr + kv_off, mask=valid[:, None], other=0.0)
            if IEEE:
                sc = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            else:
                sc = tl.dot(q, tl.trans(k)) * scale
            sc = tl.where(valid[None, :], sc, float("-inf"))
            m_new = tl.maximum(m, tl.max(sc, 1))
            alpha = tl.exp(m - m_new)
            p = tl.exp(sc - m_new[:, None])
            l = l * alpha + tl.sum(p, 1)
            if IEEE:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        # only the REP real query rows leave the program (the rest pad q to tl.dot's 16-row minimum)
        base = bh * n_splits + split
        real = rows < REP
        tl.store(part_ptr + (base * REP + rows[:, None]) * D + cols[None, :], acc, mask=real[:, None])
        tl.store(ml_ptr + base * 2 * REP + rows, m, mask=real)
        tl.store(ml_ptr + (base * 2 + 1) * REP + rows, l, mask=real)

    @triton.jit
    def _decode_attention_combine_kernel(part_ptr, ml_ptr, out_ptr, scatter_ptr, H, REP: tl.constexpr,
                                         D: tl.constexpr, SPLITS: tl.constexpr, SCATTER: tl.constexpr,
                                         PDL: tl.constexpr):
        """Program (sequence x kv head, query row): the splits' partial softmaxes merged, normalised, cast.
        SCATTER: the row's column c (of H * REP * D) stored at scatter[c] (o_proj's input order, for a
        GPTQ act-order o_proj: D scattered stores a program, where a gather kernel would be a launch)."""
        bh = tl.program_id(0).to(tl.int64)
        r = tl.program_id(1)
        cols = tl.arange(0, D)
        if SCATTER:  # no kernel writes the permutation: read it before the wait
            dst = (bh // H) * (H * REP * D) + tl.load(scatter_ptr + ((bh % H) * REP + r) * D + cols)
        else:
            dst = (bh * REP + r) * D + cols
        after_prior_grids(PDL)
        sp = tl.arange(0, SPLITS)
        m = tl.load(ml_ptr + (bh * SPLITS + sp) * 2 * REP + r)  # -inf where a split saw no key
        l = tl.load(ml_ptr + ((bh * SPLITS + sp) * 2 + 1) * REP + r)
        w = tl.where(m == float("-inf"), 0.0, tl.exp(m - tl.max(m, 0)))  # split 0 always sees key 0
        part = tl.load(part_ptr + ((bh * SPLITS + sp[:, None]) * REP + r) * D + cols[None, :])
        y = tl.sum(w[:, None] * part, 0) / tl.sum(w * l, 0)
        tl.store(out_ptr + dst, y.to(out_ptr.dtype.element_ty))

    @triton.jit
    def _watch(first_ptr, at_ptr, row, finite):
        """first[row] = min(first[row], at[row]) where a lane of ``finite`` is False: the earliest position whose
        logits held a NaN or +-inf (`next_tokens`' ``watch``). Atomic: the row's chunks, a program each, may all."""
        bad = tl.min(finite.to(tl.int32), 0) == 0
        tl.atomic_min(first_ptr + row, tl.load(at_ptr + row).to(tl.int32), mask=bad)

    @triton.jit
    def _sample_logits(x_row, offs, V, inv_t, kth):
        """(s, finite): s = x * inv_t (``x.float() / temperature`` as CUDA computes it: times the fp32
        reciprocal), -inf past the row and below the top-k threshold; whether x is neither NaN nor +-inf (True past
        the row), taken before the filter, which turns a NaN into -inf."""
        x = tl.load(x_row + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
        s = x * inv_t
        return tl.where(s >= kth, s, float("-inf")), (tl.abs(x) < float("inf")) | (offs >= V)

    @triton.jit
    def _race_keys(x_row, race_row, offs, V, inv_t, kth, TINY: tl.constexpr):
        """(s, the race's key s - log E, finite as `_sample_logits` says): argmax of the key is argmax of p / E;
        -inf where s is."""
        s, finite = _sample_logits(x_row, offs, V, inv_t, kth)
        e = tl.maximum(tl.load(race_row + offs, mask=offs < V, other=1.0), TINY)
        return s, tl.where(s > float("-inf"), s - tl.log(e), float("-inf")), finite

    @triton.jit
    def _first_argmax(key, idx):
        """The smallest index among the lanes that hold the largest key (torch.argmax's choice)."""
        return tl.min(tl.where(key == tl.max(key, 0), idx, 2147483647), 0)

    @triton.jit
    def _race_pass(x_row, race_row, start, stop, V, inv_t, kth, TINY: tl.constexpr, BLOCK: tl.constexpr,
                   WATCH: tl.constexpr):
        """Over entries [start, stop): each lane's max of s, its race leader (key, index), and (WATCH) whether
        its logits were all finite. Lanes keep their own across blocks, reduced once by the caller (a reduction
        every block makes the pass wait on barriers: 1.3x the time at 32,000 tokens in one program a row, H200)."""
        lanes = tl.arange(0, BLOCK)
        top = tl.full([BLOCK], float("-inf"), tl.float32)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_i = tl.zeros([BLOCK], tl.int32)
        finite = tl.full([BLOCK], 1, tl.int1)
        for block in range(start, stop, BLOCK):
            offs = block + lanes
            s, key, ok = _race_keys(x_row, race_row, offs, V, inv_t, kth, TINY)
            best_i = tl.where(key > best, offs, best_i)
            best = tl.maximum(key, best)
            top = tl.maximum(top, s)
            if WATCH:
                finite = finite & ok
        return top, best, best_i, finite

    @triton.jit
    def _nucleus_pass(x_row, race_row, start, stop, V, inv_t, kth, m, cand, TINY: tl.constexpr,
                      BLOCK: tl.constexpr):
        """Over entries [start, stop), per lane: the mass exp(s - m) in all and in the tokens more likely than
        the candidate (logit ``cand``), and the race leader among those."""
        lanes = tl.arange(0, BLOCK)
        total = tl.zeros([BLOCK], tl.float32)
        above = tl.zeros([BLOCK], tl.float32)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_i = tl.zeros([BLOCK], tl.int32)
        for block in range(start, stop, BLOCK):
            offs = block + lanes
            s, key, _ = _race_keys(x_row, race_row, offs, V, inv_t, kth, TINY)
            p = tl.exp(s - m)  # 0 at -inf
            total += p
            more = s > cand
            above += tl.where(more, p, 0.0)
            key = tl.where(more, key, float("-inf"))
            best_i = tl.where(key > best, offs, best_i)
            best = tl.maximum(key, best)
        return total, above, best, best_i

    @triton.jit
    def _part(part_ptr, stage, field, row, B, P):
        """Where a row's chunks keep field ``field`` of stage ``stage`` in ``part`` [stages, 3, B, P]."""
        return part_ptr + ((stage * 3 + field) * B + row) * P

    @triton.jit
    def _row_kth(kth_ptr, row, HAS_KTH: tl.constexpr):
        """The row's top-k threshold, -inf without one."""
        return tl.load(kth_ptr + row) if HAS_KTH else float("-inf")

    @triton.jit
    def _row_state(part_ptr, idx_ptr, tok_ptr, fin_ptr, stage, row, B, P, top_p, PMAX: tl.constexpr):
        """What a row's chunks left after stage ``stage`` - 1: its max m, its candidate token, and whether the
        candidate is final (top-p keeps it; or the row has no finite max: its mass is NaN, and rounds would
        never end). ``part`` [stages, 3, B, P]: stage 0 holds each chunk's max and race leader (fields 0, 2),
        a round each chunk's mass in all, above the candidate, and leader among the more likely (0, 1, 2);
        ``idx`` [stages, B, P] the leaders' tokens; ``tok`` / ``fin`` [stages, B] each round's candidate."""
        chunks = tl.arange(0, PMAX)
        real = chunks < P
        m = tl.max(tl.load(_part(part_ptr, 0, 0, row, B, P) + chunks, mask=real, other=float("-inf")), 0)
        prev = stage - 1
        key = tl.load(_part(part_ptr, prev, 2, row, B, P) + chunks, mask=real, other=float("-inf"))
        leader = _first_argmax(key, tl.load(idx_ptr + (prev * B + row) * P + chunks, mask=real, other=2147483647))
        if prev == 0:
            fin = tl.abs(m) == float("inf")
            token = leader
        else:
            total = tl.sum(tl.load(_part(part_ptr, prev, 0, row, B, P) + chunks, mask=real, other=0.0), 0)
            above = tl.sum(tl.load(_part(part_ptr, prev, 1, row, B, P) + chunks, mask=real, other=0.0), 0)
            fin_prev = tl.load(fin_ptr + prev * B + row) != 0  # then this stage's parts were never written
            fin = fin_prev | (above < top_p * total)
            token = tl.where(fin, tl.load(tok_ptr + prev * B + row), leader)
        return m, token, fin

    @triton.jit
    def _argmax_key(x):
        """float32 -> int32 whose order is torch.argmax's: the float order, -0.0 = +0.0, and NaN above
        everything (a NaN wins, the first one)."""
        bits = x.to(tl.int32, bitcast=True)
        key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negatives: larger magnitude, smaller key
        key = tl.where(x == 0.0, 0, key)
        return tl.where(x != x, 2147483647, key)

    @triton.jit
    def _argmax_chunk_kernel(x_ptr, key_ptr, idx_ptr, first_ptr, at_ptr, V, row_stride, CHUNK: tl.constexpr,
                             BLOCK: tl.constexpr, WATCH: tl.constexpr, PDL: tl.constexpr):
        """Program (chunk, row): the chunk's largest `_argmax_key` and its first index; WATCH: a NaN or +-inf in
        the chunk recorded in ``first`` (`_watch`)."""
        after_prior_grids(PDL)
        c, row = tl.program_id(0), tl.program_id(1).to(tl.int64)
        P = tl.num_programs(0)
        lanes = tl.arange(0, BLOCK)
        best = tl.full([BLOCK], -2147483648, tl.int32)
        best_i = tl.zeros([BLOCK], tl.int32)
        finite = tl.full([BLOCK], 1, tl.int1)
        for block in range(c * CHUNK, (c + 1) * CHUNK, BLOCK):
            offs = block + lanes
            x = tl.load(x_ptr + row * row_stride + offs, mask=offs < V, other=0.0).to(tl.float32)
            key = tl.where(offs < V, _argmax_key(x), -2147483648)
            best_i = tl.where(key > best, offs, best_i)  # a lane's blocks come in index order: first kept
            best = tl.maximum(key, best)
            if WATCH:
                finite = finite & (tl.abs(x) < float("inf"))
        tl.store(key_ptr + row * P + c, tl.max(best, 0))
        tl.store(idx_ptr + row * P + c, _first_argmax(best, best_i))
        if WATCH:
            _watch(first_ptr, at_ptr, row, finite)

    @triton.jit
    def _argmax_row_kernel(key_ptr, idx_ptr, out_ptr, P, PMAX: tl.constexpr, PDL: tl.constexpr):
        """Program (row): the token, from its chunks' largest keys (the first chunk's among equal ones)."""
        after_prior_grids(PDL)
        row = tl.program_id(0).to(tl.int64)
        chunks = tl.arange(0, PMAX)
        key = tl.load(key_ptr + row * P + chunks, mask=chunks < P, other=-2147483648)
        idx = tl.load(idx_ptr + row * P + chunks, mask=chunks < P, other=2147483647)
        tl.store(out_ptr + row, _first_argmax(key, idx).to(tl.int64))

    @triton.jit
    def _sample_topk_kernel(x_ptr, cand_ptr, V, row_stride, inv_t, CHUNK: tl.constexpr, CHUNK_P2: tl.constexpr,
                            KP: tl.constexpr, PDL: tl.constexpr):
        """Program (chunk, row): the chunk's KP largest s, -inf where it has fewer (bitonic, `tl.topk`). The
        row's k-th largest (k <= KP) is the k-th largest of its chunks' (`_sample_first_kernel`)."""
        after_prior_grids(PDL)
        c, row = tl.program_id(0), tl.program_id(1).to(tl.int64)
        lanes = tl.arange(0, CHUNK_P2)
        offs = c * CHUNK + lanes
        s = tl.load(x_ptr + row * row_stride + offs, mask=(offs < V) & (lanes < CHUNK), other=float("-inf"))
        top = tl.topk(s.to(tl.float32) * inv_t, KP)
        tl.store(cand_ptr + (row * tl.num_programs(0) + c) * KP + tl.arange(0, KP), top)

    @triton.jit
    def _sample_first_kernel(x_ptr, race_ptr, kth_ptr, cand_ptr, part_ptr, idx_ptr, first_ptr, at_ptr, V, row_stride,
                             inv_t, top_k, TINY: tl.constexpr, HAS_KTH: tl.constexpr, KP: tl.constexpr,
                             PMAX: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr, WATCH: tl.constexpr,
                             PDL: tl.constexpr):
        """Program (chunk, row), stage 0 of `next_tokens`'s draw: the chunk's max of s and its race leader;
        WATCH: a NaN or +-inf in the chunk recorded in ``first`` (`_watch`). The top-k threshold: read from
        ``kth`` (HAS_KTH, KP = 0), or (KP > 0) the top_k-th largest of the row's chunks' KP largest, which every
        program finds and the first writes to ``kth``."""
        after_prior_grids(PDL)
        c, row = tl.program_id(0), tl.program_id(1).to(tl.int64)
        P, B = tl.num_programs(0), tl.num_programs(1)
        if KP > 0:
            offs = tl.arange(0, PMAX * KP)
            cands = tl.load(cand_ptr + row * P * KP + offs, mask=offs < P * KP, other=float("-inf"))
            ranked = tl.topk(cands, KP)  # descending
            kth = tl.max(tl.where(tl.arange(0, KP) == top_k - 1, ranked, float("-inf")), 0)
            if c == 0:
                tl.store(kth_ptr + row, kth)
        else:
            kth = _row_kth(kth_ptr, row, HAS_KTH)
        top, best, best_i, finite = _race_pass(x_ptr + row * row_stride, race_ptr + row * V, c * CHUNK,
                                               (c + 1) * CHUNK, V, inv_t, kth, TINY, BLOCK, WATCH)
        tl.store(_part(part_ptr, 0, 0, row, B, P) + c, tl.max(top, 0))
        tl.store(_part(part_ptr, 0, 2, row, B, P) + c, tl.max(best, 0))
        tl.store(idx_ptr + row * P + c, _first_argmax(best, best_i))
        if WATCH:
            _watch(first_ptr, at_ptr, row, finite)

    @triton.jit
    def _sample_round_kernel(x_ptr, race_ptr, kth_ptr, part_ptr, idx_ptr, tok_ptr, fin_ptr, V, row_stride, inv_t,
                             top_p, stage, TINY: tl.constexpr, HAS_KTH: tl.constexpr, CHUNK: tl.constexpr,
                             BLOCK: tl.constexpr, PMAX: tl.constexpr, PDL: tl.constexpr):
        """Program (chunk, row), a top-p round over the chunk: the last stage's candidate is tested here (the
        mass above it) and the next one found (the leader among the more likely), unless it was final."""
        after_prior_grids(PDL)
        c, row = tl.program_id(0), tl.program_id(1).to(tl.int64)
        P, B = tl.num_programs(0), tl.num_programs(1)
        m, token, fin = _row_state(part_ptr, idx_ptr, tok_ptr, fin_ptr, stage, row, B, P, top_p, PMAX)
        if c == 0:
            tl.store(tok_ptr + stage * B + row, token)
            tl.store(fin_ptr + stage * B + row, fin.to(tl.int32))
        if not fin:
            x_row = x_ptr + row * row_stride
            cand = tl.load(x_row + token).to(tl.float32) * inv_t
            total, above, best, best_i = _nucleus_pass(x_row, race_ptr + row * V, c * CHUNK, (c + 1) * CHUNK, V,
                                                       inv_t, _row_kth(kth_ptr, row, HAS_KTH), m, cand, TINY, BLOCK)
            tl.store(_part(part_ptr, stage, 0, row, B, P) + c, tl.sum(total, 0))
            tl.store(_part(part_ptr, stage, 1, row, B, P) + c, tl.sum(above, 0))
            tl.store(_part(part_ptr, stage, 2, row, B, P) + c, tl.max(best, 0))
            tl.store(idx_ptr + (stage * B + row) * P + c, _first_argmax(best, best_i))

    @triton.jit
    def _sample_last_kernel(x_ptr, race_ptr, kth_ptr, part_ptr, idx_ptr, tok_ptr, fin_ptr, out_ptr, V, P,
                            row_stride, inv_t, top_p, stage, TINY: tl.constexpr, HAS_KTH: tl.constexpr,
                            TOP_P: tl.constexpr, BLOCK: tl.constexpr, PMAX: tl.constexpr, PDL: tl.constexpr):
        """Program (row): the token. Rounds the chunks' launches did not settle go on here, each a pass over
        the whole row (each round keeps its candidate with probability >= top_p, so they are few)."""
        after_prior_grids(PDL)
        row = tl.program_id(0).to(tl.int64)
        B = tl.num_programs(0)
        m, token, done = _row_state(part_ptr, idx_ptr, tok_ptr, fin_ptr, stage, row, B, P, top_p, PMAX)
        if TOP_P:
            x_row = x_ptr + row * row_stride
            kth = _row_kth(kth_ptr, row, HAS_KTH)
            while not done:
                cand = tl.load(x_row + token).to(tl.float32) * inv_t
                total, above, best, best_i = _nucleus_pass(x_row, race_ptr + row * V, 0, V, V, inv_t, kth, m, cand,
                                                           TINY, BLOCK)
                done = tl.sum(above, 0) < top_p * tl.sum(total, 0)
                token = tl.where(done, token, _first_argmax(best, best_i))
        tl.store(out_ptr + row, token.to(tl.int64))


# ---- fused glue: the ops (Triton on CUDA, PyTorch otherwise) -----------------------------------
_glue_failure: str | None = None  # set when a glue kernel failed to compile: the PyTorch ops take over


def _dispatch(x: torch.Tensor, kernel, plain):
    """``kernel()`` where the Triton glue can run, else ``plain()``; a kernel that fails to build warns once
    and falls back for good (kernels compile on their first, eager call, before any graph capture)."""
    global _glue_failure
    if not (_glue_failure is None and _use_triton(x)):
        return plain()
    try:
        return kernel()
    except Exception as e:  # pragma: no cover - a Triton/driver problem on some machine
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            raise
        _glue_failure = f"{type(e).__name__}: {e}"
        warnings.warn(f"nibble engine: fused glue kernels unavailable ({_glue_failure}); using PyTorch ops",
                      stacklevel=3)
        return plain()


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as [rows, features] with contiguous rows, any row stride: a view where one exists (the
    slices of a stacked projection's output), else a contiguous copy (``reshape``'s choice)."""
    return (t if t.stride(-1) == 1 else t.contiguous()).reshape(-1, t.shape[-1])


def rmsnorm(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm over the last dim (LlamaRMSNorm, Qwen3RMSNorm): float32 inside, rounded to h's dtype, times
    the weight."""
    hf = h.float()
    return weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)).to(h.dtype)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                columns: torch.Tensor | None = None):
    """(h, norm(h)) with h = x + residual (h = x when residual is None), as HF's RMSNorm computes it;
    ``columns``: norm(h)[..., columns] instead (the input order of GPTQ act-order layers: they then
    need no gather of their own)."""
    def plain():
        h = x if residual is None else residual + x
        y = rmsnorm(h, weight, eps)
        return h, y if columns is None else y.index_select(-1, columns)

    def kernel():
        h, out, _ = _launch_add_rmsnorm(x, residual, weight, eps, columns=columns)
        return h, out
    return _dispatch(x, kernel, plain)


def add_rmsnorm_quantize(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                         order: str = "natural"):
    """(h, q, scale): h as `add_rmsnorm` returns it, and norm(h) [rows, N] quantized per token for
    W4A4 projections (`nibble.kernels.w4a4.quantize_activations` in ``order``). On CUDA in one
    kernel: norm(h) is never written in 16 bits, and the act-quant launch goes (rows of 4096, H200:
    9.3 -> 8.0 us at 512 tokens, 52 -> 35 at 4096; benchmarks/scripts/fused_quantization.py)."""
    def plain():
        h, y = add_rmsnorm(x, residual, weight, eps)
        return (h, *w4a4.quantize_activations(y.reshape(-1, y.shape[-1]), False, order))

    def kernel():
        w4a4.check_order(order, x.shape[-1])
        return _launch_add_rmsnorm(x, residual, weight, eps, order)
    return _dispatch(x, kernel, plain)


def _launch_add_rmsnorm(x, residual, weight, eps, order=None, columns=None):
    """`_add_rmsnorm_kernel` over x's rows: (h, out, scales); out like x (only ``columns``, in that
    order, if given) and scales None, or with an ``order`` the int8 codes [rows, N] in that order and
    their float32 scales [rows]."""
    xc = x.contiguous()
    N = xc.shape[-1]
    rows = xc.numel() // N
    h = xc if residual is None else torch.empty_like(xc)
    res = xc if residual is None else residual.contiguous()
    if order is None:
        out, scales = torch.empty_like(xc), None
    else:
        out = torch.empty(rows, N, dtype=torch.int8, device=x.device)
        scales = torch.empty(rows, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(N)
    _add_rmsnorm_kernel[(rows,)](xc, res, weight, out, h, out if scales is None else scales,
                                 out if columns is None else columns, N, eps, float(torch.finfo(x.dtype).max),
                                 HAS_RES=residual is not None, QUANT=scales is not None,
                                 EVEN_ODD=order == "even_odd", GATHER=columns is not None, BLOCK=block,
                                 num_warps=_norm_warps(block, columns is not None), **_early(xc, rows))
    return h, out, scales


def _norm_warps(block: int, permuted: bool = False) -> int:
    """Warps of an `_add_rmsnorm_kernel` program (one row, padded to ``block``). 4 to 32 warps at
    rows of 4096, plain or quantizing, 1 to 4096 rows: within 3% of each other up to 1024 rows,
    4 the fastest at 4096 (H200, benchmarks/scripts/fused_quantization.py). A row permuted in the
    program (``permuted``: GPTQ act-order) moves its values across the warps: 16 warps, rows of 4096, 1 / 8 /
    128 rows 1.90 / 1.92 / 3.51 us against 2.00 / 2.06 / 4.27 at 4 (the plain norm 1.66 / 1.75 / 2.59;
    benchmarks/scripts/act_order_glue_ab.py)."""
    if permuted:
        return 16
    return 4 if block <= 4096 else 8


ROPE_HEADS = 8  # heads per program of the RoPE + cache kernel


def rope_and_cache(q, k, v, cos, sin, pos, k_cache, v_cache, n_heads, n_kv, head_dim, head_norms=None):
    """RoPE on q [B, T, Hq*D] and k, then k and v written into the caches [B, Hkv, S, D] at the tokens'
    positions ``pos``: [T] (every sequence's) or [B, T] (each its own). ``head_norms``: ((weight, eps) of
    q's, of k's) RMSNorm over each head's D dims, applied before RoPE (Qwen3's q_norm / k_norm).

    Returns the rotated q as [B, T, Hq, D]. cos/sin: the full tables [S, D].
    """
    B, T = q.shape[:2]
    pos = pos.expand(B, T)

    def plain():
        c, s = cos[pos][:, None], sin[pos][:, None]  # [B, 1, T, D]

        def rope(x, heads, norm=None):
            x = x.view(B, T, heads, head_dim)
            x = x if norm is None else rmsnorm(x, *norm)
            x = x.transpose(1, 2)
            x1, x2 = x.chunk(2, dim=-1)
            return x * c + torch.cat((-x2, x1), dim=-1) * s
        # the indices [B, 1] and [B, T] around a slice put their dims first: the cache rows as [B, T, Hkv, D]
        rows = torch.arange(B, device=pos.device)[:, None]
        q_norm, k_norm = head_norms or (None, None)
        k_cache[rows, :, pos] = rope(k, n_kv, k_norm).transpose(1, 2)
        v_cache[rows, :, pos] = v.view(B, T, n_kv, head_dim)
        return rope(q, n_heads, q_norm).transpose(1, 2)

    def kernel():
        qc, kc, vc = (_rows(t) for t in (q, k, v))
        p = pos if pos.stride(1) == 1 or T == 1 else pos.contiguous()
        q_out = torch.empty(B, T, n_heads, head_dim, dtype=q.dtype, device=q.device)
        blocks = triton.cdiv(n_heads, ROPE_HEADS) + triton.cdiv(n_kv, ROPE_HEADS)
        (q_weight, q_eps), (k_weight, k_eps) = head_norms or ((cos, 0.0), (cos, 0.0))  # cos: a pointer never read
        _rope_cache_kernel[(B * T, blocks)](qc, kc, vc, cos, sin, p, q_out, k_cache, v_cache, q_weight, k_weight,
                                            q_eps, k_eps, T, n_heads, n_kv, k_cache.shape[2], qc.stride(0),
                                            kc.stride(0), vc.stride(0), p.stride(0), D=head_dim, HALF=head_dim // 2,
                                            HEADS=ROPE_HEADS, NORM=head_norms is not None, num_warps=4,
                                            **_early(qc, B * T))
        return q_out
    return _dispatch(q, kernel, plain)


def silu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """SiLU(g) * u, rounded as PyTorch rounds ``F.silu(g) * u``."""
    def kernel():
        gc, uc = _rows(g), _rows(u)
        rows, n = gc.shape
        out = torch.empty(g.shape, dtype=g.dtype, device=g.device)
        BLOCK = 1024
        _silu_mul_kernel[(rows, triton.cdiv(n, BLOCK))](gc, uc, out, n, gc.stride(0), uc.stride(0), BLOCK=BLOCK,
                                                        num_warps=4, **_early(gc, rows))
        return out
    return _dispatch(g, kernel, lambda: F.silu(g) * u)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pos: torch.Tensor,
                     scale: float, mask: torch.Tensor, scatter: torch.Tensor | None = None) -> torch.Tensor:
    """One query token per sequence against the cache: q [B, Hkv, rep, D] (the rep query heads that
    read kv head h, folded), caches [B, Hkv, S, D], sequence b's keys at positions <= pos[b] valid (pos
    [B]; ``mask``: the same as an additive [B, 1, 1, S] mask, for the PyTorch path). Returns [B, Hkv, rep, D];
    ``scatter``: with each sequence's Hkv * rep * D columns c stored at scatter[c] instead (the inverse of a
    GPTQ act-order o_proj's input order: the layer then needs no gather of its own).

    The kernel splits the keys over programs (flash-decoding), so a short batch still spreads over
    the GPU: SDPA runs one program per (sequence, head), 32 for Llama-2-7B at batch 1, and reads
    every cache slot up to capacity; the split kernel reads only the keys up to ``pos``.
    """
    def plain():
        y = F.scaled_dot_product_attention(q, k_cache, v_cache, attn_mask=mask, scale=scale)
        if scatter is None:
            return y
        y = y.reshape(y.shape[0], -1)
        return torch.empty_like(y).index_copy_(-1, scatter, y).view(q.shape)

    def kernel():
        B, H, rep, D = q.shape
        S = k_cache.shape[2]
        qc, p = q.contiguous(), pos.expand(B).contiguous()
        kc, vc = k_cache.contiguous(), v_cache.contiguous()
        block_s = DECODE_ATTENTION_BLOCK
        # about DECODE_ATTENTION_PROGRAMS_PER_SM programs an SM, but no more splits than blocks of keys
        splits = min(triton.next_power_of_2(triton.cdiv(DECODE_ATTENTION_PROGRAMS_PER_SM * num_sms(q.device), B * H)),
                     triton.next_power_of_2(triton.cdiv(S, block_s)))
        rep_p = max(16, triton.next_power_of_2(rep))
        part = torch.empty(B * H, splits, rep, D, dtype=torch.float32, device=q.device)
        ml = torch.empty(B * H, splits, 2, rep, dtype=torch.float32, device=q.device)
        out = torch.empty_like(qc)
        early = _early(qc, B)  # one query token per sequence
        _decode_attention_kernel[(B * H, splits)](qc, kc, vc, p, part, ml, S, H, scale, REP=rep, REP_P=rep_p,
                                                  D=D, BLOCK_S=block_s, IEEE=q.dtype == torch.float32,
                                                  num_warps=DECODE_ATTENTION_WARPS, **early)
        _decode_attention_combine_kernel[(B * H, rep)](part, ml, out, out if scatter is None else scatter, H, REP=rep,
                                                       D=D, SPLITS=splits, SCATTER=scatter is not None, num_warps=2,
                                                       **early)
        return out
    return _dispatch(q, kernel, plain)


def _rmsnorm_params(norm: nn.Module):
    """(weight, eps) of an HF RMSNorm we can fuse, else None (the module is then called as is)."""
    w, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if isinstance(w, torch.Tensor) and eps is not None and type(norm).__name__.endswith("RMSNorm"):
        return w, float(eps)
    return None


def _fused_head_norms(attn: nn.Module):
    """Qwen3's per-head q_norm and k_norm as the RoPE kernel fuses them, ((weight, eps) of q's, of k's), where both are
    HF's RMSNorm; None where the attention has none, or either is another module (`Engine._attention` then calls both
    as modules, which `Engine._called_modules` counts)."""
    if not hasattr(attn, "q_norm"):
        return None
    params = (_rmsnorm_params(attn.q_norm), _rmsnorm_params(attn.k_norm))
    return None if None in params else params


# ---- the engine --------------------------------------------------------------------------------
# `Engine.generate` with stop tokens asks the GPU whether to go on every this many decode steps: each
# question waits for the steps queued before it (the CUDA graphs' launches no longer run ahead).
STOP_CHECK_STEPS = 16


# `Engine._nonfinite`'s value for a sequence whose logits were all finite (int32: the kernels' atomic_min)
_ALL_FINITE = 2 ** 31 - 1


# Below it the draw is the argmax to float32's precision, and logits / temperature overflow to +-inf, whose softmax
# is NaN everywhere (every token came out 0): decoding is greedy.
MIN_TEMPERATURE = 1e-30


def _number(value, kind=numbers.Real) -> bool:
    return isinstance(value, kind) and not isinstance(value, bool)  # True is an int to Python, not a setting


def _count(value) -> bool:
    """Whether ``value`` is an integer >= 1 (a size, a number of tokens or steps)."""
    return _number(value, numbers.Integral) and value >= 1


@dataclass(frozen=True)
class Sampling:
    """How the engine picks each next token. ``temperature`` 0 (the default, or below MIN_TEMPERATURE) is greedy;
    above 0 the token is drawn from softmax(logits / temperature) restricted to the ``top_k`` most likely tokens
    (None: all) and to the smallest set of them whose probability reaches ``top_p`` (1: all), as
    transformers' ``generate(do_sample=True, ...)`` filters them (tokens tied with the last one either
    filter keeps all stay, where transformers' sort keeps some of them). Draws come from PyTorch's random
    generator of the logits' device: ``torch.manual_seed`` makes them repeat."""
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0

    def __post_init__(self):
        if not (_number(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0: greedy), got {self.temperature!r}")
        if self.top_k is not None and not _count(self.top_k):
            raise ValueError(f"top_k must be an integer >= 1, or None for every token; got {self.top_k!r}")
        if not (_number(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] (1: no nucleus filter), got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1

    def warn_if_filters_unused(self) -> None:
        """Warn that top-k / top-p were given to greedy decoding (temperature 0), which ignores them."""
        if self.temperature < MIN_TEMPERATURE and (self.top_k is not None or self.top_p != 1):
            # one message (no values in it): Python's warning filter says it once, not at every call
            warn("top_k / top_p filter sampled tokens only: with temperature 0 decoding is greedy and they are "
                 "ignored; give a temperature > 0 to sample")


GREEDY = Sampling()


def next_tokens(logits: torch.Tensor, sampling: Sampling = GREEDY, watch=None) -> torch.Tensor:
    """The next token of each row of ``logits`` [B, V] under ``sampling``: [B] int64. Greedy: torch.argmax's
    token, on CUDA found over chunks of the row as the draw below reads them (`_argmax_chunks`).

    ``watch``: None, or (first [B] int32, at [B]): where row b's logits hold a NaN or +-inf, first[b] becomes
    min(first[b], at[b]) (the engine's: the earliest position whose logits were not finite). On the device, without a
    host sync, so a CUDA graph holds it; on CUDA the kernels below do it as they read the logits to pick the token
    (a pass of its own over [B, V] would be a launch more every decode step), elsewhere PyTorch ops do.

    Sampling runs on the logits' device without a host sync, so a CUDA graph can hold it: an
    exponential race instead of ``torch.multinomial``: with E_i ~ Exp(1) independent, argmax_i
    p_i / E_i is i with probability p_i (the Gumbel-max trick, -log E_i being Gumbel). On CUDA Triton
    kernels draw it without sorting the vocabulary, from the same draws as the PyTorch ops (`_sample_plain`),
    so a seed gives the same tokens either way. Top-p keeps a token when the tokens strictly more likely
    hold less than top_p of the mass: the kept set is a prefix of the ranking, so rejection finds the
    nucleus's winner. If the race's winner is outside it, so is every token as likely or less, and the
    winner among the more likely ones, with the same draws, is the next candidate (a race's winner within
    a set does not depend on how the set's best fared outside it); the top token always stays, so the
    rounds end, and each keeps its candidate with probability >= top_p. Launches: each row's chunks of
    SAMPLE_CHUNK entries, a program each, find their max and race leader (`_sample_first_kernel`); then
    SAMPLE_ROUNDS rounds over the chunks each test the last candidate (the mass above it) and find the next
    (`_sample_round_kernel`, reading what the chunks left before it: `_row_state`); the last launch, a
    program a row, goes on over whole rows where a row's candidate is still rejected (rare) and writes the
    token (`_sample_last_kernel`). One program a row for all of it took 66 us a step at Llama-3's 128,256
    tokens, batch 1, against 17 in chunks (H200). A top_k up to SAMPLE_TOPK_MAX takes one launch more, each
    chunk's largest (`_sample_topk_kernel`), whose top_k-th the first launch finds (42 us with top-p where
    `torch.topk` made it 125)."""
    if sampling.greedy:
        return _dispatch(logits, lambda: _argmax_chunks(logits, watch), lambda: _watched(logits, watch).argmax(-1))

    def kernel():
        B, V = logits.shape
        x = logits if logits.stride(-1) == 1 else logits.contiguous()
        inv_t = float(np.float32(1.0) / np.float32(sampling.temperature))
        chunk = SAMPLE_CHUNK
        P = triton.cdiv(V, chunk)
        kth, cands, kp, kernel_watch = None, None, 0, watch
        if sampling.top_k is not None and sampling.top_k < V:
            if sampling.top_k <= min(SAMPLE_TOPK_MAX, triton.next_power_of_2(chunk)):
                kp = triton.next_power_of_2(sampling.top_k)
                cands = torch.empty(B, P, kp, dtype=torch.float32, device=x.device)
                kth = torch.empty(B, dtype=torch.float32, device=x.device)  # the first launch writes it
            else:
                # the logits themselves are watched (the kernels read them divided, which a finite one can overflow)
                x = _watched(x, watch).float() / sampling.temperature  # the values top-k ranks, the kernels read
                kth = torch.topk(x, sampling.top_k, dim=-1).values[:, -1].contiguous()
                inv_t, kernel_watch = 1.0, None
        race = torch.empty(B, V, dtype=torch.float32, device=x.device).exponential_()
        out = torch.empty(B, dtype=torch.long, device=x.device)
        first, at = kernel_watch or (out, out)  # WATCH=False reads neither
        top_p = sampling.top_p < 1
        rounds = SAMPLE_ROUNDS if top_p else 0
        part = torch.empty(rounds + 1, 3, B, P, dtype=torch.float32, device=x.device)
        idx = torch.empty(rounds + 1, B, P, dtype=torch.int32, device=x.device)
        state = torch.empty(2, rounds + 1, B, dtype=torch.int32, device=x.device)  # each round's candidate, final?
        kth = race if kth is None else kth
        consts = dict(TINY=torch.finfo(torch.float32).tiny, HAS_KTH=kth is not race, BLOCK=SAMPLE_BLOCK,
                      num_warps=SAMPLE_WARPS, **_early(x, B))
        pmax = triton.next_power_of_2(P)
        if kp:
            _sample_topk_kernel[(P, B)](x, cands, V, x.stride(0), inv_t, CHUNK=chunk, KP=kp,
                                        CHUNK_P2=triton.next_power_of_2(chunk), PDL=consts["PDL"],
                                        launch_pdl=consts["launch_pdl"], num_warps=SAMPLE_WARPS)
        _sample_first_kernel[(P, B)](x, race, kth, race if cands is None else cands, part, idx, first, at, V,
                                     x.stride(0), inv_t, sampling.top_k or 0, KP=kp, PMAX=pmax, CHUNK=chunk,
                                     WATCH=kernel_watch is not None, **consts)
        for stage in range(1, rounds + 1):
            _sample_round_kernel[(P, B)](x, race, kth, part, idx, state[0], state[1], V, x.stride(0), inv_t,
                                         float(sampling.top_p), stage, CHUNK=chunk, PMAX=pmax, **consts)
        _sample_last_kernel[(B,)](x, race, kth, part, idx, state[0], state[1], out, V, P, x.stride(0), inv_t,
                                  float(sampling.top_p), rounds + 1, TOP_P=top_p, PMAX=pmax, **consts)
        return out
    return _dispatch(logits, kernel, lambda: _sample_plain(_watched(logits, watch), sampling))


def _watched(logits: torch.Tensor, watch) -> torch.Tensor:
    """``logits``, after `next_tokens`' ``watch`` by PyTorch ops (an isfinite pass: the CPU's, and CUDA's without
    the kernels)."""
    if watch is not None:
        first, at = watch
        bad = ~torch.isfinite(logits).all(-1)
        first.copy_(torch.where(bad, torch.minimum(first, at.to(first.dtype)), first))
    return logits


# The sampling draw's launches (`next_tokens`): rows in chunks of SAMPLE_CHUNK vocabulary entries, a program
# each, read SAMPLE_BLOCK at a time by SAMPLE_WARPS warps; SAMPLE_ROUNDS top-p rounds over the chunks, the rest
# over whole rows in the last launch, which waits for its slowest row: at batch 8 and top-p 0.9 one row in two
# batches needs a second round, so rounds over chunks (~2 us each where every row is settled) pay there. H200,
# bf16, top-p 0.9 (0.5), batch 1 / 8, us: 17.2 / 22.9 (19.2 / 30.8) at 128,256 tokens, 19.9 / 19.7 at 32,000;
# 8,192 x 2,048 x 8 warps with 2 rounds 20.0-24.7 / 25.2-29.1 (22.3 / 45.0), with 1 round 20.7 / 48.5 (30.0 /
# 86.4) (`benchmarks/results/session50-h200/sampling-chunks-*.json`).
SAMPLE_CHUNK, SAMPLE_BLOCK, SAMPLE_WARPS, SAMPLE_ROUNDS = 8192, 4096, 16, 3
# top_k up to this many is found in the launches (each chunk's largest, `_sample_topk_kernel`), beyond by torch.topk
SAMPLE_TOPK_MAX = 128


def _argmax_chunks(logits: torch.Tensor, watch=None) -> torch.Tensor:
    """``logits.argmax(-1)`` (its NaN and tie rules too) as the sampling draw's launches read a row: a program
    a chunk, then one a row. H200, bf16, batch 1 / 8 (`benchmarks/results/session51-h200/greedy-chunks.json`):
    PyTorch's reduction 8.8 / 9.0 us at 32,000 logits, 26.7 / 26.9 at Llama-3's 128,256, 8.5 / 10.3 at 151,936;
    these two launches 2.9-3.9 us at every size. Llama-3-8B-shaped W4A16 greedy decode 1.938 -> 1.904 ms a
    step at batch 1, 2.096 -> 2.056 at 8. ``watch``: as `next_tokens` takes it."""
    B, V = logits.shape
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    P = triton.cdiv(V, SAMPLE_CHUNK)
    keys = torch.empty(B, P, dtype=torch.int32, device=x.device)
    idx = torch.empty(B, P, dtype=torch.int32, device=x.device)
    out = torch.empty(B, dtype=torch.long, device=x.device)
    early = _early(x, B)
    first, at = watch or (out, out)  # WATCH=False reads neither
    _argmax_chunk_kernel[(P, B)](x, keys, idx, first, at, V, x.stride(0), CHUNK=SAMPLE_CHUNK, BLOCK=SAMPLE_BLOCK,
                                 WATCH=watch is not None, num_warps=SAMPLE_WARPS, **early)
    _argmax_row_kernel[(B,)](keys, idx, out, P, PMAX=triton.next_power_of_2(P), num_warps=1, **early)
    return out


def _sample_plain(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """`next_tokens`'s draw by PyTorch ops: the filters (`sampling_logits`, top-p by a sort), the race."""
    probs = sampling_logits(logits, sampling).softmax(-1)
    # Exp(1) draws of exactly 0 (u = 1 in -log u) would make 0 / 0 a NaN, which argmax would pick
    race = torch.empty_like(probs).exponential_().clamp_(min=torch.finfo(probs.dtype).tiny)
    return (probs / race).argmax(-1)


def sampling_logits(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """float32 logits / temperature with the tokens top-k and top-p leave out at -inf (transformers'
    temperature, top-k and top-p warpers, in that order): the distribution `next_tokens` draws from."""
    logits = logits.float() / sampling.temperature
    if sampling.top_k is not None and sampling.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sampling.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, -math.inf)
    if sampling.top_p < 1:
        ranked = logits.sort(-1, descending=True).values
        probs = ranked.softmax(-1)
        # a token stays while the tokens ranked above it hold less than top_p of the mass (the first always
        # does: also in a row of NaN logits, whose every comparison fails, whose index -1 failed in the gather), and
        # so does every token tied with the last one kept, whatever order the sort gave them
        kept = (probs.cumsum(-1) - probs < sampling.top_p).sum(-1, keepdim=True).clamp_(min=1)
        logits = logits.masked_fill(logits < ranked.gather(-1, kept - 1), -math.inf)
    return logits


def prompt_batch(prompt) -> tuple[torch.Tensor, list[int]]:
    """A batch of prompts as the engine runs it: token ids [B, T] (int64, on the prompt's device) and
    each prompt's length. ``prompt`` is a [B, T] tensor of ids (every length T), or a list of B
    prompts, each a 1-D tensor or a list of ids, of any lengths >= 1: they are padded at the end to
    the longest with id 0, which no real token's result sees (see the module's docstring)."""
    def ids_dtype(t: torch.Tensor) -> bool:
        return not (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool)

    if isinstance(prompt, torch.Tensor):
        if prompt.dim() != 2 or prompt.numel() == 0 or not ids_dtype(prompt):
            raise ValueError(f"a prompt tensor must hold integer token ids as [batch, length] with length >= 1, "
                             f"got {prompt.dtype} of shape {list(prompt.shape)} (one prompt: ids[None]; prompts "
                             f"of different lengths: a list of them)")
        return prompt.long(), [prompt.shape[1]] * prompt.shape[0]
    if isinstance(prompt, (str, bytes)) or not isinstance(prompt, (list, tuple)) or not prompt:
        raise ValueError(f"prompt must be a [batch, length] tensor of token ids or a non-empty list of prompts "
                         f"(token ids, not text: tokenize first), got {type(prompt).__name__}")
    if all(isinstance(p, numbers.Integral) for p in prompt):
        raise ValueError("prompt must be a list of prompts, each a list of token ids: one prompt is [ids] (a "
                         "tokenizer's input_ids for one text are one prompt's ids)")
    rows = []
    for i, p in enumerate(prompt):
        ids = None
        if isinstance(p, torch.Tensor):
            ids = p
        elif isinstance(p, (list, tuple)):  # an empty one is said as such, not as torch.tensor([])'s float32
            # a bool among ints would pass as an id (True: 1): the list is then a bool tensor, refused as one is
            bools = any(isinstance(t, (bool, np.bool_)) for t in p)
            ids = torch.tensor(p, dtype=torch.bool if bools else None) if p else torch.zeros(0, dtype=torch.long)
        if ids is None or ids.dim() != 1 or ids.numel() == 0 or not ids_dtype(ids):
            got = (type(p).__name__ if ids is None else "an empty one" if ids.numel() == 0 else
                   f"{ids.dtype} of shape {list(ids.shape)}")
            raise ValueError(f"prompt {i} must be a non-empty 1-D tensor or list of integer token ids, got {got}")
        rows.append(ids.long())
    if len({r.device for r in rows}) > 1:
        raise ValueError("the prompts of one batch must be on one device")
    return nn.utils.rnn.pad_sequence(rows, batch_first=True), [len(r) for r in rows]


def _stop_list(stop_tokens) -> list[int] | None:
    """``stop_tokens`` as a list of ids (None or empty: None): one id (e.g. ``tokenizer.eos_token_id``, as
    transformers' ``eos_token_id`` takes it), or an iterable / tensor of them."""
    if stop_tokens is None:
        return None
    if isinstance(stop_tokens, torch.Tensor):
        stop_tokens = stop_tokens.flatten().tolist()
    one = isinstance(stop_tokens, numbers.Number) or not hasattr(stop_tokens, "__iter__")
    ids = [stop_tokens] if one else list(stop_tokens)
    if not all(_number(t, numbers.Integral) for t in ids):
        raise ValueError(f"stop_tokens must be token ids (integers), one or several, got {stop_tokens!r} (a "
                         "tokenizer without an end-of-sequence token has eos_token_id None: leave it out)")
    return sorted(ids) or None


def _rotary_table(rotary: nn.Module, rows: int, used: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [rows, head_dim] of positions 0..rows-1 (``used`` of them reachable), from the model's rotary module.

    'dynamic' and 'longrope' ropes pick their frequencies by the longest position of a call (transformers'
    `dynamic_rope_update`), unscaled while it stays within the original context: one call for the whole table
    scaled every position once the cache outgrew that context (a 10-token prompt's logits 1.8 off for dynamic, 5.6
    for longrope). Positions within it come from a call within it; past it, from the whole table's call, where
    transformers recomputes the frequencies as a sequence grows (and keeps the keys cached before at the old ones),
    which no static table follows: said when those positions are reachable."""
    device = rotary.inv_freq.device

    def table(n: int):
        cos, sin = rotary(torch.zeros(1, dtype=dtype, device=device), torch.arange(n, device=device)[None])
        return cos[0], sin[0]

    rope_type = getattr(rotary, "rope_type", "default")
    if not ("dynamic" in rope_type or rope_type == "longrope"):
        cos, sin = table(rows)
        return cos.contiguous(), sin.contiguous()
    params = getattr(rotary.config, "rope_parameters", None) or {}
    original = (params.get("original_max_position_embeddings") if rope_type == "longrope" else None) \
        or rotary.original_max_seq_len
    table(1)  # a short call first puts back the unscaled frequencies if an earlier one had grown them
    cos, sin = table(min(rows, original))
    if rows > original:
        if used > original:
            warn(f"this model's {rope_type!r} rope rescales its frequencies with a sequence's length past {original} "
                 "positions, which the engine's one table cannot follow: sequences longer than that may decode "
                 f"otherwise than transformers' generate; keep max_seq_len <= {original}")
        long_cos, long_sin = table(rows)
        cos, sin = torch.cat([cos, long_cos[original:]]), torch.cat([sin, long_sin[original:]])
    return cos.contiguous(), sin.contiguous()


def _warn_of_bypassed_hooks(model: nn.Module, called: set[nn.Module]) -> None:
    """Warn of forward hooks on modules the engine's own forward does not call: they change ``model(...)`` and
    ``model.generate`` but would not change the engine's tokens, without a word."""
    hooked = [name for name, m in model.named_modules() if m not in called and any(
        # not transformers' own: it leaves hooks that record hidden states and attentions (output_hidden_states=True)
        not getattr(hook, "__module__", "").startswith("transformers.")
        for hook in (*m._forward_hooks.values(), *m._forward_pre_hooks.values()))]
    if hooked:
        shown = ", ".join(hooked[:4]) + (f" and {len(hooked) - 4} more" if len(hooked) > 4 else "")
        warn(f"forward hooks on {shown} do not run in nibble.Engine, which runs its own forward of the decoder "
             "(fused norms, projections and attention; of the model's modules it calls the embedding, o_proj, "
             "down_proj and lm_head); model.generate runs them")


def sliding_layers(config) -> bool:
    """Whether some layer attends over a sliding window: as transformers picks each layer's mask, by
    ``config.layer_types`` where the config has it (a Qwen2 whose ``max_window_layers`` covers every layer slides
    nowhere), else wherever a ``sliding_window`` is set and not switched off (Mistral)."""
    types = getattr(config, "layer_types", None)
    if types is not None:
        return "sliding_attention" in types
    return getattr(config, "use_sliding_window", True) and getattr(config, "sliding_window", None) is not None


class Engine:
    """Generation with a static KV cache (and CUDA graphs on CUDA): greedy, or sampled (`Sampling`).

    ``max_batch`` x ``max_seq_len`` sizes the cache (by default the model's context, or its sliding window where a
    layer slides: the engine attends over the whole cache), refused here where it exceeds the device's free memory
    (the CPU's: its physical memory); any batch up to ``max_batch`` runs. A batch of
    prompts is a ``[batch, T]`` tensor of token ids, or a list of prompts of any lengths (1-D tensors
    or lists of ids), which the engine pads at the end (see `prompt_batch`): each sequence then runs at
    its own position, as it would alone. ``cuda_graphs`` (default: on a CUDA device) replays each prefill shape and
    decode step as a CUDA graph (True is refused off CUDA); False launches every kernel eagerly, as a profiler wants.

    The model is prepared in place: put in eval mode, and its 16-bit q/k/v and gate/up weights stacked
    (`stack_weights`: same Parameter objects, same memory). The engine runs its own forward of the decoder
    (fused norms, projections and attention), so of the model's modules it calls only the embedding, o_proj,
    down_proj, lm_head (and an MLP or norm it cannot fuse): a forward hook elsewhere does not run, and is warned of.
    """

    def __init__(self, model: nn.Module, max_batch: int = 1, max_seq_len: int | None = None,
                 cuda_graphs: bool | None = None):
        if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):  # a PeftModel: its adapters wrap the
            model = model.get_base_model()  # base model's layers, which the engine calls
        check_architecture(model)
        check_weights_loaded(model)
        self.model = model.eval()
        cfg = model.config
        self.layers = decoder_layers(model)
        self.embed = model.get_input_embeddings()
        self.norm, self.lm_head = model.model.norm, model.lm_head
        self.silu = getattr(cfg, "hidden_act", None) in _SILU_ACTS
        _warn_of_bypassed_hooks(model, self._called_modules())
        self.device, self.dtype = self.embed.weight.device, self.embed.weight.dtype
        attn = self.layers[0].self_attn
        self.head_dim, self.scale = attn.head_dim, attn.scaling
        self.n_heads, self.n_kv = cfg.num_attention_heads, cfg.num_key_value_heads
        if not _count(max_batch):
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        context = getattr(cfg, "max_position_embeddings", None)
        if max_seq_len is not None and not _count(max_seq_len):
            raise ValueError(f"max_seq_len must be an integer >= 1 (None: the model's context, or its sliding window), "
                             f"got {max_seq_len!r}")
        given = max_seq_len
        # where a layer slides, the engine runs up to the window (it attends over the whole cache): the default too
        window = getattr(cfg, "sliding_window", None) if sliding_layers(cfg) else None
        if max_seq_len is None:
            max_seq_len = min(filter(None, (context, window)))
        self.max_batch = max_batch
        self.max_seq_len = max_seq_len
        # the cache length is padded to a multiple of 16 so the decode mask is aligned for SDPA
        self.capacity = -(-self.max_seq_len // 16) * 16
        self.cuda_graphs = (self.device.type == "cuda") if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and self.device.type != "cuda":
            raise ValueError("cuda_graphs=True needs the model on a CUDA device")
        if window and self.max_seq_len > window:
            raise ValueError(f"max_seq_len={self.max_seq_len} exceeds the model's sliding window ({window}): this "
                             f"engine attends over the whole cache, so it runs up to {window} positions (the default "
                             "here); transformers' model.generate runs longer sequences")
        # refused in its sizes' terms before anything of the capacity is allocated (the rotary table first), where
        # torch failed in its own ("DefaultCPUAllocator: can't allocate memory", CUDA out of memory)
        cache_bytes = 2 * len(self.layers) * max_batch * self.n_kv * self.capacity * self.head_dim * self.dtype.itemsize
        bound = memory_bound(self.device)
        if bound is not None and cache_bytes > bound[0]:
            sized = f"max_seq_len={self.max_seq_len}" + (" (the default)" if given is None else "")
            raise ValueError(f"a KV cache of max_batch={max_batch} x {sized} needs {cache_bytes} bytes "
                             f"({format_bytes(cache_bytes)}), more than {bound[1]}: lower max_seq_len or max_batch")
        if given is not None and context and given > context:
            warn(f"max_seq_len={given} exceeds the model's context ({context} = "
                 "config.max_position_embeddings): positions past it are beyond what the model was trained on")

        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            stack_weights([attn.q_proj, attn.k_proj, attn.v_proj])
            if all(hasattr(mlp, n) for n in ("gate_proj", "up_proj")):
                stack_weights([mlp.gate_proj, mlp.up_proj])
        # where decode attention stores its output for a GPTQ act-order o_proj: its input order's inverse
        self._o_proj_scatters = [torch.argsort(layer.self_attn.o_proj.input_perm)
                                 if isinstance(layer.self_attn.o_proj, PermutedInputQuantLinear) else None
                                 for layer in self.layers]
        with torch.inference_mode():
            self.positions = torch.arange(self.capacity, device=self.device)
            self.cos, self.sin = _rotary_table(model.model.rotary_emb, self.capacity, self.max_seq_len, self.dtype)
            shape = (len(self.layers), max_batch, self.n_kv, self.capacity, self.head_dim)
            self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self._mask_values = torch.tensor([0.0, float("-inf")], dtype=self.dtype, device=self.device)
            # Decode state lives on the device: each sequence's token to feed and its position; and
            # where prefill finds each prompt's last token (its length - 1).
            self.token = torch.zeros(max_batch, 1, dtype=torch.long, device=self.device)
            self.pos = torch.zeros(max_batch, dtype=torch.long, device=self.device)
            self.last = torch.zeros(max_batch, dtype=torch.long, device=self.device)
            # Each live sequence's earliest position whose logits held a NaN or +-inf (_ALL_FINITE: none), which the
            # kernels that pick the tokens record as they read the logits (`next_tokens`' watch): a static buffer the
            # graphs write, reset by each prefill, read where a generation hands its tokens over (`_check_logits`).
            self._nonfinite = torch.full((max_batch,), _ALL_FINITE, dtype=torch.int32, device=self.device)
        self._graphs: dict = {}
        self._batch = self._len = 0  # the live sequences: batch and longest length (host copies)
        self._sampling = GREEDY  # how the live sequences pick their tokens (prefill sets it)
        self._generation = 0  # counts prefills and decodes: an open stream sees another moved the decode state

    def _called_modules(self) -> set[nn.Module]:
        """The model's modules whose own forward `forward` calls (`_attention`, `_mlp`, `_add_norm`)."""
        called = {self.embed, self.lm_head}
        norms = [self.norm]
        for layer in self.layers:
            mlp = layer.mlp
            called.add(layer.self_attn.o_proj)
            norms += [layer.input_layernorm, layer.post_attention_layernorm]
            attn = layer.self_attn
            if hasattr(attn, "q_norm") and _fused_head_norms(attn) is None:
                called.update(m for norm in (attn.q_norm, attn.k_norm) for m in norm.modules())
            if self._gated(mlp):
                called.add(mlp.down_proj)
            else:
                called.update(mlp.modules())
        called.update(m for norm in norms if _rmsnorm_params(norm) is None for m in norm.modules())
        return called

    # ---- the forward pass ------------------------------------------------------------------
    def _add_norm(self, x, residual, norm):
        p = _rmsnorm_params(norm)
        if p is None:
            h = x if residual is None else residual + x
            return h, norm(h)
        return add_rmsnorm(x, residual, *p)

    def _norm_projections(self, x, residual, norm, layers, gated: bool = False):
        """(h, [layer(norm(h)) for layer in layers]) with h = x + residual; gated (layers = gate, up):
        (h, SiLU(gate(norm(h))) * up(norm(h))). W4A4 layers on CUDA get norm(h) quantized by the
        norm's kernel (`add_rmsnorm_quantize`; 16-bit activations, which the op would quantize
        alike), and a gated pair on the Hopper GEMM is one launch that multiplies in its epilogue
        (`w4a4.w4a4_wgmma_silu_mul`) where that pays (`w4a4.gated_preferred`); the rest go through
        `shared_input_forward`, GPTQ act-order layers of one input order with norm(h) written in that
        order by the norm's kernel (`shared_input_perm`): no gather launch of their own."""
        p = _rmsnorm_params(norm)
        fusable = p is not None and x.is_cuda and triton is not None and x.dtype in w4a4.KERNEL_DTYPES
        operands = w4a4_operands(layers, x.dtype) if fusable else None
        if operands is None:
            perm = shared_input_perm(layers) if p is not None else None
            h, y = self._add_norm(x, residual, norm) if perm is None else add_rmsnorm(x, residual, *p, columns=perm)
            ys = shared_input_forward(layers, y, x_in_order=perm is not None)
            return h, silu_mul(*ys) if gated else ys
        B, T, K = x.shape
        order = w4a4.activation_order(B * T, K, [qweight.shape[1] for qweight, _, _ in operands], x.device)
        h, q, scale = add_rmsnorm_quantize(x, residual, *p, order)
        if gated and order == "even_odd" and w4a4.gated_preferred(q, *operands):
            return h, w4a4.w4a4_wgmma_silu_mul(q, scale, *operands, x.dtype, order=order).view(B, T, -1)
        ys = [y.view(B, T, -1) for y in w4a4.w4a4_products(q, scale, operands, x.dtype, order)]
        return h, silu_mul(*ys) if gated else ys

    def _attention(self, i: int, attn: nn.Module, q, k, v, input_pos, mask) -> torch.Tensor:
        B, T, _ = q.shape
        k_cache, v_cache = self.k_cache[i, :B], self.v_cache[i, :B]
        pos = input_pos if mask is None else input_pos[:, None]  # [T] shared, or [B, 1]
        head_norms = _fused_head_norms(attn)  # Qwen3: each head's q and k RMS-normed over its dims before RoPE
        if head_norms is None and hasattr(attn, "q_norm"):  # not both HF's RMSNorm: their own forward
            q, k = (norm(t.view(B, T, -1, self.head_dim)).view(B, T, -1)
                    for norm, t in ((attn.q_norm, q), (attn.k_norm, k)))
        q = rope_and_cache(q, k, v, self.cos, self.sin, pos, k_cache, v_cache, self.n_heads, self.n_kv,
                           self.head_dim, head_norms)  # [B, T, Hq, D]
        rep = self.n_heads // self.n_kv
        if mask is None:  # prefill from position 0: causal attention over the prompts themselves
            # enable_gqa: query head h reads kv head h // rep where it lies (cuDNN's and flash's kernels do),
            # where a copy of the keys and values to every query head cost as much as the attention
            # (benchmarks/scripts/sdpa_backends.py --kv-heads 8)
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k_cache[:, :, :T], v_cache[:, :, :T],
                                               is_causal=True, scale=self.scale, enable_gqa=rep > 1)
            y = y.transpose(1, 2).reshape(B, T, -1)
        else:  # one token: query head h reads kv head h // rep, so fold the rep heads into the query length
            qg = q.reshape(B, self.n_kv, rep, self.head_dim)
            scatter = self._o_proj_scatters[i]
            y = decode_attention(qg, k_cache, v_cache, input_pos, self.scale, mask, scatter).reshape(B, 1, -1)
            if scatter is not None:  # y is in o_proj's input order already
                return attn.o_proj.forward_in_order(y)
        return attn.o_proj(y)

    def _gated(self, mlp: nn.Module) -> bool:
        """Whether `_mlp` runs ``mlp`` as its gate and up projections, fused, then down_proj (else it calls it)."""
        return self.silu and all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))

    def _mlp(self, mlp: nn.Module, x, residual, norm):
        """(h, mlp(norm(h))) with h = x + residual."""
        if self._gated(mlp):
            h, act = self._norm_projections(x, residual, norm, (mlp.gate_proj, mlp.up_proj), gated=True)
            return h, mlp.down_proj(act)
        h, y = self._add_norm(x, residual, norm)
        return h, mlp(y)

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor, last: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, vocab]`` of one position per sequence. Prefill (``last`` given): ``tokens`` [B, T]
        at positions ``input_pos`` [T] from 0, logits at positions ``last`` [B]. Decode (``last`` None):
        one token per sequence [B, 1], sequence b's at position ``input_pos[b]``."""
        B = tokens.shape[0]
        mask = None if last is not None else \
            self._mask_values[(self.positions > input_pos[:, None]).long()].view(B, 1, 1, -1)
        x, residual = self.embed(tokens), None  # x: what the next norm adds to the residual stream
        with sdpa_kernel(_SDPA_BACKENDS, set_priority=True):
            for i, layer in enumerate(self.layers):
                attn = layer.self_attn
                residual, qkv = self._norm_projections(x, residual, layer.input_layernorm,
                                                       (attn.q_proj, attn.k_proj, attn.v_proj))
                x = self._attention(i, attn, *qkv, input_pos, mask)
                residual, x = self._mlp(layer.mlp, x, residual, layer.post_attention_layernorm)
        _, h = self._add_norm(x, residual, self.norm)
        if last is not None:
            h = h.gather(1, last.view(B, 1, 1).expand(B, 1, h.shape[-1]))
        return self.lm_head(h[:, -1])

    # ---- graph-or-eager runners ----------------------------------------------------------
    def _run(self, key, body):
        """Run ``body()`` eagerly, or through the CUDA graph captured for ``key`` (captured on first use)."""
        if not self.cuda_graphs:
            return body()
        if key not in self._graphs:
            # The warm-ups must not move the decode state, nor the generator the sampled steps draw from
            # (a seed repeats a call's draws whether or not it captured the graph), nor record the logits of a step
            # the generation may never take (the second warm-up's).
            state = self.token, self.pos, self._nonfinite
            saved = [t.clone() for t in state]
            with torch.random.fork_rng(devices=[self.device]):
                self._graphs[key] = capture_graph(body, self.device, warmups=2)
            for t, value in zip(state, saved):
                t.copy_(value)
        graph, out = self._graphs[key]
        graph.replay()
        return out

    def _check_open(self):
        if self.k_cache is None:  # else a TypeError from indexing None, deep in the forward
            raise RuntimeError("this engine was closed (close() dropped its cache): build a new Engine to generate")

    def _check_batch(self, B: int, T: int, why: str = ""):
        """Refuse a batch of B sequences that will fill T positions of the cache, ``why`` saying what they are."""
        self._check_open()
        if not 1 <= B <= self.max_batch:
            raise ValueError(f"batch {B} is outside this engine's 1..{self.max_batch} (max_batch)")
        if T > self.max_seq_len:
            raise ValueError(f"{T} positions exceed this engine's max_seq_len={self.max_seq_len}{why}")

    @torch.inference_mode()
    def prefill(self, prompt, sampling: Sampling = GREEDY) -> torch.Tensor:
        """Start new sequences from ``prompt`` ([B, T], or a list of B prompts: `prompt_batch`): fills the
        cache, returns the logits of each prompt's last token [B, V].

        Also sets the decode state: each sequence's next token (picked by ``sampling``, which the decode
        steps of these sequences keep) and position (its prompt's length).
        """
        tokens, lengths = prompt_batch(prompt)
        self._check_ids(tokens)
        return self._prefill(tokens, lengths, sampling)

    def _prefill(self, tokens: torch.Tensor, lengths: list[int], sampling: Sampling) -> torch.Tensor:
        (B, T), longest = tokens.shape, max(lengths)
        self._check_batch(B, T)
        key = ("prefill", B, T)
        if self.cuda_graphs:
            if key not in self._graphs:
                self._graphs[key + ("input",)] = torch.zeros(B, T, dtype=torch.long, device=self.device)
            buf = self._graphs[key + ("input",)]
            buf.copy_(tokens)
        else:
            buf = tokens.to(self.device)
        lengths = torch.tensor(lengths, device=self.device)
        self.last[:B].copy_(lengths - 1)
        self._nonfinite.fill_(_ALL_FINITE)
        logits = self._run(key, lambda: self.forward(buf, self.positions[:T], self.last[:B]))
        self.token[:B, 0].copy_(next_tokens(logits, sampling, (self._nonfinite[:B], self.last[:B])))
        self.pos[:B].copy_(lengths)
        self._batch, self._len, self._sampling = B, longest, sampling
        self._generation += 1
        return logits

    def _decode_body(self, B: int, sampling: Sampling) -> torch.Tensor:
        logits = self.forward(self.token[:B], self.pos[:B])
        self.token[:B, 0].copy_(next_tokens(logits, sampling, (self._nonfinite[:B], self.pos[:B])))
        self.pos[:B].add_(1)
        return logits

    @torch.inference_mode()
    def decode(self, steps: int, collect: bool = True) -> torch.Tensor | None:
        """``steps`` decode steps after ``prefill``; returns the tokens produced [B, steps] if ``collect``.

        Each step feeds each sequence's ``self.token`` at its ``self.pos`` and picks the next as
        ``prefill``'s sampling says (a CUDA graph per batch and sampling); nothing leaves the device
        between steps.
        """
        self._check_open()
        B = self._batch
        if B == 0:
            raise RuntimeError("call prefill(prompt) before decode()")
        # before the state moves: a negative count took the sequences' length back, and the cache check with it
        if not _count(steps):
            raise ValueError(f"steps must be an integer >= 1, got {steps!r}")
        self._generation += 1  # an open stream's next chunk must not start past steps it did not take
        if self._len + steps > self.max_seq_len:
            raise ValueError(f"{self._len} + {steps} positions exceed this engine's max_seq_len={self.max_seq_len}")
        self._len += steps
        out = []
        sampling = self._sampling
        key = ("decode", B) if sampling.greedy else ("decode", B, sampling)
        for _ in range(steps):
            self._run(key, lambda: self._decode_body(B, sampling))
            if collect:
                out.append(self.token[:B, 0].clone())
        return torch.stack(out, dim=1) if collect else None

    def generate(self, prompt, max_new_tokens: int, stop_tokens=None, temperature: float = 0.0,
                 top_k: int | None = None, top_p: float = 1.0) -> torch.Tensor:
        """Continuation of each of the B prompts (``prompt``: [B, T], or a list of prompts of any lengths,
        see `prompt_batch`): the ``max_new_tokens`` new tokens, [B, max_new_tokens]; greedy by default,
        sampled for ``temperature`` > 0 (see `Sampling`, which checks the three).

        ``stop_tokens`` (a token id or several, e.g. ``model.generation_config.eos_token_id``; none by default:
        unlike transformers' generate, the engine reads no generation config; ids outside the vocabulary, which it
        never makes, are refused): stop early once every sequence has produced one, returning
        [B, n <= max_new_tokens]; a sequence that stopped first repeats its stop token until the others do. On
        CUDA the check waits for the device, so it runs every STOP_CHECK_STEPS steps (a batch may run up to that
        many steps past its last stop, the same token repeated), on the CPU every step.

        Where a sequence's logits held a NaN or an infinity at a step up to its first stop token (a float16 model
        whose activations overflowed, a corrupt checkpoint), the tokens picked from them are garbage: after the
        generation, FloatingPointError names the first such step and sequence.
        """
        request = self._request(prompt, max_new_tokens, stop_tokens, temperature, top_k, top_p)
        return torch.cat(list(self._stream(*request, every_chunk=False)), dim=1)

    def stream(self, prompt, max_new_tokens: int, stop_tokens=None, temperature: float = 0.0,
               top_k: int | None = None, top_p: float = 1.0):
        """`generate`'s tokens as they come: an iterator of [B, n] chunks, the first token, then each
        stretch of steps between two stop checks (STOP_CHECK_STEPS on CUDA, one on the CPU), which
        `generate` concatenates. The settings are checked here, before the first chunk is asked for. Logits that
        were not finite raise `generate`'s FloatingPointError in place of the chunk of the tokens picked from them."""
        return self._stream(*self._request(prompt, max_new_tokens, stop_tokens, temperature, top_k, top_p),
                            every_chunk=True)

    def _request(self, prompt, max_new_tokens, stop_tokens, temperature, top_k, top_p):
        """`generate`'s arguments checked, as `_stream` takes them: (tokens, lengths, max_new_tokens, stop ids or None,
        `Sampling`)."""
        sampling = Sampling(temperature, top_k, top_p)
        sampling.warn_if_filters_unused()
        if not _count(max_new_tokens):
            raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}")
        stop = _stop_list(stop_tokens)
        if stop is not None:  # one the model never makes would run every sequence to max_new_tokens without a word
            check_token_ids(self.model, torch.tensor(stop), "stop_tokens'", "give the stop ids of this model's "
                            "tokenizer (none: leave stop_tokens out)")
        tokens, lengths = prompt_batch(prompt)
        # the cache holds the prompt and every new token but the last, which no step reads: said, since a count of
        # one less than the prompt and the new tokens read as a miscount
        longest, room = max(lengths), self.max_seq_len - max(lengths) + 1
        fix = f"give max_new_tokens <= {room}" if room >= 1 else f"shorten it to {self.max_seq_len} tokens or fewer"
        self._check_batch(len(lengths), longest + max_new_tokens - 1,
                          f": the longest prompt's {longest} tokens and max_new_tokens={max_new_tokens} but the last, "
                          f"which no step reads; {fix}, or build the Engine with a larger max_seq_len")
        self._check_ids(tokens)
        return tokens, lengths, max_new_tokens, stop, sampling

    def _check_ids(self, tokens: torch.Tensor) -> None:
        """Refuse ids outside the embedding (an IndexError deep in the forward, or a device assert on CUDA), as
        perplexity, calibration and PE-QAT do: one min/max and one host sync a generate or prefill call, before the
        prefill; never in the decode loop."""
        check_token_ids(self.model, tokens, "the prompts'", "tokenize the prompts with this model's tokenizer")

    @torch.inference_mode()  # a generator: each step of it runs in inference mode
    def _stream(self, tokens, lengths, max_new_tokens, stop_tokens, sampling, every_chunk: bool):
        """The chunks of `stream`. The logits are checked (`_check_logits`: a host sync) before each chunk is handed
        over (``every_chunk``: a stream's reader may act on each, and reads each from the device anyway), or once
        after the last (`generate`, which then waits for the device no more often than before)."""
        B = len(lengths)
        self._prefill(tokens, lengths, sampling)
        generation = self._generation
        stop = None if stop_tokens is None else torch.tensor(stop_tokens, dtype=torch.long, device=self.device)
        stopped = torch.zeros(B, dtype=torch.bool, device=self.device)  # each sequence made a stop token
        ended = torch.zeros(B, dtype=torch.long, device=self.device)  # and which one, first
        # and at which step (0: the prefill's token): its logits after it pick no token it returns
        stop_step = torch.full((B,), max_new_tokens, dtype=torch.long, device=self.device)

        def settled(chunk, done):
            """``chunk`` (the steps after the first ``done``) with each sequence's tokens after its first stop token
            replaced by that token: the batch runs on until every sequence stopped, and what a finished one made
            meanwhile (a next turn of the conversation, say) read as part of its answer; transformers pads such rows
            too."""
            if stop is None:
                return chunk
            hit = torch.isin(chunk, stop)
            if not bool(hit.any() | stopped.any()):  # the common chunk: nothing to settle (one sync a chunk)
                return chunk
            at = hit.int().argmax(1, keepdim=True)
            first = chunk.gather(1, at)[:, 0]
            stop_step.copy_(torch.where(stopped | ~hit.any(1), stop_step, done + at[:, 0]))
            ended.copy_(torch.where(stopped, ended, first))
            past = stopped[:, None] | (hit.cumsum(1) - hit.int() > 0)
            stopped.logical_or_(hit.any(1))
            return torch.where(past, ended[:, None], chunk)

        chunk = settled(self.token[:B, :1].clone(), 0)
        if every_chunk:
            self._check_logits(B, stop_step)
        yield chunk
        every = STOP_CHECK_STEPS if self.device.type == "cuda" else 1
        left = max_new_tokens - 1
        while left > 0:
            if stop is not None and stopped.all():
                break
            if self._generation != generation:  # the decode state below is another generation's now
                raise RuntimeError("this engine ran another generation (prefill, decode, generate or stream) while "
                                   "this stream was open, and holds that one's sequences now: an engine runs one "
                                   "generation at a time; use an Engine per concurrent stream")
            chunk = settled(self.decode(min(every, left)), max_new_tokens - left)
            generation = self._generation
            left -= chunk.shape[1]
            if every_chunk:
                self._check_logits(B, stop_step)
            yield chunk
        if not every_chunk:
            self._check_logits(B, stop_step)

    def _check_logits(self, B: int, stop_step: torch.Tensor) -> None:
        """Raise FloatingPointError where the logits of one of the B live sequences held a NaN or +-inf at a step up
        to its ``stop_step`` (beyond, they pick no token it returns), as the kernels recorded them (`next_tokens`'
        watch): one read of the device. (torch.argmax picks a NaN, which the greedy kernels copy; the sampling
        kernels drop it, and a +inf takes every draw: tokens either way, without a word.)"""
        at, last, stop = torch.stack([self._nonfinite[:B].long(), self.last[:B], stop_step]).tolist()
        flagged = [b for b in range(B) if at[b] != _ALL_FINITE]
        if not flagged:
            return
        # Their keys and values in the cache are not finite either, past the positions a later generation in these
        # rows overwrites: the masked attention over the whole cache (SDPA, the CPU's) read them as NaN there, and
        # every later generation failed. Zeroed, as the cache began.
        self.k_cache[:, flagged] = 0
        self.v_cache[:, flagged] = 0
        bad = [(at[b] - last[b], b) for b in flagged if at[b] - last[b] <= stop[b]]  # step 0: the prefill's logits
        if not bad:
            return
        first, row = min(bad)
        raise nonfinite_logits_error(first, row, len(bad) - 1, B, self.dtype)

    def kv_cache_bytes(self) -> int:
        return 2 * self.k_cache.numel() * self.k_cache.element_size()

    def close(self) -> None:
        """Drop the graphs and the cache (their memory goes back to the allocator)."""
        self._graphs.clear()
        self.k_cache = self.v_cache = None


def nonfinite_logits_error(step: int, row: int, more: int, batch: int, dtype: torch.dtype) -> FloatingPointError:
    """The error for logits that held a NaN or +-inf at decode ``step`` (0: the prefill's, the first new token's) of
    sequence ``row`` of a ``batch`` (and of ``more`` others), in a model computing in ``dtype``: said the same way
    by the engine and by `nibble generate --hf-generate`'s watch over transformers' generate."""
    where = "at the prefill (the first new token's logits)" if step == 0 else \
        f"at decode step {step} (new token {step + 1})"
    if batch > 1:
        where += f" of sequence {row} of the batch" + (f" (and of {more} more)" if more else "")
    broken = "a corrupt checkpoint or a broken layer (weights holding NaN or Inf)"
    name = str(dtype).removeprefix("torch.")
    causes = (f"activations past float16's range (65504): load the model in bfloat16 (dtype=torch.bfloat16); else "
              f"{broken}" if dtype == torch.float16 else f"{broken}, or activations past {name}'s range")
    return FloatingPointError(f"the model's logits held NaN or infinite values {where}: the tokens picked from them "
                              f"are garbage. Likely causes: {causes}")
