"""Where the evaluation data is searched, how a missing file is said, and how a JSONL file is read."""
import json

import pytest

import nibble.eval.data as data
from nibble.eval.data import DataFormatError, data_file, parsing, read_jsonl, require_data, search_dirs


@pytest.fixture
def no_checkout(monkeypatch, tmp_path):
    """Searching from ``tmp_path/cwd`` as an installed nibble (no repository of its own), NIBBLE_DATA unset."""
    monkeypatch.delenv("NIBBLE_DATA", raising=False)
    monkeypatch.setattr(data, "_REPO", tmp_path / "site-packages")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return tmp_path


def _place(folder, relpath="piqa/valid.jsonl", text='{"goal": "x"}\n'):
    (folder / relpath).parent.mkdir(parents=True, exist_ok=True)
    (folder / relpath).write_text(text)
    return folder / relpath


def test_nibble_data_may_start_with_a_tilde_and_an_empty_one_is_unset(monkeypatch, tmp_path, no_checkout):
    """A shell leaves "~" in NIBBLE_DATA="~/data" as it is; NIBBLE_DATA= (set to nothing) searched the folder ""."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    placed = _place(tmp_path / "home" / "data")
    monkeypatch.setenv("NIBBLE_DATA", "~/data")
    assert search_dirs() == [tmp_path / "home" / "data"] and data_file("piqa/valid.jsonl") == placed
    monkeypatch.setenv("NIBBLE_DATA", "")
    assert search_dirs() == [tmp_path / "shared" / "data", tmp_path / "cwd" / "shared" / "data"]


def test_the_first_folder_that_holds_a_file_is_read_and_a_folder_of_its_name_is_no_file(no_checkout):
    above, here = no_checkout / "shared" / "data", no_checkout / "cwd" / "shared" / "data"
    (above / "piqa" / "valid.jsonl").mkdir(parents=True)  # a folder where the file should be: passed over
    placed = _place(here)
    assert data_file("piqa/valid.jsonl") == placed
    (above / "piqa" / "valid.jsonl").rmdir()
    placed = _place(above)
    assert data_file("piqa/valid.jsonl") == placed  # the folder above the current one first


def test_a_checkouts_own_shared_data_is_searched_first(monkeypatch, tmp_path, no_checkout):
    repo = tmp_path / "repo"
    (repo / "nibble").mkdir(parents=True)
    (repo / "pyproject.toml").write_text("")
    monkeypatch.setattr(data, "_REPO", repo)
    assert search_dirs() == [tmp_path / "shared" / "data", tmp_path / "shared" / "data",
                             tmp_path / "cwd" / "shared" / "data"]
    (repo / "pyproject.toml").unlink()  # a folder named nibble alone is no checkout
    assert search_dirs()[0] == tmp_path / "shared" / "data" and len(search_dirs()) == 2


def test_a_missing_file_is_named_once_with_every_other_missing_one_and_each_folder_searched(no_checkout):
    _place(no_checkout / "cwd" / "shared" / "data", "piqa/valid.jsonl")
    with pytest.raises(FileNotFoundError) as error:
        require_data(["boolq/dev.jsonl", "piqa/valid.jsonl", "arc/easy.jsonl", "boolq/dev.jsonl"])
    said = str(error.value)
    assert said.startswith("Evaluation data files 'boolq/dev.jsonl', 'arc/easy.jsonl' not found.\nSearched:\n"), said
    assert f"  {no_checkout / 'shared' / 'data'}  (no such folder)\n" in said
    assert f"  {no_checkout / 'cwd' / 'shared' / 'data'}\n" in said
    assert said.endswith("its README.md says each file's source and hash).")  # no checkout to place it next to
    with pytest.raises(FileNotFoundError, match="^Evaluation data file 'arc/easy.jsonl' not found"):
        require_data(["arc/easy.jsonl"])


def test_a_jsonl_file_is_read_by_line_and_a_bad_line_is_named_by_its_number(tmp_path):
    path = _place(tmp_path, "a.jsonl", '{"text": "a"}\n\n  \n{"text": "b", "n": 1}\n')
    assert read_jsonl(path, fields=("text",)) == [{"text": "a"}, {"text": "b", "n": 1}]
    for line, holds in [('["a list that runs on past forty characters of json text"]',
                         r'it is \["a list that runs on past forty charact, not an object'),
                        ('"a text for a record"', 'it is "a text for a record", not an object'),
                        ("{}", "it is an empty object"), ('{"txt": "a", "n": 2}', 'its fields are "txt", "n"')]:
        path.write_text('{"text": "a"}\n\n' + line + "\n")
        with pytest.raises(DataFormatError, match=rf'a\.jsonl, line 3: no "text" field \({holds}\); fix it$'):
            read_jsonl(path, "fix it", fields=("text",))
    path.write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(DataFormatError, match=r"a\.jsonl, line 2: not in the format nibble reads \(JSONDecodeError: "):
        read_jsonl(path)


def test_a_file_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(json.dumps({"text": "café"}, ensure_ascii=False).encode() + b"\n")
    assert read_jsonl(path) == [{"text": "café"}]
    path.write_bytes(b'{"text": "\xff"}\n')
    with pytest.raises(DataFormatError, match=r"a\.jsonl: not in the format nibble reads \(UnicodeDecodeError: "):
        read_jsonl(path)


@pytest.mark.parametrize("error", [IndexError("list index out of range"), TypeError("'int' object is not iterable"),
                                   KeyError("label")])
def test_parsing_names_the_file_and_the_fix_for_each_kind_of_bad_record(error):
    with pytest.raises(DataFormatError, match=rf"^f\.txt: not in the format nibble reads \({type(error).__name__}: "
                                              r".+\); do this$"):
        with parsing("f.txt", "do this"):
            raise error
    said = DataFormatError("f.txt: its own words")
    with pytest.raises(DataFormatError) as raised:  # one of nibble's own passes as it is
        with parsing("g.txt"):
            raise said
    assert raised.value is said


def test_a_folder_with_a_pyproject_but_no_nibble_package_is_no_checkout(monkeypatch, tmp_path, no_checkout):
    """An installed nibble's site-packages may hold some pyproject.toml: without the nibble folder beside it, it is
    not nibble's repository, and its ../shared/data is not searched."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "pyproject.toml").write_text("")
    monkeypatch.setattr(data, "_REPO", repo)
    assert search_dirs() == [tmp_path / "shared" / "data", tmp_path / "cwd" / "shared" / "data"]
