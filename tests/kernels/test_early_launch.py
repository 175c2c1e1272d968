"""Programmatic dependent launch (csrc/skinny.cuh: launch_kernel, wait_for_prior_grids; the engine's
glue kernels): a kernel that starts while the previous one still runs must read that kernel's output,
never what the buffer held before.

The producer here is a slow copy launched with PDL that lets its dependents start at once, so the
matmul after it is resident, and would read its input, long before the copy writes it. The input buffer holds garbage until then: a missing or misplaced wait gives a wrong product
(checked on the H200 with the wait removed from the kernel source: these tests fail).
"""
from __future__ import annotations

import pytest
import torch

from conftest import skip_without_cuda_kernel
from nibble.bench.kernels import random_int4
from nibble.bench.w4a4 import random_w4a4
from nibble.kernels import reference, w4a4
from nibble.kernels.early_launch import early_launch
from nibble.kernels import w4a16 as W

CUDA = torch.cuda.is_available()


def _needs_early_launch():
    if not (CUDA and early_launch(torch.device("cuda"))):
        pytest.skip("programmatic dependent launch needs an sm_90+ GPU (and NIBBLE_PDL unset)")
    if not W.mma_applicable(torch.empty(1, 32, device="cuda"), 32, 32, 32):
        skip_without_cuda_kernel("the CUDA kernels are not built here (no nvcc)")


if CUDA:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _slow_copy_kernel(src, dst, n, one, ITERS: tl.constexpr, BLOCK: tl.constexpr):
        gdc_wait()
        gdc_launch_dependents()
        delay = one
        for _ in range(ITERS):  # `one` is 1.0 at run time: ~0.5 ms of dependent multiplies, not folded
            delay = delay * one
        for start in range(tl.program_id(0) * BLOCK, n, tl.num_programs(0) * BLOCK):
            offs = start + tl.arange(0, BLOCK)
            mask = offs < n
            v = tl.load(src + offs, mask=mask).to(tl.float32) * delay  # exact: delay is 1.0
            tl.store(dst + offs, v.to(dst.dtype.element_ty), mask=mask)


def _produce(src: torch.Tensor, dst: torch.Tensor, iters: int = 200000):
    """dst.copy_(src) after ~0.5 ms (longer than a launch from Python), letting the next kernel launch
    at its start. Eight CTAs: the other SMs stay free, so even a dependent whose CTA needs a whole SM
    (the Hopper GEMMs) becomes resident while the copy runs."""
    n = src.numel()
    _slow_copy_kernel[(min(8, triton.cdiv(n, 1024)),)](src, dst, n, 1.0, ITERS=iters, BLOCK=1024, launch_pdl=True)


@pytest.mark.parametrize("M", [1, 5, 16])
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph"])
def test_gpu_w4a16_matmul_waits_for_its_producer(M, graph):
    _needs_early_launch()
    K, G, ns = 4096, 128, (4096, 1024, 1024)
    weights = [random_int4(n, K, G, "cuda") for n in ns]
    src = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    x = torch.empty_like(src)

    def step():
        _produce(src, x)
        return W.w4a16_mma_many(x, weights, G)

    if graph:
        step()
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            ys = step()
    for _ in range(3):
        x.fill_(1e4)  # stale input: what the matmul reads if it does not wait
        src.copy_(torch.randn_like(src))
        if graph:
            g.replay()
        else:
            ys = step()
        torch.cuda.synchronize()
        for y, (qw, s, z) in zip(ys, weights):
            ref = src.double() @ reference.dequantize(qw, s, z, G).double().t()
            err = ((y.double() - ref).norm() / ref.norm()).item()
            assert err < 1e-2, f"relative error {err:.3g}: the kernel read its input before the producer wrote it"


@pytest.mark.parametrize("M,split_k", [(40, 1), (64, 1), (64, 3)])
def test_gpu_w4a16_wgmma_waits_for_its_producer(M, split_k):
    """The Hopper GEMM copies its first weight tiles before it waits; x only after."""
    _needs_early_launch()
    K, N, G = 4096, 2048, 128
    qw, s, z = random_int4(N, K, G, "cuda")
    if not W.wgmma_applicable(torch.empty(1, K, device="cuda"), N, K, G):
        skip_without_cuda_kernel("w4a16_wgmma needs an sm_90 GPU and the built kernel")
    src = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    x = torch.empty_like(src)
    cfg = dict(bn=128, channels=128, split_k=split_k)
    ref = src.double() @ reference.dequantize(qw, s, z, G).double().t()
    for _ in range(3):
        x.fill_(1e4)
        _produce(src, x)
        y = W.w4a16_wgmma(x, qw, s, z, G, config=cfg)
        torch.cuda.synchronize()
        err = ((y.double() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, f"relative error {err:.3g}: the kernel read its input before the producer wrote it"


@pytest.mark.parametrize("produced", ["codes", "scales"])
@pytest.mark.parametrize("M,split_k", [(17, 1), (64, 1), (64, 2)])
def test_gpu_w4a4_wgmma_waits_for_its_producer(M, split_k, produced):
    """The persistent Hopper GEMM: its producer waits before copying x, its consumers before reading
    the token scales."""
    _needs_early_launch()
    K, N = 4096, 1024
    if not w4a4.wgmma_applicable(M, N, K, torch.device("cuda")):
        skip_without_cuda_kernel("w4a4_wgmma needs an sm_90 GPU and the built kernel")
    gen = torch.Generator().manual_seed(M)
    qweight, _ = random_w4a4(N, K, "cuda")
    w_scale = torch.ones(N, device="cuda", dtype=torch.float16)
    codes = torch.randint(-8, 8, (M, K), generator=gen, dtype=torch.int8).cuda()
    scales = torch.rand(M, generator=gen).cuda() + 0.5
    expected = reference.w4a4_accumulate(codes, qweight).double() * scales.double()[:, None]
    src, stale = (w4a4.to_even_odd(codes), 7) if produced == "codes" else (scales, 1e4)
    qx, xs = w4a4.to_even_odd(codes), scales.clone()
    cfg = dict(bn=128, channels=128, split_k=split_k)
    for _ in range(3):
        dst = qx if produced == "codes" else xs
        dst.fill_(stale)
        _produce(src, dst)
        y = w4a4.w4a4_wgmma(qx, xs, qweight, w_scale, None, torch.float32, order="even_odd", config=cfg)
        torch.cuda.synchronize()
        torch.testing.assert_close(y.double(), expected, rtol=1e-6, atol=1e-3,
                                   msg=f"{produced}: read an input before it was written")


@pytest.mark.parametrize("M", [1, 9])
def test_gpu_w4a4_matmul_waits_for_its_producer(M):
    _needs_early_launch()
    K, N = 4096, 4096
    gen = torch.Generator().manual_seed(M)
    qweight, w_scale = random_w4a4(N, K, "cuda")
    src = torch.randint(-8, 8, (M, K), generator=gen, dtype=torch.int8).cuda()
    qx, ones = torch.empty_like(src), torch.ones(M, device="cuda")  # no kernel between producer and product
    for _ in range(3):
        qx.fill_(7)
        _produce(src, qx)
        acc = w4a4.w4a4_mma(qx, ones, qweight, w_scale, out_int32=True)
        torch.cuda.synchronize()
        assert torch.equal(acc, reference.w4a4_accumulate(src, qweight)), "read the input before it was written"


@pytest.mark.parametrize("M,K,rotated", [(3, 4096, False), (60, 4096, False), (1, 11008, True), (5, 11008, True)])
def test_gpu_w4a4_chain_waits_for_its_producer(M, K, rotated):
    """Producer -> activation quantization -> product, both launched early: the op's result is that of
    the produced input (the quantization waits for the producer, the product for the quantization;
    the decode kernel at M = 3, the Hopper GEMM at 60; rotated, the rotate + quantize kernel, a
    cluster per row, csrc/rotate_quantize.cu)."""
    _needs_early_launch()
    N = 2048
    qweight, w_scale = random_w4a4(N, K, "cuda")
    src = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    if rotated and not w4a4.rotate_quantize_applicable(src):
        skip_without_cuda_kernel("the CUDA rotate + quantize kernel is not built here")
    x = torch.empty_like(src)
    expected = torch.ops.nibble.w4a4_linear(src, qweight, w_scale, None, rotated)
    for _ in range(3):
        x.fill_(1e4)
        _produce(src, x)
        y = torch.ops.nibble.w4a4_linear(x, qweight, w_scale, None, rotated)
        torch.cuda.synchronize()
        assert torch.equal(y, expected), "read an input before it was written"


def test_gpu_glue_kernels_wait_for_their_producer():
    """The engine's RMSNorm kernel after an early-launching producer reads the produced rows."""
    _needs_early_launch()
    from nibble.eval.engine import add_rmsnorm
    src = torch.randn(3, 4096, device="cuda", dtype=torch.bfloat16)
    weight = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    x = torch.empty_like(src)
    for _ in range(3):
        x.fill_(1e4)
        _produce(src, x)
        _, y = add_rmsnorm(x, None, weight, 1e-5)
        torch.cuda.synchronize()
        hf = src.float()
        ref = weight * (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(src.dtype)
        torch.testing.assert_close(y, ref)


def test_early_launch_is_for_decode_sized_launches():
    """Up to MAX_TOKENS tokens only (at prefill it measured slower), or a kernel pair's own limit
    (W4A4's quantization and product: 128), and never off CUDA."""
    from nibble.kernels import early_launch as el
    from nibble.kernels import w4a4
    assert el.MAX_TOKENS < w4a4.PRODUCT_EARLY_TOKENS
    assert not el.early_launch(torch.device("cpu"), 1)
    assert not el.early_launch(torch.device("cpu"), 1, w4a4.PRODUCT_EARLY_TOKENS)
    if CUDA:
        dev = torch.device("cuda")
        assert not el.early_launch(dev, el.MAX_TOKENS + 1)
        assert el.early_launch(dev, el.MAX_TOKENS) == el.early_launch(dev, 1)
        assert el.early_launch(dev, w4a4.PRODUCT_EARLY_TOKENS, w4a4.PRODUCT_EARLY_TOKENS) == el.early_launch(dev, 1)
        assert not el.early_launch(dev, w4a4.PRODUCT_EARLY_TOKENS + 1, w4a4.PRODUCT_EARLY_TOKENS)


def test_early_launch_asks_the_launchs_own_gpu_up_to_its_token_limit(monkeypatch):
    """On the CPU, with the per-GPU answer replaced: the token limit is inclusive, and the GPU asked is the one the
    launch runs on (``cuda:1`` is not ``cuda:0``)."""
    from nibble.kernels import early_launch as el

    asked = []
    monkeypatch.setattr(el, "_early_launch", lambda index: asked.append(index) or True)
    assert el.early_launch(torch.device("cuda", 1), el.MAX_TOKENS)
    assert not el.early_launch(torch.device("cuda", 1), el.MAX_TOKENS + 1)
    assert el.early_launch(torch.device("cuda", 0), 100, max_tokens=100)
    assert not el.early_launch(torch.device("cuda", 0), 101, max_tokens=100)
    assert asked == [1, 0]


def test_early_launch_on_cuda_without_an_index_asks_the_current_gpu(monkeypatch):
    """torch.device("cuda") is the current GPU, which need not be GPU 0 (torch.cuda.set_device)."""
    from nibble.kernels import early_launch as el

    asked = []
    monkeypatch.setattr(el, "_early_launch", lambda index: asked.append(index) or True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert el.early_launch(torch.device("cuda"), 1) and asked == [3]


def test_early_launch_needs_hopper_and_nibble_pdl_not_0(monkeypatch):
    """sm_90 and later (programmatic dependent launch); an A100 launches the plain way, and so does a Hopper GPU with
    the switch off (both settings of it here: the tests' environment has it on)."""
    from nibble.kernels import early_launch as el

    for enabled in (False, True):
        monkeypatch.setattr(el, "ENABLED", enabled)
        for capability, expected in (((8, 0), False), ((8, 9), False), ((9, 0), True), ((10, 0), True)):
            monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index, c=capability: c)
            assert el._early_launch.__wrapped__(0) is (expected and enabled)


@pytest.mark.parametrize("value, enabled", [("0", False), ("1", True), ("", True)])
def test_nibble_pdl_0_switches_early_launch_off_at_import(value, enabled):
    """Read once, when nibble is imported: a fresh interpreter on this checkout."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import nibble

    root = str(Path(nibble.__file__).resolve().parents[1])
    env = dict(os.environ, NIBBLE_PDL=value, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", "import nibble.kernels.early_launch as el; print(el.ENABLED)"],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(enabled)


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_early_launch_off_cuda_asks_no_gpu(device, monkeypatch):
    """A CPU or meta device (fake tensors, shape-only tracing) launches the plain way at any token count, without
    asking a GPU (which a CPU-only torch has none of)."""
    from nibble.kernels import early_launch as el

    monkeypatch.setattr(el, "_early_launch", lambda index: pytest.fail(f"asked GPU {index} for a {device} launch"))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: pytest.fail("asked the current GPU"))
    for tokens in (1, el.MAX_TOKENS, el.MAX_TOKENS + 1):
        assert el.early_launch(torch.device(device), tokens) is False


def test_early_launch_without_a_token_count_is_one_tokens(monkeypatch):
    """The tests ask ``early_launch(device)`` whether the GPU takes part at all: one token, within any limit."""
    from nibble.kernels import early_launch as el

    monkeypatch.setattr(el, "_early_launch", lambda index: True)
    assert el.early_launch(torch.device("cuda", 0)) and el.early_launch(torch.device("cuda", 0), max_tokens=1)
