"""W4A4 kernels (nibble/kernels/w4a4.py) against the reference (nibble/kernels/reference.py).

GPU tests run when CUDA is visible; tiny kernel tests run on the CPU under the Triton interpreter:
    TRITON_INTERPRET=1 pytest tests/kernels/test_w4a4.py -m interpreter
The rest (validation, the CPU op, fake tensors, import without Triton) runs everywhere and fast.
"""
import os
import subprocess
import sys

import pytest
import torch

from conftest import fake_cuda, poison_new_tensors, reference_on_fake_cuda, skip_without_cuda_kernel
from nibble.bench.w4a4 import unpack_weight_int8
from nibble.formats.int4 import pack_int4
from nibble.kernels import hopper, launch, reference
from nibble.kernels import w4a4
from nibble.kernels.hadamard import hadamard_transform_reference, supported_hadamard_sizes
from nibble.quantize.rtn import rtn_quantize

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = w4a4.triton is not None

# (N, K) of real layers: SmolLM2-135M, Llama-2-7B, Llama-3-8B
REAL_SHAPES = [(1536, 576), (576, 1536), (11008, 4096), (4096, 11008), (4096, 4096), (14336, 4096), (4096, 14336)]
ODD_M = [1, 3, 17, 100, 1000]


# ---- helpers ------------------------------------------------------------------------------------

def _codes_weight(N, K, device, gen=None):
    """Random canonical W4A4 weight: codes uniform in [0, 15] (so every unpack path is exercised)."""
    codes = torch.randint(0, 16, (K, N), generator=gen, dtype=torch.int32, device="cpu").to(device)
    qweight = pack_int4(codes)
    w_scale = (torch.rand(N, generator=gen) * 0.02 + 0.001).half().to(device)
    return qweight, w_scale


def _activations(M, K, dtype, device, gen=None, outliers=True):
    x = torch.randn(M, K, generator=gen, dtype=torch.float32)
    if outliers and K >= 64:
        x[:, torch.randperm(K, generator=gen)[: K // 64]] *= 20
    x *= torch.logspace(-1, 1, M).unsqueeze(1)  # rows on different scales
    return x.to(device=device, dtype=dtype)


def _qx(M, K, device, gen=None):
    return torch.randint(-8, 8, (M, K), generator=gen, dtype=torch.int8).to(device)


def _exact_acc(qx, qweight):
    """Exact int32 qx @ (q - 8): float64 for small problems, cuBLAS int8 (exact integers) for big ones."""
    M, K = qx.shape
    if qx.is_cuda and M * K * qweight.shape[1] > 2**26 and qweight.shape[1] % 8 == 0:
        w8 = unpack_weight_int8(qweight)  # [N, K]
        pad = max(0, 17 - M)
        a = torch.cat([qx, qx.new_zeros(pad, K)]) if pad else qx
        return torch._int_mm(a, w8.t())[:M]
    return reference.w4a4_accumulate(qx, qweight)


def _half_integer_rows(M, K, dtype, gen=None, subnormal=True):
    """Rows whose quotients x / scale fall on and a few ulps beside every half-integer (where a
    quotient rounded the wrong way would flip a code), on scales across the dtype's range, subnormal
    ones included unless told not to."""
    low, high = (-130, 121) if dtype == torch.bfloat16 else (-20, 15)
    if not subnormal:
        low = -100 if dtype == torch.bfloat16 else -10
    e = torch.randint(low, high, (M,), generator=gen).float()
    amax = torch.exp2(e).to(dtype).float()
    amax[amax == 0] = torch.finfo(dtype).tiny
    scale = amax / torch.full_like(amax, 7.0)
    k = torch.randint(-7, 7, (M, K), generator=gen).float() + 0.5
    x = (k * scale[:, None]).to(dtype)
    bits = x.view(torch.int16)
    magnitude = bits & 0x7FFF
    nudge = torch.randint(-3, 4, bits.shape, generator=gen, dtype=torch.int16)
    bits += nudge * ((magnitude > 3) & (magnitude < 0x7000))  # stays finite, keeps its sign
    x[:, 0] = amax.to(dtype)  # |x| < 7 scale elsewhere, so this sets the scale
    return x


def _exact_half_quotient_rows(K, dtype):
    """Rows whose quotients are exactly +-3.5, which x RN(1 / scale) misses by an ulp (and rounds to the wrong code)
    for about one largest value in six: row i's largest value (7 scale) has the mantissa 1 + i / 128, every one of
    bfloat16's, the others are +-half of it. (`_half_integer_rows` rounds its values to dtype, off a half-integer
    by far more than a float32 ulp.) Then a bfloat16 row at the bottom of the normal range, its values all normal,
    whose 1 / scale overflows float32 without the division's 2^64 pre-scale."""
    amax = 1 + torch.arange(128) / 128
    x = (amax[:, None] / 2).repeat(1, K)
    x[:, 1::2] *= -1
    x[:, 0] = amax
    if dtype == torch.bfloat16:
        tiny = torch.finfo(dtype).tiny
        x = torch.cat([x, torch.tensor([1.5, 1.0, -1.25, 1.5, -1.5] * (K // 5) + [1.0] * (K % 5))[None] * tiny])
    return x.to(dtype)


def _ref_quant(x):
    """The reference quantizer on the CPU. (On CUDA, PyTorch turns `amax / 7` into `amax * (1/7)`,
    one rounding off the spec's float32 division; the kernel divides exactly, like the CPU.)"""
    return reference.quantize_activations(x.cpu())


@pytest.fixture(autouse=True)
def _poisoned_outputs(monkeypatch):
    """Every CUDA tensor torch.empty / empty_like hand out in these tests holds garbage (NaN, the
    type's largest integer: never a code, scale or sum a kernel writes), so an output a kernel leaves
    unwritten cannot look right; under the Triton interpreter every CPU one too (`poison_new_tensors`).
    Poisoning the caching allocator's free memory does not do it: blocks of up to 1 MiB come from
    another pool, and a loop over configs gets back the previous call's block, which holds the same answer."""
    poison_new_tensors(monkeypatch, cpu=INTERPRET)


def _ulp_close(y, ref, dtype, terms=None):
    """y within one rounding of ref in the output dtype (the epilogue may fuse its multiply-add).

    ``terms``: sum of the magnitudes the fp32 epilogue adds (|acc sx sw| + |bias|); when the bias
    cancels the product, ref is tiny and the fp32 roundings of the terms (2^-23 each) dominate.
    """
    eps = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10, torch.float32: 2.0 ** -20}[dtype]
    tiny = torch.finfo(dtype).tiny if dtype != torch.bfloat16 else 1e-30
    err = (y.double() - ref.double()).abs()
    bound = eps * ref.double().abs() + tiny
    if terms is not None:
        bound = bound + 2.0 ** -21 * terms.double()
    assert torch.isfinite(y).all(), "non-finite output"
    assert bool((err <= bound).all()), f"max err {err.max().item()} beyond one {dtype} rounding"


def _first_unsupported_hadamard(start):
    ok = set(supported_hadamard_sizes(4 * start))
    return next(k for k in range(start, 4 * start, 8) if k not in ok)


# ---- everywhere: validation, CPU op, fake tensors ---------------------------------------------------

def test_cpu_op_is_the_reference():
    qw, ws = _codes_weight(48, 64, "cpu")
    x = _activations(5, 64, torch.float32, "cpu")
    b = torch.randn(48)
    y = torch.ops.nibble.w4a4_linear(x, qw, ws, b, False)
    assert torch.equal(y, reference.w4a4_linear(x, qw, ws, b, False))
    y = torch.ops.nibble.w4a4_linear(x, qw, ws, None, True)
    assert torch.equal(y, reference.w4a4_linear(x, qw, ws, None, True))


@reference_on_fake_cuda
def test_the_reference_backend_takes_float32_on_a_cuda_device():
    """The op's 16-bit rule (its GPU kernels') refused float32 CUDA activations on backend='reference' too."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from nibble import kernels
    mode = FakeTensorMode(allow_non_fake_inputs=True)  # the reference makes small constant tensors of its own
    x, qw, ws = fake_cuda(mode, torch.randn(3, 64), *_codes_weight(24, 64, "cpu"))
    with mode:
        assert kernels.w4a4_linear(x, qw, ws, backend="reference").dtype == torch.float32
        with pytest.raises(TypeError, match="float16 or bfloat16"):
            torch.ops.nibble.w4a4_linear(x, qw, ws, None, False)


def test_opcheck_schema_and_fake():
    qw, ws = _codes_weight(32, 64, "cpu")
    x = _activations(3, 64, torch.float32, "cpu")
    torch.library.opcheck(torch.ops.nibble.w4a4_linear.default, (x, qw, ws, torch.randn(32), False),
                          test_utils=("test_schema", "test_faketensor"))


def test_shared_input_op_equals_one_op_per_layer_on_cpu():
    (qw1, ws1), (qw2, ws2) = _codes_weight(32, 64, "cpu"), _codes_weight(48, 64, "cpu")
    x = _activations(5, 64, torch.float32, "cpu")
    b = torch.randn(48)
    for had in (False, True):
        y1, y2 = torch.ops.nibble.w4a4_linears(x, [qw1, qw2], [ws1, ws2], [None, b], had)
        assert torch.equal(y1, torch.ops.nibble.w4a4_linear(x, qw1, ws1, None, had))
        assert torch.equal(y2, torch.ops.nibble.w4a4_linear(x, qw2, ws2, b, had))
    torch.library.opcheck(torch.ops.nibble.w4a4_linears.default, (x, [qw1, qw2], [ws1, ws2], [None, b], False),
                          test_utils=("test_schema", "test_faketensor"))
    with pytest.raises(ValueError, match="one length"):
        torch.ops.nibble.w4a4_linears(x, [qw1, qw2], [ws1], [None, b], False)
    with pytest.raises(ValueError, match="packs K"):  # every layer is checked
        torch.ops.nibble.w4a4_linears(x, [qw1, _codes_weight(48, 32, "cpu")[0]], [ws1, ws2], [None, None], False)


@pytest.mark.parametrize("case,says", [
    ("x3d", r"x must be 2-D \[M, K\] .*got shape \(2, 4, 64\)"),
    ("k_not_mult_8", "K=60 must be a multiple of 8"),
    ("k_mismatch", r"qweight \(8, 32\) packs K=64 rows but x has K=72"),
    ("qweight_dtype", r"qweight must be the canonical packed int32 .*got torch.int64"),
    ("w_scale_shape", r"w_scale must be a per-channel \[32\] .*got torch.float16 \(31,\)"),
    ("w_scale_dtype", r"w_scale must be a per-channel \[32\] .*got torch.int32 \(32,\)"),
    ("bias_shape", r"bias must be a float tensor of shape \[32\], got torch.float32 \(33,\)"),
    ("hadamard_size", "input_hadamard=True needs a supported Hadamard size: no Hadamard matrix of size \\d+")])
def test_clear_errors(case, says):
    qw, ws = _codes_weight(32, 64, "cpu")
    x = torch.randn(4, 64)
    args = dict(x=x, qweight=qw, w_scale=ws, bias=None, input_hadamard=False)
    if case == "x3d":
        args["x"] = torch.randn(2, 4, 64)
    elif case == "k_not_mult_8":
        args["x"] = torch.randn(4, 60)
    elif case == "k_mismatch":
        args["x"] = torch.randn(4, 72)
    elif case == "qweight_dtype":
        args["qweight"] = qw.to(torch.int64)
    elif case == "w_scale_shape":
        args["w_scale"] = ws[:31]
    elif case == "w_scale_dtype":
        args["w_scale"] = ws.to(torch.int32)
    elif case == "bias_shape":
        args["bias"] = torch.randn(33)
    elif case == "hadamard_size":
        K = _first_unsupported_hadamard(64)
        qk, wk = _codes_weight(32, K, "cpu")
        args.update(x=torch.randn(4, K), qweight=qk, w_scale=wk, input_hadamard=True)
    with pytest.raises(ValueError, match=says):
        torch.ops.nibble.w4a4_linear(**args)


def test_matmul_rejects_bad_inputs_clearly():
    qw, ws = _codes_weight(32, 64, "cpu")
    qx = torch.zeros(4, 64, dtype=torch.int8)
    sx = torch.ones(4)
    with pytest.raises(ValueError, match="int8"):
        w4a4._check_matmul_inputs(qx.float(), sx, qw, ws, None)
    with pytest.raises(ValueError, match="x_scale"):
        w4a4._check_matmul_inputs(qx, sx.half(), qw, ws, None)
    with pytest.raises(ValueError, match="packs K"):
        w4a4._check_matmul_inputs(torch.zeros(4, 72, dtype=torch.int8), sx, qw, ws, None)


def test_module_imports_and_runs_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch\n"
            "from nibble.kernels import w4a4, reference\n"
            "from nibble.formats.int4 import pack_int4\n"
            "assert w4a4.triton is None\n"
            "qw = pack_int4(torch.randint(0, 16, (64, 16), dtype=torch.int32)); ws = torch.rand(16).half()\n"
            "x = torch.randn(3, 64)\n"
            "assert torch.equal(torch.ops.nibble.w4a4_linear(x, qw, ws, None, False),"
            " reference.w4a4_linear(x, qw, ws))\n"
            "q, s = w4a4.quantize_activations(x.bfloat16())\n"
            "assert torch.equal(q, reference.quantize_activations(x.bfloat16())[0])\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd()] + sys.path), TRITON_INTERPRET="0")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def test_wgmma_config_model():
    """The fitted model's picks (H200, benchmarks/results/w4a4-explore-h200.json): split-K on the
    deep 4096-wide layers at 128 tokens, 64 x 128 tiles at 64 tokens, 128 x 256 tiles from 1024
    tokens; splits only where each keeps 2 stages and the CTAs fit two waves; a pure function."""
    for M in (17, 64, 128, 256, 1024, 4096):
        for N, K in ((4096, 4096), (12288, 4096), (4096, 11008), (28672, 8192), (8192, 28672), (576, 1536)):
            cfg = w4a4.WGMMA.config(M, N, K)
            assert cfg == w4a4.WGMMA.config(M, N, K)
            tile = (cfg["bn"], cfg["channels"])
            assert tile in w4a4.WGMMA.tiles() and cfg["split_k"] in hopper.SPLITS
            assert cfg["split_k"] == 1 or (hopper.tile_count(M, N, *tile) * cfg["split_k"] <= 2 * 132
                                           and -(-K // 128) // cfg["split_k"] >= 2)
    assert w4a4.WGMMA.config(128, 4096, 11008)["split_k"] >= 3 and w4a4.WGMMA.config(128, 4096, 14336)["split_k"] >= 3
    # The splits of a tile are one cluster and a GPU holds fewer clusters than SMs / split: the
    # H200's 30 clusters of 4 cannot take the 32 tiles of a 4096-wide layer at 128 tokens at once.
    h200 = {1: 132, 2: 66, 3: 39, 4: 30, 6: 17, 8: 15}
    assert w4a4.WGMMA.config(128, 4096, 11008, h200) == dict(bn=128, channels=128, split_k=3)
    # 64 x 128 tiles (session 20) where they measured fastest: up to 64 tokens, and the 4096 x 4096
    # o_proj at 128 tokens in two splits (10.7 against 13.5 us for 128 x 128 in three)
    assert w4a4.WGMMA.config(64, 12288, 4096, h200) == dict(bn=64, channels=128, split_k=1)
    assert w4a4.WGMMA.config(128, 4096, 4096, h200) == dict(bn=64, channels=128, split_k=2)
    assert w4a4.WGMMA.config(128, 12288, 4096, h200) == dict(bn=128, channels=128, split_k=1)
    assert all(w4a4.WGMMA.config(1024, n, k) == dict(bn=128, channels=256, split_k=1)
               for n, k in ((12288, 4096), (14336, 4096), (8192, 28672)))


def test_wgmma_tiles_for_layers_side_by_side():
    """One launch over several layers runs only tiles whose channels divide every width but the
    last (a tile never spans two layers), and its config is picked among those."""
    assert w4a4.WGMMA.tiles([4096, 1024, 1024]) == w4a4.WGMMA.tiles()
    assert w4a4.WGMMA.tiles([11008, 11008]) == w4a4.WGMMA.tiles()  # 43 x 256
    assert w4a4.WGMMA.tiles([896, 128, 128]) == ((128, 128), (64, 128))  # Qwen2-0.5B: 7 x 128
    assert w4a4.WGMMA.tiles([576, 192, 192]) == ()  # SmolLM2: one launch per layer
    for M in (17, 128, 256, 257, 512, 4096):
        cfg = w4a4.WGMMA.config(M, 896 + 256, 896, widths=[896, 128, 128])
        # 64 x 128 up to the 256 tokens it was swept at (WGMMA.model.max_tokens), 128 x 128 above
        assert (cfg["bn"], cfg["channels"]) == ((64, 128) if M <= 256 else (128, 128))
        launch = w4a4.WGMMA.launch_config(None, M, 896, [896, 128, 128], hopper.ideal_clusters(132))
        assert launch == cfg
    with pytest.raises(ValueError, match=r"must be one of \(\) .* got none that fits"):
        w4a4.WGMMA.launch_config(None, 64, 576, [576, 192, 192], hopper.ideal_clusters(132))
    with pytest.raises(ValueError, match="split_k must be 1 to 8"):
        w4a4.WGMMA.launch_config(dict(bn=128, channels=128, split_k=16), 64, 4096, [4096], hopper.ideal_clusters(132))
    with pytest.raises(ValueError, match="multiple of the channels"):
        w4a4.WGMMA.launch_config(dict(bn=128, channels=256, split_k=1), 64, 896, [896, 128, 128],
                                 hopper.ideal_clusters(132))


def test_pick_config_covers_decode_and_prefill():
    assert w4a4.pick_config(1, 28672, 8192)["kind"] == "gemv"
    for M in (2, 16, 17, 128, 1024, 4096):
        cfg = w4a4.pick_config(M, 4096, 4096)
        assert cfg["kind"] == "mma" and cfg["split_k"] >= 1


def test_the_act_quant_kernel_refuses_x_that_is_not_2d_16_bit_first():
    """Said as the kernel's own rules, before the device's: a 3-D x was "need CUDA tensors" on the CPU."""
    with pytest.raises(ValueError, match=r"x must be 2-D \[M, K\] \(flatten leading dims first\), got shape \(1, 2, 64\)"):
        w4a4.quantize_activations_triton(torch.randn(1, 2, 64).half())
    with pytest.raises(TypeError, match="the W4A4 kernels take float16 or bfloat16 activations, got torch.float32"):
        w4a4.quantize_activations_triton(torch.randn(2, 64))
    with pytest.raises(TypeError, match="x must be a torch.Tensor, got list"):
        w4a4.quantize_activations_triton([[0.0] * 64])


def test_the_products_check_their_operands_before_the_device():
    """On the CPU without the interpreter the device check would refuse anything: these are said first, as what is
    wrong with the operand."""
    qx, sx = torch.randint(-8, 8, (2, 64), dtype=torch.int8), torch.rand(2)
    qw, ws = pack_int4(torch.randint(0, 16, (64, 16), dtype=torch.int32)), torch.rand(16).half()
    with pytest.raises(TypeError, match="qx must be a torch.Tensor, got list"):
        w4a4.w4a4_matmul_triton(qx.tolist(), sx, qw, ws)
    with pytest.raises(TypeError, match="w_scale must be a torch.Tensor, got float"):
        w4a4.w4a4_matmul_triton(qx, sx, qw, 0.5)
    with pytest.raises(ValueError, match=r"qx must be int8 \[M, K\], got torch.int32"):
        w4a4.w4a4_matmul_triton(qx.int(), sx, qw, ws)
    with pytest.raises(ValueError, match=r"x_scale must be float32 \[2\], got torch.float16"):
        w4a4.w4a4_matmul_triton(qx, sx.half(), qw, ws)


def test_the_layer_checks_say_a_per_channel_scale_one_device_and_lists_of_one_length():
    x = torch.randn(2, 64)
    qw, ws = pack_int4(torch.randint(0, 16, (64, 16), dtype=torch.int32)), torch.rand(16).half()
    with pytest.raises(ValueError, match=r"w_scale must be a per-channel \[16\] float16/bfloat16/float32 tensor"):
        w4a4.checked_layers(x, [qw], [ws[:, None]], [None], False)
    with pytest.raises(ValueError, match=r"w_scale must be a per-channel \[16\].*got torch.int32"):
        w4a4.checked_layers(x, [qw], [ws.int()], [None], False)
    with pytest.raises(ValueError, match=r"x, qweight, w_scale and bias must be on one device, got \['cpu', 'meta'\]"):
        w4a4.checked_layers(x, [qw], [ws.to("meta")], [None], False)
    with pytest.raises(ValueError, match="qweights, w_scales and biases must be non-empty lists of one length, got 1, 2, 1"):
        w4a4.checked_layers(x, [qw], [ws, ws], [None], False)
    with pytest.raises(ValueError, match="non-empty lists of one length, got 0, 0, 0"):
        w4a4.checked_layers(x, [], [], [], False)


def test_the_layer_and_product_checks_refuse_lists_and_scales_that_do_not_line_up():
    """zip dropped the layer without a bias entry (one output fewer, without a word); a float64 w_scale is none of
    the kernels' types; a 3-D qx and a token scale of another length were read as other shapes."""
    x = torch.randn(4, 64)
    qw, ws = pack_int4(torch.randint(0, 16, (64, 16), dtype=torch.int32)), torch.rand(16).half()
    with pytest.raises(ValueError, match="non-empty lists of one length, got 2, 2, 1"):
        w4a4.checked_layers(x, [qw, qw], [ws, ws], [None], False)
    with pytest.raises(ValueError, match=r"w_scale must be a per-channel \[16\] .*got torch.float64"):  # no kernel reads it
        w4a4.checked_layers(x, [qw], [ws.double()], [None], False)
    qx, sx = torch.randint(-8, 8, (4, 64), dtype=torch.int8), torch.rand(4)
    with pytest.raises(ValueError, match=r"x_scale must be float32 \[4\], got torch.float32 \(3,\)"):
        w4a4._check_matmul_inputs(qx, sx[:3], qw, ws, None)
    with pytest.raises(ValueError, match=r"qx must be int8 \[M, K\], got torch.int8 \(1, 4, 64\)"):
        w4a4._check_matmul_inputs(qx[None], sx[:1], qw, ws, None)


def test_the_shared_input_ops_fake_checks_the_layers_and_keeps_x_dtype():
    """Under FakeTensorMode (torch.compile's tracing) the shared-input op refuses what it refuses at run time, and
    answers in x's 16-bit type (opcheck above runs float32 x, where a float32 fake could not be told apart)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    (qw1, ws1), (qw2, ws2) = _codes_weight(32, 64, "cpu"), _codes_weight(48, 64, "cpu")
    x = _activations(3, 64, torch.float32, "cpu").bfloat16()
    torch.library.opcheck(torch.ops.nibble.w4a4_linears.default, (x, [qw1, qw2], [ws1, ws2], [None, None], False),
                          test_utils=("test_schema", "test_faketensor"))
    with FakeTensorMode() as mode:
        fx, fq1, fq2, fw1, fw2 = (mode.from_tensor(t) for t in (x, qw1, qw2, ws1, ws2))
        ys = torch.ops.nibble.w4a4_linears(fx, [fq1, fq2], [fw1, fw2], [None, None], False)
        assert [(y.shape, y.dtype) for y in ys] == [((3, 32), torch.bfloat16), ((3, 48), torch.bfloat16)]
        with pytest.raises(ValueError, match=r"w_scale must be a per-channel \[48\]"):
            torch.ops.nibble.w4a4_linears(fx, [fq1, fq2], [fw1, fw1], [None, None], False)


@pytest.mark.skipif(INTERPRET, reason="the interpreter runs the Triton kernel on the CPU")
def test_the_activation_quantization_off_the_gpu_rotates_where_asked():
    """`quantize_activations` without the kernels is the reference's, with the online Hadamard where asked (the
    tests above ask for none off the GPU), in either order."""
    x = _activations(5, 64, torch.bfloat16, "cpu")
    for had, spec in ((True, reference.rotate_quantize_activations), (False, reference.quantize_activations)):
        q, s = w4a4.quantize_activations(x, input_hadamard=had)
        want_q, want_s = spec(x)
        assert torch.equal(q, want_q) and torch.equal(s, want_s)
        assert torch.equal(w4a4.quantize_activations(x, had, "even_odd")[0], w4a4.to_even_odd(want_q))
    assert not torch.equal(w4a4.quantize_activations(x, True)[0], w4a4.quantize_activations(x, False)[0])


def test_m_buckets_end_at_their_bounds():
    assert [w4a4.m_bucket(M) for M in (1, 2, 16, 17, 128, 129, 1024, 1025, 8192)] == [1, 16, 16, 128, 128, 1024,
                                                                                        1024, 4096, 4096]


def test_auto_split_fills_the_sms_and_keeps_k_steps_per_split():
    """Decode (M <= 64): about two waves of programs, each of >= 4 K steps; above, one wave of >= 8 steps; none
    where the tiles alone fill the waves. The gemv kernel: four waves of >= 4 steps."""
    mma = w4a4.CANDIDATES[16][0]  # 64 x 128 tiles, 128-deep K steps
    assert w4a4.auto_split(mma, 64, 4096, 4096) == 8  # 32 tiles: 9 splits fill 2 waves; 32 steps allow 8
    assert w4a4.auto_split(mma, 65, 4096, 4096) == 3  # 64 tiles: 3 splits fill one wave (up to 32 // 8 allowed)
    assert w4a4.auto_split(mma, 1, 4096, 512) == 1  # 4 K steps: no split keeps 4 each
    assert w4a4.auto_split(mma, 64, 264 * 128, 4096) == 1  # 264 tiles: two waves already
    gemv = w4a4.CANDIDATES[1][0]  # 256 columns, 16 words of K a step
    assert w4a4.auto_split(gemv, 1, 4096, 4096) == 8  # 16 tiles want 33 splits; 32 steps allow 8
    assert w4a4.auto_split(gemv, 1, 4096, 4096, sms=16) == 4  # 16 tiles x 4 = four waves of 16 SMs


def test_the_tuned_candidate_is_picked_for_its_shape():
    assert w4a4.pick_config(1, 4096, 4096) == dict(w4a4.CANDIDATES[1][1], split_k=w4a4.auto_split(
        w4a4.CANDIDATES[1][1], 1, 4096, 4096))
    assert w4a4.pick_config(1, 4096, 2048)["BN"] == w4a4.CANDIDATES[1][0]["BN"]  # not tuned: the bucket's first


def test_successors_launch_early_where_they_measured_faster():
    from nibble.kernels.launch import SUCCESSOR_AT_END, SUCCESSOR_CAPPED

    assert [w4a4.mma_successor(M) for M in (1, 4, 5, 16)] == [SUCCESSOR_CAPPED] * 2 + [SUCCESSOR_AT_END] * 2
    early = {(M, warps) for M in range(1, 17) for warps in (4, 8, 16) if w4a4.rotate_quantize_successor(M, warps)}
    assert early == {(M, w) for M in range(1, 5) for w in (4, 8, 16)} | {(M, w) for M in range(9, 17) for w in (8, 16)}


def test_rotate_quantize_plans_of_the_docstrings_sizes():
    """K = m s p: the dense factor H_m (x) H_s, rows of p = 64, or 128 where m * 2^k / 64 would pass 256 rows."""
    plans = {576: (36, 1, 4), 1536: (12, 2, 6), 4096: (1, 64, 6), 11008: (172, 1, 6), 14336: (28, 8, 6),
             18944: (148, 1, 7), 28672: (28, 8, 7), 16384: (1, 256, 6), 32768: (1, 256, 7)}
    assert {K: w4a4.rotate_quantize_plan(K) for K in plans} == plans
    assert w4a4.rotate_quantize_plan(65536) is None  # 512 rows of 128: more than a CTA cluster holds
    assert w4a4.rotate_quantize_plan(48) is None  # 12 x 4: rows of 4 are too short for ldmatrix


def test_rotate_quantize_takes_rows_of_8_the_shortest_ldmatrix_reads():
    """The bound of the refusal above is p >= 8, not 16: 12 x 8 and 172 x 8 (a row of 8-column pieces) are plans."""
    assert w4a4.rotate_quantize_plan(96) == (12, 1, 3) and w4a4.rotate_quantize_plan(1376) == (172, 1, 3)


def test_rotate_quantize_shared_memory_is_the_kernels():
    """csrc/rotate_quantize.cu: smem_bytes (the rows padded to 16, one float a warp and one more for the row's max),
    which decides where the kernel fits: a byte short and the launch fails."""
    import re

    src = (w4a4.cuda_build.CSRC / "rotate_quantize.cu").read_text()
    threads = int(re.search(r"constexpr int THREADS = (\d+), WARPS = THREADS / 32", src).group(1))
    assert "return mp * (p + 8) * 2 + 16 * (p + 4) * 4 + (WARPS + 1) * 4;" in src
    for rows, log2p in ((172, 6), (28 * 8, 7), (36, 4), (1, 6)):
        p, mp = 1 << log2p, (rows + 15) // 16 * 16
        assert w4a4.rotate_quantize_smem(rows, log2p) == mp * (p + 8) * 2 + 16 * (p + 4) * 4 + (threads // 32 + 1) * 4


def test_the_act_quant_plan_pads_a_row_to_a_power_of_two():
    """(rows a program, padded row, warps): 4096 elements a program, up to 64 a thread."""
    assert w4a4._act_plan(4096, False) == (1, 4096, 4, None)
    assert w4a4._act_plan(11008, False) == (1, 16384, 8, None)
    assert w4a4._act_plan(576, False) == (4, 1024, 4, None)
    assert w4a4._act_plan(32768, False) == (1, 32768, 16, None)
    assert w4a4._act_plan(100, False) == (32, 128, 4, None)


# ---- compile-only check (sm_90 target, no GPU needed): the PTX unpack's layout assumption ---------

@pytest.mark.skipif(not HAS_TRITON or INTERPRET, reason="needs triton (and its bundled ptxas), not the interpreter")
@pytest.mark.skipif(not (HAS_CUDA or os.environ.get("NIBBLE_TEST_SM90_COMPILE") == "1"),
                    reason="compiles for sm_90 (~5 s per config): runs with CUDA or NIBBLE_TEST_SM90_COMPILE=1")
def test_asm_unpack_layout():
    """Every shipped tensor-core config must hand each asm unpack call the eight copies of one word
    and the nibble indices 0..7 in order (else the packed int8 results would mix words)."""
    import re
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = {"x_ptr": "*i8", "w_ptr": "*i32", "xs_ptr": "*fp32", "ws_ptr": "*fp16", "b_ptr": "*bf16",
           "y_ptr": "*bf16", "part_ptr": "*i32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
           "stride_xm": "i32", "stride_ym": "i32", "k_per_split": "i32", "split_k": "i32"}
    names = list(sig)
    div = [n for n in sig if sig[n].startswith("*")] + ["N", "K", "stride_xm", "stride_ym", "k_per_split"]
    seen = set()
    for c in (c for b in w4a4.CANDIDATES.values() for c in b if c["kind"] == "mma"):
        key = (c["BM"], c["BN"], c["BK"], c["num_warps"], c["num_stages"])
        if key in seen:
            continue
        seen.add(key)
        ce = dict(BM=c["BM"], BN=c["BN"], BK=c["BK"], GROUP_M=c["GROUP_M"], EVEN_K=True,
                  EVEN_N=True, SPLIT=False, HAS_BIAS=False, OUT_INT=False, UNPACK_ASM=True)
        full = dict(sig, **{k: "constexpr" for k in ce})
        src = ASTSource(fn=w4a4._w4a4_mma_kernel, signature=full, constexprs=ce,
                        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in div})
        ck = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": c["num_warps"], "num_stages": c["num_stages"]})
        calls = re.findall(r'\{ <4 x i8>, <4 x i8> \} asm "[^"]*", "[^"]*"\(([^)]*)\)', ck.asm["llir"])
        assert calls, f"{key}: no asm unpack found"
        for args in calls:
            ops = [o.strip() for o in args.split(",")]
            assert len(set(ops[:8])) == 1, f"{key}: one asm call sees several words: {ops[:8]}"
            assert [o.split()[-1] for o in ops[8:]] == [str(i) for i in range(8)], f"{key}: nibbles out of order"


def test_asm_unpack_only_for_checked_tiles():
    """The PTX unpack's register-layout assumption is checked for the shipped tiles only; any other
    config takes the plain unpack (64x64x64 at 4 warps with the asm one gave wrong products)."""
    shipped = [c for b in w4a4.CANDIDATES.values() for c in b if c["kind"] == "mma"]
    assert shipped and all(w4a4._asm_unpack_checked(c) for c in shipped)
    assert not w4a4._asm_unpack_checked(dict(kind="mma", BM=64, BN=64, BK=64))
    assert not w4a4._asm_unpack_checked(dict(shipped[0], num_warps=shipped[0]["num_warps"] * 2))


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("split_k", [1, 3])
def test_custom_triton_tile_exact(split_k):
    """A tile outside the shipped candidates (plain unpack) is still exact."""
    M, N, K = 70, 256, 512
    qw, _ = _codes_weight(N, K, "cuda")
    qx = _qx(M, K, "cuda")
    cfg = dict(kind="mma", BM=64, BN=64, BK=64, split_k=split_k)
    assert torch.equal(w4a4.w4a4_accumulate_triton(qx, qw, config=cfg), reference.w4a4_accumulate(qx, qw))


# ---- the Triton kernels: tiny cases under the interpreter ------------------------------------------

@pytest.mark.interpreter
@pytest.mark.skipif(not (INTERPRET and HAS_TRITON), reason="needs TRITON_INTERPRET=1 (and triton)")
@pytest.mark.parametrize("M,K,dtype,chunked", [(3, 64, torch.bfloat16, False), (5, 200, torch.float16, False),
                                               (2, 96, torch.bfloat16, False), (5, 200, torch.bfloat16, True),
                                               (4, 5000, torch.float16, True), (3, 360, torch.bfloat16, False),
                                               (2, 11008, torch.bfloat16, False)])
def test_interp_act_quant_exact(M, K, dtype, chunked, monkeypatch):
    monkeypatch.setattr(w4a4, "CHUNKED_MIN_M", 1 if chunked else 1 << 30)
    monkeypatch.setattr(w4a4, "CHUNKED_MIN_K", 1)
    x = _activations(M, K, dtype, "cpu")
    x[0, 3] = float("nan")
    x[1, 5] = float("inf")
    x[-1] = 0
    q, s = w4a4.quantize_activations_triton(x)
    qr, sr = reference.quantize_activations(x)
    assert torch.equal(q, qr) and torch.equal(s, sr)


@pytest.mark.interpreter
@pytest.mark.skipif(not (INTERPRET and HAS_TRITON), reason="needs TRITON_INTERPRET=1 (and triton)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("gpu_division", [False, True])
def test_interp_act_quant_half_integer_quotients(dtype, gpu_division, monkeypatch):
    """gpu_division: `_row_quotients`' GPU branch (Markstein's correction, the 2^64 pre-scale of tiny scales: bf16
    rows down to 2^-100 take it) instead of the interpreter's div_rn, with an FMA that rounds once from float64
    (the interpreter's own rounds twice, in float32). It has no other interpreter-only branch on this path."""
    if gpu_division:
        from triton.runtime import interpreter

        def fma_from_float64(builder, a, b, c):
            exact = a.data.astype("float64") * b.data.astype("float64") + c.data.astype("float64")
            return interpreter.TensorHandle(exact.astype("float32"), c.dtype.scalar)
        monkeypatch.setattr(w4a4, "interpreting", lambda: False)
        monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fma", fma_from_float64)
    # normal numbers only: the interpreter converts subnormal bf16 to float32 wrongly
    x = _half_integer_rows(6, 96, dtype, torch.Generator().manual_seed(1), subnormal=False)
    x = torch.cat([x, _exact_half_quotient_rows(96, dtype)])
    q, s = w4a4.quantize_activations_triton(x)
    qr, sr = reference.quantize_activations(x)
    assert torch.equal(q, qr) and torch.equal(s, sr)


def _nonfinite_zero_and_huge_rows(M, K, dtype, device):
    """M >= 8 random rows of K >= 64 but rows 0-7: a NaN, a +Inf, a -Inf, all zeros, all NaN, all the dtype's
    largest value, a -Inf and a +Inf, all its smallest normal (the scale underflows nowhere in float32; the
    interpreter converts subnormal bfloat16 wrongly)."""
    x = _activations(M, K, dtype, device)
    x[0, 7] = float("nan")
    x[1, 9] = float("inf")
    x[2, 11] = -float("inf")
    x[3] = 0
    x[4] = float("nan")
    x[5, :] = torch.finfo(dtype).max
    x[6, 40] = -float("inf")
    x[6, 41] = float("inf")
    x[7] = torch.finfo(dtype).tiny
    return x


@pytest.mark.interpreter
@pytest.mark.skipif(not (INTERPRET and HAS_TRITON), reason="needs TRITON_INTERPRET=1 (and triton)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunked", [False, True])
def test_interp_act_quant_nonfinite_zero_and_huge_rows(dtype, chunked, monkeypatch):
    """The CPU twin of test_act_quant_nonfinite_zero_and_huge_rows. A lone NaN cannot show a kernel that keeps it:
    the interpreter's tl.maximum propagates NaN (the GPU's returns the other operand) and its tl.max skips it, and
    a NaN's code comes out 0. A row (or, chunked, a chunk) of NaN only, with no zero padding (K a power of two),
    does: its scale became NaN where the spec's is 0."""
    monkeypatch.setattr(w4a4, "CHUNKED_MIN_M", 1 if chunked else 1 << 30)
    monkeypatch.setattr(w4a4, "CHUNKED_MIN_K", 1)
    monkeypatch.setattr(w4a4, "CHUNK_K", 32)  # two chunks a row: the scale carries over the chunk of NaN
    x = _nonfinite_zero_and_huge_rows(9, 64, dtype, "cpu")
    x[8, :32] = float("nan")
    q, s = w4a4.quantize_activations_triton(x)
    qr, sr = reference.quantize_activations(x)
    assert torch.isfinite(s).all() and s[4] == 0 and (q[4] == 0).all()
    assert torch.equal(q, qr) and torch.equal(s, sr)


def _interp_cases():
    return [
        (1, 40, 96, dict(kind="gemv", BN=32, BKW=4, split_k=2)),
        (1, 64, 64, dict(kind="gemv", BN=64, BKW=8, split_k=1)),
        (1, 40, 136, dict(kind="gemv", BN=32, BKW=4, split_k=2)),  # K // 8 = 17 words: a masked tail
        (17, 64, 96, dict(kind="mma", BM=16, BN=32, BK=64, split_k=2)),
        (17, 64, 128, dict(kind="mma", BM=16, BN=32, BK=64, split_k=2)),  # K, N even: unmasked
        (20, 48, 128, dict(kind="mma", BM=16, BN=32, BK=32, GROUP_M=2, split_k=1)),
    ]


@pytest.mark.interpreter
@pytest.mark.skipif(not (INTERPRET and HAS_TRITON), reason="needs TRITON_INTERPRET=1 (and triton)")
@pytest.mark.parametrize("M,N,K,cfg", _interp_cases())
def test_interp_matmul_exact(M, N, K, cfg):
    qw, ws = _codes_weight(N, K, "cpu")
    qx = _qx(M, K, "cpu")
    assert torch.equal(w4a4.w4a4_accumulate_triton(qx, qw, config=cfg), reference.w4a4_accumulate(qx, qw))
    sx = torch.rand(M) + 0.01
    b = torch.randn(N).bfloat16()
    y = w4a4.w4a4_matmul_triton(qx, sx, qw, ws, b, torch.bfloat16, config=cfg)
    _ulp_close(y, reference.w4a4_matmul(qx, sx, qw, ws, b, torch.float32), torch.bfloat16)


@pytest.mark.interpreter
@pytest.mark.skipif(not (INTERPRET and HAS_TRITON), reason="needs TRITON_INTERPRET=1 (and triton)")
def test_interp_gemv_config_refuses_several_tokens():
    """The gemv computes one token (the dispatch gives it M = 1 only): a config forcing it on more is refused."""
    qw, _ = _codes_weight(32, 64, "cpu")
    with pytest.raises(ValueError, match="a gemv config computes one token, got M=3"):
        w4a4.w4a4_accumulate_triton(_qx(3, 64, "cpu"), qw, config=_interp_cases()[0][3])


@pytest.mark.interpreter
@pytest.mark.skipif(not (INTERPRET and HAS_TRITON), reason="needs TRITON_INTERPRET=1 (and triton)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("M,N,K,cfg", [_interp_cases()[0], _interp_cases()[3]])
def test_interp_matmul_saturates_like_the_reference(M, N, K, cfg, dtype):
    # Products beyond the output type's range (here: a token scale of float32's max) must saturate
    # to its largest finite value, as in the reference, never become Inf.
    qw, ws = _codes_weight(N, K, "cpu")
    qx = _qx(M, K, "cpu")
    sx = torch.rand(M) + 0.01
    sx[0] = torch.finfo(torch.float32).max
    y = w4a4.w4a4_matmul_triton(qx, sx, qw, ws, None, dtype, config=cfg)
    ref = reference.w4a4_matmul(qx, sx, qw, ws, None, dtype)
    assert torch.isfinite(y).all() and torch.isfinite(ref).all()
    sat = ref[0].float().abs() == torch.finfo(dtype).max
    assert sat.sum() > N // 4 and torch.equal(y[0][sat], ref[0][sat])


@pytest.mark.interpreter
@pytest.mark.skipif(not (INTERPRET and HAS_TRITON), reason="needs TRITON_INTERPRET=1 (and triton)")
def test_interp_act_quant_fused_hadamard_equals_unfused_kernel(monkeypatch):
    """The rotation fused into the act-quant kernel (4 rows of 576 fuse only unsplit: SPLIT_ROW_TILES 0) quantizes
    as the transform kernel, then the plain act-quant kernel, do."""
    from nibble.kernels import hadamard
    monkeypatch.setattr(hadamard, "SPLIT_ROW_TILES", 0)
    x = _activations(4, 576, torch.bfloat16, "cpu")
    q, s = w4a4.quantize_activations_triton(x, True)
    q2, s2 = w4a4.quantize_activations_triton(hadamard.hadamard_transform_triton(x, split=False), False)
    assert torch.equal(q, q2) and torch.equal(s, s2)


@pytest.mark.interpreter
@pytest.mark.skipif(not (INTERPRET and HAS_TRITON), reason="needs TRITON_INTERPRET=1 (and triton)")
@pytest.mark.parametrize("K", [256, 576])
def test_interp_act_quant_fused_hadamard_in_even_odd_order(K, monkeypatch):
    """The fused rotation (HADAMARD) and the even_odd code order in one kernel: Sylvester only, and with a dense
    factor (fused for a few rows only when they are not split)."""
    from nibble.kernels import hadamard
    monkeypatch.setattr(hadamard, "SPLIT_ROW_TILES", 0)
    x = _activations(4, K, torch.bfloat16, "cpu")
    q, s = w4a4.quantize_activations_triton(x, True)
    q_eo, s_eo = w4a4.quantize_activations_triton(x, True, order="even_odd")
    assert torch.equal(q_eo, w4a4.to_even_odd(q)) and torch.equal(s_eo, s)


# ---- GPU: activation quantization ------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", ODD_M + [256, 4096])
@pytest.mark.parametrize("K", [576, 1536, 4096, 11008, 14336, 28672])
def test_act_quant_equals_reference(M, K, dtype):
    x = _activations(M, K, dtype, "cuda")
    q, s = w4a4.quantize_activations(x)
    qr, sr = _ref_quant(x)
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and s.shape == (M,)
    assert torch.equal(s.cpu(), sr)
    assert torch.equal(q.cpu(), qr), f"{(q.cpu() != qr).sum().item()} codes differ"


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,K,chunked", [(1, 4096, False), (7, 11008, False), (600, 4096, False),
                                         (600, 11008, False), (600, 28672, False), (600, 28672, True),
                                         (600, 576, True)])
def test_act_quant_half_integer_quotients(M, K, chunked, dtype, monkeypatch):
    # The kernels divide without div.rn (w4a4._row_quotients); a quotient off by an ulp would show
    # here as a code rounded the other way.
    monkeypatch.setattr(w4a4, "CHUNKED_MIN_M", 1 if chunked else 1 << 30)
    monkeypatch.setattr(w4a4, "CHUNKED_MIN_K", 1)
    gen = torch.Generator().manual_seed(M * K)
    x = _half_integer_rows(M, K, dtype, gen).cuda()
    q, s = w4a4.quantize_activations(x)
    qr, sr = _ref_quant(x)
    assert (qr.abs() >= 1).float().mean() > 0.5  # the quotients sit at the half-integers, not near 0
    assert torch.equal(s.cpu(), sr)
    assert torch.equal(q.cpu(), qr), f"{(q.cpu() != qr).sum().item()} codes differ"


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [1, 300, 4096])
@pytest.mark.parametrize("K", [576, 11008, 28672])
def test_chunked_act_quant_equals_reference(M, K, dtype, monkeypatch):
    monkeypatch.setattr(w4a4, "CHUNKED_MIN_M", 1)
    monkeypatch.setattr(w4a4, "CHUNKED_MIN_K", 1)
    x = _activations(M, K, dtype, "cuda")
    x[0, 1] = float("nan")
    x[-1] = 0
    q, s = w4a4.quantize_activations(x)
    qr, sr = _ref_quant(x)
    assert torch.equal(s.cpu(), sr) and torch.equal(q.cpu(), qr)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [9, 300])
def test_act_quant_nonfinite_zero_and_huge_rows(dtype, M):
    x = _nonfinite_zero_and_huge_rows(M, 4104, dtype, "cuda")
    q, s = w4a4.quantize_activations(x)
    qr, sr = _ref_quant(x)
    assert torch.isfinite(s).all()
    assert s[3] == 0 and s[4] == 0 and (q[3] == 0).all() and (q[4] == 0).all()
    assert torch.equal(s.cpu(), sr) and torch.equal(q.cpu(), qr)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K", [576, 1536, 4096, 11008, 14336])
@pytest.mark.parametrize("M", [1, 17, 100, 300])  # 576 at 300 rows: the first that runs fused
def test_act_quant_fused_hadamard(M, K, dtype):
    from nibble.kernels.hadamard import hadamard_transform_triton
    x = _activations(M, K, dtype, "cuda")
    q, s = w4a4.quantize_activations_triton(x, input_hadamard=True)
    # Same arithmetic as the unfused kernel chain (one row per program; M < 32 rotates with the
    # row-splitting transform), so identical codes...
    q2, s2 = w4a4.quantize_activations_triton(hadamard_transform_triton(x, split=False), input_hadamard=False)
    assert torch.equal(q, q2) and torch.equal(s, s2)
    # ...and the float32 spec up to rare +-1 flips where the rotated value rounds differently.
    qr, sr = reference.quantize_activations(hadamard_transform_reference(x))
    assert torch.allclose(s, sr, rtol=2 ** -6, atol=0)
    d = (q.int() - qr.int()).abs()
    assert d.max() <= 1 and d.float().mean() < 0.01, f"{int((d > 0).sum())} flips of {d.numel()}"



@pytest.mark.parametrize("K", [64, 576, 1536, 2048, 2816])
def test_rotate_quantize_plan_is_the_hadamard_matrix(K):
    """The CUDA kernel's view of a row, [m s, p] with dense factor H_m (x) H_s and butterflies over p,
    is H_K itself (2816 = 44 x 64; 1536 = (12 x 2) x 64; 2048 = 32 x 64)."""
    from nibble.kernels.hadamard import _sylvester, hadamard_matrix
    m, s, log2p = w4a4.rotate_quantize_plan(K)
    rows = m * s
    dense = w4a4._dense_factor(m, s, torch.float64, torch.device("cpu"))
    assert rows * (1 << log2p) == K and not dense[rows:].any() and not dense[:, rows:].any()
    h = torch.kron(dense[:rows, :rows], _sylvester(1 << log2p)) / K ** 0.5
    assert torch.allclose(h, hadamard_matrix(K, torch.float64), rtol=0, atol=1e-12)


def test_rotate_quantize_says_what_it_needs():
    """Called directly where the CUDA kernel cannot run (a CPU tensor, a size it does not take), it
    says so; the op runs anywhere."""
    with pytest.raises(ValueError, match="CUDA tensor on an sm_90"):
        w4a4.rotate_quantize(torch.randn(2, 11008, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        w4a4.rotate_quantize(torch.randn(2, 11008))


def _rotate_quantize_or_skip(x):
    """Skip unless the kernel runs here for rows like x's (the dispatch's row and CTA caps do not
    apply to the tests that call it directly)."""
    if not w4a4._rotate_quantize_runs(x):
        skip_without_cuda_kernel("the CUDA rotate + quantize kernel is not available here (nvcc, sm_90+, shared memory)")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K", [64, 576, 1536, 4096, 11008, 14336, 18944, 28672])
@pytest.mark.parametrize("M", [1, 3, 8, 16])
def test_rotate_quantize_matches_the_spec(M, K, dtype):
    """csrc/rotate_quantize.cu against the float32 spec (rotate, round to x's type, quantize): scales
    to the rotation's rounding, codes up to rare +-1 flips; the even_odd order is the natural codes
    permuted; every output written (outputs poisoned); a strided view reads its rows."""
    x = _activations(M, K, dtype, "cuda")
    _rotate_quantize_or_skip(x)
    q, s = w4a4.rotate_quantize(x)
    qr, sr = reference.quantize_activations(hadamard_transform_reference(x))
    assert q.dtype == torch.int8 and s.dtype == torch.float32 and q.shape == (M, K) and s.shape == (M,)
    assert torch.allclose(s, sr.to(s.device), rtol=2 ** -6, atol=0)
    d = (q.int() - qr.to(q.device).int()).abs()
    assert d.max() <= 1 and d.float().mean() < 0.01, f"{int((d > 0).sum())} flips of {d.numel()}"
    qe, se = w4a4.rotate_quantize(x, "even_odd")
    assert torch.equal(se, s) and torch.equal(qe, w4a4.to_even_odd(q))
    x2 = _activations(2 * M, K, dtype, "cuda")[::2]
    q2, s2 = w4a4.rotate_quantize(x2)
    q3, s3 = w4a4.rotate_quantize(x2.contiguous())
    assert torch.equal(q2, q3) and torch.equal(s2, s3)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rotate_quantize_zeroes_nonfinite_rows_and_zero_rows(dtype):
    """A non-finite input, which the rotation spreads over its row, zeroes the row as the spec does
    (`reference.rotate_quantize_activations`; it saturated to +-7 at the largest scale until session 55, where
    the Triton kernels gave zeros); all-zero rows get scale 0 and codes 0, never NaN."""
    K = 11008
    x = _activations(5, K, dtype, "cuda")
    x[0, 3] = float("nan")
    x[1, 4] = float("inf")
    x[2] = 0
    x[3, 9] = -float("inf")
    _rotate_quantize_or_skip(x)
    q, s = w4a4.rotate_quantize(x)
    qr, sr = reference.rotate_quantize_activations(x)
    assert torch.isfinite(s).all() and (s[:4] == 0).all() and (q[:4] == 0).all()
    assert torch.allclose(s, sr.to(s.device), rtol=2 ** -6, atol=0)
    d = (q.int() - qr.to(q.device).int()).abs()
    assert d.max() <= 1 and d.float().mean() < 0.01


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_rotated_act_quant_takes_the_cuda_kernel_where_it_applies(monkeypatch):
    """quantize_activations(input_hadamard=True) runs rotate_quantize for up to ROTATE_QUANTIZE_MAX_M
    rows and ROTATE_QUANTIZE_MAX_CTAS CTAs (checked by counting calls), the Triton kernels for more and
    for sizes it does not take (12 x 4 = 48)."""
    x = _activations(5, 11008, torch.bfloat16, "cuda")
    _rotate_quantize_or_skip(x)
    calls = []
    real = w4a4.rotate_quantize
    monkeypatch.setattr(w4a4, "rotate_quantize", lambda x, *a, **k: calls.append(tuple(x.shape)) or real(x, *a, **k))
    q, s = w4a4.quantize_activations(x, input_hadamard=True)
    assert calls == [(5, 11008)]
    q2, s2 = real(x)
    assert torch.equal(q, q2) and torch.equal(s, s2)
    many = _activations(w4a4.ROTATE_QUANTIZE_MAX_M + 1, 11008, torch.bfloat16, "cuda")
    assert not w4a4.rotate_quantize_applicable(many)
    # 16 rows of 14336 are 16 x 14 CTAs, past ROTATE_QUANTIZE_MAX_CTAS: the Triton path, the same codes
    wide = _activations(16, 14336, torch.bfloat16, "cuda")
    assert not w4a4.rotate_quantize_applicable(wide) and w4a4.rotate_quantize_applicable(wide[:8])
    qr, sr = reference.quantize_activations(hadamard_transform_reference(wide))
    assert (w4a4.quantize_activations(wide, input_hadamard=True)[0].int() - qr.to("cuda").int()).abs().max() <= 1
    assert w4a4.rotate_quantize_plan(48) is None  # 12 x 4: rows of 4 are too short for ldmatrix
    small = _activations(5, 48, torch.bfloat16, "cuda")
    q, s = w4a4.quantize_activations(small, input_hadamard=True)
    qr, sr = reference.quantize_activations(hadamard_transform_reference(small))
    assert (q.int() - qr.to(q.device).int()).abs().max() <= 1
    assert calls == [(5, 11008)]  # neither the wide rows nor the small ones took it


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_rotate_quantize_needs_a_rows_cluster_resident(monkeypatch):
    """This GPU holds the cluster of every plan the models need (up to 16 CTAs, non-portable); where a
    GPU (or a partition of one) cannot, the op keeps the Triton path and the kernel called directly
    says what it needs."""
    import ctypes
    import functools

    x = _activations(3, 11008, torch.bfloat16, "cuda")
    lib = w4a4._rotate_quantize_lib(x.device)
    if lib is None or torch.cuda.get_device_capability() < (9, 0):
        skip_without_cuda_kernel("the CUDA rotate + quantize kernel is not available here (nvcc, sm_90+)")
    for K in (576, 4096, 11008, 14336, 18944, 28672):
        m, s, log2p = w4a4.rotate_quantize_plan(K)
        n = ctypes.c_int(-1)
        assert lib.nibble_rotate_quantize_clusters(m * s, log2p, ctypes.byref(n)) == 0 and n.value >= 1, K
    assert w4a4._rotate_quantize_runs(x)
    # the answer worked out afresh for this test (it is kept per device and row size), from a query
    # that answers success and leaves the count at the caller's 0: no cluster fits
    monkeypatch.setattr(w4a4, "_rotate_quantize_runs_on", functools.cache(w4a4._rotate_quantize_runs_on.__wrapped__))
    monkeypatch.setattr(lib, "nibble_rotate_quantize_clusters", lambda m, log2p, clusters: 0)
    assert not w4a4.rotate_quantize_applicable(x)
    with pytest.raises(ValueError, match="holds a row's thread-block cluster"):
        w4a4.rotate_quantize(x)
    q, s = w4a4.quantize_activations(x, input_hadamard=True)
    qr, sr = reference.quantize_activations(hadamard_transform_reference(x))
    assert torch.allclose(s, sr.to(s.device), rtol=2 ** -6, atol=0)
    assert (q.int() - qr.to(q.device).int()).abs().max() <= 1

def _nonfinite_tokens(M, K, dtype, device):
    """M >= 7 rows of K: rows 0-3 hold a NaN, a +Inf, a -Inf, a +Inf and a -Inf; row 4 is all the dtype's largest
    value, whose float32 rotation overflows in bfloat16 (a token without Inf whose rotation holds them) and in
    float16 is finite but beyond float16 (it saturates); row 5 starts with two of them, whose float32 rotation
    overflows in bfloat16 only where they add (elsewhere it is finite, not zero); the rest are ordinary rows."""
    x = _activations(M, K, dtype, device)
    x[0, 5 % K] = float("nan")
    x[1, 7 % K] = float("inf")
    x[2, 2] = -float("inf")
    x[3, 3], x[3, K - 1] = float("inf"), -float("inf")
    x[4] = torch.finfo(dtype).max
    x[5, :2] = torch.finfo(dtype).max
    return x


def _zeroed_tokens(dtype):
    """How many of `_nonfinite_tokens`' first rows quantize to zeros: rows 4 and 5 too in bfloat16."""
    return 6 if dtype == torch.bfloat16 else 4


def _check_rotated_nonfinite(q, s, x):
    """The spec (docs/ARCHITECTURE.md, `reference.rotate_quantize_activations`): the rotation spreads a NaN or
    +-Inf over its whole token, which quantizes to zeros (scale 0), whatever the path, and so does a token whose
    float32 rotation overflows; a float16 token rotated past 65504 saturates (scale 65504 / 7); the other tokens
    as always (the Triton kernels' rare +-1 against the float32 spec)."""
    qr, sr = reference.rotate_quantize_activations(x.cpu())
    bad = _zeroed_tokens(x.dtype)
    assert (qr[:bad] == 0).all() and (sr[:bad] == 0).all() and (sr[bad:] > 0).all()
    assert torch.equal(q[:bad].cpu(), qr[:bad]) and torch.equal(s[:bad].cpu(), sr[:bad])
    assert torch.equal(s[4].cpu(), sr[4])  # 0, or float16's saturated amax over 7
    assert torch.isfinite(s).all() and (q[bad:].int() - qr[bad:].to(q.device).int()).abs().max() <= 1


def test_rotated_reference_zeroes_a_token_holding_a_nonfinite_value():
    x = _nonfinite_tokens(7, 256, torch.bfloat16, "cpu")
    q, s = reference.rotate_quantize_activations(x)
    _check_rotated_nonfinite(q, s, x)
    qr, sr = reference.quantize_activations(hadamard_transform_reference(x))  # finite tokens: rotate, quantize
    assert torch.equal(q[6:], qr[6:]) and torch.equal(s[6:], sr[6:])
    qweight, w_scale = _codes_weight(24, 256, "cpu")
    bias = torch.randn(24).bfloat16()
    y = reference.w4a4_linear(x, qweight, w_scale, bias, input_hadamard=True)
    assert torch.equal(y[:6], bias.expand(6, -1)) and torch.isfinite(y).all()


@pytest.mark.interpreter
@pytest.mark.skipif(not (INTERPRET and HAS_TRITON), reason="needs TRITON_INTERPRET=1 (and triton)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K", [8, 16, 40, 128, 200, 576])
@pytest.mark.parametrize("split", [False, True])
def test_interp_rotated_act_quant_zeroes_nonfinite_tokens_for_every_plan(K, dtype, split, monkeypatch):
    """The Triton path on every kind of Hadamard plan: one factor (K < 256: 8, 40 and 200 dense, 16 and 128
    Sylvester, where the tf32 pieces never compute Inf - Inf; +-Inf saturated to the largest scale until session
    63) and several (576), fused and through the row-splitting transform (the split path, for a few rows with
    a dense factor); then the product gives such a token the bias alone."""
    from nibble.kernels import hadamard
    if split and hadamard.hadamard_plan(K).dense_pad == 1:
        pytest.skip("no dense factor: always fused")
    monkeypatch.setattr(hadamard, "SPLIT_ROW_TILES", 1 << 30 if split else 0)
    x = _nonfinite_tokens(7, K, dtype, "cpu")
    q, s = w4a4.quantize_activations_triton(x, input_hadamard=True)
    _check_rotated_nonfinite(q, s, x)
    qweight, w_scale = _codes_weight(32, K, "cpu")
    bias = torch.randn(32).to(dtype)
    y = w4a4.w4a4_matmul_triton(q, s, qweight, w_scale, bias, dtype)
    bad = _zeroed_tokens(dtype)
    assert torch.equal(y[:bad], bias.expand(bad, -1)) and torch.isfinite(y).all()


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("M", [7, 300])  # the CUDA rotate + quantize kernel's rows (where it runs), the Triton ones'
@pytest.mark.parametrize("K", [8, 16, 40, 128, 200, 576, 4096, 11008, 14336])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_rotated_act_quant_and_layer_with_nonfinite_tokens(M, K, dtype):
    """Every kind of plan (K < 256: one Hadamard factor; 40 and 200 have no CUDA kernel plan, so 7 rows take the
    Triton row-splitting transform) on every GPU path."""
    from nibble import kernels
    x = _nonfinite_tokens(M, K, dtype, "cuda")
    q, s = w4a4.quantize_activations(x, input_hadamard=True)
    _check_rotated_nonfinite(q, s, x)
    qweight, w_scale = _codes_weight(256, K, "cuda")
    bias = torch.randn(256, device="cuda").to(dtype)
    y = kernels.w4a4_linear(x, qweight, w_scale, bias, input_hadamard=True)
    bad = _zeroed_tokens(dtype)
    assert torch.equal(y[:bad], bias.expand(bad, -1)) and torch.isfinite(y).all()


# ---- GPU: the integer part, bit-exact ------------------------------------------------------------

def _configs_for(M, N, K):
    """The heuristic config, every tuning candidate of M's bucket (each with its automatic split and
    with a forced one), so whichever the tuned table picks is covered."""
    cfgs = [None]
    for c in w4a4.CANDIDATES[w4a4.m_bucket(M)]:
        cfgs.append(dict(c))  # automatic split-K
        cfgs.append(dict(c, split_k=1 if w4a4.auto_split(c, M, N, K) > 1 else 3))
    return cfgs


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("N,K", REAL_SHAPES + [(100, 576), (4104, 4096)])
@pytest.mark.parametrize("M", ODD_M + [16, 128])
def test_int32_accumulators_bit_exact(M, N, K):
    gen = torch.Generator().manual_seed(M * 7919 + N * 31 + K)
    qw, _ = _codes_weight(N, K, "cuda", gen)
    qx = _qx(M, K, "cuda", gen)
    exact = _exact_acc(qx, qw)
    for cfg in _configs_for(M, N, K):
        acc = w4a4.w4a4_accumulate_triton(qx, qw, config=cfg)
        assert torch.equal(acc, exact), f"config {cfg}: {(acc != exact).sum().item()} of {acc.numel()} differ"


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
def test_exact_reference_helper_agrees_with_float64():
    qw, _ = _codes_weight(1024, 2048, "cuda")
    qx = _qx(40, 2048, "cuda")
    assert torch.equal(_exact_acc(qx, qw), reference.w4a4_accumulate(qx, qw))


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
def test_extreme_codes_do_not_overflow():
    # all activations -8 and all weights 0 (q - 8 = -8): acc = 64 K, the largest magnitude
    K, N = 14336, 256
    qw = pack_int4(torch.zeros(K, N, dtype=torch.int32)).cuda()
    for M in (1, 64, 256):
        qx = torch.full((M, K), -8, dtype=torch.int8, device="cuda")
        acc = w4a4.w4a4_accumulate_triton(qx, qw)
        assert (acc == 64 * K).all()


# ---- GPU: scaled output and the op -------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [1, 3, 17, 100, 1000])
@pytest.mark.parametrize("bias", [False, True])
def test_scaled_output_within_rounding(M, dtype, bias):
    N, K = 4096, 4096
    qw, ws = _codes_weight(N, K, "cuda")
    qx = _qx(M, K, "cuda")
    sx = torch.rand(M, device="cuda") * 0.1 + 1e-3
    b = torch.randn(N, device="cuda").to(dtype) if bias else None
    y = w4a4.w4a4_matmul_triton(qx, sx, qw, ws, b, out_dtype=dtype)
    acc = _exact_acc(qx, qw).double()
    prod = acc * sx.double()[:, None] * ws.double()[None, :]
    ref = prod + (b.double() if bias else 0)
    _ulp_close(y, ref, dtype, terms=prod.abs() + (b.double().abs() if bias else 0))


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("N,K", REAL_SHAPES)
@pytest.mark.parametrize("M", ODD_M)
@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_linear_op_real_shapes(M, N, K, dtype):
    w = torch.randn(N, K, device="cuda") * 0.02
    q = rtn_quantize(w, -1, symmetric=True, clip_search=False)
    qw, ws = q.qweight, q.scales[0]
    x = _activations(M, K, dtype, "cuda", outliers=False)  # unrotated, an outlier column zeroes its row's codes
    b = torch.randn(N, device="cuda").to(dtype) * 0.1
    y = torch.ops.nibble.w4a4_linear(x, qw, ws, b, False)
    assert y.shape == (M, N) and y.dtype == dtype
    # same codes as the reference quantizer, then an exact integer product: one output rounding apart
    qx, sx = (t.cuda() for t in _ref_quant(x))
    assert (qx != 0).float().mean() > 0.5
    acc = _exact_acc(qx, qw).double()
    prod = acc * sx.double()[:, None] * ws.double()[None, :]
    _ulp_close(y, prod + b.double(), dtype, terms=prod.abs() + b.double().abs())


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("N,K", [(1536, 576), (4096, 11008), (4096, 14336)])
@pytest.mark.parametrize("M", [1, 17, 100])
def test_linear_op_with_hadamard(M, N, K):
    qw, ws = _codes_weight(N, K, "cuda")
    x = _activations(M, K, torch.bfloat16, "cuda")
    y = torch.ops.nibble.w4a4_linear(x, qw, ws, None, True)
    ref = reference.w4a4_linear(x, qw, ws, None, True)
    assert torch.isfinite(y).all()
    rel = ((y.double() - ref.double()).norm() / ref.double().norm()).item()
    assert rel < 2e-2, rel  # rare +-1 activation-code flips from rounding the rotation


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("M", [1, 7, 16, 17, 100])
@pytest.mark.parametrize("had", [False, True])
def test_shared_input_op_equals_one_op_per_layer(M, had):
    # q/k/v of a GQA block: three widths, one input quantized once; the same kernels per layer
    K = 576
    layers = [_codes_weight(N, K, "cuda") for N in (576, 192, 192)]
    biases = [None, torch.randn(192, device="cuda").bfloat16(), None]
    x = _activations(M, K, torch.bfloat16, "cuda", outliers=had)  # unrotated outliers zero most codes
    ys = torch.ops.nibble.w4a4_linears(x, [q for q, _ in layers], [s for _, s in layers], biases, had)
    for y, (qw, ws), b in zip(ys, layers, biases):
        assert torch.equal(y, torch.ops.nibble.w4a4_linear(x, qw, ws, b, had))


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
def test_linear_op_nonfinite_and_zero_tokens_stay_finite():
    N, K = 1536, 576
    qw, ws = _codes_weight(N, K, "cuda")
    x = _activations(6, K, torch.bfloat16, "cuda")
    x[0, 3] = float("nan")
    x[1, 4] = float("inf")
    x[2] = 0
    x[3] = float("nan")
    for had in (False, True):
        y = torch.ops.nibble.w4a4_linear(x, qw, ws, None, had)
        assert torch.isfinite(y).all()
        assert (y[2] == 0).all() and (y[3] == 0).all()
    # without the rotation the codes are exact, so the output is one rounding from the spec, which
    # saturates the Inf token's huge products at the largest finite bf16
    y = torch.ops.nibble.w4a4_linear(x, qw, ws, None, False)
    qx, sx = (t.cuda() for t in _ref_quant(x))
    ref = _exact_acc(qx, qw).double() * sx.double()[:, None] * ws.double()[None, :]
    big = torch.finfo(torch.bfloat16).max
    _ulp_close(y, ref.clamp(-big, big), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("M", [1, 5, 300])
def test_torch_compile_and_cuda_graph(M):
    N, K = 4096, 4096
    qw, ws = _codes_weight(N, K, "cuda")
    b = torch.randn(N, device="cuda").bfloat16()
    x = _activations(M, K, torch.bfloat16, "cuda")
    eager = torch.ops.nibble.w4a4_linear(x, qw, ws, b, True)

    @torch.compile(fullgraph=True)
    def f(x):
        return torch.ops.nibble.w4a4_linear(x, qw, ws, b, True) * 2

    assert torch.equal(f(x), eager * 2)

    static_x = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        torch.ops.nibble.w4a4_linear(static_x, qw, ws, b, True)  # warm-up (compilation) outside capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static_y = torch.ops.nibble.w4a4_linear(static_x, qw, ws, b, True)
    x2 = _activations(M, K, torch.bfloat16, "cuda") * 3
    static_x.copy_(x2)
    static_y.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_y, torch.ops.nibble.w4a4_linear(x2, qw, ws, b, True))


# ---- GPU: the CUDA C++ decode kernel (csrc/w4a4_mma.cu) ------------------------------------------

def _needs_mma_kernel():
    if not w4a4.mma_applicable(torch.zeros(1, 32, dtype=torch.int8, device="cuda"), 32, 32):
        skip_without_cuda_kernel("the CUDA W4A4 kernel is not built here (no nvcc or sm < 80)")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [1, 5, 8, 9, 16])
def test_mma_kernel_many_layers_in_one_launch(M):
    """Up to three layers of different widths in one launch (CTAs numbered across them): the int32
    sums exact, the scaled outputs equal to one launch per layer, a bias on some layers only."""
    _needs_mma_kernel()
    gen = torch.Generator().manual_seed(M)
    K = 1056
    layers = [_codes_weight(N, K, "cuda", gen) for N in (576, 64, 192)]
    biases = [None, torch.randn(64, device="cuda").bfloat16(), torch.randn(192, device="cuda").bfloat16()]
    qx = _qx(M, K, "cuda", gen)
    sx = torch.rand(M, device="cuda") + 0.5
    accs = w4a4.w4a4_mma_many(qx, torch.ones(M, device="cuda"), [(qw, ws, None) for qw, ws in layers], out_int32=True)
    for acc, (qw, _) in zip(accs, layers):
        assert torch.equal(acc, _exact_acc(qx, qw))
    ys = w4a4.w4a4_mma_many(qx, sx, [(qw, ws, b) for (qw, ws), b in zip(layers, biases)], torch.float16)
    for y, (qw, ws), b in zip(ys, layers, biases):
        assert torch.equal(y, w4a4.w4a4_mma(qx, sx, qw, ws, b, torch.float16))
    with pytest.raises(ValueError, match="share the w_scale dtype"):
        w4a4.w4a4_mma_many(qx, sx, [(layers[0][0], layers[0][1], None), (layers[1][0], layers[1][1].float(), None)])
    with pytest.raises(ValueError, match="1 to 3 layers"):
        w4a4.w4a4_mma_many(qx, sx, [(qw, ws, None) for qw, ws in layers + layers[:1]])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [1, 4, 5, 16])
def test_mma_kernel_successor_modes(M):
    """Every successor mode (launch.SUCCESSOR_*; skinny.cuh) keeps the int32 sums exact, in a CUDA graph
    of launches back to back (the capped mode raises a launch's shared memory up to a whole SM's):
    fewer CTAs than SMs, a few per SM and several waves, one and three layers a launch; a mode the
    kernel does not know is refused."""
    _needs_mma_kernel()
    gen = torch.Generator().manual_seed(M)
    K = 4096
    launches = [[_codes_weight(N, K, "cuda", gen)] for N in (4096, 12288, 28672)] + \
        [[_codes_weight(N, K, "cuda", gen) for N in (4096, 1024, 1024)]]
    qx, ones = _qx(M, K, "cuda", gen), torch.ones(M, device="cuda")
    for successor in (0, 1, 2):
        def run():
            return [w4a4.w4a4_mma_many(qx, ones, [(qw, ws, None) for qw, ws in layers], out_int32=True,
                                       successor=successor) for layers in launches]
        run()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            accs = run()
        for acc in accs:
            for a in acc:
                a.fill_(-1)
        g.replay()
        torch.cuda.synchronize()
        for acc, layers in zip(accs, launches):
            for a, (qw, _) in zip(acc, layers):
                assert torch.equal(a, _exact_acc(qx, qw)), f"successor {successor}"
    with pytest.raises(ValueError, match="successor must be"):
        w4a4.w4a4_mma(qx, ones, *launches[0][0], successor=3)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("warps", [1, 4, 8, 16])
def test_mma_kernel_int32_accumulators_bit_exact(warps):
    """Every M of both token tiles, K split unevenly over the warps (65 steps of 32), fewer steps than
    the ring, the extreme codes and activations; outputs poisoned before each call."""
    _needs_mma_kernel()
    gen = torch.Generator().manual_seed(warps)
    for N, K in ((192, 576), (576, 1536), (1024, 2080), (64, 64), (4096, 4096)):
        qw, ws = _codes_weight(N, K, "cuda", gen)
        for M in (1, 2, 3, 7, 8, 9, 15, 16):
            qx = _qx(M, K, "cuda", gen)
            acc = w4a4.w4a4_mma(qx, torch.ones(M, device="cuda"), qw, ws, out_int32=True, warps=warps)
            exact = _exact_acc(qx, qw)
            assert torch.equal(acc, exact), f"N={N} K={K} M={M}: {(acc != exact).sum().item()} differ"
    # the extreme products: codes 0 and 15 (values -8, 7) against activations -8 and 7
    K = 28672
    qw = pack_int4(torch.tensor([0, 15], dtype=torch.int32).repeat(K * 32 // 2).view(K, 32)).cuda()
    qx = torch.tensor([-8, 7], dtype=torch.int8).repeat(K // 2).view(1, K).cuda()
    acc = w4a4.w4a4_mma(qx, torch.ones(1, device="cuda"), qw, torch.ones(32, device="cuda"), out_int32=True,
                        warps=warps)
    assert torch.equal(acc, _exact_acc(qx, qw))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("w_scale_dtype", [torch.float16, torch.float32])
def test_mma_kernel_scaled_output_within_rounding(dtype, bias, w_scale_dtype):
    _needs_mma_kernel()
    _check_scaled_output(lambda qx, sx, qw, ws, b, M: w4a4.w4a4_mma(qx, sx, qw, ws, b, out_dtype=dtype),
                         (1, 5, 16), dtype, bias, w_scale_dtype, seed=1)


def _check_scaled_output(product, ms, dtype, bias, w_scale_dtype, seed):
    """product(qx, sx, qw, ws, bias, M) on a 4096 x 4096 layer against the exact integer product
    scaled in float64: within one rounding of `dtype`, for every M in `ms`; outputs poisoned."""
    N, K = 4096, 4096
    gen = torch.Generator().manual_seed(seed)
    qw, ws = _codes_weight(N, K, "cuda", gen)
    ws = ws.to(w_scale_dtype)
    for M in ms:
        qx = _qx(M, K, "cuda", gen)
        sx = (torch.rand(M, generator=gen) * 0.1 + 1e-3).cuda()
        b = None if bias is None else torch.randn(N, generator=gen).to(device="cuda", dtype=bias)
        y = product(qx, sx, qw, ws, b, M)
        assert y.dtype == dtype and y.shape == (M, N)
        prod = _exact_acc(qx, qw).double() * sx.double()[:, None] * ws.double()[None, :]
        ref = prod + (0 if b is None else b.double())
        _ulp_close(y, ref, dtype, terms=prod.abs() + (0 if b is None else b.double().abs()))


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
def test_decode_op_takes_the_mma_kernel_and_saturates_like_the_reference(monkeypatch):
    """M <= 16 with N, K multiples of 32 runs csrc/w4a4_mma.cu (checked by counting calls); a token
    that held Inf saturates."""
    _needs_mma_kernel()
    calls = []
    real = w4a4.w4a4_mma
    monkeypatch.setattr(w4a4, "w4a4_mma", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    qw, ws = _codes_weight(576, 1536, "cuda")
    x = _activations(3, 1536, torch.bfloat16, "cuda", outliers=False)
    x[1, 7] = float("inf")
    y = torch.ops.nibble.w4a4_linear(x, qw, ws, None, False)
    assert calls == [(3, 1536)]
    ref = reference.w4a4_linear(x.cpu(), qw.cpu(), ws.cpu(), None, False)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y.cpu().float(), ref.float(), rtol=1e-2, atol=1e-2)


def test_mma_kernel_rejects_what_it_cannot_run():
    qx, sx = torch.zeros(17, 64, dtype=torch.int8), torch.ones(17)
    qw, ws = _codes_weight(64, 64, "cpu")
    with pytest.raises(ValueError, match="M <= 16"):
        w4a4.w4a4_mma(qx, sx, qw, ws)
    assert not w4a4.mma_applicable(qx[:1], 64, 64)  # CPU tensors


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_quotients_never_leave_the_int4_range(dtype):
    """The act-quant kernels do not clamp rint(x / scale) to [-8, 7] (w4a4._store_int4_codes): with
    |x| <= amax and scale = RN(amax / 7), every correctly rounded quotient rounds into [-7, 7]. Checked
    for every finite positive value of the dtype as amax (x = amax is the largest quotient a row has;
    the kernels' 2^64 rescaling of tiny scales leaves quotients unchanged)."""
    bits = torch.arange(1, 0x7C00 if dtype == torch.float16 else 0x7F80, dtype=torch.int32).to(torch.int16)
    amax = bits.view(dtype).float()
    scale = amax / 7  # float32, correctly rounded, as the kernels' div_rn
    quotient = amax / scale
    assert (scale > 0).all() and quotient.max() < 7.5 and torch.round(quotient).max() == 7
    assert quotient.max() <= 7 * (1 + 2.0 ** -14)


# ---- the even_odd activation order (csrc/w4a4_wgmma.cu's K order) ----------------------------------

def test_even_odd_order_is_the_documented_permutation():
    q = torch.arange(64, dtype=torch.int32).view(1, 64)
    e = w4a4.to_even_odd(q)[0].tolist()
    assert e[:16] == list(range(0, 32, 2)) and e[16:32] == list(range(1, 32, 2))
    assert e[32:48] == list(range(32, 64, 2)) and e[48:] == list(range(33, 64, 2))
    with pytest.raises(ValueError, match="multiple of 32"):
        w4a4.to_even_odd(torch.zeros(2, 48, dtype=torch.int8))
    x = _activations(3, 64, torch.float32, "cpu")
    q_nat, s_nat = w4a4.quantize_activations(x)
    q_eo, s_eo = w4a4.quantize_activations(x, order="even_odd")
    assert torch.equal(q_eo, w4a4.to_even_odd(q_nat)) and torch.equal(s_eo, s_nat)
    with pytest.raises(ValueError, match="order must be one of"):
        w4a4.quantize_activations(x, order="odd_even")


@pytest.mark.interpreter
@pytest.mark.skipif(not (INTERPRET and HAS_TRITON), reason="needs TRITON_INTERPRET=1 (and triton)")
@pytest.mark.parametrize("M,K,dtype,chunked", [(3, 64, torch.bfloat16, False), (5, 96, torch.float16, False),
                                               (4, 2112, torch.bfloat16, True), (3, 2720, torch.float16, False)])
def test_interp_act_quant_even_odd(M, K, dtype, chunked, monkeypatch):
    monkeypatch.setattr(w4a4, "CHUNKED_MIN_M", 1 if chunked else 1 << 30)
    monkeypatch.setattr(w4a4, "CHUNKED_MIN_K", 1)
    x = _activations(M, K, dtype, "cpu")
    q, s = w4a4.quantize_activations_triton(x, order="even_odd")
    qr, sr = reference.quantize_activations(x)
    assert torch.equal(q, w4a4.to_even_odd(qr)) and torch.equal(s, sr)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize("K,had", [(576, False), (4096, False), (11008, False), (28672, False), (4096, True),
                                   (11008, True), (14336, True)])
def test_act_quant_even_odd_on_gpu(K, had, chunked, monkeypatch):
    if chunked and had:
        pytest.skip("the chunked kernel has no fused rotation")
    monkeypatch.setattr(w4a4, "CHUNKED_MIN_M", 1 if chunked else 1 << 62)
    monkeypatch.setattr(w4a4, "CHUNKED_MIN_K", 1)
    for M in (1, 17, 300):
        x = _activations(M, K, torch.bfloat16, "cuda")
        q, s = w4a4.quantize_activations_triton(x, had)
        qe, se = w4a4.quantize_activations_triton(x, had, order="even_odd")
        assert torch.equal(qe, w4a4.to_even_odd(q)) and torch.equal(se, s)


# ---- GPU: the CUDA C++ Hopper GEMM (csrc/w4a4_wgmma.cu) ----------------------------------------------

def _needs_wgmma_kernel():
    if not (HAS_CUDA and w4a4.wgmma_applicable(32, 32, 32, "cuda")):
        skip_without_cuda_kernel("the wgmma W4A4 kernel needs an sm_90 GPU (H100/H200) and nvcc")


def _wgmma_configs(M, N, K):
    """The heuristic config, every compiled (tokens, channels) tile, and a forced split-K."""
    auto = w4a4.WGMMA.config(M, N, K)
    k_tiles = -(-K // hopper.STAGE_K)
    cfgs = [None] + [dict(bn=bn, channels=ch, split_k=auto["split_k"]) for bn, ch in w4a4.WGMMA.tiles()]
    if k_tiles >= 3:
        cfgs.append(dict(auto, split_k=3))
    return cfgs


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("N,K", REAL_SHAPES + [(100, 576), (4104, 4096), (8192, 28672), (260, 4160)])
@pytest.mark.parametrize("M", [17, 64, 65, 100, 128, 129, 1000])
def test_wgmma_int32_accumulators_bit_exact(M, N, K):
    """Odd M (token tails), N not a multiple of the 128 / 256-channel tiles, K not a multiple of the
    128-deep stage (576, 4160), every compiled tile shape, split-K; outputs poisoned."""
    _needs_wgmma_kernel()
    gen = torch.Generator().manual_seed(M * 7919 + N * 31 + K)
    qw, _ = _codes_weight(N, K, "cuda", gen)
    qx = _qx(M, K, "cuda", gen)
    exact = _exact_acc(qx, qw)
    ones_m, ones_n = torch.ones(M, device="cuda"), torch.ones(N, device="cuda")
    for cfg in _wgmma_configs(M, N, K):
        acc = w4a4.w4a4_wgmma(qx, ones_m, qw, ones_n, out_int32=True, config=cfg)
        assert torch.equal(acc, exact), f"config {cfg}: {(acc != exact).sum().item()} of {acc.numel()} differ"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("tile", w4a4.WGMMA.tiles(), ids=lambda t: f"bn{t[0]}_ch{t[1]}")
def test_wgmma_split_k_sums_exact(tile):
    """Each CTA of a tile's cluster adds the other splits' partials of its share of the token rows, a
    batch of rows at a time (hopper.cuh: RowShare, sum_partials): every split count up to 8 (and an
    uneven 5: the last split shorter), token tails inside a batch of rows and a share, channel tails
    (lanes past N load clamped columns), and more tiles than resident clusters (each cluster walks
    several tiles, its producer meeting the consumers' barrier of every one)."""
    _needs_wgmma_kernel()
    bn, ch = tile
    gen = torch.Generator().manual_seed(bn + ch)
    K = 4224  # 33 stages of 128
    for M, N, splits in ((17, 260, (2, 5, 8)), (bn + 3, 260, (2, 5, 8)), (300, 260, (2, 5, 8)), (1000, 4104, (3, 8))):
        qw, _ = _codes_weight(N, K, "cuda", gen)
        qx = _qx(M, K, "cuda", gen)
        exact = _exact_acc(qx, qw)
        ones_m, ones_n = torch.ones(M, device="cuda"), torch.ones(N, device="cuda")
        for split in splits:
            acc = w4a4.w4a4_wgmma(qx, ones_m, qw, ones_n, out_int32=True, config=dict(bn=bn, channels=ch, split_k=split))
            assert torch.equal(acc, exact), f"M={M} split={split}: {(acc != exact).sum().item()} differ"
        # a config without split_k is one split (the launch read cfg["split_k"]: a KeyError)
        acc = w4a4.w4a4_wgmma(qx, ones_m, qw, ones_n, out_int32=True, config=dict(bn=bn, channels=ch))
        assert torch.equal(acc, exact), f"M={M} without split_k: {(acc != exact).sum().item()} differ"


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_wgmma_extreme_codes_do_not_overflow():
    """The weight bytes carry 16 (q - 8): the largest sums are 16x the true ones and must still fit."""
    _needs_wgmma_kernel()
    K, N = 28672, 256
    for code, act in ((0, -8), (15, 7), (0, 7)):
        qw = pack_int4(torch.full((K, N), code, dtype=torch.int32)).cuda()
        qx = torch.full((40, K), act, dtype=torch.int8, device="cuda")
        acc = w4a4.w4a4_wgmma(qx, torch.ones(40, device="cuda"), qw, torch.ones(N, device="cuda"), out_int32=True)
        assert (acc == (code - 8) * act * K).all()


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bias", [None, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("w_scale_dtype", [torch.float16, torch.float32])
def test_wgmma_scaled_output_within_rounding(dtype, bias, w_scale_dtype):
    """M = 17 (one 64-token tile), 200 unsplit and split over K (the int32 partials summed by the
    last CTA before the float epilogue)."""
    _needs_wgmma_kernel()
    for split in (1, 4):
        _check_scaled_output(lambda qx, sx, qw, ws, b, M: w4a4.w4a4_wgmma(
            qx, sx, qw, ws, b, out_dtype=dtype, config=dict(w4a4.WGMMA.config(M, 4096, 4096), split_k=split)),
            (17, 200), dtype, bias, w_scale_dtype, seed=2 + split)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("kernel", ["wgmma", "triton"])
def test_split_k_repeated_calls(kernel):
    """Repeated split-K products stay right. The Triton kernels share one counter buffer per stream
    (launch.split_counters, no memset per call): each call must leave its tiles' counters at zero, or
    the next call would finish early. (The wgmma kernel's splits meet in a cluster: no counters.)"""
    if kernel == "wgmma":
        _needs_wgmma_kernel()
    M, N, K = 200, 1024, 4096
    qw, ws = _codes_weight(N, K, "cuda")
    qx, sx = _qx(M, K, "cuda"), torch.rand(M, device="cuda") + 0.5
    if kernel == "wgmma":
        run = lambda: w4a4.w4a4_wgmma(qx, sx, qw, ws, None, torch.float32,  # noqa: E731
                                      config=dict(bn=128, channels=128, split_k=4))
    else:
        # a shipped config (the asm unpack's layout is checked for those only), split four ways
        cfg = dict(next(c for b in w4a4.CANDIDATES.values() for c in b if c["kind"] == "mma"), split_k=4)
        run = lambda: w4a4.w4a4_matmul_triton(qx, sx, qw, ws, None, torch.float32, config=cfg)  # noqa: E731
    ys = [run() for _ in range(4)]
    torch.cuda.synchronize()
    if kernel == "triton":
        assert int(launch.split_counters(qx.device, 64)[:64].abs().sum()) == 0
    expected = reference.w4a4_accumulate(qx, qw).double() * sx.double()[:, None] * ws.double()
    for y in ys:
        torch.testing.assert_close(y.double(), expected, rtol=1e-5, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("had", [False, True])
@pytest.mark.parametrize("widths,launches", [((4096, 4352, 4096), [3]), ((4100, 4096), [1, 1])])
def test_prefill_ops_take_the_wgmma_kernel(had, widths, launches, monkeypatch):
    """Enough tokens on Hopper: the op quantizes in the even_odd order once and runs
    csrc/w4a4_wgmma.cu, one launch for the group where every width but the last is a multiple of a
    tile's channels, else one per layer (checked by counting calls); outputs equal the Triton
    product's, finite where a token held Inf (the Triton product's saturation is checked against the
    reference on the interpreter)."""
    _needs_wgmma_kernel()
    calls = []
    real = w4a4.w4a4_wgmma_many
    monkeypatch.setattr(w4a4, "w4a4_wgmma_many",
                        lambda qx, sx, layers, *a, **k: calls.append((len(layers), k.get("order"))) or real(qx, sx, layers, *a, **k))
    K = 4096
    layers = [_codes_weight(n, K, "cuda") for n in widths]
    x = _activations(1000, K, torch.bfloat16, "cuda", outliers=had)  # unrotated outliers zero most codes
    assert all(w4a4.wgmma_preferred(1000, qw.shape[1], K, "cuda") for qw, _ in layers)
    x[5, 9] = float("inf")
    ys = torch.ops.nibble.w4a4_linears(x, [w for w, _ in layers], [s for _, s in layers], [None] * len(widths), had)
    assert calls == [(n, "even_odd") for n in launches]
    qx, sx = w4a4.quantize_activations_triton(x, had)
    for y, (qw, ws) in zip(ys, layers):
        assert torch.isfinite(y).all()
        assert torch.equal(y, w4a4.w4a4_matmul_triton(qx, sx, qw, ws, None, out_dtype=torch.bfloat16))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("M", [17, 100, 300])
def test_wgmma_many_layers_in_one_launch(M):
    """Up to three layers side by side in one launch (hopper.cuh: column_weight), the last one's
    width not a multiple of the tile, K not a multiple of the stage: the int32 sums exact for every
    tile the widths allow and with split-K, the scaled outputs equal to one launch per layer (a bias
    on some layers only); outputs poisoned."""
    _needs_wgmma_kernel()
    gen = torch.Generator().manual_seed(M)
    K, widths = 1056, (512, 256, 260)
    layers = [_codes_weight(n, K, "cuda", gen) for n in widths]
    biases = [None, torch.randn(256, device="cuda").bfloat16(), torch.randn(260, device="cuda").bfloat16()]
    qx = _qx(M, K, "cuda", gen)
    sx = torch.rand(M, device="cuda") + 0.5
    assert w4a4.WGMMA.tiles(widths) == w4a4.WGMMA.tiles()
    for bn, ch in w4a4.WGMMA.tiles(widths):
        for split in (1, 3):
            cfg = dict(bn=bn, channels=ch, split_k=split)
            accs = w4a4.w4a4_wgmma_many(qx, torch.ones(M, device="cuda"), [(qw, ws, None) for qw, ws in layers],
                                        out_int32=True, config=cfg)
            for acc, (qw, _) in zip(accs, layers):
                assert torch.equal(acc, _exact_acc(qx, qw)), f"config {cfg}"
            ys = w4a4.w4a4_wgmma_many(qx, sx, [(qw, ws, b) for (qw, ws), b in zip(layers, biases)], torch.float16,
                                      config=cfg)
            for y, (qw, ws), b in zip(ys, layers, biases):
                assert torch.equal(y, w4a4.w4a4_wgmma(qx, sx, qw, ws, b, torch.float16, config=cfg)), f"config {cfg}"
    odd = [layers[2], layers[0]]  # 260 columns first: no tile fits
    assert not w4a4.wgmma_many_applicable(qx, [(qw, ws, None) for qw, ws in odd])
    with pytest.raises(ValueError, match="multiple of the channels"):
        w4a4.w4a4_wgmma_many(qx, sx, [(qw, ws, None) for qw, ws in odd], config=dict(bn=128, channels=128, split_k=1))
    with pytest.raises(ValueError, match="share the w_scale dtype"):
        w4a4.w4a4_wgmma_many(qx, sx, [(layers[0][0], layers[0][1], None), (layers[1][0], layers[1][1].float(), None)])
    with pytest.raises(ValueError, match="1 to 3 layers"):
        w4a4.w4a4_wgmma_many(qx, sx, [(qw, ws, None) for qw, ws in layers + layers[:1]])


def _gated_layers(N, K, gen, bias, w_scale_dtype=torch.float16):
    """A gate and an up layer (qweight, w_scale, bias) of N x K; scales that put the products
    around 1 to 30, where SiLU bends and the bf16 roundings of both factors matter."""
    layers = []
    for _ in range(2):
        qw, _ = _codes_weight(N, K, "cuda", gen)
        ws = ((torch.rand(N, generator=gen) + 0.5) * 2.0 / K ** 0.5).to(device="cuda", dtype=w_scale_dtype)
        b = None if bias is None else torch.randn(N, generator=gen).to(device="cuda", dtype=bias)
        layers.append((qw, ws, b))
    return layers


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("N,K,bias", [(11008, 4096, None), (14336, 4096, None), (1536, 576, None),
                                      (260, 1056, torch.bfloat16), (4100, 4096, torch.float32)])
@pytest.mark.parametrize("M", [17, 100, 129, 512])
def test_wgmma_silu_mul_equals_the_products_then_the_glue_kernel(M, N, K, bias, dtype):
    """The gated launch (csrc/w4a4_wgmma.cu: GATED) against the two products rounded to dtype and
    the engine's SiLU(gate) * up kernel on them, to the bit: every tile, with and without split-K,
    N not a multiple of the tile's 64 / 128 gate columns (260, 4100), K not a multiple of the
    stage (576, 1056), a bias on both; within a rounding or two of Hugging Face's F.silu(g) * u in
    PyTorch (the reference); outputs poisoned."""
    _needs_wgmma_kernel()
    from nibble.eval import engine
    gen = torch.Generator().manual_seed(M * 31 + N + K)
    gate, up = _gated_layers(N, K, gen, bias)
    qx = _qx(M, K, "cuda", gen)
    sx = (torch.rand(M, generator=gen) * 0.5 + 0.5).cuda()
    unfused = engine.silu_mul(*(w4a4.w4a4_wgmma(qx, sx, *layer, dtype) for layer in (gate, up)))
    ref = reference.w4a4_silu_mul(qx, sx, gate, up, dtype)
    assert torch.isfinite(unfused).all() and unfused.abs().max() > 1
    torch.testing.assert_close(unfused.float(), ref.float(), rtol=2 ** -6, atol=1e-5)
    k_tiles = -(-K // hopper.STAGE_K)
    configs = [None] + [dict(bn=bn, channels=ch, split_k=split) for bn, ch in w4a4.WGMMA.tiles()
                        for split in ((1, 3) if k_tiles >= 6 else (1,))]
    for cfg in configs:
        y = w4a4.w4a4_wgmma_silu_mul(qx, sx, gate, up, dtype, config=cfg)
        assert y.shape == (M, N) and y.dtype == dtype
        assert torch.equal(y, unfused), f"config {cfg}: {(y != unfused).sum().item()} of {y.numel()} differ"


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
def test_wgmma_silu_mul_saturates_and_checks_its_inputs():
    """A token that held +-Inf (a huge scale) gives what the unfused path gives; wrong pairs are refused."""
    _needs_wgmma_kernel()
    from nibble.eval import engine
    gen = torch.Generator().manual_seed(5)
    M, N, K = 40, 512, 1024
    gate, up = _gated_layers(N, K, gen, None)
    qx = _qx(M, K, "cuda", gen)
    sx = (torch.rand(M, generator=gen) + 0.5).cuda()
    sx[3] = torch.finfo(torch.bfloat16).max / 7
    y = w4a4.w4a4_wgmma_silu_mul(qx, sx, gate, up, torch.bfloat16, order="natural")
    assert torch.equal(y, engine.silu_mul(*w4a4.w4a4_wgmma_many(qx, sx, [gate, up], torch.bfloat16)))
    assert not torch.isnan(y).any()
    narrow = (gate[0][:, :256].contiguous(), gate[1][:256].contiguous(), None)
    assert not w4a4.gated_applicable(qx, narrow, up)
    with pytest.raises(ValueError, match="one width"):
        w4a4.w4a4_wgmma_silu_mul(qx, sx, narrow, up)
    with pytest.raises(ValueError, match="bias on both or neither"):
        w4a4.w4a4_wgmma_silu_mul(qx, sx, gate, (*up[:2], torch.zeros(N, device="cuda")))
    with pytest.raises(TypeError, match="float16 or bfloat16"):
        w4a4.w4a4_wgmma_silu_mul(qx, sx, gate, up, torch.float32)
    with pytest.raises(ValueError, match="sm_90"):
        w4a4.w4a4_wgmma_silu_mul(qx[:16], sx[:16], gate, up)  # 16 tokens: the decode kernel's


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_cuda_kernels_take_misaligned_views():
    """qx and qweight as views at offsets that break the kernels' 16-byte copies: handled, exact."""
    _needs_mma_kernel()
    N, K = 512, 1024
    qw_big, _ = _codes_weight(N + 4, K, "cuda")
    qw = qw_big.view(-1)[1:1 + K // 8 * N].view(K // 8, N)  # one word past an aligned start
    for M in (3, 300):
        qx = _qx(M, K + 1, "cuda")[:, 1:]  # rows one byte off
        exact = _exact_acc(qx.contiguous(), qw.contiguous())
        kernels = [w4a4.w4a4_mma] if M <= w4a4.MMA_MAX_M else []
        if w4a4.wgmma_applicable(M, N, K, "cuda"):
            kernels.append(w4a4.w4a4_wgmma)
        for kernel in kernels:
            acc = kernel(qx, torch.ones(M, device="cuda"), qw, torch.ones(N, device="cuda"), out_int32=True)
            assert torch.equal(acc, exact), kernel.__name__


def test_wgmma_rejects_what_it_cannot_run():
    qx, sx = torch.zeros(17, 64, dtype=torch.int8), torch.ones(17)
    qw, ws = _codes_weight(64, 64, "cpu")
    with pytest.raises(ValueError, match="sm_90"):
        w4a4.w4a4_wgmma(qx, sx, qw, ws)
    assert not w4a4.wgmma_applicable(17, 64, 64, "cpu")
    gate = up = (qw, ws, None)
    assert not w4a4.gated_applicable(qx, gate, up) and not w4a4.gated_preferred(torch.zeros(4096, 64), gate, up)
    with pytest.raises(ValueError, match="sm_90"):
        w4a4.w4a4_wgmma_silu_mul(qx, sx, gate, up)
    assert w4a4.product_order(17, 64, 64, "cpu") == "natural"
    with pytest.raises(ValueError, match="even_odd activations are for w4a4_wgmma"):
        w4a4.w4a4_matmul(qx, sx, qw, ws, order="even_odd")


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
def test_cuda_op_rejects_float32_and_mixed_devices():
    qw, ws = _codes_weight(64, 64, "cuda")
    with pytest.raises(TypeError, match="bfloat16"):
        torch.ops.nibble.w4a4_linear(torch.randn(2, 64, device="cuda"), qw, ws, None, False)
    with pytest.raises(ValueError, match="one device"):
        torch.ops.nibble.w4a4_linear(torch.randn(2, 64, device="cuda").bfloat16(), qw.cpu(), ws, None, False)


def _sizes_the_fused_rotation_cannot_hold():
    """Hadamard sizes the reference rotates but the fused Triton kernel refuses (`kernel_fits`): a dense
    factor over 256 (344 = 172 x 2; 288 = 36 x 8, which `rotate_quantize` takes at up to 16 rows) or a row
    over 32768 (44032 = 172 x 256)."""
    from nibble.kernels import hadamard
    sizes = [344, 288, 44032]
    assert all(hadamard.hadamard_factors(k) and not hadamard.kernel_fits(k) for k in sizes)
    return sizes


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=[pytest.mark.interpreter, pytest.mark.skipif(
        not (INTERPRET and HAS_TRITON), reason="needs TRITON_INTERPRET=1 (and triton)")]),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")])])
@pytest.mark.parametrize("K", _sizes_the_fused_rotation_cannot_hold())
def test_act_quant_rotates_sizes_the_fused_kernel_cannot_hold(K, device):
    """rotate_model takes every size the reference rotates; the Triton path refused ~2,190 of them up to
    16,384 at the first forward on a GPU. It rotates those by the reference and quantizes after: the
    reference's codes exactly, a non-finite token zeroed as everywhere; the first time a size does, it says so
    (a user who chose W4A4 for its speed learns which layer pays)."""
    import warnings

    from nibble.kernels import hadamard
    hadamard.warn_past_kernel.cache_clear()
    with pytest.warns(UserWarning, match=f"online Hadamard of size {K} runs PyTorch's reference rotation"):
        w4a4.quantize_activations_triton(_activations(2, K, torch.bfloat16, device), input_hadamard=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # said once a size
        w4a4.quantize_activations_triton(_activations(2, K, torch.bfloat16, device), input_hadamard=True)
    for M in (3,) if K > 4096 else (5, 37):  # 5 rows of 288: rotate_quantize on the GPU
        x = _activations(M, K, torch.bfloat16, device)
        x[1, 7] = float("inf")
        qr, sr = reference.rotate_quantize_activations(x)
        q, s = w4a4.quantize_activations_triton(x, input_hadamard=True)
        assert s[1] == 0 and s[0] > 0 and torch.equal(q, qr) and torch.equal(s, sr)
        if K > 32768:  # rows the whole-row kernel cannot hold take the chunked one, at any M
            assert all(map(torch.equal, w4a4.quantize_activations_triton(x), reference.quantize_activations(x)))
        for order in ("natural", "even_odd") if K % 32 == 0 else ("natural",):
            q, s = w4a4.quantize_activations(x, input_hadamard=True, order=order)
            want = w4a4.to_even_odd(qr) if order == "even_odd" else qr
            if w4a4.rotate_quantize_applicable(x):  # its dense factor sums in tensor-core float32: rare flips
                assert (q.int() - want.int()).abs().max() <= 1 and torch.allclose(s, sr, rtol=2 ** -6, atol=0)
            else:
                assert torch.equal(q, want) and torch.equal(s, sr)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAS_CUDA and HAS_TRITON), reason="needs a CUDA GPU and triton")
@pytest.mark.parametrize("K", [344, 288])
@pytest.mark.parametrize("M", [1, 5, 17, 100])
def test_linear_op_with_hadamard_beyond_the_fused_kernel(M, K):
    N = 200
    qw, ws = _codes_weight(N, K, "cuda")
    x = _activations(M, K, torch.bfloat16, "cuda")
    y = torch.full((M, N), float("nan"), dtype=torch.bfloat16, device="cuda")
    # in a CUDA graph, as the engine runs it (the reference's dense factor was copied to the GPU on every call)
    torch.ops.nibble.w4a4_linear(x, qw, ws, None, True)  # warm-up: builds and caches what the call needs
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y.copy_(torch.ops.nibble.w4a4_linear(x, qw, ws, None, True))
    graph.replay()
    qx, sx = reference.rotate_quantize_activations(x)
    prod = _exact_acc(qx, qw).double() * sx.double()[:, None] * ws.double()[None, :]
    if w4a4.rotate_quantize_applicable(x):  # 288 at up to 16 rows: rare +-1 flips
        rel = ((y.double() - prod).norm() / prod.norm()).item()
        assert torch.isfinite(y).all() and rel < 2e-2, rel
    else:
        _ulp_close(y, prod, torch.bfloat16, terms=prod.abs())
    K = _first_unsupported_hadamard(K)
    with pytest.raises(ValueError, match=f"input_hadamard=True needs a supported Hadamard size.*{K}"):
        torch.ops.nibble.w4a4_linear(_activations(M, K, torch.bfloat16, "cuda"), *_codes_weight(N, K, "cuda"),
                                     None, True)
