import json
import re

import pytest
import torch

from conftest import tiny_model
from nibble import QuantConfig
from nibble.models.architecture import decoder_layers
from nibble.quantize.calibration import (calibration_batches, calibration_for, calibration_text, capture_block_inputs,
                                         forward_block, token_batches)


class ByteTokenizer:
    """Stand-in tokenizer: one token per UTF-8 byte."""

    def encode(self, text, add_special_tokens=False):
        return list(text.encode("utf-8"))


@pytest.mark.parametrize("source", ["c4", "gutenberg"])
def test_batches_are_seeded_non_overlapping_windows_of_the_text(source):
    tok = ByteTokenizer()
    a = calibration_batches(tok, n_samples=16, seq_len=256, source=source, seed=0)
    assert a.shape == (16, 256) and a.dtype == torch.long
    assert torch.equal(a, calibration_batches(tok, n_samples=16, seq_len=256, source=source, seed=0))
    assert not torch.equal(a, calibration_batches(tok, n_samples=16, seq_len=256, source=source, seed=1))
    assert len({tuple(r.tolist()) for r in a}) == 16
    # each sample one of the stream's windows ids[k L : (k + 1) L], none twice, in stream order: distinct rows alone let
    # overlapping windows, or windows shifted off the stream's start, pass
    ids = torch.tensor(tok.encode(calibration_text(source)))
    windows = ids[: ids.numel() // 256 * 256].reshape(-1, 256)
    k = [next(i for i, w in enumerate(windows) if torch.equal(w, row)) for row in a]
    assert k == sorted(set(k))


def test_calibration_for_a_model_cuts_the_default_windows_to_its_context():
    """quantize_model refuses windows past the model's context: the default ones (512 tokens) of the CLI and the
    report fit a model of a shorter one (256), and the sizes given are kept as they are."""
    tok, gptq = ByteTokenizer(), QuantConfig(method="gptq")
    assert calibration_for(gptq, tok, tiny_model(), n_samples=2).shape == (2, 256)
    assert calibration_for(gptq, tok, tiny_model(max_position_embeddings=4096), n_samples=2).shape == (2, 512)
    assert calibration_for(gptq, tok, tiny_model(), n_samples=2, seq_len=300).shape == (2, 300)
    assert calibration_for(QuantConfig(), tok, tiny_model()) is None


def test_jsonl_file_source_and_too_short_text_names_the_minimum(tmp_path):
    path = tmp_path / "tiny.jsonl"
    path.write_text("\n".join(json.dumps({"text": "x" * 100}) for _ in range(3)))  # 302 bytes with separators
    assert calibration_batches(ByteTokenizer(), n_samples=2, seq_len=128, source=str(path)).shape == (2, 128)
    with pytest.raises(ValueError, match=r"has 304 tokens.*at least 512 tokens"):
        calibration_batches(ByteTokenizer(), n_samples=4, seq_len=128, source=str(path))


@pytest.mark.parametrize("name, content, what", [
    ("own.jsonl", '{"text": "a"}\n\n{"content": "b"}\n', r'own\.jsonl, line 3: no "text" field \(its fields are '
                                                         r'"content"\)'),
    ("own.jsonl", '["a"]\n', r'own\.jsonl, line 1: no "text" field \(it is \["a"\], not an object\)'),
    ("own.jsonl", '{"text": 3}\n', r"own\.jsonl: not in the format nibble reads \(TypeError: .*\)"),
    ("own.txt", b"\xff\xfe", r"own\.txt: not in the format nibble reads \(UnicodeDecodeError: .*\)"),
    ("own.txt", " \n\t\n" * 100, r"own\.txt: holds no text, only whitespace")])  # trained on windows of blanks
def test_a_text_of_the_users_own_not_in_the_format_is_told_what_it_must_hold(tmp_path, name, content, what):
    """It was told to copy the file again from the shared data folder, which holds no copy of the user's own."""
    from nibble.eval.data import DataFormatError

    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(DataFormatError) as error:
        calibration_text(str(path))
    assert re.match(f"{re.escape(str(tmp_path))}/{what}; a calibration text of your own is a .txt file of UTF-8 "
                    r'text, or a \.jsonl file of one JSON object a line with its text as a string in a "text" field: '
                    r'\{"text": "\.\.\."\}$', str(error.value)), str(error.value)
    assert "shared data" not in str(error.value)


def test_a_byte_order_mark_is_not_calibration_text(tmp_path):
    """It was read as a character (U+FEFF) and tokenized: other windows than the same text without it."""
    (tmp_path / "bom.txt").write_bytes(b"\xef\xbb\xbfsome text")
    assert calibration_text(str(tmp_path / "bom.txt")) == "some text"


def test_wikitext2_test_is_refused_for_calibration_by_its_content_not_its_name(tmp_path, monkeypatch):
    """The path was matched against "wiki.test" and "wikitext2": WikiText-2 *train* (and any path holding "wikitext2")
    was refused as the test set, while a copy of the test set under another name calibrated without a word."""
    paragraphs = [f" Paragraph {i} of the evaluation set , tokenized as WikiText @-@ 2 is . " * 4 for i in range(3)]
    (tmp_path / "data" / "wikitext2").mkdir(parents=True)
    test = tmp_path / "data" / "wikitext2" / "wiki.test.raw"
    test.write_text(" \n = Title = \n \n" + " \n".join(paragraphs) + " \n")
    monkeypatch.setenv("NIBBLE_DATA", str(tmp_path / "data"))
    copy = tmp_path / "notes.txt"
    copy.write_bytes(test.read_bytes())
    records = tmp_path / "mixed.jsonl"  # one of its paragraphs among other text
    records.write_text(json.dumps({"text": "other text " * 100}) + "\n" + json.dumps({"text": paragraphs[1]}) + "\n")
    for path, shared in ((test, 3), (copy, 3), (records, 1)):
        with pytest.raises(ValueError, match=f"^refusing to calibrate on {re.escape(str(path))}: it holds WikiText-2 "
                                             rf"test, the evaluation set \({shared} paragraphs? of {re.escape(str(test))}"
                                             r"\); .*WikiText-2 train is fine"):
            calibration_batches(ByteTokenizer(), n_samples=2, seq_len=16, source=str(path))
    train = tmp_path / "wikitext2" / "wiki.train.raw"
    train.parent.mkdir()
    train.write_text(" = Another article = \n" + "Its own text , not the test set 's . " * 100)
    assert calibration_batches(ByteTokenizer(), n_samples=2, seq_len=16, source=str(train)).shape == (2, 16)


def test_token_batches_accepts_tensors_lists_and_dicts():
    ids = torch.randint(0, 10, (10, 8))
    assert [b.shape[0] for b in token_batches(ids, 4)] == [4, 4, 2]
    assert len(token_batches([ids[0], ids[1]], 4)) == 2
    assert torch.equal(token_batches({"input_ids": ids}, 16)[0], ids)
    with pytest.raises(ValueError, match="empty"):
        token_batches(ids[:0], 4)


@pytest.mark.parametrize("arch,overrides", [
    ("llama", {}), ("qwen2", {}),
    # layer 1 slides over 4 tokens, layer 0 attends to all: each block must be walked with its own mask (every block
    # had block 0's: layer 1 calibrated 22% off its real output)
    ("qwen2", dict(use_sliding_window=True, sliding_window=4, max_window_layers=1)),
    # dropout in a model left in training mode: calibration measures the eval-mode activations
    ("llama", dict(attention_dropout=0.5))])
def test_block_by_block_walk_reproduces_the_model(arch, overrides):
    model = tiny_model(arch, **overrides).train(bool(overrides.get("attention_dropout")))
    ids = torch.randint(0, 256, (6, 16))
    inputs, kwargs = capture_block_inputs(model, ids, batch_size=4)
    assert len(kwargs) == len(decoder_layers(model)) and all(len(kw) == 2 for kw in kwargs)
    assert [x.shape for x in inputs] == [(4, 16, 64), (2, 16, 64)]
    watch = {"mlp.down_proj": decoder_layers(model)[0].mlp.down_proj}
    for i, block in enumerate(decoder_layers(model)):
        inputs, stats = forward_block(block, inputs, kwargs[i], watch if i == 0 else None)
        if i == 0:
            st = stats["mlp.down_proj"]
            assert st.n == 6 * 16 and st.hessian.shape == (192, 192)
            torch.testing.assert_close(st.hessian, st.hessian.t())
    assert model.training == bool(overrides.get("attention_dropout"))  # the mode it was in
    with torch.no_grad():
        want = model.eval()(ids, output_hidden_states=True, use_cache=False).hidden_states[-1]  # after the final norm
    got = model.model.norm(torch.cat(inputs))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
