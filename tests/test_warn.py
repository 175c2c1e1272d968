"""nibble.warn: a warning names the line that called into nibble, however deep nibble's own calls went."""
import linecache
import os

import pytest
import torch

import nibble
from nibble.warn import warn


def said_at(record) -> str:
    """The source line a recorded warning names."""
    return linecache.getline(record.filename, record.lineno).strip()


def test_a_warning_names_the_first_line_outside_nibble_past_nibbles_decorators():
    # functions whose code is a file of nibble's: a helper two calls deep, one of them wearing @torch.no_grad, whose
    # wrapper frame (torch's) lies between nibble's own
    source = ("def helper():\n    warn('deep')\n\n"
              "@torch.no_grad()\ndef middle():\n    helper()\n\n"
              "def entry():\n    middle()\n")
    scope = {"warn": warn, "torch": torch}
    exec(compile(source, os.path.join(os.path.dirname(nibble.__file__), "made_up.py"), "exec"), scope)
    with pytest.warns(UserWarning, match="deep") as record:
        scope["entry"]()
    assert record[0].filename == __file__ and said_at(record[0]) == 'scope["entry"]()'


def test_a_warning_called_from_outside_nibble_names_its_caller():
    with pytest.warns(UserWarning, match="here") as record:
        warn("here")
    assert record[0].filename == __file__ and said_at(record[0]) == 'warn("here")'
