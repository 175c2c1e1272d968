"""Run-time build of the CUDA C++ kernels: cache keying, clear errors, and (where nvcc exists) a real build."""
from __future__ import annotations

import ctypes
import fnmatch
import importlib
import shutil
from pathlib import Path

import pytest
import torch

from nibble.kernels import cuda_build


def test_the_package_ships_every_kernel_source():
    """A pip-installed nibble builds its CUDA kernels from csrc/ at first use: the package data in
    pyproject.toml must cover every file there (a wheel without them falls back to Triton)."""
    tomllib = pytest.importorskip("tomllib")
    pyproject = Path(cuda_build.__file__).resolve().parents[2] / "pyproject.toml"
    if not pyproject.exists():
        pytest.skip("an installed package: no pyproject.toml next to it")
    patterns = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]["package-data"]["nibble.kernels"]
    sources = sorted(f.name for f in cuda_build.CSRC.iterdir() if f.is_file())
    assert sources and all(any(fnmatch.fnmatch(f"csrc/{name}", p) for p in patterns) for name in sources), sources


def test_libraries_name_every_kernel_source():
    """`LIBRARIES` (what `prebuild` builds, and which need sm_90a) covers csrc/*.cu exactly."""
    assert set(cuda_build.LIBRARIES) == {p.stem for p in cuda_build.CSRC.glob("*.cu")}


def test_a_first_use_build_says_so_and_a_cached_one_does_not(tmp_path, monkeypatch, capsys):
    """An uncached kernel takes nvcc 5-60 s: the process says so on stderr, before and after; a cache
    hit, or a quiet build (`prebuild`'s, under its progress bar), says nothing."""
    monkeypatch.setenv("NIBBLE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cuda_build, "_nvcc_version", lambda nvcc: "nvcc 13.0")
    monkeypatch.setattr(cuda_build, "_compile", lambda nvcc, src, out, arch: out.write_bytes(b"so"))
    path = cuda_build.build("rotate_quantize", "90", nvcc="nvcc")
    err = capsys.readouterr().err
    assert "compiling the CUDA kernel rotate_quantize for sm_90" in err and "built rotate_quantize for sm_90 in" in err
    assert cuda_build.build("rotate_quantize", "90", nvcc="nvcc") == path and not capsys.readouterr().err
    cuda_build.build("w4a4_mma", "90", nvcc="nvcc", quiet=True)
    assert not capsys.readouterr().err


def test_a_cache_folder_that_cannot_be_made_names_nibble_cache_dir(tmp_path, monkeypatch):
    """NIBBLE_CACHE_DIR naming a file was FileExistsError's traceback; an uncreatable one did not say which setting."""
    monkeypatch.setattr(cuda_build, "_nvcc_version", lambda nvcc: "nvcc 13.0")
    monkeypatch.setattr(cuda_build, "_compile", lambda *a: pytest.fail("compiled without a cache folder"))
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("NIBBLE_CACHE_DIR", str(tmp_path / "a-file"))
    with pytest.raises(cuda_build.CudaBuildError, match=r"cannot use .*a-file as the kernel cache folder .*"
                                                        r"\$NIBBLE_CACHE_DIR.*point NIBBLE_CACHE_DIR at a writable"):
        cuda_build.build("rotate_quantize", "90", nvcc="nvcc")
    monkeypatch.delenv("NIBBLE_CACHE_DIR")
    monkeypatch.setenv("HOME", str(tmp_path / "a-file"))  # ~/.cache/nibble inside a file
    with pytest.raises(cuda_build.CudaBuildError, match=r"cannot use .*a-file/.cache/nibble as the kernel cache "
                                                        r"folder \(.*; it is the default\): point NIBBLE_CACHE_DIR"):
        cuda_build.build("rotate_quantize", "90", nvcc="nvcc")


def test_missing_nvcc_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(cuda_build, "find_nvcc", lambda: None)
    with pytest.raises(cuda_build.CudaBuildError, match="nvcc"):
        cuda_build.build("w4a16_mma", "90")


def test_broken_nvcc_path_is_a_clear_error(tmp_path):
    with pytest.raises(cuda_build.CudaBuildError, match="NVCC"):
        cuda_build.build("w4a16_mma", "90", nvcc=str(tmp_path / "no-such-nvcc"))


def test_an_edited_variant_refuses_an_anchor_that_is_not_there_once(tmp_path):
    """Experiments build edited copies of a kernel (`build_edited`); an edit whose text the kernel
    no longer holds exactly once says so instead of building something else."""
    for anchor in ("text no kernel holds", "#include"):
        with pytest.raises(cuda_build.CudaBuildError, match="changed: the edit anchored on"):
            cuda_build.build_edited("w4a4_wgmma", [(anchor, "")], tmp_path)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("script", ["w4a4_item_timeline", "w4a4_one_warpgroup", "w4a4_stages", "w4a4_copy_knockout",
                                    "w4a4_lean_registers", "w4a4_successor_trigger", "w4a4_tensormap_prefetch",
                                    "w4a4_deep_stages", "w4a4_grid_barrier", "w4a4_k_parts", "w4a4_stream_k"])
def test_the_experiment_scripts_edits_still_anchor_in_the_kernel(script, monkeypatch):
    """The scripts that rebuild csrc/w4a4_wgmma.cu with edits name texts of the kernel; when the
    kernel changes under them they fail on the device (it happened twice). Each text must be there
    exactly once in the current source."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks" / "scripts"))
    module = importlib.import_module(script)
    # name -> edits of the scripts built on wgmma_ab.build_variants (knockouts: variants timed, not compared)
    variants = {**getattr(module, "VARIANT_EDITS", {}), **getattr(module, "KNOCKOUT_EDITS", {})}
    headers = getattr(module, "HEADER_EDITS", {})  # headers the variants edit too
    edits = getattr(module, "EDITS", None) or [pair for pairs in variants.values() for pair in pairs] or (
        [] if headers else [(module.ANCHOR, "")])
    source = (cuda_build.CSRC / "w4a4_wgmma.cu").read_text()
    assert [source.count(old) for old, _ in edits] == [1] * len(edits)
    for header, pairs in headers.items():
        text = (cuda_build.CSRC / header).read_text()
        assert [text.count(old) for old, _ in pairs] == [1] * len(pairs), header


def test_the_skinny_kernel_variants_still_anchor_in_the_sources(monkeypatch):
    """benchmarks/scripts/w4a16_skinny_variants.py, w4a16_shared_x.py, w4a16_tail_pieces.py and w4a16_spread.py
    rebuild csrc/w4a16_mma.cu (and headers) with the edits of each variant; every text they replace must
    be in the current sources exactly once."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks" / "scripts"))
    variants = importlib.import_module("w4a16_skinny_variants")
    shared_x = importlib.import_module("w4a16_shared_x")
    tail = importlib.import_module("w4a16_tail_pieces")
    spread = importlib.import_module("w4a16_spread")
    edit_sets = [*(edits for v in variants.SETS.values() for edits in v.values()),
                 {"w4a16_mma.cu": shared_x.KERNEL_EDITS, **shared_x.HEADER_EDITS}, {"w4a16_mma.cu": tail.EDITS},
                 {"w4a16_mma.cu": spread.EDITS, **spread.HEADER_EDITS}]
    for edits in edit_sets:
        for file, pairs in edits.items():
            source = (cuda_build.CSRC / file).read_text()
            assert [source.count(old) for old, _ in pairs] == [1] * len(pairs), (file, pairs)


def test_the_tma_stream_experiment_still_builds_on_the_skinny_kernel(tmp_path, monkeypatch):
    """benchmarks/scripts/w4a16_tma_stream.cu is appended to csrc/w4a16_mma.cu and uses its helpers
    (raw_codes, step_mmas, GroupFold, store_fragments): its edit must anchor, and with nvcc it must build."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks" / "scripts"))
    module = importlib.import_module("w4a16_tma_stream")
    assert (cuda_build.CSRC / "w4a16_mma.cu").read_text().count(module.ANCHOR) == 1
    if cuda_build.find_nvcc() is None:
        pytest.skip("building needs nvcc (the CUDA toolkit)")
    assert hasattr(module.build(tmp_path, "copy"), "nibble_w4a16_tma")


@pytest.mark.skipif(cuda_build.find_nvcc() is None, reason="needs nvcc (the CUDA toolkit)")
def test_builds_an_edited_variant_with_an_edited_header(tmp_path):
    """Header edits reach the kernel and the headers that include the edited one (all copied beside)."""
    lib = cuda_build.build_edited("w4a16_mma", [], tmp_path, arch="90",
                                  header_edits={"skinny.cuh": [("constexpr int MAX_WEIGHTS = 3;",
                                                                "constexpr int MAX_WEIGHTS = 3;  // edited")]})
    assert hasattr(lib, "nibble_w4a16_mma") and (tmp_path / "skinny.cuh").read_text().count("// edited") == 1
    assert {p.name for p in tmp_path.glob("*.cuh")} == {p.name for p in cuda_build.CSRC.glob("*.cuh")}


@pytest.mark.skipif(cuda_build.find_nvcc() is None, reason="needs nvcc (the CUDA toolkit)")
def test_builds_an_edited_variant(tmp_path):
    """An edited copy outside csrc/ finds its headers and loads (the one-warpgroup experiment's edit)."""
    lib = cuda_build.build_edited("w4a4_wgmma", [("static constexpr int CH = CH_, J = CH / 128;",
                                                  "static constexpr int CH = CH_, J = CH / 128;  // edited")], tmp_path)
    assert hasattr(lib, "nibble_w4a4_wgmma") and (tmp_path / "w4a4_wgmma_edited.cu").read_text().count("// edited") == 1


@pytest.mark.skipif(cuda_build.find_nvcc() is None, reason="needs nvcc (the CUDA toolkit)")
@pytest.mark.parametrize("name,arch,symbols", [
    ("w4a16_mma", "90", ("nibble_w4a16_mma", "nibble_cuda_error_string")),
    ("w4a4_mma", "90", ("nibble_w4a4_mma", "nibble_w4a4_cuda_error_string")),
    ("w4a4_wgmma", "90a", ("nibble_w4a4_wgmma", "nibble_w4a4_wgmma_error_string")),
    ("w4a16_wgmma", "90a", ("nibble_w4a16_wgmma", "nibble_w4a16_wgmma_error_string")),
    ("rotate_quantize", "90", ("nibble_rotate_quantize", "nibble_rotate_quantize_clusters",
                                          "nibble_rotate_quantize_error_string"))])
def test_builds_for_sm90_and_caches(tmp_path, monkeypatch, name, arch, symbols):
    """Each kernel source compiles for Hopper on a machine without a GPU; the second call is a cache hit."""
    monkeypatch.setenv("NIBBLE_CACHE_DIR", str(tmp_path))
    path = cuda_build.build(name, arch)
    assert path.parent == tmp_path and path.exists()
    mtime = path.stat().st_mtime_ns
    assert cuda_build.build(name, arch) == path and path.stat().st_mtime_ns == mtime
    lib = ctypes.CDLL(str(path))
    assert all(getattr(lib, s) for s in symbols)


def test_cache_key_covers_the_shared_headers(tmp_path, monkeypatch):
    """Editing csrc/*.cuh must rebuild the kernels that include it."""
    shutil.copytree(cuda_build.CSRC, tmp_path / "csrc")
    monkeypatch.setattr(cuda_build, "CSRC", tmp_path / "csrc")
    monkeypatch.setattr(cuda_build, "_nvcc_version", lambda nvcc: "nvcc 13.0")
    before = cuda_build.library_path("w4a16_mma", "90", "nvcc")
    header = tmp_path / "csrc" / "skinny.cuh"
    header.write_text(header.read_text() + "\n// edited\n")
    assert cuda_build.library_path("w4a16_mma", "90", "nvcc") != before


def test_ask_once_asks_each_device_once(monkeypatch):
    """A library's query of the GPU (the Hopper GEMMs' resident clusters) runs once per device, with
    that device current; later calls, on every launch, get the first answer."""
    import contextlib
    current = []
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext(current.append(index)))
    monkeypatch.setattr(cuda_build, "_ASKED", {})
    asked = []
    ask = lambda: asked.append(1) or len(asked)  # noqa: E731
    assert [cuda_build.ask_once("q", torch.device("cuda", 1), ask) for _ in range(3)] == [1, 1, 1]
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert cuda_build.ask_once("q", torch.device("cuda"), ask) == 1  # no index: the current device, 1
    assert cuda_build.ask_once("q", torch.device("cuda", 0), ask) == 2
    assert cuda_build.ask_once("other", torch.device("cuda", 0), ask) == 3
    assert current == [1, 0, 0]


def test_resident_clusters_reads_the_library_query():
    """{split: clusters} from the library's ``nibble_*_wgmma_clusters(split, int *out)``; a CUDA error or
    no cluster that fits is an error that says which split."""
    from nibble.kernels import hopper

    def query(split, out):
        out._obj.value = 132 // split - (split == 4) * 3
        return 0
    assert hopper.resident_clusters(query) == {1: 132, 2: 66, 3: 44, 4: 30, 6: 22, 8: 16}
    with pytest.raises(RuntimeError, match=r"clusters of 1 CTAs on this GPU \(CUDA error 1\)"):
        hopper.resident_clusters(lambda split, out: 1)
    with pytest.raises(RuntimeError, match="clusters of 1 CTAs"):
        hopper.resident_clusters(lambda split, out: 0)  # leaves 0: nothing fits
    with pytest.raises(RuntimeError, match=r"clusters of 1 CTAs on this GPU \(CUDA error 700\)"):
        hopper.resident_clusters(lambda split, out: setattr(out._obj, "value", 16) or 700)  # a count, and an error


def test_launch_arrays_hold_the_values_and_repeat_without_a_rebuild():
    """The launchers' C arrays: `c_array` holds what it was given; `constant_array` (a layer's weight
    pointers and widths, passed at every eager call) is built once per distinct values; `pointer_arrays`
    takes one array per column of tensors, None as a null pointer."""
    import ctypes
    assert list(cuda_build.c_array(ctypes.c_int, [3, -1, 7])) == [3, -1, 7]
    a = cuda_build.constant_array(ctypes.c_int, (4096, 11008))
    assert list(a) == [4096, 11008]
    assert cuda_build.constant_array(ctypes.c_int, (4096, 11008)) is a
    assert cuda_build.constant_array(ctypes.c_int, (4096, 11009)) is not a
    t, u = torch.zeros(3), torch.ones(5)
    qweights, biases = cuda_build.pointer_arrays([(t, u), (None, u)])
    assert list(qweights) == [t.data_ptr(), u.data_ptr()]
    assert list(biases) == [None, u.data_ptr()]  # ctypes reads a null c_void_p back as None


def test_weight_arrays_are_the_launchers_argument_groups_in_order():
    """`weight_arrays`: one pointer array per column of the weights (all qweights, all scales, ...),
    then the outputs' pointers, the widths and the outputs' row strides."""
    import ctypes
    weights = [(torch.zeros(4, 3), torch.ones(2, 3)), (torch.zeros(4, 5), torch.ones(2, 5))]  # (qweight, scales)
    outs = [torch.empty(7, 3), torch.empty(7, 16)[:, :5]]
    qweights, scales, out_ptrs, widths, strides = cuda_build.weight_arrays(zip(*weights), outs, [3, 5])
    assert list(qweights) == [w[0].data_ptr() for w in weights]
    assert list(scales) == [w[1].data_ptr() for w in weights]
    assert list(out_ptrs) == [o.data_ptr() for o in outs]
    assert list(widths) == [3, 5] and list(strides) == [3, 16]  # the second output's rows are 16 apart
    assert widths._type_ is ctypes.c_int and strides._type_ is ctypes.c_int


def test_nvcc_named_by_the_nvcc_variable_comes_first(monkeypatch, tmp_path):
    monkeypatch.setenv("NVCC", str(tmp_path / "cuda-13" / "bin" / "nvcc"))
    assert cuda_build.find_nvcc() == str(tmp_path / "cuda-13" / "bin" / "nvcc")


def test_a_library_is_cached_per_architecture(monkeypatch, tmp_path):
    monkeypatch.setenv("NIBBLE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cuda_build, "_nvcc_version", lambda nvcc: "nvcc 13.0")
    paths = {arch: cuda_build.library_path("w4a16_mma", arch, "nvcc") for arch in ("80", "90", "90a")}
    assert len(set(paths.values())) == 3 and all(p.parent == tmp_path for p in paths.values())
    assert all(p.name.startswith(f"w4a16_mma-sm{arch}-") for arch, p in paths.items())


def test_prebuild_refuses_an_arch_that_is_not_a_compute_capability(monkeypatch):
    monkeypatch.setattr(cuda_build, "build", lambda *a: pytest.fail("built for a malformed arch"))
    for arch in ("9", "sm90", "9.0", "", "9\u00b2"):  # "²" is str.isdigit, not int
        with pytest.raises(ValueError, match="arch must be a compute capability as digits"):
            cuda_build.prebuild(arch)


def test_prebuild_runs_one_nvcc_per_cpu_at_most_one_per_library(monkeypatch):
    import concurrent.futures

    workers = []
    real_pool = concurrent.futures.ThreadPoolExecutor
    monkeypatch.setattr(concurrent.futures, "ThreadPoolExecutor", lambda n: workers.append(n) or real_pool(n))
    monkeypatch.setattr(cuda_build, "build", lambda name, arch, nvcc=None, quiet=False: f"/c/{name}-{arch}")
    for cpus, arch, expected in ((2, "90", 2), (64, "90", len(cuda_build.LIBRARIES)),
                                 (64, "80", sum(not hopper for hopper in cuda_build.LIBRARIES.values())),
                                 (None, "90", 1)):  # os.cpu_count() unknown: one at a time
        monkeypatch.setattr(cuda_build.os, "cpu_count", lambda c=cpus: c)
        cuda_build.prebuild(arch)
        assert workers.pop() == expected
    cuda_build.prebuild("90", jobs=3)
    assert workers.pop() == 3


def test_the_architecture_is_the_capability_as_digits(monkeypatch):
    monkeypatch.setattr(cuda_build, "capability", lambda device: (8, 9))
    assert cuda_build.device_arch(torch.device("cuda", 0)) == "89"
    monkeypatch.setattr(cuda_build, "capability", lambda device: (9, 0))
    assert cuda_build.device_arch(torch.device("cuda", 0)) == "90"
    assert cuda_build.target("w4a16_wgmma", "90") == "90a" and cuda_build.target("w4a16_mma", "90") == "90"


def test_kernels_switched_off_are_none_without_asking_the_gpu(monkeypatch):
    monkeypatch.setattr(cuda_build, "ENABLED", False)
    monkeypatch.setattr(cuda_build, "ask_once", lambda *a: pytest.fail("asked the GPU"))
    assert cuda_build.library("w4a16_mma", torch.device("cuda", 0), lambda lib: None) is None


def test_a_library_that_cannot_load_is_said_once_and_none(monkeypatch):
    """An OSError loading the built file (a broken cache, a driver too old for it) falls back to Triton with a
    warning, as a failed build does."""
    loads = []

    def load(name, device):
        loads.append(name)
        raise OSError("libcuda.so.1: cannot open shared object file")
    monkeypatch.setattr(cuda_build, "device_arch", lambda device: "90")
    monkeypatch.setattr(cuda_build, "load", load)
    monkeypatch.setattr(cuda_build, "_AVAILABLE", {})
    with pytest.warns(UserWarning, match="the CUDA kernel w4a16_mma is unavailable, using the Triton kernels instead "
                                         r"\(libcuda.so.1"):
        assert cuda_build._library_for_arch("w4a16_mma", torch.device("cuda", 0), lambda lib: None) is None
    assert cuda_build._library_for_arch("w4a16_mma", torch.device("cuda", 0), lambda lib: None) is None
    assert loads == ["w4a16_mma"]


@pytest.mark.parametrize("value, enabled", [("0", False), ("1", True), (None, True)])
def test_nibble_cuda_kernels_0_switches_the_cuda_kernels_off_at_import(value, enabled):
    import os
    import subprocess
    import sys

    root = str(Path(cuda_build.__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("NIBBLE_CUDA_KERNELS", None)
    env.update({} if value is None else {"NIBBLE_CUDA_KERNELS": value})  # unset: on
    out = subprocess.run([sys.executable, "-c", "import nibble.kernels.cuda_build as c; print(c.ENABLED)"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(enabled)


def test_an_edited_variant_carries_its_edited_headers(tmp_path, monkeypatch):
    """With ``header_edits`` every csrc/ header is copied beside the edited kernel, the one named edited, and
    ``append`` ends the kernel's copy (all written, into a folder made with its parents, before nvcc runs: here
    there is none)."""
    monkeypatch.setattr(cuda_build, "find_nvcc", lambda: None)
    header = (cuda_build.CSRC / "skinny.cuh").read_text()
    anchor = next(line for line in header.splitlines() if line.strip() and header.count(line) == 1)
    out_dir, tmp_path = tmp_path, tmp_path / "variants" / "edited"
    with pytest.raises(cuda_build.CudaBuildError, match="needs nvcc"):
        cuda_build.build_edited("w4a16_mma", [], tmp_path, append="\n// APPENDED\n",
                                header_edits={"skinny.cuh": [(anchor, "// EDITED")]})
    assert "// EDITED" in (tmp_path / "skinny.cuh").read_text() and anchor not in (tmp_path / "skinny.cuh").read_text()
    assert {p.name for p in tmp_path.glob("*.cuh")} == {p.name for p in cuda_build.CSRC.glob("*.cuh")}
    assert (tmp_path / "w4a16_mma_edited.cu").read_text() == (cuda_build.CSRC / "w4a16_mma.cu").read_text() + \
        "\n// APPENDED\n"
    assert [p.name for p in out_dir.iterdir()] == ["variants"]


def test_the_kernel_cache_is_nibble_cache_dir_else_the_users_cache_folder(monkeypatch, tmp_path):
    """$NIBBLE_CACHE_DIR where set (and not empty), else ~/.cache/nibble."""
    monkeypatch.setenv("NIBBLE_CACHE_DIR", str(tmp_path / "kernels"))
    assert cuda_build.cache_dir() == tmp_path / "kernels"
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for unset in (monkeypatch.delenv, lambda name: monkeypatch.setenv(name, "")):
        unset("NIBBLE_CACHE_DIR")
        assert cuda_build.cache_dir() == tmp_path / "home" / ".cache" / "nibble"


def test_nvcc_is_found_on_path_then_in_cuda_home_then_torchs(monkeypatch, tmp_path):
    """Without $NVCC: nvcc on PATH, then $CUDA_HOME/bin/nvcc, then torch's CUDA_HOME, then /usr/local/cuda; a home
    without bin/nvcc is passed over, and with none found it is None (`build` then says what is missing)."""
    import os

    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.delenv("NVCC", raising=False)
    for home in ("cuda-env", "cuda-torch", "no-nvcc"):
        (tmp_path / home / "bin").mkdir(parents=True)
    for home in ("cuda-env", "cuda-torch"):
        (tmp_path / home / "bin" / "nvcc").write_text("")
    exists = os.path.exists  # only this test's folders: the machine's own /usr/local/cuda left out
    monkeypatch.setattr(cuda_build.os.path, "exists", lambda p: str(p).startswith(str(tmp_path)) and exists(p))
    monkeypatch.setattr(cuda_build.shutil, "which", lambda name: "/opt/bin/nvcc" if name == "nvcc" else None)
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda-env"))
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(tmp_path / "cuda-torch"))
    assert cuda_build.find_nvcc() == "/opt/bin/nvcc"
    monkeypatch.setattr(cuda_build.shutil, "which", lambda name: None)
    assert cuda_build.find_nvcc() == str(tmp_path / "cuda-env" / "bin" / "nvcc")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path / "no-nvcc"))
    assert cuda_build.find_nvcc() == str(tmp_path / "cuda-torch" / "bin" / "nvcc")
    monkeypatch.delenv("CUDA_HOME")
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", None)
    assert cuda_build.find_nvcc() is None


def test_the_cache_key_covers_the_kernel_source_and_the_nvcc_version(tmp_path, monkeypatch):
    """An edited kernel or another CUDA toolkit builds afresh (a stale library is never loaded); another kernel's
    edit leaves the cached one be."""
    shutil.copytree(cuda_build.CSRC, tmp_path / "csrc")
    monkeypatch.setattr(cuda_build, "CSRC", tmp_path / "csrc")
    version = "nvcc 13.0"
    monkeypatch.setattr(cuda_build, "_nvcc_version", lambda nvcc: version)
    before = cuda_build.library_path("w4a16_mma", "90", "nvcc")
    other = tmp_path / "csrc" / "w4a4_mma.cu"
    other.write_text(other.read_text() + "\n// edited\n")
    assert cuda_build.library_path("w4a16_mma", "90", "nvcc") == before
    version = "nvcc 12.8"
    assert cuda_build.library_path("w4a16_mma", "90", "nvcc") != before
    version = "nvcc 13.0"
    source = tmp_path / "csrc" / "w4a16_mma.cu"
    source.write_text(source.read_text() + "\n// edited\n")
    assert cuda_build.library_path("w4a16_mma", "90", "nvcc") != before


def test_an_nvcc_that_fails_to_run_is_a_clear_error(tmp_path, monkeypatch):
    """`nvcc --version` exiting non-zero (a broken toolkit) is a CudaBuildError that names it, not a traceback."""
    nvcc = tmp_path / "nvcc"
    nvcc.write_text("#!/bin/sh\nexit 3\n")
    nvcc.chmod(0o755)
    monkeypatch.setenv("NIBBLE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(cuda_build.CudaBuildError, match=r"cannot run nvcc at .*nvcc'.*set \$NVCC"):
        cuda_build.build("w4a16_mma", "90", nvcc=str(nvcc))


def test_a_build_compiles_the_kernel_for_its_target_inside_the_cache_folder(tmp_path, monkeypatch):
    """`build` runs the nvcc it is given on csrc/<name>.cu for the arch asked, into a temporary folder inside the
    cache folder (one file system: the move into place is atomic), made with its parents; what is left is the
    library alone."""
    cache = tmp_path / "not-yet" / "cache"
    monkeypatch.setenv("NIBBLE_CACHE_DIR", str(cache))
    monkeypatch.setattr(cuda_build, "_nvcc_version", lambda nvcc: "nvcc 13.0")
    monkeypatch.setattr(cuda_build, "find_nvcc", lambda: pytest.fail("looked for nvcc when given one"))
    calls = []

    def compile(nvcc, src, out, arch):
        calls.append((nvcc, src, out.parent.parent, arch))
        out.write_bytes(b"a library")
    monkeypatch.setattr(cuda_build, "_compile", compile)
    path = cuda_build.build("w4a4_wgmma", "90a", nvcc="/opt/cuda/bin/nvcc", quiet=True)
    assert calls == [("/opt/cuda/bin/nvcc", cuda_build.CSRC / "w4a4_wgmma.cu", cache, "90a")]
    assert path.parent == cache and path.read_bytes() == b"a library" and list(cache.iterdir()) == [path]


def test_nvcc_builds_a_shared_library_for_the_arch_and_says_why_it_failed(tmp_path, monkeypatch):
    """`_compile`'s nvcc line: a shared library of real code for sm_<arch> (not PTX alone), csrc/ on the include
    path; a failure (an exit status, or nvcc killed by a signal) is a CudaBuildError with the tail of its output."""
    import subprocess

    runs, result = [], (0, "")
    monkeypatch.setattr(cuda_build.subprocess, "run", lambda cmd, **kw: runs.append(cmd) or subprocess.CompletedProcess(
        cmd, result[0], "", result[1]))
    src, out = tmp_path / "k.cu", tmp_path / "k.so"
    cuda_build._compile("/opt/nvcc", src, out, "90a")
    cmd = runs.pop()
    assert cmd[0] == "/opt/nvcc" and "-shared" in cmd and f"-I{cuda_build.CSRC}" in cmd
    assert "-gencode=arch=compute_90a,code=sm_90a" in cmd and cmd[-3:] == ["-o", str(out), str(src)]
    for status in (2, -9):
        result = (status, "x" * 5000 + "\nk.cu(7): error: identifier undefined")
        with pytest.raises(cuda_build.CudaBuildError, match=r"nvcc failed to build k.cu for sm_80:\n") as e:
            cuda_build._compile("/opt/nvcc", src, out, "80")
        assert str(e.value).endswith("identifier undefined") and len(str(e.value)) < 4100


def test_an_edited_variant_is_compiled_from_its_copy_for_the_arch_asked(tmp_path, monkeypatch):
    """`build_edited` compiles the edited copy in ``out_dir`` (never csrc/) for ``arch`` (default sm_90a) and loads
    what it built."""
    calls = []
    monkeypatch.setattr(cuda_build, "find_nvcc", lambda: "/opt/nvcc")
    monkeypatch.setattr(cuda_build, "_compile", lambda *a: calls.append(a))
    monkeypatch.setattr(cuda_build.ctypes, "CDLL", lambda path: ("loaded", path))
    lib = cuda_build.build_edited("w4a4_mma", [], tmp_path, arch="90")
    assert lib == ("loaded", str(tmp_path / "w4a4_mma_edited.so"))
    cuda_build.build_edited("w4a4_wgmma", [], tmp_path)
    assert calls == [("/opt/nvcc", tmp_path / "w4a4_mma_edited.cu", tmp_path / "w4a4_mma_edited.so", "90"),
                     ("/opt/nvcc", tmp_path / "w4a4_wgmma_edited.cu", tmp_path / "w4a4_wgmma_edited.so", "90a")]


def test_prebuild_refuses_gpus_before_ampere_and_a_jobs_count_below_one(monkeypatch):
    """sm_70 (V100) and sm_75 (T4) lack the bf16 MMAs; 8.0 and newer are built, the Hopper GEMMs for 90 alone (not
    for Blackwell's 100 or 120). ``jobs=0`` is refused, not taken as the CPUs."""
    built = []
    monkeypatch.setattr(cuda_build, "build", lambda name, arch, nvcc=None, quiet=False: built.append(arch) or arch)
    for arch in ("70", "75", "79"):
        with pytest.raises(ValueError, match="need compute capability 8.0 or newer"):
            cuda_build.prebuild(arch)
    assert not built
    for arch in ("80", "89", "100", "120"):
        assert set(cuda_build.prebuild(arch).values()) == {arch}
    assert set(cuda_build.prebuild("90").values()) == {"90", "90a"}
    with pytest.raises(ValueError, match="jobs must be an integer >= 1, got 0"):
        cuda_build.prebuild("90", jobs=0)


def test_prebuild_lists_the_libraries_in_order_whatever_finishes_first(monkeypatch):
    """The paths come back in `LIBRARIES`' order (what `nibble build-kernels` prints), not as the builds end: here
    the first library's build waits for the last one's."""
    import threading

    names = list(cuda_build.LIBRARIES)
    last_built = threading.Event()

    def build(name, arch, nvcc=None, quiet=False):
        if name == names[0]:
            assert last_built.wait(60)
        if name == names[-1]:
            last_built.set()
        return f"/c/{name}-{arch}"
    monkeypatch.setattr(cuda_build, "build", build)
    paths = cuda_build.prebuild("90", jobs=len(names))
    assert list(paths.items()) == [(n, f"/c/{n}-{cuda_build.target(n, '90')}") for n in names]


def test_the_capability_is_asked_once_per_device(monkeypatch):
    """`capability` (asked at every launch by the kernels' dispatch) asks torch once per device, that device
    current."""
    import contextlib

    current = []
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext(current.append(index)))
    monkeypatch.setattr(cuda_build, "_ASKED", {})
    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda device=None: asked.append(current[-1]) or {0: (9, 0), 1: (8, 6)}[current[-1]])
    assert [cuda_build.capability(torch.device("cuda", 1)) for _ in range(3)] == [(8, 6)] * 3
    assert cuda_build.capability("cuda:0") == (9, 0) and cuda_build.device_arch(torch.device("cuda", 0)) == "90"
    assert asked == [1, 0]


def test_a_library_is_built_and_opened_once_per_target(monkeypatch):
    """`load`: the Hopper GEMMs built for sm_90a, the others for the GPU's own arch; each (library, target) built and
    opened once a process (another ctypes handle would lack the signatures `library` set on the first), GPUs of
    two archs each their own."""
    import types

    monkeypatch.setattr(cuda_build, "device_arch", lambda device: {0: "90", 1: "80"}[device.index])
    built = []
    monkeypatch.setattr(cuda_build, "build", lambda name, arch: built.append((name, arch)) or Path(f"/c/{name}-{arch}"))
    monkeypatch.setattr(cuda_build.ctypes, "CDLL", lambda path: types.SimpleNamespace(path=path))
    monkeypatch.setattr(cuda_build, "_LIBS", {})
    hopper, ampere = torch.device("cuda", 0), torch.device("cuda", 1)
    wgmma = cuda_build.load("w4a16_wgmma", hopper)
    assert wgmma.path == "/c/w4a16_wgmma-90a" and cuda_build.load("w4a16_wgmma", hopper) is wgmma
    assert cuda_build.load("w4a16_mma", hopper).path == "/c/w4a16_mma-90"
    assert cuda_build.load("w4a16_mma", ampere).path == "/c/w4a16_mma-80"
    assert built == [("w4a16_wgmma", "90a"), ("w4a16_mma", "90"), ("w4a16_mma", "80")]


def test_signatures_type_the_launcher_and_its_error_string():
    """The launcher returns a CUDA error code (an int) and takes ``argtypes``; the error string function turns a
    code into its message (bytes)."""
    import types

    lib = types.SimpleNamespace(nibble_k=types.SimpleNamespace(), nibble_k_error_string=types.SimpleNamespace())
    argtypes = [ctypes.c_void_p, ctypes.c_int]
    cuda_build.signatures("nibble_k", argtypes, "nibble_k_error_string")(lib)
    assert (lib.nibble_k.restype, lib.nibble_k.argtypes) == (ctypes.c_int, argtypes)
    assert (lib.nibble_k_error_string.restype, lib.nibble_k_error_string.argtypes) == (ctypes.c_char_p, [ctypes.c_int])


def test_a_launch_passes_the_current_stream_last_and_switches_devices_only_when_needed(monkeypatch):
    """`launch` calls the launcher with the device's current raw stream last and returns its error code; a device
    without an index is the current one; another device is made current for the call, and only then."""
    import contextlib

    current, switched, calls = [0], [], []
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 1000 + index, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: current[-1], raising=False)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current[-1])

    @contextlib.contextmanager
    def device(index):
        switched.append(index)
        current.append(index)
        yield
        current.pop()
    monkeypatch.setattr(torch.cuda, "device", device)

    def launcher(*args):
        calls.append((current[-1], args))
        return len(calls) - 1
    assert cuda_build.launch(launcher, torch.device("cuda", 0), 7, 8) == 0
    assert cuda_build.launch(launcher, torch.device("cuda"), 9) == 1
    assert cuda_build.launch(launcher, torch.device("cuda", 1), 5) == 2
    assert calls == [(0, (7, 8, 1000)), (0, (9, 1000)), (1, (5, 1001))] and switched == [1] and current == [0]


def test_each_library_is_loaded_and_configured_once_per_device(monkeypatch):
    """`library`: each kernel library its own answer, loaded and given its signatures once; later calls (every
    launch) get the same library."""
    import contextlib
    import types

    monkeypatch.setattr(cuda_build, "ENABLED", True)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    monkeypatch.setattr(cuda_build, "_ASKED", {})
    monkeypatch.setattr(cuda_build, "_AVAILABLE", {})
    monkeypatch.setattr(cuda_build, "device_arch", lambda device: "90")
    loaded, configured = [], []
    monkeypatch.setattr(cuda_build, "load",
                        lambda name, device: loaded.append(name) or types.SimpleNamespace(name=name))
    gpu = torch.device("cuda", 0)
    mma = cuda_build.library("w4a16_mma", gpu, lambda lib: configured.append(lib.name))
    assert mma.name == "w4a16_mma" and cuda_build.library("w4a16_mma", gpu, lambda lib: pytest.fail("again")) is mma
    assert cuda_build.library("w4a16_wgmma", gpu, lambda lib: configured.append(lib.name)).name == "w4a16_wgmma"
    assert loaded == configured == ["w4a16_mma", "w4a16_wgmma"]


def test_a_library_that_cannot_be_built_is_said_once_and_none(monkeypatch):
    """A failed build (no nvcc, a compile error) falls back to Triton with a warning that says why."""
    def load(name, device):
        raise cuda_build.CudaBuildError("nvcc failed to build rotate_quantize.cu for sm_90")
    monkeypatch.setattr(cuda_build, "device_arch", lambda device: "90")
    monkeypatch.setattr(cuda_build, "load", load)
    monkeypatch.setattr(cuda_build, "_AVAILABLE", {})
    with pytest.warns(UserWarning, match=r"the CUDA kernel rotate_quantize is unavailable, using the Triton kernels "
                                         r"instead \(nvcc failed to build"):
        assert cuda_build._library_for_arch("rotate_quantize", torch.device("cuda", 0), lambda lib: None) is None
