"""The documentation against the checkout: each relative link of README.md and docs/*.md names a file of the
checkout, and an anchor after it one of that file's headings, as GitHub makes their anchors; the README's Python
block runs."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def github_anchor(heading: str) -> str:
    """GitHub's id for a Markdown heading: lower case, punctuation but - and _ dropped, spaces as -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a # in a code block is a comment
    return {github_anchor(m) for m in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_github_anchor_drops_punctuation_and_backticks():
    assert github_anchor("The engine: `nibble.Engine`") == "the-engine-nibbleengine"
    assert github_anchor("transformers' `from_pretrained`, and back") == "transformers-from_pretrained-and-back"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_and_anchor_resolves(page):
    links = [link for link in LINK.findall(page.read_text()) if not re.match(r"[a-z]+:", link)]
    for link in links:
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.exists(), f"{page.name}: {link} names no file"
        if anchor:
            assert anchor in anchors(target), f"{page.name}: {link} names no heading of {target.name}"
    assert page.name not in ("README.md", "USAGE.md") or links  # the pages with links were read


def test_the_readme_python_block_runs_on_a_cpu(tmp_path, monkeypatch):
    """Docs that match the code: the README's Python API block runs as written, on a CPU. The edits are the GPU's
    "cuda" to "cpu", and the two directories a reader has for models this suite does not: the GPTQ one is the
    block's own AutoAWQ save, the Llama-3-8B one a tiny random Llama whose widths group 128 divides, as that
    model's do."""
    from conftest import tiny_model, tiny_tokenizer

    block = re.search(r"## Python API\n\n```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S).group(1)
    edits = {'device="cuda"': 'device="cpu"', 'device_map="cuda"': 'device_map="cpu"', ".cuda()": "",
             '"Llama-2-7B-GPTQ-dir"': '"smollm2-awq"', '"Meta-Llama-3-8B-dir"': '"llama-dir"'}
    for old, new in edits.items():
        assert old in block, f"the README's Python block no longer has {old}: update this test's edits"
        block = block.replace(old, new)
    tiny_model(hidden_size=128, intermediate_size=256).save_pretrained(tmp_path / "llama-dir")
    tiny_tokenizer().save_pretrained(tmp_path / "llama-dir")
    monkeypatch.chdir(tmp_path)
    scope = {}
    exec(compile(block, "README.md", "exec"), scope)
    assert scope["new"].shape == (3, 20)  # the ragged batch, as its comment says
    assert (tmp_path / "smollm2-w4a16" / "model.safetensors").exists() and (tmp_path / "smollm2-awq").is_dir()
    assert type(scope["model"].model.layers[0].mlp.down_proj).__name__ == "QuantLinear"


def test_every_option_the_docs_name_is_declared_by_nibble_or_a_benchmark_script():
    """An option renamed in the code and not in the docs: each `--option` of README.md and docs/*.md (HISTORY.md
    tells of removed ones) is declared somewhere in nibble/ or benchmarks/scripts/, but other tools' own."""
    others = {"--no-deps",  # pip's
              "--merge"}  # llama-gguf-split's
    sources = "".join(p.read_text() for folder in ("nibble", "benchmarks/scripts") for p in (ROOT / folder).rglob("*")
                      if p.suffix in (".py", ".sh"))
    declared = set(re.findall(r"[\"'](--[a-z][a-z0-9-]+)[\"'=]", sources))
    named = {option for page in PAGES if page.name != "HISTORY.md"
             for option in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]+", page.read_text())}
    assert len(named) > 40 and not others & declared  # the pages were read; an allow-listed one became ours
    assert named - others <= declared, sorted(named - others - declared)
