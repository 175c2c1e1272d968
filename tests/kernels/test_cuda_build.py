"""Run-time build of the CUDA C++ kernels: cache keying, clear errors, and (where nvcc exists) a real build."""
from __future__ import annotations

import ctypes

import pytest

from nibble.kernels import cuda_build


def test_missing_nvcc_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(cuda_build, "find_nvcc", lambda: None)
    with pytest.raises(cuda_build.CudaBuildError, match="nvcc"):
        cuda_build.build("w4a16_mma", "90")


def test_broken_nvcc_path_is_a_clear_error(tmp_path):
    with pytest.raises(cuda_build.CudaBuildError, match="NVCC"):
        cuda_build.build("w4a16_mma", "90", nvcc=str(tmp_path / "no-such-nvcc"))


@pytest.mark.skipif(cuda_build.find_nvcc() is None, reason="needs nvcc (the CUDA toolkit)")
def test_builds_for_sm90_and_caches(tmp_path, monkeypatch):
    """The kernel source compiles for Hopper on a machine without a GPU; the second call is a cache hit."""
    monkeypatch.setenv("NIBBLE_CACHE_DIR", str(tmp_path))
    path = cuda_build.build("w4a16_mma", "90")
    assert path.parent == tmp_path and path.exists()
    mtime = path.stat().st_mtime_ns
    assert cuda_build.build("w4a16_mma", "90") == path and path.stat().st_mtime_ns == mtime
    lib = ctypes.CDLL(str(path))
    assert lib.nibble_w4a16_mma and lib.nibble_cuda_error_string
