"""`import nibble`: its public names, imported on first use."""
import subprocess
import sys
from pathlib import Path

import pytest

import nibble


def test_the_public_names_are_there_and_imported_only_when_used():
    """`import nibble` imported every public name's module, and torch, transformers and accelerate with them (~4 s)
    before `nibble --help` could print."""
    code = ("import sys\nimport nibble\nassert 'torch' not in sys.modules, 'import nibble imported torch'\n"
            "from nibble import Engine, QuantConfig\nassert 'torch' in sys.modules\n"
            "from nibble.config import QuantConfig as defined\nassert QuantConfig is defined\nprint('ok')")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(nibble.__file__).parents[1], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


def test_every_name_of_all_is_importable_and_listed_by_dir():
    from nibble.eval.engine import Engine
    from nibble.models.serialization import load_quantized

    scope = {}
    exec("from nibble import *", scope)
    assert set(nibble.__all__) <= set(scope) and set(nibble.__all__) <= set(dir(nibble))
    assert scope["Engine"] is Engine and nibble.load_quantized is load_quantized
    with pytest.raises(AttributeError, match="module 'nibble' has no attribute 'Engin'"):
        nibble.Engin
    from nibble import kernels  # a submodule, not one of the public names: imported as before
    assert kernels.__name__ == "nibble.kernels"
