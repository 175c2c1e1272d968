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
    for arch in ("9", "sm90", "9.0", ""):
        with pytest.raises(ValueError, match="arch must be a compute capability as digits"):
            cuda_build.prebuild(arch)


def test_prebuild_runs_one_nvcc_per_cpu_at_most_one_per_library(monkeypatch):
    import concurrent.futures

    workers = []
    real_pool = concurrent.futures.ThreadPoolExecutor
    monkeypatch.setattr(concurrent.futures, "ThreadPoolExecutor", lambda n: workers.append(n) or real_pool(n))
    monkeypatch.setattr(cuda_build, "build", lambda name, arch, nvcc=None, quiet=False: f"/c/{name}-{arch}")
    for cpus, arch, expected in ((2, "90", 2), (64, "90", len(cuda_build.LIBRARIES)),
                                 (64, "80", sum(not hopper for hopper in cuda_build.LIBRARIES.values()))):
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


@pytest.mark.parametrize("value, enabled", [("0", False), ("1", True)])
def test_nibble_cuda_kernels_0_switches_the_cuda_kernels_off_at_import(value, enabled):
    import os
    import subprocess
    import sys

    root = str(Path(cuda_build.__file__).resolve().parents[2])
    env = dict(os.environ, NIBBLE_CUDA_KERNELS=value, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", "import nibble.kernels.cuda_build as c; print(c.ENABLED)"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(enabled)


def test_an_edited_variant_carries_its_edited_headers(tmp_path, monkeypatch):
    """With ``header_edits`` every csrc/ header is copied beside the edited kernel, the one named edited (written
    before nvcc runs: here there is none)."""
    monkeypatch.setattr(cuda_build, "find_nvcc", lambda: None)
    header = (cuda_build.CSRC / "skinny.cuh").read_text()
    anchor = next(line for line in header.splitlines() if line.strip() and header.count(line) == 1)
    with pytest.raises(cuda_build.CudaBuildError, match="needs nvcc"):
        cuda_build.build_edited("w4a16_mma", [], tmp_path, header_edits={"skinny.cuh": [(anchor, "// EDITED")]})
    assert "// EDITED" in (tmp_path / "skinny.cuh").read_text() and anchor not in (tmp_path / "skinny.cuh").read_text()
    assert {p.name for p in tmp_path.glob("*.cuh")} == {p.name for p in cuda_build.CSRC.glob("*.cuh")}
    assert (tmp_path / "w4a16_mma_edited.cu").read_text() == (cuda_build.CSRC / "w4a16_mma.cu").read_text()
