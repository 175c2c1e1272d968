"""Where the evaluation data lives.

nibble never downloads data: it reads the offline copies laid out as in `shared/data`
(see that folder's README.md for every file's format, source and hash). In the repo that folder
is `../shared/data` next to the checkout, which is also how CI lays it out.
"""

import os
from pathlib import Path

ENV_VAR = "NIBBLE_DATA"

# nibble/eval/data.py -> the repository root (flat layout)
_REPO = Path(__file__).resolve().parents[2]


def search_dirs() -> list[Path]:
    """Candidate data folders, most specific first."""
    dirs = []
    if os.environ.get(ENV_VAR):
        dirs.append(Path(os.environ[ENV_VAR]).expanduser())
    dirs += [
        _REPO.parent / "shared" / "data",
        Path.cwd().parent / "shared" / "data",
        Path.cwd() / "shared" / "data",
    ]
    return dirs


def _how_to_fix(dirs: list[Path]) -> str:
    searched = "\n".join(f"  {d}{'' if d.is_dir() else '  (no such folder)'}" for d in dirs)
    return (
        f"Searched:\n{searched}\n"
        f"Fix: set {ENV_VAR} to a folder with the shared data layout "
        "(wikitext2/wiki.test.raw, piqa/valid.jsonl, ...; see shared/data/README.md), "
        "or place that folder at ../shared/data next to the nibble checkout."
    )


def data_dir() -> Path:
    """The first existing folder among `search_dirs()`."""
    dirs = search_dirs()
    for d in dirs:
        if d.is_dir():
            return d
    raise FileNotFoundError(f"No evaluation data folder found.\n{_how_to_fix(dirs)}")


def data_file(relpath: str) -> Path:
    """Path of `relpath` (e.g. "wikitext2/wiki.test.raw") in the first data folder that has it."""
    dirs = search_dirs()
    for d in dirs:
        path = d / relpath
        if path.is_file():
            return path
    raise FileNotFoundError(f"Evaluation data file {relpath!r} not found.\n{_how_to_fix(dirs)}")
