"""Where the evaluation data lives.

nibble never downloads data: it reads the offline copies laid out as in `shared/data`
(see that folder's README.md for every file's format, source and hash). In the repo that folder
is `../shared/data` next to the checkout, which is also how CI lays it out; $NIBBLE_DATA names another (then the
only one searched).
"""

import json
import os
from contextlib import contextmanager
from pathlib import Path

ENV_VAR = "NIBBLE_DATA"

# nibble/eval/data.py -> the repository root (flat layout)
_REPO = Path(__file__).resolve().parents[2]


def _env_dir() -> Path | None:
    """The folder $NIBBLE_DATA names, if it is set."""
    return Path(os.environ[ENV_VAR]).expanduser() if os.environ.get(ENV_VAR) else None


def _checkout() -> bool:
    """Whether nibble runs from its repository (an installed one has no ../shared/data of its own)."""
    return (_REPO / "pyproject.toml").is_file() and (_REPO / "nibble").is_dir()


def search_dirs() -> list[Path]:
    """Candidate data folders, most specific first: $NIBBLE_DATA alone where it is set (a folder named by mistake
    had other folders' copies read with a warning lost among progress bars, the results credited to no folder)."""
    env = _env_dir()
    if env is not None:
        return [env]
    return [_REPO.parent / "shared" / "data"] * _checkout() + [
        Path.cwd().parent / "shared" / "data",
        Path.cwd() / "shared" / "data",
    ]


def _how_to_fix(dirs: list[Path]) -> str:
    env = _env_dir()
    searched = "\n".join(f"  {d}{f'  ({ENV_VAR})' if d == env else ''}{'' if d.is_dir() else '  (no such folder)'}"
                         for d in dirs)
    return (
        f"Searched:\n{searched}\n"
        f"Fix: set {ENV_VAR} to a folder with the shared data layout "
        "(wikitext2/wiki.test.raw, piqa/valid.jsonl, ...; its README.md says each file's source and hash)"
        + (f" (only it is searched while {ENV_VAR} is set)" if env is not None else
           ", or place that folder at ../shared/data next to the nibble checkout." if _checkout() else ".")
    )


def require_data(relpaths) -> None:
    """Refuse a run whose data files are not all there, naming every missing one, before the work that would
    read them last: a model loaded and quantized first (minutes for a 7B one; `nibble demo` 3.5 on a CPU) was
    lost to a missing perplexity file."""
    dirs = search_dirs()
    missing = [r for r in dict.fromkeys(relpaths) if _find(r, dirs) is None]
    if missing:
        raise FileNotFoundError(f"Evaluation data file{'s' * (len(missing) > 1)} {', '.join(map(repr, missing))} "
                                f"not found.\n{_how_to_fix(dirs)}")


def data_file(relpath: str) -> Path:
    """Path of `relpath` (e.g. "wikitext2/wiki.test.raw") in the first data folder that has it."""
    require_data([relpath])
    return _find(relpath, search_dirs()) / relpath


def _find(relpath: str, dirs: list[Path]) -> Path | None:
    """The first of ``dirs`` that holds ``relpath``."""
    return next((d for d in dirs if (d / relpath).is_file()), None)


class DataFormatError(ValueError):
    """A data file that is there but does not hold what nibble reads from it."""


# What to do about a shared data file that does not hold what nibble reads (a user's own file is told its format)
COPY_AGAIN = "copy the file again from the shared data folder (its README.md gives every file's format)"


@contextmanager
def parsing(where, fix: str = COPY_AGAIN):
    """An error of reading records from ``where`` (a file, or several, or a line of one): bad UTF-8, a line that
    is not JSON, a missing key, a value of another kind, as one DataFormatError that names it and ``fix``, what to
    do (a user's own file: what it must hold)."""
    try:
        yield
    except DataFormatError:
        raise
    except (UnicodeDecodeError, KeyError, IndexError, TypeError, ValueError) as e:
        raise DataFormatError(f"{where}: not in the format nibble reads ({type(e).__name__}: {e}); {fix}") from e


def read_jsonl(path: Path, fix: str = COPY_AGAIN, fields=()) -> list[dict]:
    """The JSON records of ``path``, one a line (blank lines skipped), each an object holding ``fields``; a bad line
    is named by its number, with ``fix`` (`parsing`)."""
    with parsing(path, fix), open(path, encoding="utf-8") as f:
        lines = list(f)
    records = []
    for number, line in enumerate(lines, 1):
        if line.strip():
            with parsing(f"{path}, line {number}", fix):
                record = json.loads(line)
            missing = [name for name in fields if not isinstance(record, dict) or name not in record]
            if missing:
                holds = (f"it is {json.dumps(record)[:40]}, not an object" if not isinstance(record, dict) else
                         f"its fields are {', '.join(map(json.dumps, record))}" if record else "it is an empty object")
                raise DataFormatError(f"{path}, line {number}: no {', '.join(map(json.dumps, missing))} field "
                                      f"({holds}); {fix}")
            records.append(record)
    return records
