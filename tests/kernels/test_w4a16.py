"""W4A16 op ``torch.ops.nibble.w4a16_linear``: CPU path, input checks, GPU kernels, compile / CUDA graphs.

GPU tests are skipped without CUDA. Tiny-shape runs of the Triton kernels on CPU through the
interpreter are opt-in (slow): ``NIBBLE_TRITON_INTERPRET_TESTS=1 TRITON_INTERPRET=1 pytest tests/kernels/test_w4a16.py``.

Tolerance: the kernel's error against a float64 reference must be at most twice the error of the
same product computed by PyTorch in the activation dtype (``x @ W.to(dtype).T``), plus a tiny atol.
"""
from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from conftest import fake_cuda, poison_new_tensors, reference_on_fake_cuda, skip_without_cuda_kernel
from nibble.kernels import hopper, launch
from nibble.kernels import w4a16 as W
from nibble.kernels.reference import dequantize, w4a16_matmul

CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
INTERP = os.environ.get("NIBBLE_TRITON_INTERPRET_TESTS") == "1" and os.environ.get("TRITON_INTERPRET") == "1"
needs_interp = pytest.mark.skipif(not (INTERP and W.HAS_TRITON),
                                  reason="set NIBBLE_TRITON_INTERPRET_TESTS=1 TRITON_INTERPRET=1 to run")


def make_weight(N, K, G, symmetric=False, device="cpu", seed=0):
    """Random canonical INT4 weight: codes in [0, 15], positive scales, symmetric (z = -8 s) or
    asymmetric integer zero point (z = -zp s)."""
    g = torch.Generator(device=device).manual_seed(seed)
    codes = torch.randint(0, 16, (K, N), generator=g, dtype=torch.int32, device=device)
    from nibble.formats.int4 import pack_int4
    qweight = pack_int4(codes)
    scales = (torch.rand(K // G, N, generator=g, device=device) * 0.02 + 0.002).half()
    if symmetric:
        zeros = (-8 * scales.float()).half()
    else:
        zp = torch.randint(0, 16, (K // G, N), generator=g, device=device).float()
        zeros = (-zp * scales.float()).half()
    return qweight, scales, zeros


def errors(out, x, qweight, scales, zeros, G):
    w = dequantize(qweight, scales, zeros, G)  # fp32 [N, K], on the weight's device
    ref = x.double() @ w.double().t()
    base = (x @ w.to(x.dtype).t()).double()
    den = ref.norm().clamp_min(1e-30)
    return ((out.double() - ref).norm() / den).item(), ((base - ref).norm() / den).item()


def assert_close(out, x, qweight, scales, zeros, G, factor=2.0):
    assert out.shape == (x.shape[0], qweight.shape[1]) and out.dtype == x.dtype
    assert torch.isfinite(out).all(), "non-finite output (unwritten or poisoned element)"
    e, eb = errors(out, x, qweight, scales, zeros, G)
    assert e <= factor * eb + 1e-6, f"rel err {e:.3e} > {factor} x baseline {eb:.3e}"


# ------------------------------------------------------------------------------------------ CPU
def test_cpu_matches_reference():
    qw, s, z = make_weight(64, 256, 64)
    x = torch.randn(5, 256, dtype=torch.bfloat16)
    y = torch.ops.nibble.w4a16_linear(x, qw, s, z, 64)
    torch.testing.assert_close(y, w4a16_matmul(x, qw, s, z, 64))


def test_fake_tensor_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode
    qw, s, z = make_weight(48, 128, 32)
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(3, 128, dtype=torch.float16))
        args = [mode.from_tensor(t) for t in (qw, s, z)]
        y = torch.ops.nibble.w4a16_linear(x, *args, 32)
    assert y.shape == (3, 48) and y.dtype == torch.float16


@pytest.mark.parametrize("bad", ["fp32", "k_not_group", "k_not_8", "shape", "scales_dtype", "x3d"])
def test_input_checks(bad):
    qw, s, z = make_weight(32, 128, 64)
    x = torch.randn(2, 128, dtype=torch.float16)
    G = 64
    exc = ValueError
    if bad == "fp32":
        x, exc, says = x.float(), TypeError, "float16 or bfloat16, got torch.float32"
    elif bad == "k_not_group":
        G, says = 48, "in_features=128 is not divisible by group_size=48"
    elif bad == "k_not_8":
        x, says = torch.randn(2, 124, dtype=torch.float16), "K=124 must be a multiple of 8"
    elif bad == "shape":
        s, says = s[:1], r"scales must have shape \(2, 32\)"
    elif bad == "scales_dtype":
        s, exc, says = s.float(), TypeError, "scales must be float16"
    elif bad == "x3d":
        x, says = x[None], r"shape \[M, K\]"
    with pytest.raises(exc, match=says):
        torch.ops.nibble.w4a16_linear(x, qw, s, z, G)
    # the fake implementations refuse at trace time what the op refuses at run time (they checked x's rank only)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fakes = [mode.from_tensor(t) for t in (x, qw, s, z)]
        for call in (lambda: torch.ops.nibble.w4a16_linear(*fakes, G),
                     lambda: torch.ops.nibble.w4a16_linears(fakes[0], [fakes[1]], [fakes[2]], [fakes[3]], G)):
            with pytest.raises(exc, match=says):
                call()


def test_the_cpu_path_says_a_qweight_of_another_rank_is_the_wrong_shape():
    """Checked with x's width, before the weight's own checks: a shape error, said as one."""
    from nibble import kernels

    qw, s, z = make_weight(32, 128, 64)
    x = torch.randn(2, 128, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"qweight must be a 2-D int32 tensor \[K // 8, N\], got shape \(1, 16, 32\)"):
        kernels.w4a16_linear(x, qw[None], s, z, 64)
    with pytest.raises(ValueError, match=r"x has K=120 in its last dimension but qweight \(16, 32\) packs K=128"):
        kernels.w4a16_linear(x[:, :120], qw, s, z, 64)


def test_the_cpu_path_refuses_a_bias_that_is_not_one_float_a_channel():
    """A [N, 1] bias broadcast into an [M, N] sum of another shape, an integer one was added as integers: refused as the
    GPU path refuses them."""
    from nibble import kernels

    qw, s, z = make_weight(32, 128, 64)
    x = torch.randn(2, 128)
    for bias in (torch.randn(32, 1), torch.randn(2, 32), torch.ones(32, dtype=torch.int32)):
        for call in (lambda: kernels.w4a16_linear(x, qw, s, z, 64, bias),
                     lambda: kernels.w4a16_linears(x, [(qw, s, z, bias)], 64)):
            with pytest.raises(ValueError, match=r"bias must be a float tensor of shape \[32\]"):
                call()


def test_the_kernels_functions_take_the_ops_under_a_dispatch_mode():
    """Under FakeTensorMode (make_fx, memory estimators) the functions ran the kernels' bodies on tensors without
    data (on a GPU: launches on fake tensors); the ops answer with their fake implementations."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from nibble import kernels
    from nibble.formats.int4 import pack_int4
    mode = FakeTensorMode()
    w4a4_weight = (pack_int4(torch.randint(0, 16, (128, 24), dtype=torch.int32)), torch.rand(24).half())
    x, qw, s, z, qw4, s4 = fake_cuda(mode, torch.randn(3, 128, dtype=torch.float16), *make_weight(48, 128, 32),
                                     *w4a4_weight)
    with mode:
        y = kernels.w4a16_linear(x, qw, s, z, 32)
        y4 = kernels.w4a4_linear(x, qw4, s4, None, True)
    assert (y.shape, y.device.type, y4.shape, y4.dtype) == ((3, 48), "cuda", (3, 24), torch.float16)


@reference_on_fake_cuda
def test_backend_reference_runs_the_reference_on_cuda_tensors_too(monkeypatch):
    """backend="reference" forces PyTorch's reference wherever x is, on a GPU as well, where "auto" takes the op (while
    the kernels can run there); only CPU tensors ran it in the tests, where it is every backend's path but "triton"."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from nibble import kernels
    from nibble.kernels import reference
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # the reference makes small constant tensors of its own
    x, qw, s, z = fake_cuda(mode, torch.randn(3, 128, dtype=torch.float16), *make_weight(48, 128, 32))
    ran, real = [], reference.w4a16_matmul
    monkeypatch.setattr(reference, "w4a16_matmul", lambda *a: ran.append(a[0].device.type) or real(*a))
    with mode:
        for backend, runs in (("reference", ["cuda"]), ("auto", ["cuda"] if kernels.TRITON_UNUSABLE else [])):
            ran.clear()
            y = kernels.w4a16_linear(x, qw, s, z, 32, backend=backend)
            assert (y.shape, y.device.type, ran) == ((3, 48), "cuda", runs)


@reference_on_fake_cuda
def test_the_reference_on_a_gpu_is_said_for_cuda_tensors_outside_tracing_only(monkeypatch):
    """Where the kernels cannot run (TRITON_UNUSABLE), "auto" runs the reference and warns that it runs on the GPU: for
    a CUDA tensor, never for a CPU one (the reference is the CPU's path: nothing to say), nor under a dispatch mode
    or torch.compile (the warning reads the caller's frames, which Dynamo cannot trace)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from nibble import kernels
    said = []
    monkeypatch.setattr(kernels, "TRITON_UNUSABLE", "need the `triton` package")
    monkeypatch.setattr(kernels, "warn_reference_on_gpu", lambda: said.append("warned"))
    qw, s, z = make_weight(48, 128, 32)
    assert kernels.w4a16_linear(torch.randn(3, 128), qw, s, z, 32).shape == (3, 48) and said == []
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes = fake_cuda(mode, torch.randn(3, 128, dtype=torch.float16), qw, s, z)
    with mode:
        assert kernels.w4a16_linear(*fakes, 32).shape == (3, 48)
    assert said == []
    assert kernels._use_kernel(fakes[0], "auto") is False and said == ["warned"]  # a CUDA tensor, eagerly


def test_forward_mode_ad_without_torch_func_counts_as_a_transform():
    """`transforms_active` (which QuantLinear and the Hadamard op ask for a jvp) sees torch.autograd.forward_ad's dual
    level too, where no functorch transform is active; the torch.func tests saw only functorch's flag."""
    import torch.autograd.forward_ad as fwAD
    from nibble import kernels

    assert not kernels.transforms_active()
    with fwAD.dual_level():
        assert kernels.transforms_active() and not torch._C._are_functorch_transforms_active()
    assert not kernels.transforms_active()


def test_float32_activations_on_the_op_path_come_back_float32_in_their_leading_dims():
    """The GPU kernels run float32 x in bfloat16 (`_kernel_input`) and every output is cast back to x's type, in x's
    leading dims (fake CUDA tensors: the op path without a GPU). The op path's other tests ran 16-bit x, or compared
    a compiled call with an eager one, which came back in the same wrong type."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from nibble import kernels
    from nibble.formats.int4 import pack_int4
    mode = FakeTensorMode()
    x, qw, s, z, bias, qw4, s4 = fake_cuda(mode, torch.randn(2, 3, 128), *make_weight(48, 128, 32), torch.randn(48),
                                            pack_int4(torch.randint(0, 16, (128, 24), dtype=torch.int32)),
                                            torch.rand(24).half())
    with mode:
        ys = [kernels.w4a16_linear(x, qw, s, z, 32), kernels.w4a16_linear(x, qw, s, z, 32, bias),
              *kernels.w4a16_linears(x, [(qw, s, z, None), (qw, s, z, bias)], 32),
              kernels.w4a4_linear(x, qw4, s4, None, True), *kernels.w4a4_linears(x, [(qw4, s4, None)] * 2)]
    assert [(y.shape[:2], y.dtype) for y in ys] == [((2, 3), torch.float32)] * 7


def test_the_op_path_refuses_a_bias_that_is_not_one_float_a_channel():
    """On the op path (a GPU) the bias is added after the op, by `_finish`: a [N, 1] one broadcast into another sum
    where M == N, an integer one was added; refused there with the CPU path's words (fake CUDA tensors)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from nibble import kernels
    mode = FakeTensorMode()
    x, qw, s, z = fake_cuda(mode, torch.randn(48, 128, dtype=torch.float16), *make_weight(48, 128, 32))
    for bias in (torch.randn(48, 1), torch.ones(48, dtype=torch.int32)):
        (b,) = fake_cuda(mode, bias)
        with mode:
            for call in (lambda: kernels.w4a16_linear(x, qw, s, z, 32, b),
                         lambda: kernels.w4a16_linears(x, [(qw, s, z, b)], 32)):
                with pytest.raises(ValueError, match=r"bias must be a float tensor of shape \[48\]"):
                    call()


def test_gather_columns_takes_the_reference_under_a_dispatch_mode():
    """Under FakeTensorMode (make_fx, memory estimators) or torch.compile the gather is index_select, which traces; the
    Triton kernel would launch on CUDA tensors without data."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from nibble import kernels
    mode = FakeTensorMode()
    x, index = fake_cuda(mode, torch.randn(2, 3, 128, dtype=torch.float16), torch.randperm(128))
    with mode:
        y = kernels.gather_columns(x, index)
    assert (y.shape, y.dtype, y.device.type) == ((2, 3, 128), torch.float16, "cuda")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="the interpreter runs the Triton kernels on CPU")
@pytest.mark.skipif(W.triton is None, reason="without triton the entry points say they need it first")
def test_the_gpu_entry_points_refuse_cpu_tensors_by_name():
    """Called with CPU tensors they failed inside Triton ("0 active drivers") or torch ("Torch not compiled with
    CUDA enabled"); every kernel family says it with one check (`triton_device.check_triton_device`)."""
    from nibble.kernels import hadamard, w4a4

    qw, s, z = make_weight(32, 128, 64)
    x = torch.randn(2, 128, dtype=torch.float16)
    calls = {"W4A16 Triton kernels need CUDA tensors": [
        lambda: W.w4a16_linear_cuda(x, qw, s, z, 64),
        lambda: W._launch(x, qw, s, z, 64, W.select_config(2, 32, 128, 64)),
        lambda: W.gather_columns(x, torch.randperm(128))],
        "W4A4 kernels need CUDA tensors": [lambda: w4a4.quantize_activations_triton(x)],
        "Hadamard kernels need CUDA tensors": [lambda: hadamard.hadamard_transform_triton(x)],
        "w4a16_mma is a CUDA kernel": [lambda: W.w4a16_mma(x, qw, s, z, 64)]}
    for says, fns in calls.items():
        for fn in fns:
            with pytest.raises(ValueError, match=f"{says}.*got device cpu"):
                fn()


def test_dequantize_checks_the_weight():
    """The dense dequantization (the op's many-token path, the benchmarks' bf16 copy) refuses a group
    that does not divide K, or scales of another group, instead of reading past their rows."""
    qw, s, z = make_weight(32, 576, 64)
    assert W.dequantize_cuda(qw, s, z, 64, dtype=torch.float32).shape == (32, 576)
    with pytest.raises(ValueError, match="in_features=576 is not divisible by group_size=128"):
        W.dequantize_cuda(qw, s, z, 128)
    with pytest.raises(ValueError, match=r"shape \(4, 32\)"):
        W.dequantize_cuda(qw, s[:8], z[:8], 72 * 2)
    with pytest.raises(ValueError, match=r"scales must have shape \(18, 32\)"):
        W.dequantize_cuda(qw, s, z, 32)


def test_dequantize_off_the_gpu_returns_the_dtype_asked_bfloat16_by_default():
    """Its CPU fallback (the reference) in the GPU pass's type: bfloat16 unless asked, the float32 weight rounded once
    (the test above asks for float32, the reference's own default, so a dropped dtype passed)."""
    qw, s, z = make_weight(32, 576, 64)
    w32 = dequantize(qw, s, z, 64)
    w = W.dequantize_cuda(qw, s, z, 64)
    assert w.dtype == torch.bfloat16 and torch.equal(w, w32.bfloat16())
    w = W.dequantize_cuda(qw, s, z, 64, dtype=torch.float16)
    assert w.dtype == torch.float16 and torch.equal(w, w32.half())


def _run_elsewhere(code: str) -> subprocess.CompletedProcess:
    """``code`` run by a fresh interpreter on this checkout (outside Triton's interpreter), checked to succeed."""
    env = dict(os.environ, PYTHONPATH=os.getcwd() + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return r


def test_imports_without_triton():
    code = ("import sys; sys.modules['triton'] = None; sys.modules['triton.language'] = None\n"
            "import torch, nibble.kernels.w4a16 as W\n"
            "assert not W.HAS_TRITON\n"
            "from nibble.quantize.rtn import rtn_quantize\n"
            "q = rtn_quantize(torch.randn(16, 64), 32)\n"
            "y = torch.ops.nibble.w4a16_linear(torch.randn(2, 64).half(), q.qweight, q.scales, q.zeros, 32)\n"
            "assert y.shape == (2, 16)\n")
    _run_elsewhere(code)


def test_a_triton_older_than_the_kernels_need_is_named_with_its_version():
    """A triton without programmatic dependent launch (before 3.4: torch 2.7's 3.3) failed the kernel modules' imports
    as if it were missing: the W4A16 kernels said "need triton; install it" where it was installed, and the W4A4 ones
    "need the `triton` package (pip install triton)"."""
    pytest.importorskip("triton")
    code = ("import importlib, triton, torch\n"
            "del importlib.import_module('triton.language.extra.cuda').gdc_launch_dependents\n"
            "triton.__version__ = '3.3.1'\n"
            "from nibble.kernels import w4a16, w4a4, KernelUnavailableError, triton_device\n"
            "assert not w4a16.HAS_TRITON and w4a4.triton is None\n"
            "print(triton_device.TRITON_UNUSABLE)\n"
            "try:\n"
            "    w4a4.quantize_activations_triton(torch.randn(2, 64, dtype=torch.float16))\n"
            "except KernelUnavailableError as e:\n"
            "    print(e)\n")
    r = _run_elsewhere(code)
    need = "need triton >= 3.4 (programmatic dependent launch), found triton 3.3.1: pip install -U 'triton>=3.4'"
    assert r.stdout.splitlines() == [need, f"the W4A4 kernels {need}"]


def test_a_gpu_without_usable_triton_runs_the_reference_and_says_so_once():
    """Backend "auto" on CUDA tensors where the kernels cannot run: W4A16 raised, while W4A4's product and the
    Hadamard op ran PyTorch's reference on the GPU without a word. Now all three run the reference and one warning
    says why; backend="triton" refuses. Without a GPU, only the warning's text is checked."""
    pytest.importorskip("triton")
    code = ("import importlib, warnings, triton, torch\n"
            "del importlib.import_module('triton.language.extra.cuda').gdc_launch_dependents\n"
            "triton.__version__ = '3.3.1'\n"
            "import nibble.kernels as K\n"
            "from nibble.kernels import reference, triton_device\n"
            "from nibble.kernels.hadamard import hadamard_transform, hadamard_transform_reference\n"
            "from nibble.formats.int4 import pack_int4\n"
            "from nibble.quantize.rtn import rtn_quantize\n"
            "warnings.simplefilter('always')\n"
            "with warnings.catch_warnings(record=True) as said:\n"
            "    if not torch.cuda.is_available():\n"
            "        triton_device.warn_reference_on_gpu(); triton_device.warn_reference_on_gpu()\n"
            "    else:\n"
            "        x = torch.randn(3, 256, device='cuda', dtype=torch.bfloat16)\n"
            "        q = rtn_quantize(torch.randn(48, 256), 128)\n"
            "        w = [t.cuda() for t in (q.qweight, q.scales, q.zeros)]\n"
            "        for _ in range(2):\n"
            "            assert torch.equal(K.w4a16_linear(x, *w, 128), reference.w4a16_matmul(x, *w, 128))\n"
            "        qw = pack_int4(torch.randint(0, 16, (256, 48), dtype=torch.int32)).cuda()\n"
            "        ws = torch.rand(48, device='cuda').half()\n"
            "        assert torch.equal(K.w4a4_linear(x, qw, ws, input_hadamard=True),\n"
            "                           reference.w4a4_linear(x, qw, ws, None, True))\n"
            "        assert torch.equal(torch.ops.nibble.w4a4_linear(x, qw, ws, None, True),\n"
            "                           reference.w4a4_linear(x, qw, ws, None, True))\n"
            "        assert torch.equal(hadamard_transform(x), hadamard_transform_reference(x))\n"
            "        try:\n"
            "            K.w4a16_linear(x, *w, 128, backend='triton')\n"
            "            raise AssertionError('backend=triton ran')\n"
            "        except K.KernelUnavailableError as e:\n"
            "            print(e)\n"
            "print(len(said), said[0].message)\n")
    r = _run_elsewhere(code)
    need = "need triton >= 3.4 (programmatic dependent launch), found triton 3.3.1: pip install -U 'triton>=3.4'"
    lines = r.stdout.splitlines()
    assert lines[-1] == (f"1 nibble's GPU kernels {need}; until then, PyTorch's reference runs on the GPU (the same "
                         "values, many times slower); backend='triton' makes this an error")
    assert lines[:-1] == ([f"the GPU kernels {need}"] if CUDA else [])


def test_select_config_is_pure_and_covers_all_m():
    for M in (1, 2, 3, 16, 17, 64, 65, 1000, 100000):
        for N, K, G in ((4096, 4096, 128), (576, 1536, 64), (28672, 8192, 32)):
            a = W.select_config(M, N, K, G)
            assert a == W.select_config(M, N, K, G)
            assert a.split_k >= 1


# ---------------------------------------------------------------------------------- interpreter
@needs_interp
@pytest.mark.parametrize("M,N,K,G,dtype,kind", [
    (1, 64, 256, 128, torch.float16, "gemv"),
    (2, 40, 192, 64, torch.float16, "gemv"),
    (3, 64, 256, 128, torch.float16, "dot"),
    (5, 48, 192, 32, torch.float16, "dot_nf"),
    (20, 64, 256, 128, torch.float16, "dot_tr"),
    # bf16, factored (its raw codes exact in bf16; its dots in float32 under the interpreter), split-K. (Not
    # the dequantizing mode: the interpreter truncates the weights to bf16, where GPUs round them.)
    (7, 40, 384, 128, torch.bfloat16, "dot_tr"),
    # the planes in natural K order (dq_asm=0: Triton ops on CUDA too), factored and not, K off the block
    (5, 40, 256, 128, torch.float16, "dot_dq0"),
    (3, 48, 192, 32, torch.float16, "dot_nf_dq0"),
    # unfactored with the weight as the MMA's A operand (the shipped M <= 16 config with GPTQ's g32/g64) and K on
    # the block (unmasked scale and zero tiles), both slot orders; the gemv in bf16 (x read as float32, no bf16 dot)
    (5, 40, 256, 32, torch.float16, "dot_nf_tr"),
    (5, 40, 256, 32, torch.float16, "dot_nf_tr_dq0"),
    (1, 64, 256, 128, torch.bfloat16, "gemv"),
])
def test_interpreter_tiny(M, N, K, G, dtype, kind):
    qw, s, z = make_weight(N, K, G, seed=M)
    # x is followed in memory by a NaN: a K mask one column too wide read it for the last token (past K the weight
    # is 0, and a finite stray value times 0 changed nothing: K = 192 passed with the mask off by one)
    buf = torch.full((M * K + 1,), float("nan"), dtype=dtype)
    x = buf[:-1].view(M, K)
    x.copy_(torch.randn(M, K, dtype=dtype))
    cfg = {"gemv": W.Config(kind="gemv", block_n=32, block_k=64, split_k=2),
           "dot": W.Config(block_m=16, block_n=32, block_k=128, split_k=2),
           "dot_nf": W.Config(block_m=16, block_n=32, block_k=128, factored=False),
           "dot_tr": W.Config(block_m=16, block_n=32, block_k=128, trans=True, split_k=2),
           "dot_dq0": W.Config(block_m=16, block_n=32, block_k=128, trans=True, split_k=2, dq_asm=0),
           "dot_nf_dq0": W.Config(block_m=16, block_n=32, block_k=128, factored=False, dq_asm=0),
           "dot_nf_tr": W.Config(block_m=16, block_n=32, block_k=128, factored=False, trans=True),
           "dot_nf_tr_dq0": W.Config(block_m=16, block_n=32, block_k=128, factored=False, trans=True, dq_asm=0)}[kind]
    out = torch.full((M, N), float("nan"), dtype=dtype)
    W._launch(x, qw, s, z, G, cfg, out=out)
    assert_close(out, x, qw, s, z, G)


DEQUANT_SHAPES = [(40, 192, 64), (64, 256, 128), (100, 320, 32), (72, 136, 8)]  # N, K off the 64 x 128 blocks


def assert_dequantized(out, qw, s, z, G):
    """Every element written, each the float32 spec rounded once to out's dtype (one ulp: the kernel's fp32 sum
    runs in another order)."""
    ref = dequantize(qw, s, z, G).to(out.device)
    assert torch.isfinite(out).all(), "unwritten (NaN-poisoned) element"
    ulp = torch.finfo(out.dtype).eps * ref.abs() + torch.finfo(out.dtype).tiny
    assert ((out.float() - ref).abs() <= ulp).all()


@needs_interp
@pytest.mark.parametrize("N,K,G", DEQUANT_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_interpreter_dequantize(N, K, G, dtype):
    qw, s, z = make_weight(N, K, G, seed=N + K)
    out = torch.full((N, K), float("nan"), dtype=dtype)
    W._dequantize_launch(qw, s, z, G, out)
    assert_dequantized(out, qw, s, z, G)


# ------------------------------------------------------------------------------------------ GPU
# (N, K) from real models: Llama-2-7B q/o (4096, 4096), up (11008, 4096), down (4096, 11008);
# Llama-3-8B k/v (1024, 4096), up (14336, 4096), down (4096, 14336); Qwen2-0.5B (896, 896),
# (4864, 896), (896, 4864); SmolLM2-135M MLP (1536 / 576, 576 / 1536);
# Llama-70B up (28672, 8192), down (8192, 28672).
SHAPES_G = [
    ((4096, 4096), 128), ((11008, 4096), 128), ((4096, 11008), 128), ((1024, 4096), 128),
    ((14336, 4096), 64), ((4096, 14336), 32), ((4864, 896), 64), ((896, 4864), 32),
    ((1536, 576), 64), ((576, 1536), 128),
]
MS = [1, 3, 17, 100, 1000]


@needs_cuda
@pytest.mark.parametrize("shape_g", SHAPES_G, ids=lambda v: f"N{v[0][0]}_K{v[0][1]}_G{v[1]}")
@pytest.mark.parametrize("M", MS)
def test_gpu_shapes(shape_g, M):
    (N, K), G = shape_g
    i = SHAPES_G.index(shape_g) + M
    dtype = torch.bfloat16 if i % 2 else torch.float16
    qw, s, z = make_weight(N, K, G, symmetric=(i % 3 == 0), device="cuda", seed=i)
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    y = torch.ops.nibble.w4a16_linear(x, qw, s, z, G)
    torch.cuda.synchronize()
    assert_close(y, x, qw, s, z, G)


@needs_cuda
@pytest.mark.parametrize("M", [1, 2, 5, 16, 33, 64, 65, 300])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_poisoned_out_every_bucket(M, dtype):
    """Every M bucket writes every output of a NaN-filled `out`: the dispatch's own path (on Hopper
    the CUDA kernels, or dequantize + cuBLAS), and the Triton bucket `select_config` names for M (gemv,
    dot with split-K, dequantize), the path of GPUs the CUDA kernels do not run on."""
    N, K, G = 3072, 2048, 128
    qw, s, z = make_weight(N, K, G, device="cuda", seed=M)
    x = torch.randn(M, K, device="cuda", dtype=dtype) * 3
    for config in (None, W.select_config(M, N, K, G, launch.num_sms(x.device))):
        out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
        W.w4a16_linear_cuda(x, qw, s, z, G, config=config, out=out)
        torch.cuda.synchronize()
        assert_close(out, x, qw, s, z, G)


@needs_cuda
@pytest.mark.parametrize("N,K,G", DEQUANT_SHAPES + [(11008, 4096, 128), (4096, 14336, 32)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_gpu_dequantize_writes_every_element(N, K, G, dtype):
    """The dense pass of the dequantize + cuBLAS path (GPUs without the CUDA kernels, above 16 tokens)."""
    qw, s, z = make_weight(N, K, G, device="cuda", seed=N + K)
    out = torch.full((N, K), float("nan"), dtype=dtype, device="cuda")
    assert W.dequantize_cuda(qw, s, z, G, dtype=dtype, out=out) is out
    torch.cuda.synchronize()
    assert_dequantized(out, qw, s, z, G)


@needs_cuda
@pytest.mark.parametrize("cfg", [
    W.Config(kind="gemv", block_n=512, block_k=64, num_warps=4, num_stages=1, split_k=3),
    W.Config(block_m=16, block_n=64, num_warps=4, num_stages=3, trans=True, split_k=5),
], ids=lambda c: f"{c.kind}_m{c.block_m}_n{c.block_n}_k{c.block_k}_s{c.split_k}_t{int(c.trans)}_f{int(c.factored)}_a{c.dq_asm}")
@pytest.mark.parametrize("M", [1, 2, 7, 16])
def test_gpu_explicit_configs(cfg, M):
    """Every kernel variant the dispatch table may name, incl. odd N (masked), K % BLOCK_K != 0 and
    the factored epilogue (groups of 128, a multiple of the dot kernel's K block)."""
    if cfg.kind == "gemv" and M > 2:
        pytest.skip("gemv handles M <= 2")
    for (N, K, G) in ((1000, 576, 64), (520, 4864, 32), (1000, 1664, 128)):
        for dtype in (torch.float16, torch.bfloat16):
            qw, s, z = make_weight(N, K, G, symmetric=(N == 1000), device="cuda", seed=N + M)
            x = torch.randn(M, K, device="cuda", dtype=dtype)
            out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
            W._launch(x, qw, s, z, G, cfg, out=out)
            torch.cuda.synchronize()
            assert_close(out, x, qw, s, z, G)


MMA_CONFIGS = [c for c in (W.MmaConfig(t, w, l1) for t in (1, 2, 4, 8) for w in (1, 4, 8, 16) for l1 in (False, True))
               if W.mma_config_valid(c, 8 * c.token_tiles)]


@needs_cuda
@pytest.mark.parametrize("cfg", MMA_CONFIGS, ids=lambda c: f"t{c.token_tiles}_w{c.warps}" + "_l1" * c.x_l1)
def test_gpu_mma_every_config(cfg):
    """The CUDA tensor-core kernel in every instantiation: SmolLM2's k/v shape (N = 192), one group
    per column, group 32, K = 65 steps of 32 (uneven split over warps, fewer steps than stages), 3 groups
    of 128 (fewer groups than warps: warps own whole groups), groups of 256 (group ends counted at run
    time), odd M."""
    if not W.mma_applicable(torch.empty(1, 32, device="cuda"), 32, 32, 32):
        skip_without_cuda_kernel("CUDA kernel not built here (no nvcc or sm < 80)")
    for (N, K, G) in ((192, 576, 64), (576, 1536, 1536), (1024, 2080, 32), (96, 384, 128), (256, 1024, 256)):
        for M in sorted({1, max(1, 8 * cfg.token_tiles - 3), 8 * cfg.token_tiles}):
            dtype = torch.bfloat16 if (M + N) % 2 else torch.float16
            qw, s, z = make_weight(N, K, G, symmetric=(N == 576), device="cuda", seed=N + M)
            x = torch.randn(M, K, device="cuda", dtype=dtype) * 2
            out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
            W.w4a16_mma(x, qw, s, z, G, config=cfg, out=out)
            torch.cuda.synchronize()
            assert_close(out, x, qw, s, z, G)


@needs_cuda
@pytest.mark.parametrize("G", [64, 128, 256])
@pytest.mark.parametrize("M", [1, 16, 29, 64])
def test_gpu_mma_zero_and_far_apart_scales(M, G):
    """Groups whose scale is 0 (a constant group: the weight is its zero), the smallest fp16
    subnormal, and neighbours 10^6 apart: at four token tiles (here M = 29) the kernel keeps its sums
    in units of the current group's scale (csrc/w4a16_mma.cu: RunningFold), which must neither divide
    by a zero scale nor lose the sums across such steps; the other M take the fresh-sum fold."""
    if not W.mma_applicable(torch.empty(1, 32, device="cuda"), 32, 32, 32):
        skip_without_cuda_kernel("CUDA kernel not built here (no nvcc or sm < 80)")
    N, K = 512, 2048
    qw, s, z = make_weight(N, K, G, device="cuda", seed=M + G)
    groups = K // G
    s[1::4] = 0                                  # constant groups: weight = z
    s[2::4, ::3] = 2.0 ** -24                    # the smallest fp16 subnormal
    s[3::4, 1::2] *= 1000                        # next to ...
    s[0::4, 1::2] /= 1000                        # ... far smaller ones
    z[1::4] = torch.randn(z[1::4].shape, device="cuda").half() * 0.01
    assert (s == 0).any() and groups >= 4
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(M, K, device="cuda", dtype=dtype)
        out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
        W.w4a16_mma(x, qw, s, z, G, out=out)
        torch.cuda.synchronize()
        assert_close(out, x, qw, s, z, G)


@needs_cuda
@pytest.mark.parametrize("M", [1, 3, 8, 13, 16, 29, 32])
def test_gpu_mma_many_weights(M):
    """Up to three weights in one launch (a block's q/k/v): each output matches its own product;
    weights of different widths (CTAs numbered across them), groups of 32 / 128 / per column, outputs
    poisoned, and a non-contiguous output row stride."""
    if not W.mma_applicable(torch.empty(1, 32, device="cuda"), 32, 32, 32):
        skip_without_cuda_kernel("CUDA kernel not built here (no nvcc or sm < 80)")
    for K, G, ns in ((576, 64, (576, 192, 192)), (2048, 128, (1024, 256)), (1536, 1536, (96, 4096, 32)),
                     (1024, 32, (320,))):
        dtype = torch.bfloat16 if (M + K) % 2 else torch.float16
        weights = [make_weight(n, K, G, symmetric=i == 1, device="cuda", seed=M + n + i) for i, n in enumerate(ns)]
        x = torch.randn(M, K, device="cuda", dtype=dtype) * 2
        padded = [torch.full((M, n + 32), float("nan"), device="cuda", dtype=dtype) for n in ns]
        W.w4a16_mma_many(x, weights, G, outs=[p[:, :n] for p, n in zip(padded, ns)])
        torch.cuda.synchronize()
        for p, n, w in zip(padded, ns, weights):
            assert_close(p[:, :n], x, *w, G)
            assert torch.isnan(p[:, n:]).all(), "wrote past its columns"
        for warps in (4, 16 if M <= 16 else 8):
            ys = W.w4a16_mma_many(x, weights, G, config=W.MmaConfig(W.select_mma_config(M, 32, K).token_tiles, warps))
            for y, w in zip(ys, weights):
                assert_close(y, x, *w, G)


@needs_cuda
@pytest.mark.parametrize("M", [1, 5, 8, 13, 16])
def test_gpu_mma_x_through_l1(M):
    """x copied through the L1 or around it (``MmaConfig.x_l1``) gives the same bits and the
    reference's values, on layers on both sides of ``x_through_l1`` (more CTAs than SMs or fewer, K
    up to 4096 or deeper), single and several weights, groups of 64 / 128, outputs poisoned."""
    if not W.mma_applicable(torch.empty(1, 32, device="cuda"), 32, 32, 32):
        skip_without_cuda_kernel("CUDA kernel not built here (no nvcc or sm < 80)")
    for ns, K, G in (((8192,), 4096, 128), ((8192,), 4160, 64), ((4096, 4096, 4096), 4096, 128),
                     ((12288,), 8192, 128), ((2048,), 4096, 128)):
        dtype = torch.bfloat16 if (M + K) % 2 else torch.float16
        weights = [make_weight(n, K, G, device="cuda", seed=M + n + K + i) for i, n in enumerate(ns)]
        x = torch.randn(M, K, device="cuda", dtype=dtype) * 2
        picked = W.select_mma_config(M, sum(ns), K, launch.num_sms(x.device))
        got = {}
        for x_l1 in (False, True):
            outs = [torch.full((M, n), float("nan"), device="cuda", dtype=dtype) for n in ns]
            W.w4a16_mma_many(x, weights, G, config=replace(picked, x_l1=x_l1), outs=outs)
            torch.cuda.synchronize()
            for out, w in zip(outs, weights):
                assert_close(out, x, *w, G)
            got[x_l1] = outs
        for around, through in zip(got[False], got[True]):
            torch.testing.assert_close(through, around, rtol=0, atol=0)


@needs_cuda
@pytest.mark.parametrize("M", [1, 4, 5, 16, 24])
def test_gpu_mma_successor_modes(M):
    """Every successor mode (skinny.cuh: Successor; the capped one raises a launch's shared memory up
    to a whole SM's) gives the reference's values and the plain launch's bits, in a CUDA graph of four
    launches back to back, each reading the one before's output: layers with fewer CTAs than SMs, a
    few per SM and several waves, one and two weights a launch, outputs poisoned before the replay."""
    if not W.mma_applicable(torch.empty(1, 32, device="cuda"), 32, 32, 32):
        skip_without_cuda_kernel("CUDA kernel not built here (no nvcc or sm < 80)")
    for n1, n2, G in ((4096, 4096, 128), (12288, 4096, 64), (28672, 4096, 128), (2048, 4096, 32)):
        wa = [make_weight(n2, n1, G, device="cuda", seed=M + n1), make_weight(64, n1, G, device="cuda", seed=M)]
        wb = [make_weight(n1, n2, G, device="cuda", seed=M + n2)]
        x = torch.randn(M, n1, device="cuda", dtype=torch.bfloat16)
        got = {}
        for mode in (launch.SUCCESSOR_AT_END, launch.SUCCESSOR_CAPPED, launch.SUCCESSOR_IF_FULL):
            layers = [wa, wb, wa, wb]
            outs = [[torch.empty(M, qw.shape[1], device="cuda", dtype=x.dtype) for qw, _, _ in ws] for ws in layers]

            def chain():
                src = x
                for ws, o in zip(layers, outs):
                    cfg = W.select_mma_config(M, sum(qw.shape[1] for qw, _, _ in ws), src.shape[1])
                    W.w4a16_mma_many(src, ws, G, config=replace(cfg, successor=mode), outs=o)
                    src = o[0]
            chain()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                chain()
            for o in outs:
                for t in o:
                    t.fill_(float("nan"))
            g.replay()
            torch.cuda.synchronize()
            for src, ws, o in zip([x] + [o[0] for o in outs[:-1]], layers, outs):
                for out, w in zip(o, ws):
                    assert_close(out, src, *w, G)
            got[mode] = [t.clone() for o in outs for t in o]
        for mode in (launch.SUCCESSOR_CAPPED, launch.SUCCESSOR_IF_FULL):
            for a, b in zip(got[mode], got[launch.SUCCESSOR_AT_END]):
                torch.testing.assert_close(a, b, rtol=0, atol=0)


@needs_cuda
def test_gpu_w4a16_linears_dispatch():
    """The grouped op: one launch at decode sizes, per-weight ops above, equal to w4a16_linear either way."""
    K, G = 1024, 128
    weights = [make_weight(n, K, G, device="cuda", seed=n) for n in (512, 128, 128)]
    for M in (1, 24, 48, 100, 300):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        ys = torch.ops.nibble.w4a16_linears(x, *(list(t) for t in zip(*weights)), G)
        for y, w in zip(ys, weights):
            assert_close(y, x, *w, G)
    x = torch.randn(33, K, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="32 for several"):
        W.w4a16_mma_many(x, weights, G)
    with pytest.raises(ValueError, match="one scales and zeros"):
        torch.ops.nibble.w4a16_linears(x, [weights[0][0]], [], [weights[0][2]], G)


@needs_cuda
def test_gpu_mma_dispatch_and_fallbacks():
    """M <= 64 with aligned N, K takes the CUDA kernel; odd N or M > 64 take the Triton / cuBLAS paths."""
    x = torch.randn(4, 512, device="cuda", dtype=torch.float16)
    assert W.mma_applicable(x, 256, 512, 128) or W._mma_lib(x.device) is None
    assert not W.mma_applicable(x, 1000, 512, 128)
    assert not W.mma_applicable(torch.randn(65, 512, device="cuda", dtype=torch.float16), 256, 512, 128)
    assert not W.mma_applicable(x, 256, 576, 96)  # group not a power of two times 32
    qw, s, z = make_weight(1000, 512, 128, device="cuda")
    assert_close(torch.ops.nibble.w4a16_linear(x, qw, s, z, 128), x, qw, s, z, 128)


@needs_cuda
def test_gpu_large_70b_layers():
    for (N, K) in ((28672, 8192), (8192, 28672)):
        qw, s, z = make_weight(N, K, 128, device="cuda", seed=N)
        for M in (1, 16, 128):
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            assert_close(torch.ops.nibble.w4a16_linear(x, qw, s, z, 128), x, qw, s, z, 128)


@needs_cuda
def test_gpu_noncontiguous_and_device_mix():
    qw, s, z = make_weight(256, 512, 128, device="cuda")
    xb = torch.randn(512, 6, device="cuda", dtype=torch.float16)
    x = xb.t()  # non-contiguous [6, 512]
    assert not x.is_contiguous()
    assert_close(torch.ops.nibble.w4a16_linear(x, qw, s, z, 128), x.contiguous(), qw, s, z, 128)
    with pytest.raises(ValueError, match="one device"):
        torch.ops.nibble.w4a16_linear(x.cpu(), qw, s, z, 128)


@needs_cuda
@pytest.mark.parametrize("M", [1, 13, 100])
def test_gpu_launches_follow_new_weights_and_the_current_stream(M):
    """What the launchers keep between eager calls are pointer values, not tensors: weights freed and
    others allocated (the caching allocator hands blocks back) are each read as themselves. And a
    launch lands on the current stream: queued behind a sleep on a side stream, its poisoned output
    is still untouched once the default stream is idle, and right once the side stream is done."""
    K, N, G = 512, 256, 128
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    if not W.mma_applicable(x[:1], N, K, G):
        skip_without_cuda_kernel("CUDA kernel not built here (no nvcc or sm < 80)")
    for seed in range(3):
        qw, s, z = make_weight(N, K, G, device="cuda", seed=seed)
        assert_close(torch.ops.nibble.w4a16_linear(x, qw, s, z, G), x, qw, s, z, G)
        del qw, s, z
    qw, s, z = make_weight(N, K, G, device="cuda", seed=7)
    many = W.w4a16_mma_many if M <= 32 else W.w4a16_wgmma_many
    if M > 32 and not W.wgmma_applicable(x, N, K, G):
        pytest.skip("the Hopper GEMM runs on sm_90 only")
    assert_close(many(x, [(qw, s, z)], G)[0], x, qw, s, z, G)  # loads the kernel: a first load waits for the GPU
    out = torch.full((M, N), float("nan"), device="cuda", dtype=x.dtype)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU clocks ahead of the launch on this stream
        many(x, [(qw, s, z)], G, outs=[out])
    torch.cuda.default_stream().synchronize()
    assert torch.isnan(out).all(), "the launch ran on another stream than the current one"
    side.synchronize()
    assert_close(out, x, qw, s, z, G)


@needs_cuda
def test_gpu_split_k_repeatable():
    """The Triton kernels' split-K fix-up sums partials in a fixed order: repeated calls are bitwise
    equal, and right. (The op takes the CUDA kernels at these sizes on Hopper: the Triton configs
    are named here.)"""
    qw, s, z = make_weight(4096, 4096, 128, device="cuda")
    for M in (1, 2, 9):
        x = torch.randn(M, 4096, device="cuda", dtype=torch.bfloat16)
        cfg = W.select_config(M, 4096, 4096, 128, launch.num_sms(x.device))
        assert cfg.split_k > 1
        ys = [W.w4a16_linear_cuda(x, qw, s, z, 128, config=cfg) for _ in range(5)]
        for y in ys[1:]:
            assert torch.equal(y, ys[0])
        assert_close(ys[0], x, qw, s, z, 128)


@needs_cuda
def test_gpu_split_k_counters_per_stream():
    """Split-K tile counters belong to a stream: kernels on two streams of one device never share them."""
    dev = torch.device("cuda")
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(a):
        ca = launch.split_counters(dev, 16)
    with torch.cuda.stream(b):
        cb = launch.split_counters(dev, 16)
    assert ca.data_ptr() != cb.data_ptr()
    with torch.cuda.stream(a):
        assert launch.split_counters(dev, 16).data_ptr() == ca.data_ptr()


@needs_cuda
def test_gpu_torch_compile():
    qw, s, z = make_weight(8192, 4096, 128, device="cuda")  # 80 tokens: the wgmma kernel on Hopper

    def f(x):
        return torch.ops.nibble.w4a16_linear(x, qw, s, z, 128) * 2 + 1

    cf = torch.compile(f, fullgraph=True)
    for M in (1, 4, 80):
        x = torch.randn(M, 4096, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(cf(x), f(x))


@needs_cuda
@pytest.mark.parametrize("M", [1, 2, 8, 200])
@pytest.mark.parametrize("N", [2048, 8192])  # 200 tokens: dequantise + cuBLAS, or the wgmma kernel (split-K)
def test_gpu_cuda_graph_capture(M, N):
    qw, s, z = make_weight(N, 4096, 128, device="cuda", seed=M)
    x = torch.randn(M, 4096, device="cuda", dtype=torch.float16)
    torch.ops.nibble.w4a16_linear(x, qw, s, z, 128)  # warm-up (compile, counters)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = torch.ops.nibble.w4a16_linear(x, qw, s, z, 128)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        assert_close(y, x, qw, s, z, 128)


# ---- GPU: the Hopper GEMM for many tokens (csrc/w4a16_wgmma.cu) -------------------------------------
def _needs_wgmma_kernel():
    if not (CUDA and W.wgmma_applicable(torch.empty(1, 8, device="cuda"), 256, 256, 128)):
        skip_without_cuda_kernel("the wgmma W4A16 kernel needs an sm_90 GPU (H100/H200) and nvcc")


@needs_cuda
@pytest.mark.parametrize("tile", W.WGMMA.tiles(), ids=lambda t: f"bn{t[0]}_ch{t[1]}")
@pytest.mark.parametrize("G", [32, 64, 128, 256, "column"])
def test_gpu_wgmma_every_instantiation(tile, G):
    """Every compiled tile x group layout, both activation dtypes, with and without split-K; odd M,
    N not a multiple of the channel tile, K not a multiple of the 128-deep stage (per-column
    groups), outputs poisoned with NaN."""
    _needs_wgmma_kernel()
    bn, channels = tile
    for (N, K) in ((1000, 1536), (256, 2560), (4104, 640)):
        g = K if G == "column" else G
        if K % g:
            continue
        for M, split, dtype in ((1, 1, torch.bfloat16), (bn + 1, 3, torch.float16), (2 * bn + 37, 1, torch.bfloat16),
                                (300, 2, torch.bfloat16)):
            qw, s, z = make_weight(N, K, g, symmetric=(M % 2 == 0), device="cuda", seed=N + M + bn)
            x = torch.randn(M, K, device="cuda", dtype=dtype) * 2
            out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
            W.w4a16_wgmma(x, qw, s, z, g, config=dict(bn=bn, channels=channels, split_k=split), out=out)
            torch.cuda.synchronize()
            assert_close(out, x, qw, s, z, g)
    for K in (576, 1000):  # one group per column, K % 128 != 0
        qw, s, z = make_weight(512, K, K, device="cuda", seed=K)
        x = torch.randn(77, K, device="cuda", dtype=torch.bfloat16)
        assert_close(W.w4a16_wgmma(x, qw, s, z, K, config=dict(bn=bn, channels=channels, split_k=2)), x, qw, s, z, K)
    # a config without split_k is one split (the launch read cfg["split_k"]: a KeyError)
    assert_close(W.w4a16_wgmma(x, qw, s, z, K, config=dict(bn=bn, channels=channels)), x, qw, s, z, K)


@needs_cuda
@pytest.mark.parametrize("G", [32, 128])
def test_gpu_wgmma_rounds_each_weight_once(G):
    """The Hopper GEMM dequantizes to the weight the reference rounds, bit for bit, in both
    activation dtypes (bf16 through fp32, fp16 in 16-bit fused multiply-adds): one-hot rows of x
    make each output one weight, accumulated exactly. Scales 10^4 apart, integer zero points (as
    GPTQ / AWQ store them: then q s + z is exact in fp32, and so is the reference's weight before
    its one rounding), and zero scales (the weight is z) included."""
    _needs_wgmma_kernel()
    N, K = 512, 1024
    qw, s, z = make_weight(N, K, G, device="cuda", seed=G)
    s[1::4] *= 100
    s[2::4] /= 100
    zp = torch.randint(0, 16, s.shape, device="cuda", generator=torch.Generator("cuda").manual_seed(G))
    z = (-zp * s.float()).half()
    s[3::4, ::5] = 0
    rows = torch.randperm(K, device="cuda")[:160]
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.zeros(len(rows), K, device="cuda", dtype=dtype)
        x[torch.arange(len(rows)), rows] = 1
        want = dequantize(qw, s, z, G).to(dtype)[:, rows].t()
        for tile in W.WGMMA.tiles():
            out = torch.full((len(rows), N), float("nan"), device="cuda", dtype=dtype)
            W.w4a16_wgmma(x, qw, s, z, G, config=dict(bn=tile[0], channels=tile[1], split_k=1), out=out)
            torch.cuda.synchronize()
            assert torch.equal(out, want), (dtype, tile)


@needs_cuda
@pytest.mark.parametrize("tile", W.WGMMA.tiles(), ids=lambda t: f"bn{t[0]}_ch{t[1]}")
def test_gpu_wgmma_split_k_every_split_count(tile):
    """Each CTA of a tile's cluster sums the splits' fp32 partials of its share of the token rows in
    split order, a batch of rows at a time, storing each batch as it is done (hopper.cuh: RowShare,
    sum_partials): every split count up to 8 (5: the last split shorter), token tails inside a batch
    and a share, a channel tail; outputs poisoned."""
    _needs_wgmma_kernel()
    bn, channels = tile
    N, K = 1000, 4224
    qw, s, z = make_weight(N, K, 128, device="cuda", seed=bn + channels)
    for M in (bn + 3, 300):
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        for split in (2, 5, 8):
            out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
            W.w4a16_wgmma(x, qw, s, z, 128, config=dict(bn=bn, channels=channels, split_k=split), out=out)
            torch.cuda.synchronize()
            assert_close(out, x, qw, s, z, 128)


@needs_cuda
def test_gpu_wgmma_split_k_repeatable():
    """The split-K sums run in split order (hopper.cuh: RowShare): repeated calls are bitwise equal."""
    _needs_wgmma_kernel()
    qw, s, z = make_weight(4096, 4096, 128, device="cuda")
    x = torch.randn(200, 4096, device="cuda", dtype=torch.bfloat16)
    ys = [W.w4a16_wgmma(x, qw, s, z, 128, config=dict(bn=128, channels=256, split_k=4)) for _ in range(5)]
    torch.cuda.synchronize()
    assert all(torch.equal(y, ys[0]) for y in ys[1:])
    assert_close(ys[0], x, qw, s, z, 128)


@needs_cuda
def test_gpu_wgmma_views_and_strided_out():
    """Misaligned or strided views of x are copied (the TMA reads 16-byte aligned rows); an `out`
    the epilogue cannot store into receives a copy."""
    _needs_wgmma_kernel()
    qw, s, z = make_weight(512, 1024, 128, device="cuda")
    base = torch.randn(100 * 1024 + 1, device="cuda", dtype=torch.float16)
    x = base[1:].view(100, 1024)  # data_ptr % 16 == 2
    out = torch.full((100, 1024), float("nan"), device="cuda", dtype=torch.float16)[:, 3:515]
    W.w4a16_wgmma(x, qw, s, z, 128, out=out)
    assert_close(out, x, qw, s, z, 128)


@needs_cuda
@pytest.mark.parametrize("M", [33, 129, 300])
def test_gpu_wgmma_many_weights(M):
    """Up to three weights side by side in one launch (hopper.cuh: column_weight), the last one's
    width not a multiple of the tile: for every tile the widths allow, with and without split-K,
    each output equals its own launch's bitwise (same tile, same K order) and is close to the
    reference; outputs poisoned, with a row stride wider than the output."""
    _needs_wgmma_kernel()
    K, ns = 1536, (512, 256, 200)
    for G in (64, 128):
        weights = [make_weight(n, K, G, symmetric=i == 1, device="cuda", seed=M + n + G) for i, n in enumerate(ns)]
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16 if G == 128 else torch.float16) * 2
        assert W.WGMMA.tiles(ns) == W.WGMMA.tiles()
        for bn, channels in W.WGMMA.tiles(ns):
            for split in (1, 3):
                cfg = dict(bn=bn, channels=channels, split_k=split)
                padded = [torch.full((M, n + 16), float("nan"), device="cuda", dtype=x.dtype) for n in ns]
                W.w4a16_wgmma_many(x, weights, G, config=cfg, outs=[p[:, :n] for p, n in zip(padded, ns)])
                torch.cuda.synchronize()
                for p, n, w in zip(padded, ns, weights):
                    assert torch.isnan(p[:, n:]).all(), "wrote past its columns"
                    assert torch.equal(p[:, :n], W.w4a16_wgmma(x, *w, G, config=cfg)), f"config {cfg}"
                    assert_close(p[:, :n], x, *w, G)
    with pytest.raises(ValueError, match="multiple of the channels"):
        W.w4a16_wgmma_many(x, weights[::-1], G, config=dict(bn=128, channels=128, split_k=1))


@needs_cuda
def test_gpu_linears_take_one_wgmma_launch(monkeypatch):
    """Prefill sizes: a group runs as one wgmma launch (Llama-2-7B's q/k/v at 128 tokens: one wave of
    tiles instead of three), a tiny one too (Llama-3.2-1B's: one launch, not a dequantization and a
    cuBLAS product per weight); a group no tile fits (a width but the last not a multiple of 128)
    runs one product per weight, and a tiny layer alone dequantize + cuBLAS (`large_m_kernel`)."""
    _needs_wgmma_kernel()
    calls = []
    real = W.w4a16_wgmma_many
    monkeypatch.setattr(W, "w4a16_wgmma_many", lambda x, ws, *a, **k: calls.append(len(ws)) or real(x, ws, *a, **k))
    G = 128
    for ns, K, launches in (((4096, 1024, 1024), 4096, [3]), ((2048, 512, 512), 2048, [3]),
                            ((8200, 8192), 4096, [1, 1]), ((2048,), 2048, [])):
        calls.clear()
        weights = [make_weight(n, K, G, device="cuda", seed=n) for n in ns]
        x = torch.randn(128, K, device="cuda", dtype=torch.bfloat16)
        ys = torch.ops.nibble.w4a16_linears(x, *(list(t) for t in zip(*weights)), G)
        assert calls == launches
        for y, w in zip(ys, weights):
            assert_close(y, x, *w, G)


@needs_cuda
def test_gpu_prefill_takes_the_wgmma_kernel(monkeypatch):
    """Between 33 and WGMMA_MAX_M tokens the op runs csrc/w4a16_wgmma.cu on Hopper (no dequantised
    copy of the weight)."""
    _needs_wgmma_kernel()
    calls = []
    real = W.w4a16_wgmma
    monkeypatch.setattr(W, "w4a16_wgmma", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    monkeypatch.setattr(W, "dequantize_cuda", None)  # the old path would fail loudly
    qw, s, z = make_weight(8192, 4096, 128, device="cuda")  # not a tiny layer (TINY_LAYER)
    for M in (33, 128, 1000):
        x = torch.randn(M, 4096, device="cuda", dtype=torch.bfloat16)
        assert_close(torch.ops.nibble.w4a16_linear(x, qw, s, z, 128), x, qw, s, z, 128)
    assert calls == [33, 128, 1000]


def test_wgmma_config_rules():
    """A compiled tile; split-K only where each split keeps 2 K tiles and the CTAs fit two waves;
    few tokens take 64-token tiles, many 256; more splits where output tiles are few; pure."""
    for M in (17, 64, 65, 128, 256, 1024, 2048):
        for N, K in ((4096, 4096), (28672, 8192), (8192, 28672), (4096, 14336), (576, 1536)):
            cfg = W.WGMMA.config(M, N, K, hopper.ideal_clusters(132))
            assert cfg == W.WGMMA.config(M, N, K, hopper.ideal_clusters(132))
            tile = (cfg["bn"], cfg["channels"])
            assert tile in W.WGMMA.tiles() and cfg["split_k"] in hopper.SPLITS
            tiles = hopper.tile_count(M, N, *tile)
            assert cfg["split_k"] == 1 or (tiles <= 2 * (132 // cfg["split_k"]) and -(-K // 128) // cfg["split_k"] >= 2)
    assert W.WGMMA.config(64, 28672, 8192)["bn"] == 64 and W.WGMMA.config(2048, 28672, 8192)["bn"] == 256
    assert W.WGMMA.config(128, 4096, 14336)["split_k"] > W.WGMMA.config(128, 28672, 8192)["split_k"] == 1
    # weights side by side in one launch: tiles whose channels divide every width but the last
    assert W.WGMMA.tiles([4096, 1024, 1024]) == W.WGMMA.tiles() and W.WGMMA.tiles([576, 192, 192]) == ()
    assert W.WGMMA.tiles([896, 128, 128]) == ((128, 128), (256, 128), (64, 128))
    # no tile above the tokens it was swept at: 64 x 128 up to 256
    assert all(W.WGMMA.config(M, N, K)["bn"] != 64 or W.WGMMA.config(M, N, K)["channels"] != 128
               for M in (257, 512, 2048) for N, K in ((576, 576), (1152, 896), (4096, 4096), (12288, 4096)))
    assert W.WGMMA.config(64, 8192, 28672, {1: 132, 2: 66, 3: 39, 4: 30, 6: 17, 8: 15}) == dict(
        bn=64, channels=128, split_k=2)
    assert W.WGMMA.config(1024, 1152, 896, widths=[896, 128, 128])["channels"] == 128
    assert W.wgmma_group_ok(32, 4096) and W.wgmma_group_ok(256, 4096) and W.wgmma_group_ok(576, 576)
    assert not W.wgmma_group_ok(96, 576) and not W.wgmma_group_ok(16, 4096)


def test_large_m_kernel_rules():
    """The measured dispatch: skinny up to 32 tokens, wgmma to WGMMA_MAX_M, dequantise + cuBLAS above;
    a tiny layer alone (<= TINY_LAYER weights) skinny up to 64 tokens and dequantise + cuBLAS above."""
    assert W.large_m_kernel(32, 28672, 8192) == "skinny" and W.large_m_kernel(33, 28672, 8192) == "wgmma"
    assert W.large_m_kernel(33, 4096, 4096) == "wgmma" and W.large_m_kernel(128, 4096, 4096) == "wgmma"
    assert W.large_m_kernel(128, 4096, 11008) == "wgmma" and W.large_m_kernel(128, 6144, 4096) == "wgmma"
    assert W.large_m_kernel(64, 2 * 4864, 896, 2) == "wgmma"  # Qwen2-0.5B's gate/up in one launch
    for N, K in ((576, 576), (3072, 576), (896, 4864), (2048, 2048), (3072, 2048)):  # tiny
        assert N * K <= W.TINY_LAYER
        assert W.large_m_kernel(64, N, K) == "skinny" and W.large_m_kernel(65, N, K) == "dequant"
        assert W.large_m_kernel(W.WGMMA_MAX_M, N, K) == "dequant"
        # several tiny weights in one launch: one wgmma launch, not two launches per weight
        assert W.large_m_kernel(32, N, K, 3) == "skinny" and W.large_m_kernel(33, N, K, 3) == "wgmma"
        assert W.large_m_kernel(W.WGMMA_MAX_M + 1, N, K, 2) == "dequant"
    assert W.large_m_kernel(W.WGMMA_MAX_M, 28672, 8192) == "wgmma"
    assert W.large_m_kernel(W.WGMMA_MAX_M + 1, 28672, 8192) == "dequant"


def test_wgmma_rejects_what_it_cannot_run():
    x = torch.randn(100, 512, dtype=torch.bfloat16)
    qw, s, z = make_weight(256, 512, 128)
    with pytest.raises(ValueError, match="sm_90"):
        W.w4a16_wgmma(x, qw, s, z, 128)


def test_w4a16_linears_cpu_matches_per_weight_op():
    """The grouped op on the CPU: the reference per weight; its checks name the mismatch."""
    K, G = 256, 64
    weights = [make_weight(n, K, G, seed=n) for n in (64, 32)]
    x = torch.randn(3, K, dtype=torch.bfloat16)
    ys = torch.ops.nibble.w4a16_linears(x, *(list(t) for t in zip(*weights)), G)
    for y, w in zip(ys, weights):
        torch.testing.assert_close(y, torch.ops.nibble.w4a16_linear(x, *w, G), rtol=0, atol=0)
    torch.library.opcheck(torch.ops.nibble.w4a16_linears.default, (x, *(list(t) for t in zip(*weights)), G),
                          test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(ValueError, match="packs K=128"):
        torch.ops.nibble.w4a16_linears(x, [weights[0][0], make_weight(32, 128, G)[0]], [w[1] for w in weights],
                                       [w[2] for w in weights], G)


def test_pick_split_takes_the_least_split_that_fills_the_waves_and_at_most_the_k_blocks():
    assert W._pick_split(1, 66, 64, 132) == 4    # 264 CTAs fill two waves; 8 splits would too, no better
    assert W._pick_split(1, 1, 4, 132) == 4      # as many splits as K blocks, no more
    assert W._pick_split(1, 1, 64, 132, max_split=32) == 32
    assert W._pick_split(2, 132, 64, 132) == 1   # the tiles fill two waves alone


def test_select_config_buckets_m_and_scales_in_the_tile_for_small_groups():
    assert W.select_config(1, 4096, 4096, 128).kind == W.select_config(2, 4096, 4096, 128).kind == "gemv"
    assert W.select_config(3, 4096, 4096, 128).kind == W.select_config(16, 4096, 4096, 128).kind == "dot"
    assert W.select_config(17, 4096, 4096, 128).kind == "dequant"
    assert W.select_config(16, 4096, 4096, 128).factored and W.select_config(16, 4096, 4096, 256).factored
    assert not W.select_config(16, 4096, 4096, 32).factored and not W.select_config(16, 4096, 4096, 64).factored


def test_with_split_splits_decode_sizes_only():
    dot = W.DISPATCH[16]
    assert W.with_split(dot, 16, 4096, 4096, 128).split_k > 1
    assert W.with_split(dot, 64, 4096, 4096, 128).split_k > 1
    assert W.with_split(dot, 64, 128, 4096, 128).split_k > 1
    assert W.with_split(dot, 65, 128, 4096, 128).split_k == 1  # 10 tiles, but 65 tokens: no split
    assert W.with_split(W.DISPATCH[1 << 62], 1, 128, 4096, 128).split_k == 1  # dequantize + cuBLAS


def test_the_gemv_split_counts_one_tile_for_both_tokens_and_k_blocks_of_one_group():
    """The gemv kernel holds its M <= 2 tokens in one tile (BLOCK_M = M) and reads K in blocks of one group at most
    (`_pow2_divisor`): two tokens split as one does (32 splits, not 24 for two token tiles), and a group of 32 gives
    K / 32 blocks to split (32 at K = 1024, not the 16 of 64-deep blocks)."""
    assert W.select_config(2, 4096, 4096, 128).split_k == W.select_config(1, 4096, 4096, 128).split_k == 32
    assert W.select_config(1, 4096, 1024, 32).split_k == W.select_config(2, 4096, 1024, 32).split_k == 32


def test_select_config_scales_in_the_tile_for_a_group_that_is_not_a_multiple_of_the_block():
    """Not only groups smaller than the 128-deep K block: 192 (one and a half blocks) cannot be factored either."""
    assert not W.select_config(16, 4096, 4608, 192).factored and W.select_config(16, 4096, 4608, 384).factored


def test_pow2_divisor_is_the_largest_power_of_two_dividing_the_group_up_to_the_cap():
    assert [W._pow2_divisor(g, 64) for g in (8, 32, 48, 64, 128, 4096, 96)] == [8, 32, 16, 64, 64, 64, 32]


def test_group_shift_steps_takes_power_of_two_groups_of_32_and_up():
    """log2(group / 32); 30 (the kernel's "one group per column") for a group of K; None where the kernel has none."""
    assert [W._group_shift_steps(g, 4096) for g in (32, 64, 128, 1024)] == [0, 1, 2, 5]
    assert W._group_shift_steps(4096, 4096) == 30 and W._group_shift_steps(576, 576) == 30
    assert W._group_shift_steps(96, 4096) is None and W._group_shift_steps(16, 4096) is None
    assert W._group_shift_steps(192, 4096) is None


def test_mma_shared_memory_is_the_ring_or_the_reduction_whichever_is_larger():
    """csrc/w4a16_mma.cu: smem_bytes; four token tiles carry the next group's scales (704 bytes of parameters)."""
    assert W.mma_smem_bytes(W.MmaConfig(1, 8)) == 8 * 4 * (640 + 512)
    assert W.mma_smem_bytes(W.MmaConfig(4, 8)) == 8 * 4 * (704 + 4 * 512)
    assert W.mma_smem_bytes(W.MmaConfig(8, 8), ring_stages=1) == 8 * 8 * 8 * 32 * 4  # the reduction's
    assert not W.mma_config_valid(W.MmaConfig(1, 4), 9) and W.mma_config_valid(W.MmaConfig(2, 4), 9)


def test_backend_triton_refuses_cpu_tensors_even_with_a_gpu(monkeypatch):
    """With a GPU visible, a model left on the CPU is told to move, not run on the reference or fail inside Triton."""
    from nibble import kernels

    qw, s, z = make_weight(32, 128, 64)
    x = torch.randn(2, 128)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(kernels.KernelUnavailableError, match=r"need CUDA tensors; the input is on cpu: move the model "
                                                             r"and inputs to the GPU with .to\('cuda'\)"):
        kernels.w4a16_linear(x, qw, s, z, 64, backend="triton")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(kernels.KernelUnavailableError, match="need a CUDA GPU and none is visible"):
        kernels.w4a16_linear(x, qw, s, z, 64, backend="triton")


def test_the_op_refuses_weights_of_the_wrong_kind_or_shape():
    """Each said as what the format asks (`Int4Weight`): an int32 qweight of two dimensions, float16 scales and zeros
    of one row per group and one column per channel, one device, at least one weight."""
    qw, s, z = make_weight(32, 128, 64)
    x = torch.randn(2, 128, dtype=torch.float16)
    with pytest.raises(TypeError, match=r"qweight must be a 2-D int32 tensor \[K // 8, N\], got torch.int32 \(1, 16, 32\)"):
        torch.ops.nibble.w4a16_linear(x, qw[None], s, z, 64)
    with pytest.raises(ValueError, match=r"scales must have shape \(2, 32\) for K=128, N=32, group 64; got \(2, 16\)"):
        torch.ops.nibble.w4a16_linear(x, qw, s[:, :16], z, 64)
    with pytest.raises(TypeError, match="zeros must be float16, got torch.bfloat16"):
        torch.ops.nibble.w4a16_linear(x, qw, s, z.bfloat16(), 64)
    with pytest.raises(ValueError, match="needs one scales and zeros tensor per qweight, got 0 qweights"):
        torch.ops.nibble.w4a16_linears(x, [], [], [], 64)
    with pytest.raises(ValueError, match=r"x, qweight, scales, zeros must be on one device, got \['cpu', 'meta'\]"):
        W.check_one_device(x, qw.to("meta"), s, z)


def test_the_op_over_several_weights_refuses_lists_of_other_lengths():
    """One scales and one zeros tensor per qweight: zip would drop the weight without its scales or zeros and return
    one output fewer, without a word. The op and its fake (FakeTensorMode) alike."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    (qw, s, z), (qw2, s2, z2) = make_weight(32, 128, 64), make_weight(16, 128, 64, seed=1)
    x = torch.randn(2, 128, dtype=torch.float16)
    for args, got in ((([qw, qw2], [s, s2], [z]), "2 qweights, 2 scales, 1 zeros"),
                      (([qw, qw2], [s], [z, z2]), "2 qweights, 1 scales, 2 zeros")):
        with pytest.raises(ValueError, match=f"needs one scales and zeros tensor per qweight, got {got}"):
            torch.ops.nibble.w4a16_linears(x, *args, 64)
        with FakeTensorMode() as mode:
            fx = mode.from_tensor(x)
            fargs = [[mode.from_tensor(t) for t in ts] for ts in args]
            with pytest.raises(ValueError, match=f"got {got}"):
                torch.ops.nibble.w4a16_linears(fx, *fargs, 64)


def test_the_skinny_kernel_applies_to_cuda_tensors_only():
    x = torch.randn(2, 128, dtype=torch.float16)
    assert not W.mma_applicable(x, 32, 128, 64)
    with pytest.raises(ValueError, match="w4a16_mma is a CUDA kernel: it needs CUDA tensors, got device cpu"):
        W.w4a16_mma(x, *make_weight(32, 128, 64), 64)


def test_a_tiny_layer_is_at_most_8_mib_of_weights():
    assert W.large_m_kernel(64, 2048, 4096) == "skinny" and W.large_m_kernel(65, 2048, 4096) == "dequant"
    assert W.large_m_kernel(64, 2048, 4104) == "wgmma"  # one channel of K more than 8 MiB


def test_mma_warps_start_at_four_and_stop_at_32_warps_an_sm():
    assert W.select_mma_config(16, 12288, 2048, 132).warps == 4  # 64 K steps: no doubling, and never fewer than 4
    assert W.select_mma_config(16, 32000, 8192, 132).warps == 8   # 1000 CTAs x 4 warps < 32 an SM: doubled once
    assert W.select_mma_config(16, 33792, 8192, 132).warps == 4   # 1056 CTAs x 4 warps: 32 an SM already


def test_select_mma_config_rules():
    """Valid for its M; warps doubled only while the GPU has < 32 warps per SM and each warp keeps
    >= 16 K steps at M <= 8, >= 32 above (unless there are fewer CTAs than SMs), and at M <= 8 only
    where the doubled grid fits at once or each warp keeps >= 32 steps; pure."""
    for M in (1, 8, 9, 16, 17, 32, 33, 64):
        for N, K in ((4096, 4096), (28672, 8192), (8192, 28672), (11008, 4096), (576, 1536), (96, 64)):
            cfg = W.select_mma_config(M, N, K, 132)
            assert cfg == W.select_mma_config(M, N, K, 132)
            assert W.mma_config_valid(cfg, M) and M <= 8 * cfg.token_tiles < 2 * max(M, 8)
            ctas, steps = N // 32, K // 32
            if cfg.warps > 4:
                half = cfg.warps // 2
                min_steps = 16 if M <= 8 else 32
                assert ctas * half < 32 * 132 and (ctas < 132 or steps >= 2 * min_steps * half)
                assert M > 8 or ctas * cfg.warps <= 32 * 132 or steps >= 32 * cfg.warps
    assert W.select_mma_config(1, 12288, 4096, 132).warps == 8   # 128 K steps: 16 per warp at 8 warps
    assert W.select_mma_config(1, 4096, 4096, 132).warps == 16   # 128 CTAs < 132 SMs: warps are the only parallelism
    assert W.select_mma_config(1, 28672, 8192, 132).warps == 8   # 896 CTAs x 8 warps: two waves, but 32 steps a warp
    assert W.select_mma_config(16, 12288, 4096, 132).warps == 4  # 128 K steps: 32 per warp at 4 warps
    assert W.select_mma_config(1, 22016, 4096, 132).warps == 4   # 688 CTAs x 8 warps: a second wave
    assert W.select_mma_config(8, 28672, 4096, 132).warps == 4
    assert W.select_mma_config(16, 22016, 4096, 132).warps == 4  # (two tiles: the steps rule already)


def test_x_through_l1_rule():
    """x goes through the L1 only where an SM holds several CTAs, at one token tile, or two with K <=
    4096; the config says so, and a config asking for it at four or eight tiles is refused."""
    assert W.select_mma_config(1, 12288, 4096, 132).x_l1
    assert W.select_mma_config(8, 28672, 8192, 132).x_l1
    assert W.select_mma_config(16, 12288, 4096, 132).x_l1
    assert not W.select_mma_config(16, 28672, 8192, 132).x_l1  # deeper, at two tiles: 3-6% slower
    assert not W.select_mma_config(1, 4096, 4096, 132).x_l1    # 128 CTAs on 132 SMs: nothing to share
    assert not W.select_mma_config(1, 4224, 4096, 132).x_l1    # 132 CTAs: still one per SM
    assert W.select_mma_config(1, 4256, 4096, 132).x_l1
    assert not W.select_mma_config(32, 12288, 4096, 132).x_l1  # four tiles: 5-40% slower
    assert W.select_mma_config(16, 4096, 4096, 64).x_l1        # the SM count is the device's
    assert not W.mma_config_valid(W.MmaConfig(4, 4, x_l1=True), 32)
    assert W.mma_config_valid(W.MmaConfig(2, 4, x_l1=True), 16)


def test_successor_launch_rule():
    """The next kernel launches at once at one and two token tiles: capped up to 4 tokens, and above
    where x does not go through the L1; where it does, only if the CTAs fill the SMs; at the end from
    four tiles. The config carries it; a config with another value is refused."""
    pick = W.select_mma_config
    assert pick(1, 12288, 4096, 132).successor == launch.SUCCESSOR_CAPPED    # x_l1, but 1 token
    assert pick(4, 12288, 4096, 132).successor == launch.SUCCESSOR_CAPPED
    assert pick(5, 12288, 4096, 132).successor == launch.SUCCESSOR_IF_FULL   # x_l1 at 5 tokens: keep the L1
    assert pick(16, 12288, 4096, 132).successor == launch.SUCCESSOR_IF_FULL
    assert pick(16, 4096, 11008, 132).successor == launch.SUCCESSOR_CAPPED   # 128 CTAs: x around the L1
    assert pick(16, 28672, 8192, 132).successor == launch.SUCCESSOR_CAPPED   # two tiles, K > 4096: around
    assert pick(17, 4096, 4096, 132).successor == launch.SUCCESSOR_AT_END    # four tiles
    assert pick(64, 4096, 4096, 132).successor == launch.SUCCESSOR_AT_END
    assert W.MmaConfig(1, 8).successor == launch.SUCCESSOR_AT_END            # explicit configs: as before
    assert not W.mma_config_valid(W.MmaConfig(1, 8, successor=3), 1)


# --------------------------------------------------------------------- act-order input gather
@pytest.mark.parametrize("device", [pytest.param("cpu", marks=needs_interp), pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize("M,K", [(1, 64), (3, 4096), (17, 1100), (40, 200), (128, 11008), (33, 16400)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gather_columns_kernel_is_index_select(device, M, K, dtype, monkeypatch):
    # a GPTQ act-order layer's input in its stored order (PermutedInputQuantLinear); leading dims, and a
    # transposed input the launcher must make contiguous; both kernels (a row per program above 64 rows
    # of at most GATHER_ROW_MAX_K: 80 x 200, 256 x 11008; 66 x 16400 is wider); outputs poisoned (NaN)
    poison_new_tensors(monkeypatch, cpu=device == "cpu")
    g = torch.Generator().manual_seed(M * K)
    x = torch.randn(2, M, K, generator=g).to(device, dtype)
    index = torch.randperm(K, generator=g).to(device)
    assert torch.equal(W.gather_columns(x, index), x.index_select(-1, index))
    xt = torch.randn(K, M, generator=g).to(device, dtype).t()
    assert torch.equal(W.gather_columns(xt, index), xt.index_select(-1, index))
