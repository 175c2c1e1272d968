"""Build nibble's CUDA C++ kernels (``nibble/kernels/csrc/*.cu``) at first use and load them.

Each source is compiled by ``nvcc`` into a shared library for the GPU's own architecture and
cached under ``$NIBBLE_CACHE_DIR`` (default ``~/.cache/nibble``), keyed by the source's hash, the
architecture and the nvcc version; later processes load the cached file in milliseconds. The
libraries export plain C launchers that take raw pointers and a CUDA stream, called through
``ctypes``: no PyTorch headers, no ninja, and launches land on PyTorch's current stream, so
CUDA-graph capture records them like any other kernel.

A build takes 5-60 s per library (`LIBRARIES`; ~3 min for all five, one after another, on a
2-core machine), so a process that meets an uncached kernel says so on stderr while nvcc runs;
``nibble build-kernels`` (`prebuild`) builds them all ahead, in parallel, with a progress bar.

``load(name, device)`` returns the ``ctypes.CDLL`` or raises ``CudaBuildError`` saying what is
missing (no nvcc, compile error); callers fall back to the Triton kernels and say so once.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from typing import Callable
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
# Every kernel library (csrc/<name>.cu) and whether it needs sm_90a, the architecture-specific
# target of wgmma and setmaxnreg (Hopper only), rather than the GPU's portable one.
LIBRARIES = {"w4a16_mma": False, "w4a16_wgmma": True, "w4a4_mma": False, "w4a4_wgmma": True,
             "rotate_quantize": False}
_LIBS: dict = {}
_LOCK = threading.Lock()


class CudaBuildError(RuntimeError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("NIBBLE_CACHE_DIR") or Path.home() / ".cache" / "nibble")


def find_nvcc() -> str | None:
    """$NVCC, then nvcc on PATH, then $CUDA_HOME/bin/nvcc (as torch.utils.cpp_extension finds it)."""
    if os.environ.get("NVCC"):
        return os.environ["NVCC"]
    found = shutil.which("nvcc")
    if found:
        return found
    try:
        from torch.utils.cpp_extension import CUDA_HOME
    except Exception:  # pragma: no cover - torch without cpp_extension
        CUDA_HOME = None
    for home in (os.environ.get("CUDA_HOME"), CUDA_HOME, "/usr/local/cuda"):
        if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return None


def _nvcc_version(nvcc: str) -> str:
    return subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout.strip()


def library_path(name: str, arch: str, nvcc: str) -> Path:
    # the source and every shared header it may include (csrc/*.cuh)
    src = b"".join(p.read_bytes() for p in [CSRC / f"{name}.cu", *sorted(CSRC.glob("*.cuh"))])
    key = hashlib.sha256(src + arch.encode() + _nvcc_version(nvcc).encode()).hexdigest()[:16]
    return cache_dir() / f"{name}-sm{arch}-{key}.so"


def build(name: str, arch: str, nvcc: str | None = None, quiet: bool = False) -> Path:
    """Compile csrc/<name>.cu for sm_<arch> (e.g. "90", or "90a" for wgmma) unless the cached library
    exists; return its path. A compile says so on stderr, before and after, unless ``quiet``."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise CudaBuildError("nibble's CUDA kernels are compiled at first use and need nvcc (the CUDA toolkit); "
                             "none found on PATH, in $CUDA_HOME or via $NVCC")
    try:
        out = library_path(name, arch, nvcc)
    except (OSError, subprocess.CalledProcessError) as e:
        raise CudaBuildError(f"cannot run nvcc at {nvcc!r} ({e}); install the CUDA toolkit or set $NVCC") from e
    if out.exists():
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a file there, a read-only place: say which setting chose it
        raise CudaBuildError(f"cannot use {out.parent} as the kernel cache folder ({e.strerror}; it is "
                             f"{'$NIBBLE_CACHE_DIR' if os.environ.get('NIBBLE_CACHE_DIR') else 'the default'}): "
                             "point NIBBLE_CACHE_DIR at a writable folder") from e
    if not quiet:
        print(f"nibble: compiling the CUDA kernel {name} for sm_{arch} with nvcc, once (5-60 s; cached in "
              f"{out.parent}; `nibble build-kernels` builds every kernel ahead)", file=sys.stderr, flush=True)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_out = Path(tmp) / out.name
        _compile(nvcc, CSRC / f"{name}.cu", tmp_out, arch)
        os.replace(tmp_out, out)  # atomic: concurrent builders never load a half-written file
    if not quiet:
        print(f"nibble: built {name} for sm_{arch} in {time.monotonic() - start:.0f} s", file=sys.stderr, flush=True)
    return out


def prebuild(arch: str, jobs: int | None = None) -> dict[str, Path]:
    """Build every kernel library for GPUs of compute capability ``arch`` ("90" for H100/H200, "80"
    for A100, ...) ahead of first use, ``jobs`` nvcc processes at a time (default: the CPUs, at most
    one per library); {name: cached path}. The Hopper GEMMs (sm_90a) are built for "90" only: other
    GPUs never run them."""
    from concurrent.futures import ThreadPoolExecutor, as_completed

    from tqdm.auto import tqdm

    if not (arch.isdecimal() and len(arch) >= 2):
        raise ValueError(f"arch must be a compute capability as digits, e.g. 90 for H100/H200 or 80 for A100; got {arch!r}")
    if int(arch) < 80:  # nvcc's "Unsupported gpu architecture" or a failed mma.sync said less: the kernels' bf16 MMAs
        raise ValueError(f"nibble's CUDA kernels need compute capability 8.0 or newer (A100, L4, H100, ...): arch {arch} "
                         "lacks the bf16 tensor-core MMA they are built on")
    if jobs is not None:
        from nibble.config import check_count
        check_count("jobs", jobs)  # 0 or -3 was taken as "the CPUs" without a word
    targets = {name: target(name, arch) for name, specific in LIBRARIES.items() if not specific or arch == "90"}
    jobs = jobs or min(len(targets), os.cpu_count() or 1)
    paths = {}
    with ThreadPoolExecutor(max(1, jobs)) as pool, tqdm(total=len(targets), desc=f"nibble kernels for sm_{arch}",
                                                        unit="library") as bar:
        futures = {pool.submit(build, name, built_for, None, True): name for name, built_for in targets.items()}
        for done in as_completed(futures):
            paths[futures[done]] = done.result()
            bar.set_postfix_str(futures[done])
            bar.update()
    return {name: paths[name] for name in targets}


def _compile(nvcc: str, src: Path, out: Path, arch: str) -> None:
    """nvcc: ``src`` -> the shared library ``out`` for sm_<arch>, csrc/ on the include path (so a
    copy of a kernel elsewhere finds its headers)."""
    cmd = [nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", f"-I{CSRC}",
           f"-gencode=arch=compute_{arch},code=sm_{arch}", "-o", str(out), str(src)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise CudaBuildError(f"nvcc failed to build {src.name} for sm_{arch}:\n{proc.stderr[-4000:]}")


def build_edited(name: str, edits, out_dir: Path, arch: str = "90a", append: str = "",
                 header_edits: dict | None = None) -> ctypes.CDLL:
    """An experiment's variant of a kernel, loaded: csrc/<name>.cu with each (old, new) of ``edits``
    replaced (each ``old`` must occur exactly once, or the kernel changed under the experiment) and
    ``append`` added, compiled into ``out_dir`` (benchmarks/scripts: an instrumented or restructured
    copy; the package's sources and cache are untouched). With ``header_edits`` ({"skinny.cuh":
    edits}) every csrc/ header is copied beside it, those named edited: quoted includes look in the
    including file's folder first, so the copy and the headers it includes all see the edits."""
    def edited(file: str, pairs) -> str:
        src = (CSRC / file).read_text()
        for old, new in pairs:
            if src.count(old) != 1:
                raise CudaBuildError(f"csrc/{file} changed: the edit anchored on {old.splitlines()[0]!r} "
                                     f"occurs {src.count(old)} times, not once")
            src = src.replace(old, new)
        return src
    sources = {f"{name}.cu": edited(f"{name}.cu", edits) + append}
    if header_edits:
        sources.update({h.name: edited(h.name, header_edits.get(h.name, [])) for h in sorted(CSRC.glob("*.cuh"))})
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    for file, src in sources.items():
        (Path(out_dir) / (f"{name}_edited.cu" if file == f"{name}.cu" else file)).write_text(src)
    cu, so = Path(out_dir) / f"{name}_edited.cu", Path(out_dir) / f"{name}_edited.so"
    nvcc = find_nvcc()
    if nvcc is None:
        raise CudaBuildError("building a kernel variant needs nvcc; none found on PATH, in $CUDA_HOME or via $NVCC")
    _compile(nvcc, cu, so, arch)
    return ctypes.CDLL(str(so))


def capability(device) -> tuple[int, int]:
    """``torch.cuda.get_device_capability``, asked once per device (`ask_once`): the kernels' dispatch
    asks at every call, and each question costs the host microseconds an eager forward pays per layer."""
    return ask_once("capability", torch.device(device), lambda: tuple(torch.cuda.get_device_capability()))


def device_arch(device: torch.device) -> str:
    """"90" for an H100/H200, "80" for an A100: the GPU's compute capability as digits."""
    major, minor = capability(device)
    return f"{major}{minor}"


def target(name: str, arch: str) -> str:
    """What nvcc builds library ``name`` for on GPUs of ``arch``: "90a" (wgmma and other sm_90a-only
    instructions) for the libraries `LIBRARIES` marks, else ``arch`` itself."""
    return arch + "a" if LIBRARIES[name] else arch


def load(name: str, device: torch.device) -> ctypes.CDLL:
    arch = target(name, device_arch(device))
    with _LOCK:
        if (name, arch) not in _LIBS:
            _LIBS[(name, arch)] = ctypes.CDLL(str(build(name, arch)))
        return _LIBS[(name, arch)]


def signatures(entry: str, argtypes: list, error_string: str) -> Callable[[ctypes.CDLL], None]:
    """A ``configure`` for `library`: the launcher ``entry`` takes ``argtypes`` and returns a CUDA
    error code, which ``error_string`` turns into its message."""
    def configure(lib: ctypes.CDLL) -> None:
        launcher, message = getattr(lib, entry), getattr(lib, error_string)
        launcher.restype, launcher.argtypes = ctypes.c_int, argtypes
        message.restype, message.argtypes = ctypes.c_char_p, [ctypes.c_int]
    return configure


def c_array(ctype, values) -> ctypes.Array:
    """A C array of ``values`` for a launcher's pointer argument (ctypes passes its address; the
    launcher copies what it needs into the kernel's parameters before it returns)."""
    return (ctype * len(values))(*values)


@functools.lru_cache(maxsize=4096)
def constant_array(ctype, values: tuple) -> ctypes.Array:
    """`c_array` of values that come back call after call (a layer's weight pointers and widths:
    an eager forward passes the same ones at every token), built once. Never written: the
    launchers take them as const."""
    return c_array(ctype, values)


def pointer_arrays(columns) -> list:
    """A `constant_array` of pointers for each column of tensors (None: a null pointer), e.g. the
    qweights, scales and zeros of the weights one launch computes."""
    return [constant_array(ctypes.c_void_p, tuple(None if t is None else t.data_ptr() for t in ts)) for ts in columns]


def weight_arrays(columns, outs, widths) -> list:
    """The arguments every several-weight launcher takes after its weight count, in this order: the
    `pointer_arrays` of the weights' ``columns`` (e.g. qweights, scales, zeros), the ``outs``' pointers,
    the weights' ``widths`` (output columns) and the outs' row strides."""
    return [*pointer_arrays(columns), c_array(ctypes.c_void_p, [o.data_ptr() for o in outs]),
            constant_array(ctypes.c_int, tuple(widths)), constant_array(ctypes.c_int, tuple(o.stride(0) for o in outs))]


def launch(launcher, device: torch.device, *args) -> int:
    """``launcher(*args, stream)`` with ``device`` current and its current stream last (PyTorch's,
    so CUDA-graph capture records the launch); returns the launcher's CUDA error code. An eager
    forward launches once per layer and token, so this asks the raw stream handle (what Inductor's
    generated code asks) and switches devices only when ``device`` is not current: the public
    `torch.cuda.current_stream` and `torch.cuda.device` cost the host several microseconds each."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = torch._C._cuda_getCurrentRawStream(index)
    if torch._C._cuda_getDevice() == index:
        return launcher(*args, stream)
    with torch.cuda.device(index):
        return launcher(*args, stream)


ENABLED = os.environ.get("NIBBLE_CUDA_KERNELS", "1") != "0"
_AVAILABLE: dict = {}  # (name, arch) -> configured library, or None when it cannot be built


_ASKED: dict = {}


def ask_once(question: str, device: torch.device, ask: Callable[[], object]):
    """``ask()`` run with ``device`` current the first time ``question`` is asked of that device;
    its answer from then on (a library's query of the GPU, kept off the launch path)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if (question, index) not in _ASKED:
        with torch.cuda.device(index):
            _ASKED[question, index] = ask()
    return _ASKED[question, index]


def library(name: str, device: torch.device, configure: Callable[[ctypes.CDLL], None]) -> ctypes.CDLL | None:
    """``load(name, device)`` with ``configure(lib)`` applied once (its ctypes signatures), or None:
    switched off by ``NIBBLE_CUDA_KERNELS=0`` (read when nibble is imported, as ``NIBBLE_PDL`` is), or no
    nvcc / a failed build, said once per library and architecture. Callers fall back to their Triton
    kernels on None."""
    if not ENABLED:
        return None
    return ask_once(f"library {name}", device, lambda: _library_for_arch(name, device, configure))  # every launch asks


def _library_for_arch(name: str, device: torch.device, configure) -> ctypes.CDLL | None:
    arch = target(name, device_arch(device))
    if (name, arch) not in _AVAILABLE:
        try:
            lib = load(name, device)
            configure(lib)
        except (CudaBuildError, OSError) as e:
            warnings.warn(f"nibble: the CUDA kernel {name} is unavailable, using the Triton kernels instead ({e})")
            lib = None
        _AVAILABLE[(name, arch)] = lib
    return _AVAILABLE[(name, arch)]
