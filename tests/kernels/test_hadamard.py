"""Hadamard matrices, the reference transform, the Triton kernel and the nibble::hadamard_transform op.

The kernel tests run on CUDA, or on the CPU under the Triton interpreter:
    TRITON_INTERPRET=1 pytest tests/kernels/test_hadamard.py
"""
import hashlib
import math
import os
import subprocess
import sys

import pytest
import torch

from conftest import poison_new_tensors
from nibble.kernels import hadamard as had
from nibble.kernels.hadamard import (hadamard_factors, hadamard_matrix, hadamard_transform,
                                     hadamard_transform_reference, supported_hadamard_sizes)

MODEL_SIZES = [64, 128, 576, 1536, 4096, 8192, 11008, 14336, 28672]
SMALL_SIZES = [1, 2, 8, 12, 20, 24, 28, 36, 40, 64, 96, 128, 172, 192, 256, 576]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else ("cpu" if INTERPRET else None)
needs_kernel = pytest.mark.skipif(KERNEL_DEVICE is None, reason="needs CUDA, or TRITON_INTERPRET=1 on the CPU")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(autouse=True)
def _poisoned_outputs(monkeypatch):
    """The kernel's output (torch.empty) holds NaN until written, on CUDA and under the interpreter on the CPU:
    an element it leaves unwritten cannot pass for a result."""
    poison_new_tensors(monkeypatch, cpu=INTERPRET)


def _activations(rows, n, dtype=torch.float64, device="cpu", seed=0):
    """Gaussian rows with a few large outlier channels, like LLM activations."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g, dtype=torch.float64)
    x[:, torch.randperm(n, generator=g)[: max(1, n // 64)]] *= 30
    return x.to(device=device, dtype=dtype)


# ---- matrices ------------------------------------------------------------------------------------

@pytest.mark.parametrize("m", [m for m in range(1, 200) if had._construction(m) is not None])
def test_every_base_construction_is_a_pm1_hadamard_matrix(m):
    h = had._construction(m)()
    assert h.shape == (m, m) and torch.all(h.abs() == 1)
    assert torch.equal(h @ h.T, m * torch.eye(m, dtype=torch.float64))


def test_williamson_43_rows_are_symmetric_coset_constant_and_complementary():
    rows = had._williamson_rows_43()
    group = [1, 42, 6, 37, 36, 7]
    paf = torch.zeros(43, dtype=torch.float64)
    for a in rows:
        assert all(a[s] == a[-s % 43] for s in range(43))  # symmetric circulant
        for x in range(1, 43):
            assert all(a[(x * h) % 43] == a[x] for h in group)
        paf += torch.stack([(a * a.roll(-s)).sum() for s in range(43)])
    assert paf[0] == 172 and torch.all(paf[1:] == 0)  # A^2 + B^2 + C^2 + D^2 = 172 I


def _legendre(a: int, q: int) -> int:
    """The quadratic character of a mod the prime q, by Euler's criterion."""
    r = pow(a % q, (q - 1) // 2, q)
    return 0 if r == 0 else (1 if r == 1 else -1)


def _paley_textbook(m: int) -> torch.Tensor:
    """The matrix the module docstring names for order m, entry by entry: Paley I (I + S) where q = m - 1 is a prime
    3 mod 4, else Paley II from the conference matrix of q = m / 2 - 1."""
    q = m - 1
    if had._is_prime(q) and q % 4 == 3:
        def s(i, j):  # S = [[0, 1], [-1, Q]], Q[i, j] = chi(j - i)
            return 0 if i == j else 1 if i == 0 else -1 if j == 0 else _legendre(j - i, q)
        return torch.tensor([[(i == j) + s(i, j) for j in range(m)] for i in range(m)], dtype=torch.float64)
    q = m // 2 - 1
    c = [[0 if i == j else 1 if 0 in (i, j) else _legendre(j - i, q) for j in range(q + 1)] for i in range(q + 1)]
    one, zero = ((1, 1), (1, -1)), ((1, -1), (-1, -1))
    return torch.tensor([[c[i // 2][j // 2] * one[i % 2][j % 2] if i // 2 != j // 2 else zero[i % 2][j % 2]
                          for j in range(m)] for i in range(m)], dtype=torch.float64)


@pytest.mark.parametrize("m", [m for m in range(2, 200) if had._construction(m) is not None and m != 172])
def test_paley_matrices_are_the_documented_constructions_sign_for_sign(m):
    """A saved W4A4 + Hadamard checkpoint holds down_proj weights multiplied by H_n.T, and its input is rotated by
    H_n online when it loads: another Hadamard matrix of the same order (a row negated, S - I for I + S), as
    orthogonal as this one, passed every other test and would load those checkpoints into a model computing
    another function, without a word. So each dense factor is pinned: the Paley ones to their definition (the
    character by Euler's criterion), written here entry by entry."""
    assert torch.equal(had._base_matrix(m), _paley_textbook(m))  # what the reference and the kernels read


def test_williamson_172_is_the_matrix_checkpoints_were_rotated_with():
    """The order-172 factor (Llama's 11008 = 172 * 64) came from a search, not a formula: its signs are pinned by
    their digest (why: the test above)."""
    h = had._base_matrix(172)
    digest = hashlib.sha256((h > 0).to(torch.uint8).numpy().tobytes()).hexdigest()
    assert digest == "17ed601ccf42ffcca35477b7731a9389bcf9f892fd6d93c5d323967890d6af1d"


@pytest.mark.parametrize("n,m", [(576, 36), (1536, 12), (4096, 1), (8192, 1), (11008, 172), (14336, 28),
                                 (28672, 28), (64, 1), (128, 1), (192, 12), (96, 12), (40, 20), (344, 172)])
def test_model_sizes_factor_as_documented(n, m):
    assert hadamard_factors(n) == (m, n // m)


@pytest.mark.parametrize("n", [12, 20, 40, 96, 172, 192, 576, 1536])
def test_hadamard_matrix_is_orthonormal_kronecker_of_its_factors(n):
    h = hadamard_matrix(n, torch.float64)
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-12)
    m, p = hadamard_factors(n)
    assert torch.allclose(h, torch.kron(hadamard_matrix(m, torch.float64), hadamard_matrix(p, torch.float64)))


def test_sylvester_entries_are_parity_of_bit_overlap():
    parity = torch.tensor([[bin(a & b).count("1") % 2 for b in range(64)] for a in range(64)])
    assert torch.equal(hadamard_matrix(64, torch.float64) * 8, (1 - 2 * parity).double())


@pytest.mark.parametrize("n", [3, 6, 52, 100, 116, 10004])
def test_unsupported_size_is_a_clear_error(n):
    with pytest.raises(ValueError, match=r"Paley.*nearest supported sizes"):
        hadamard_factors(n)
    with pytest.raises(ValueError, match=f"size {n}"):
        hadamard_transform_reference(torch.zeros(2, n))


def test_inputs_the_transform_cannot_rotate_are_clear_errors():
    """Integers and bools came back truncated, a complex tensor without its imaginary part; a 0-d tensor met an
    IndexError and an empty last dimension a message naming "None" as a supported size."""
    from nibble.kernels.hadamard import hadamard_transform
    x = torch.randn(2, 8) * 4
    for bad in (x.long(), x > 0, torch.complex(x, torch.randn(2, 8))):
        with pytest.raises(TypeError, match=f"real floating-point tensor, got {bad.dtype}"):
            hadamard_transform(bad)
    with pytest.raises(ValueError, match="0-d tensor"):
        hadamard_transform(torch.tensor(1.5))
    with pytest.raises(ValueError, match="size of at least 1, got 0"):
        hadamard_transform(torch.randn(2, 0))


def test_supported_sizes_list_holds_the_model_sizes_and_follows_the_rule():
    sizes = supported_hadamard_sizes(30000)
    assert set(MODEL_SIZES) <= set(sizes)
    assert sizes[:12] == [1, 2, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40]
    assert 52 not in sizes and 100 not in sizes  # 13 * 4 and 25 * 4: no Paley prime, no Williamson table



def _documented_orders(limit: int) -> set[int]:
    """The module docstring's base orders up to ``limit``, from the rule alone: 1, q + 1 (q prime, q % 4 == 3),
    2(q + 1) (q prime, q % 4 == 1) and 172."""
    primes = [q for q in range(2, limit) if all(q % d for d in range(2, q))]
    return ({1, 172} | {q + 1 for q in primes if q % 4 == 3} | {2 * (q + 1) for q in primes if q % 4 == 1}) & \
        set(range(1, limit + 1))


def test_supported_sizes_are_exactly_the_documented_rule():
    """n = m * 2^k for a documented base order m, and nothing else, up to and including the limit (9 = 3^2 and
    25 = 5^2 are no primes: Paley orders 20 / 52 of them would not be Hadamard matrices; 104 = 8 * 13 needs the
    search past 4 * 13 = 52)."""
    limit = 1200
    orders = _documented_orders(limit)
    rule = [n for n in range(1, limit + 1) if any(n % m == 0 and (n // m) & (n // m - 1) == 0 for m in orders)]
    assert supported_hadamard_sizes(limit) == rule and rule[-1] == limit and 104 in rule
    assert supported_hadamard_sizes(limit - 1) == rule[:-1]


@pytest.mark.parametrize("n,lo,hi", [(3, 2, 4), (6, 4, 8), (52, 48, 56), (100, 96, 104), (116, 112, 120)])
def test_an_unsupported_size_names_the_nearest_supported_ones(n, lo, hi):
    with pytest.raises(ValueError, match=rf"no Hadamard matrix of size {n}: .* the nearest supported sizes are "
                                         rf"{lo} and {hi}$"):
        hadamard_factors(n)

# ---- reference -----------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 2, 12, 40, 96, 172, 192, 576, 1536])
@pytest.mark.parametrize("inverse", [False, True])
def test_reference_equals_dense_matrix_product(n, inverse):
    x = _activations(7, n, seed=n)
    h = hadamard_matrix(n, torch.float64)
    want = x @ (h if inverse else h.T)
    assert torch.allclose(hadamard_transform_reference(x, inverse), want, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("n", [4096, 11008, 14336, 28672])
def test_reference_on_large_sizes_equals_factored_product(n):
    # H_n = H_m (x) H_p: with the row viewed as X [m, p], x @ H_n.T is H_m X H_p^T.
    x = _activations(3, n, seed=n)
    m, p = hadamard_factors(n)
    want = hadamard_matrix(m, torch.float64) @ x.view(3, m, p) @ hadamard_matrix(p, torch.float64).T
    assert torch.allclose(hadamard_transform_reference(x), want.view(3, n), atol=1e-10)
    assert torch.allclose(hadamard_transform_reference(hadamard_transform_reference(x), inverse=True), x, atol=1e-10)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reference_keeps_shape_and_dtype_and_norm(dtype):
    x = _activations(6, 192, dtype=dtype).view(2, 3, 192)
    y = hadamard_transform_reference(x)
    assert y.shape == x.shape and y.dtype == dtype
    assert torch.allclose(y.double().norm(dim=-1), x.double().norm(dim=-1), rtol=1e-2)


# ---- the op --------------------------------------------------------------------------------------

def _nonfinite_rows(n, dtype, device="cpu"):
    """Rows 0-3 hold a NaN, a +Inf, a -Inf, a +Inf and a -Inf; row 4 is ordinary."""
    x = _activations(5, n, dtype=dtype, device=device)
    x[0, 1] = float("nan")
    x[1, n - 1] = float("inf")
    x[2, n // 2] = -float("inf")
    x[3, 0], x[3, n - 1] = float("inf"), -float("inf")
    return x


@pytest.mark.parametrize("n", [2, 8, 12, 40, 128, 576])
@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
def test_reference_makes_every_output_that_is_not_finite_nan(n, dtype):
    """The documented rule (module docstring): a row holding NaN or +-Inf comes out all NaN (one +Inf gave +-Inf
    here and NaN in the kernel until session 63), and so does each output whose sum overflows."""
    x = _nonfinite_rows(n, dtype)
    y = hadamard_transform_reference(x)
    assert y[:4].isnan().all() and torch.isfinite(y[4]).all()
    big = torch.zeros(1, n, dtype=dtype)
    big[0, :2] = torch.finfo(dtype).max  # x[0] + x[1] overflows where the two add (not float16's, in float32)
    y = hadamard_transform_reference(big)[0]
    adds = hadamard_matrix(n, torch.float64)[:, :2].sum(dim=1) != 0
    assert torch.equal(y.isnan(), adds & (dtype != torch.float16)) and (y[~adds] == 0).all()


def test_op_on_cpu_is_the_reference_and_passes_opcheck():
    x = _activations(5, 96, dtype=torch.float32)
    assert torch.equal(hadamard_transform(x), hadamard_transform_reference(x))
    torch.library.opcheck(torch.ops.nibble.hadamard_transform.default, (x, False))
    torch.library.opcheck(torch.ops.nibble.hadamard_transform.default, (x.requires_grad_(), True))


def test_op_gradient_is_the_opposite_transform():
    x = _activations(3, 24, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda t: hadamard_transform(t), (x,))
    assert torch.autograd.gradcheck(lambda t: hadamard_transform(t, inverse=True), (x,))


def test_every_torch_func_transform_gives_the_hadamard_matrix():
    """torch.func.grad / jacrev refused the op (no setup_context) and jvp / jacfwd took it for a constant."""
    x, t = _activations(3, 24, dtype=torch.float64), _activations(3, 24, dtype=torch.float64)
    h = hadamard_matrix(24, torch.float64)  # y = x @ H.T: the Jacobian of a row is H
    torch.testing.assert_close(torch.func.jacfwd(hadamard_transform)(x[0]), h)
    torch.testing.assert_close(torch.func.jacrev(hadamard_transform)(x[0]), h)
    torch.testing.assert_close(torch.func.jvp(hadamard_transform, (x,), (t,))[1], t @ h.T)
    torch.testing.assert_close(torch.func.vmap(torch.func.grad(lambda r: (hadamard_transform(r) * t[0]).sum()))(x),
                               (t[0] @ h).expand(3, -1))
    torch.testing.assert_close(torch.func.vmap(hadamard_transform, in_dims=1)(x.T.contiguous()),  # rows as columns
                               hadamard_transform(x))


def test_op_traces_into_one_graph_under_torch_compile():
    f = torch.compile(lambda t: hadamard_transform(t * 2) + 1, fullgraph=True, backend="aot_eager")
    x = _activations(4, 40, dtype=torch.float32)
    assert torch.allclose(f(x), hadamard_transform_reference(x * 2) + 1)
    xg = x.clone().requires_grad_()  # with a gradient too (Dynamo cannot trace the eager Function's jvp)
    f(xg).sum().backward()
    assert torch.allclose(xg.grad, 2 * hadamard_transform_reference(torch.ones_like(x), inverse=True), atol=1e-6)



def test_a_compiled_transform_refuses_what_the_eager_one_refuses_with_its_words():
    """The op's fake checks its input as the op does: tracing an integer or 0-d tensor fails with the eager
    message (a 0-d one met an IndexError in the size check), which Dynamo wraps in a RuntimeError."""
    torch._dynamo.reset()
    f = torch.compile(hadamard_transform, fullgraph=True, backend="eager")
    with pytest.raises(RuntimeError, match="the Hadamard transform rotates the last dimension; got a 0-d tensor"):
        f(torch.tensor(1.5))
    with pytest.raises(RuntimeError, match="real floating-point tensor, got torch.int64"):
        f(torch.randint(0, 9, (2, 8)))
    torch._dynamo.reset()  # an unsupported size too, while tracing (a run-time ValueError came after the graph was made)
    with pytest.raises(RuntimeError, match="no Hadamard matrix of size 100: .*nearest supported sizes are 96 and 104"):
        torch.compile(hadamard_transform, fullgraph=True, backend="eager", dynamic=False)(torch.randn(2, 100))

def test_module_imports_and_runs_the_reference_without_triton():
    code = ("import sys; sys.modules['triton'] = None; import torch; "
            "from nibble.kernels.hadamard import hadamard_transform as h; "
            "x = torch.randn(3, 96); assert torch.allclose(h(h(x), inverse=True), x, atol=1e-5)")
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, "TRITON_INTERPRET": "0"})


# ---- kernel --------------------------------------------------------------------------------------

def _same_dtype_error(x64, want, dtype, inverse):
    """Max error of PyTorch doing the transform itself in `dtype` (H_m X H_p^T, two matmuls)."""
    rows, n = x64.shape
    m, p = hadamard_factors(n)
    hm, hp = hadamard_matrix(m, dtype).to(x64.device), hadamard_matrix(p, dtype).to(x64.device)
    if inverse:
        hm, hp = hm.T, hp.T
    y = hm @ (x64.to(dtype).view(rows, m, p) @ hp.T)
    return (y.view(rows, n).double() - want).abs().max().item()


def _check_kernel(n, dtype, inverse, rows=61):
    x64 = _activations(rows, n, device=KERNEL_DEVICE, seed=n + rows)
    x = x64.to(dtype)
    want = hadamard_transform_reference(x.double(), inverse)  # exact transform of the rounded input
    y = had.hadamard_transform_triton(x, inverse)
    assert y.dtype == dtype and y.shape == x.shape
    err = (y.double() - want).abs().max().item()
    base = _same_dtype_error(x.double(), want, dtype, inverse)
    if INTERPRET and dtype == torch.bfloat16:
        base *= 2  # the interpreter truncates float32 -> bfloat16 (one ulp); GPUs round to nearest (half)
    # float32 runs on tensor cores: products are exact, but their accumulation is not IEEE-rounded
    # (about 2^-19 of the largest output, measured on an H200); 16-bit outputs round far above that.
    atol = (4e-6 if dtype == torch.float32 else 1e-6) * want.abs().max().item()
    assert err <= 2 * base + atol, f"n={n} {dtype}: kernel error {err:.3g}, PyTorch same-dtype error {base:.3g}"


@pytest.mark.interpreter
@needs_kernel
@pytest.mark.parametrize("n", SMALL_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inverse", [False, True])
def test_kernel_matches_float64_within_same_dtype_error(n, dtype, inverse):
    _check_kernel(n, dtype, inverse)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("n", MODEL_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 300])
def test_kernel_on_model_sizes_matches_float64_within_same_dtype_error(n, dtype, rows):
    _check_kernel(n, dtype, inverse=False, rows=rows)
    _check_kernel(n, dtype, inverse=True, rows=rows)


@pytest.mark.interpreter
@needs_kernel
@pytest.mark.parametrize("n", [3072, 5120])  # dense 12 -> 16 and 20 -> 32, then 16 x 16 Sylvester
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [False, True])
def test_kernel_on_plans_of_three_factors_matches_float64(n, dtype, split, monkeypatch):
    """A dense factor and A > 1 (the plans of 14336 and 28672, which only GPUs run), whole rows and, for 5120,
    split into two slices of 16 dense outputs."""
    monkeypatch.setattr(had, "SPLIT_ROW_TILES", 1 << 30 if split else 0)
    _check_kernel(n, dtype, inverse=False, rows=2)


@pytest.mark.interpreter
@needs_kernel
@pytest.mark.parametrize("n", [576, 1536, 11008])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_split_over_programs_give_the_unsplit_transform(n, dtype):
    # few rows spread each row's dense outputs over programs (decode); the sums are the same
    x = _activations(3, n, device=KERNEL_DEVICE, seed=n).to(dtype)
    whole, split = had.hadamard_transform_triton(x, split=False), had.hadamard_transform_triton(x, split=True)
    if x.is_cuda:  # the same MMAs in the same order per output
        assert torch.equal(split, whole)
    else:  # numpy may order a narrower matmul's sums differently: float32 last-bit differences, which
        # can round a 16-bit output to its neighbour (one ulp of float16 in 1 of 33,024 outputs, CI)
        ulp = 1e-6 if dtype == torch.float32 else torch.finfo(dtype).eps
        torch.testing.assert_close(split, whole, rtol=0, atol=ulp * whole.abs().max().item())
    assert torch.equal(had.hadamard_transform_triton(x), split)  # few rows: split by default


@pytest.mark.interpreter
@needs_kernel
@pytest.mark.parametrize("n", [8, 16, 40, 128, 200, 256, 576])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("split", [False, True])
def test_kernel_makes_a_row_holding_nan_or_inf_nan_as_the_reference(n, dtype, split):
    """One rule on every device (module docstring): plans of one factor (n < 256 in 16 bits: 8, 40 and 200 dense,
    16 and 128 Sylvester) kept +-Inf, the others' tf32 pieces made NaN, the reference gave +-Inf."""
    x = _nonfinite_rows(n, dtype, KERNEL_DEVICE)
    y = had.hadamard_transform_triton(x, split=split)
    assert y[:4].isnan().all() and torch.isfinite(y[4]).all()
    assert torch.equal(y.isnan().cpu(), hadamard_transform_reference(x.cpu()).isnan())


@pytest.mark.interpreter
@needs_kernel
def test_kernel_handles_leading_dims_row_strides_and_no_rows():
    x = _activations(24, 2 * 192, dtype=torch.float16, device=KERNEL_DEVICE)[:, :192]  # row stride 384
    y = had.hadamard_transform_triton(x)
    assert torch.allclose(y.float(), hadamard_transform_reference(x).float(), atol=2e-2, rtol=1e-2)
    y3 = had.hadamard_transform_triton(x.contiguous().view(2, 3, 4, 192))
    assert y3.shape == (2, 3, 4, 192) and torch.allclose(y3.view(24, 192), y)
    assert had.hadamard_transform_triton(torch.empty(0, 3, 64, device=KERNEL_DEVICE)).shape == (0, 3, 64)


@pytest.mark.interpreter
@needs_kernel
def test_kernel_rejects_what_it_cannot_do_with_a_clear_error():
    with pytest.raises(TypeError, match="hadamard_transform_reference"):
        had.hadamard_transform_triton(torch.zeros(2, 64, dtype=torch.float64, device=KERNEL_DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        had.hadamard_transform_triton(torch.zeros(64, 2, device=KERNEL_DEVICE).T)
    with pytest.raises(ValueError, match="Paley"):
        had.hadamard_transform_triton(torch.zeros(2, 100, device=KERNEL_DEVICE))


@pytest.mark.gpu
@needs_cuda
def test_op_on_cuda_runs_the_kernel_under_compile_and_cuda_graphs():
    x = _activations(64, 11008, dtype=torch.bfloat16, device="cuda")
    want = had.hadamard_transform_triton(x)
    assert torch.equal(hadamard_transform(x), want)
    compiled = torch.compile(lambda t: hadamard_transform(t), fullgraph=True)
    assert torch.equal(compiled(x), want)
    static = x.clone()
    hadamard_transform(static)  # warm up: compile the kernel, cache its matrix on the device
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = hadamard_transform(static)
    static.copy_(x.flip(0))
    graph.replay()
    assert torch.equal(out, want.flip(0))


@pytest.mark.gpu
@needs_cuda
def test_op_gradient_on_cuda_is_the_opposite_transform():
    x = _activations(8, 1536, dtype=torch.float32, device="cuda").requires_grad_()
    g = torch.randn_like(x)
    hadamard_transform(x).backward(g)
    assert torch.allclose(x.grad, hadamard_transform_reference(g, inverse=True), atol=1e-4)
    assert math.isclose(x.grad.norm().item(), g.norm().item(), rel_tol=1e-5)


def test_real_sizes_past_the_kernels_are_said_once_with_the_limit_they_pass():
    """Qwen2-72B's intermediate 29568 (a dense factor of 924) and Llama-3.1-405B's 53248 (a row of 65536 once
    padded) rotate by the reference on a GPU: correct, slower, and silent until the warning; sizes the kernels hold
    say nothing."""
    import warnings

    had.warn_past_kernel.cache_clear()
    for n, limit in ((29568, r"dense factor of 1024 \(at most 256\)"), (53248, r"row of 65536 \(at most 32768\)")):
        assert not had.kernel_fits(n)
        with pytest.warns(UserWarning, match=f"online Hadamard of size {n} runs PyTorch's reference.*{limit}"):
            had.warn_past_kernel(n)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        had.warn_past_kernel(29568)  # once a size
        for n in (576, 1536, 11008, 14336, 28672):
            assert had.kernel_fits(n)
