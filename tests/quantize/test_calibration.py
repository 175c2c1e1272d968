import json
import re

import pytest
import torch

from conftest import tiny_model
from nibble import QuantConfig
from nibble.models.architecture import decoder_layers
from nibble.quantize.calibration import (InputStats, calibration_batches, calibration_files, calibration_for,
                                         calibration_text, capture_block_inputs, forward_block, input_groups,
                                         quantize_blocks, source_data_files, token_batches)


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


@pytest.mark.parametrize("n_samples, seq_len", [(0, 16), (2, 1)])
def test_sizes_that_cut_no_window_of_two_tokens_are_refused_by_name(n_samples, seq_len):
    """A window of one token has no next token to predict: it calibrates nothing, and must be refused as zero
    samples are, naming both sizes, before the text is read."""
    with pytest.raises(ValueError, match=rf"^need n_samples >= 1 and seq_len >= 2, got n_samples={n_samples}, "
                                         rf"seq_len={seq_len}$"):
        calibration_batches(ByteTokenizer(), n_samples=n_samples, seq_len=seq_len)


def test_too_short_text_says_how_many_windows_it_does_hold(tmp_path):
    """The refusal's hint names the n_samples the text can give at this seq_len (its windows), not the n_samples
    asked for, which it just said it cannot give."""
    g = torch.Generator().manual_seed(5)
    words = [f"w{int(i)}" for i in torch.randint(0, 1000, (200,), generator=g)]
    path = tmp_path / "short.txt"
    path.write_text(" ".join(words)[:700])  # 700 bytes: 5 windows of 128 tokens
    assert calibration_batches(ByteTokenizer(), n_samples=5, seq_len=128, source=str(path)).shape == (5, 128)
    with pytest.raises(ValueError, match=r"has 700 tokens, too short for n_samples=8 windows of seq_len=128: that "
                                         r"needs at least 1024 tokens\. Use fewer samples \(it holds n_samples=5 at "
                                         r"this seq_len\)"):
        calibration_batches(ByteTokenizer(), n_samples=8, seq_len=128, source=str(path))


def test_one_evaluation_paragraph_is_counted_in_the_singular(tmp_path, monkeypatch):
    """The refusal counts the shared paragraphs: '1 paragraph of', '2 paragraphs of' (the other test's pattern takes
    either form)."""
    g = torch.Generator().manual_seed(6)
    paragraphs = [" ".join(f"word{int(i)}" for i in torch.randint(0, 10000, (40,), generator=g)) for _ in range(2)]
    (tmp_path / "data" / "wikitext2").mkdir(parents=True)
    test = tmp_path / "data" / "wikitext2" / "wiki.test.raw"
    test.write_text(" \n".join(paragraphs) + " \n")
    monkeypatch.setenv("NIBBLE_DATA", str(tmp_path / "data"))
    for shared, form in ((1, "paragraph"), (2, "paragraphs")):
        own = tmp_path / f"own{shared}.txt"
        own.write_text("other text " * 100 + "\n" + "\n".join(paragraphs[:shared]) + "\n")
        with pytest.raises(ValueError, match=rf"the evaluation set \({shared} {form} of {re.escape(str(test))}\)"):
            calibration_batches(ByteTokenizer(), n_samples=2, seq_len=16, source=str(own))


def test_an_evaluation_paragraph_of_exactly_the_threshold_length_is_refused(tmp_path, monkeypatch):
    """Lines of WikiText-2 test of at least 200 characters are its own: one of exactly 200 is refused, one of 199 (as
    short as a line of any text may be) is not."""
    from nibble.quantize.calibration import _EVALUATION_LINE

    g = torch.Generator().manual_seed(7)
    letters = "abcdefghijklmnopqrstuvwxyz "
    text = "".join(letters[int(i)] for i in torch.randint(0, len(letters), (2 * _EVALUATION_LINE,), generator=g))
    at = "x" + text[:_EVALUATION_LINE - 2] + "y"  # no blank at either end: strip() leaves it as it is
    below = "x" + text[_EVALUATION_LINE:2 * _EVALUATION_LINE - 3] + "y"
    assert (len(at), len(below)) == (_EVALUATION_LINE, _EVALUATION_LINE - 1)
    (tmp_path / "data" / "wikitext2").mkdir(parents=True)
    (tmp_path / "data" / "wikitext2" / "wiki.test.raw").write_text(f" {at} \n {below} \n")
    monkeypatch.setenv("NIBBLE_DATA", str(tmp_path / "data"))
    filler = "other text " * 100
    for line, refused in ((at, True), (below, False)):
        own = tmp_path / f"own{len(line)}.txt"
        own.write_text(f"{filler}\n{line}\n")
        if refused:
            with pytest.raises(ValueError, match=r"\(1 paragraph"):
                calibration_batches(ByteTokenizer(), n_samples=2, seq_len=16, source=str(own))
        else:
            assert calibration_batches(ByteTokenizer(), n_samples=2, seq_len=16, source=str(own)).shape == (2, 16)


def test_rtn_reads_no_calibration_file_and_the_calibrated_methods_read_c4():
    """require_data checks these before a model loads: an RTN run must not fail for a missing C4 excerpt it never
    reads, and a GPTQ/AWQ run must find it missing before the model is loaded."""
    assert calibration_files(None) == [] and calibration_files("rtn") == []
    assert calibration_files("gptq") == calibration_files("awq") == ["c4/c4_demo.jsonl"]


def test_a_folder_is_no_calibration_source(tmp_path):
    """A source is a name in SOURCES or a file: a folder (the data folder given for a file in it, say) is refused
    before any work, by name, not read as a text."""
    with pytest.raises(FileNotFoundError, match=rf"calibration source '{re.escape(str(tmp_path))}': neither one of "
                                                r"\['c4', 'gutenberg'\] nor a file"):
        source_data_files([str(tmp_path)])
    with pytest.raises(FileNotFoundError, match="nor a file"):
        calibration_text(str(tmp_path))


def test_token_batches_takes_one_1d_sequence_as_one_row_and_gives_long_ids():
    """A 1-D tensor is one sequence of tokens (a row), not that many sequences of one token; ids of another integer
    dtype (int32, as a tokenizer's numpy output) come back as the LongTensor an embedding needs."""
    g = torch.Generator().manual_seed(8)
    seq = torch.randint(1, 256, (12,), generator=g)
    (batch,) = token_batches(seq, 4)
    assert batch.shape == (1, 12) and torch.equal(batch[0], seq)
    ids = torch.randint(1, 256, (5, 8), generator=g, dtype=torch.int32)
    batches = token_batches(ids, 2)
    assert [b.dtype for b in batches] == [torch.long] * 3 and torch.equal(torch.cat(batches), ids.long())


def test_input_stats_are_the_hessian_and_mean_absolute_input_over_every_row():
    """H = 2/n X^T X and mean |x| over the rows of every batch added (n: rows, not batches): AWQ's scales come from
    mean |x|, where a signed mean lets inputs of either sign cancel."""
    g = torch.Generator().manual_seed(9)
    xs = [torch.randn(3, 5, 16, generator=g) * torch.linspace(0.1, 3, 16) for _ in range(2)]
    stats = InputStats()
    for x in xs:
        stats.add(x)
    X = torch.cat(xs).reshape(-1, 16)
    assert stats.n == 30
    torch.testing.assert_close(stats.hessian, 2 * X.t() @ X / 30)
    torch.testing.assert_close(stats.mean_abs, X.abs().mean(0))


def test_forward_block_without_outputs_stops_only_once_every_watched_linear_saw_each_batch():
    """keep_outputs=False stops a batch early, but not before the last watched linear (down_proj, at the block's end)
    has its input, in every batch; and the block is left in the mode it was in."""
    model = tiny_model("llama", attention_dropout=0.5)
    ids = torch.randint(0, 256, (6, 8), generator=torch.Generator().manual_seed(10))
    inputs, kwargs = capture_block_inputs(model, ids, batch_size=4)  # two batches
    block = decoder_layers(model)[0].train()
    watch = {"self_attn.q_proj": block.self_attn.q_proj, "mlp.down_proj": block.mlp.down_proj}
    outputs, stats = forward_block(block, inputs, kwargs[0], watch, keep_outputs=False)
    assert outputs is None and block.training and block.self_attn.training
    assert [stats[name].n for name in watch] == [6 * 8, 6 * 8]
    _, full = forward_block(block, inputs, kwargs[0], watch)  # the same statistics as the whole forward's
    for name in watch:
        torch.testing.assert_close(stats[name].hessian, full[name].hessian)
    assert block.training


def test_input_groups_keep_an_unknown_linear_alone_after_the_known_ones():
    """A linear outside the Llama families' names (a model's extra projection) is quantized too, alone: dropped
    from the groups, GPTQ and AWQ left it out of the results without a word."""
    names = ["extra.proj", "mlp.down_proj", "self_attn.k_proj", "self_attn.q_proj", "mlp.up_proj"]
    assert input_groups(names) == [["self_attn.q_proj", "self_attn.k_proj"], ["mlp.up_proj"], ["mlp.down_proj"],
                                   ["extra.proj"]]


@pytest.mark.parametrize("progress", [True, False])
def test_the_walk_shows_a_progress_bar_of_the_blocks_only_when_asked(progress, capsys):
    """quantize_blocks names its bar after the method (``desc``) and counts the decoder blocks; progress=False
    is silent."""
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (12, 16), generator=torch.Generator().manual_seed(11))  # 192 tokens: no warning
    seen = []

    def quantize_block(prefix, block, linears, groups, inputs, kwargs, results):
        seen.append(prefix)
        return forward_block(block, inputs, kwargs)[0]
    assert quantize_blocks(model, QuantConfig(method="gptq", group_size=32), ids, quantize_block, "Walking",
                           batch_size=4, progress=progress, onload=None) == {}
    assert seen == ["model.layers.0", "model.layers.1"]
    err = capsys.readouterr().err
    assert ("Walking" in err and "2/2" in err) if progress else "Walking" not in err


def test_the_walk_checks_its_calibration_before_it_runs_the_model():
    """quantize_blocks refuses windows of one token (position 0 alone calibrates nothing) as quantize_model does,
    for callers that give GPTQ or AWQ their calibration directly; no block is quantized."""
    model = tiny_model("llama")
    ids = torch.randint(0, 256, (200, 1), generator=torch.Generator().manual_seed(12))
    seen = []
    with pytest.raises(ValueError, match="calibration windows of seq_len=1 show the model position 0 alone"):
        quantize_blocks(model, QuantConfig(method="gptq", group_size=32), ids,
                        lambda prefix, *args: seen.append(prefix), "Walking", batch_size=4, progress=False, onload=None)
    assert seen == []


def test_check_statistics_refuses_any_of_its_statistics_not_finite():
    """Every statistic given is checked, not the first alone: AWQ passes the Hessian and mean |x|."""
    from nibble.quantize.calibration import check_statistics

    g = torch.Generator().manual_seed(19)
    H, mean = torch.rand(8, 8, generator=g) + 0.1, torch.rand(8, generator=g) + 0.1
    check_statistics(H, mean)
    for bad in (float("inf"), float("nan")):
        spoiled = mean.clone()
        spoiled[3] = bad
        with pytest.raises(ValueError, match="the statistics of its calibration inputs are not finite"):
            check_statistics(H, spoiled)
