import math
import warnings

import pytest
import torch

from conftest import tiny_model
from nibble.eval import data
from nibble.eval.data import DataFormatError
from nibble.eval.perplexity import (check_model_window, check_window, default_seq_len, encode, model_device,
                                    perplexity, wikitext2_perplexity, wikitext2_text)


class ByteTokenizer:
    """One token per UTF-8 byte (matches the 256-token tiny model)."""

    def encode(self, text, add_special_tokens=True):
        return list(text.encode("utf-8"))


def hand_nll(model, ids, seq_len):
    """Mean next-token NLL over full windows scored one at a time, log-softmax written out."""
    total, count = 0.0, 0
    for start in range(0, len(ids) - seq_len + 1, seq_len):
        window = torch.tensor(ids[start : start + seq_len])
        with torch.no_grad():
            logits = model(window[None]).logits[0].double()
        logprobs = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
        for t in range(seq_len - 1):
            total -= logprobs[t, window[t + 1]].item()
            count += 1
    return total / count, count


def test_perplexity_is_exp_of_mean_nll_over_full_windows_and_drops_the_tail():
    model = tiny_model()
    ids = torch.randint(0, 256, (50,)).tolist()  # 3 windows of 16, a 2-token tail
    nll, count = hand_nll(model, ids, 16)

    out = perplexity(model, ids, seq_len=16, progress=False)

    assert out["windows"] == 3 and out["tokens"] == count == 3 * 15 and out["seq_len"] == 16
    assert out["nll"] == pytest.approx(nll, rel=1e-5)
    assert out["ppl"] == pytest.approx(math.exp(nll), rel=1e-5)
    other_tail = ids[:48] + [7, 9]
    assert perplexity(model, other_tail, seq_len=16, progress=False)["nll"] == pytest.approx(out["nll"], rel=1e-6)


def test_a_mean_nll_past_the_range_of_exp_is_an_infinite_perplexity():
    """math.exp of a mean NLL past ~709.8 raised OverflowError: `nibble eval ppl` of a model whose logits are huge
    (a broken quantization) was a traceback, a report's config a failure. Its perplexity is infinite, its NLL kept."""
    model = tiny_model()
    with torch.no_grad():
        model.model.norm.weight.mul_(1e5)  # logits ~1e5 apart: a wrong token costs that much
    ids = torch.randint(0, 256, (33,)).tolist()
    nll, _ = hand_nll(model, ids, 16)
    out = perplexity(model, ids, seq_len=16, progress=False)
    assert nll > 710 and out["nll"] == pytest.approx(nll, rel=1e-5) and out["ppl"] == math.inf
    with torch.no_grad():
        model.model.norm.weight[0] = math.nan  # logits not finite: a NaN perplexity, not an infinite one
    out = perplexity(model, ids, seq_len=16, progress=False)
    assert math.isnan(out["nll"]) and math.isnan(out["ppl"])


@pytest.mark.parametrize("memory, batch_size, says", [
    (3 * 16 * 256 * 4 - 1, 3, r"a forward pass of 3 windows of 16 tokens \(batch_size=3\) makes 48.00 KiB of logits "
                              r"\(256 float32 values a token\), more than a test's 48.00 KiB: give a smaller "
                              r"batch_size \(each of the windows: 16.00 KiB\)"),
    (3 * 16 * 256 * 4 - 1, 8, r"of 3 windows of 16 tokens \(batch_size=8\)"),  # the stream's 3 windows, not 8
    (16 * 256 * 4 - 1, 1, "give a shorter seq_len"), (3 * 16 * 256 * 4, 3, None)])
def test_a_batch_whose_logits_exceed_the_memory_is_refused_in_its_sizes(memory, batch_size, says, monkeypatch):
    """`nibble eval ppl --batch-size 64` of SmolLM2 on a 23 GiB CPU asked for 24 GiB of logits: the process was
    killed without a word."""
    import nibble.eval.perplexity as ppl

    bounds = []
    monkeypatch.setattr(ppl, "memory_bound", lambda device: bounds.append(device) or (memory, "a test's 48.00 KiB"))
    model = tiny_model()
    ids = torch.randint(0, 256, (3 * 16 + 5,))
    if says:
        with pytest.raises(ValueError, match=says):
            perplexity(model, ids, seq_len=16, batch_size=batch_size, progress=False)
    else:
        assert perplexity(model, ids, seq_len=16, batch_size=batch_size, progress=False)["windows"] == 3
    assert bounds == [torch.device("cpu")]


def test_batched_windows_give_the_unbatched_perplexity():
    model = tiny_model()
    ids = torch.randint(0, 256, (5 * 24 + 3,))
    one = perplexity(model, ids, seq_len=24, batch_size=1, progress=False)
    many = perplexity(model, ids, seq_len=24, batch_size=3, progress=False)  # batches of 3 and 2
    assert many["nll"] == pytest.approx(one["nll"], rel=1e-5)
    assert many["windows"] == one["windows"] == 5


@pytest.mark.parametrize("tokens, batch_size, bar", [(16, 1, None), (32, 2, None), (32, 1, "2/2")])
def test_a_bar_shows_only_where_the_windows_take_several_forward_passes(tokens, batch_size, bar, capsys):
    """One pass (one window, or a batch of them all) showed a bar at 0 for all of it, then at the end."""
    perplexity(tiny_model(), list(range(tokens)), seq_len=16, batch_size=batch_size)
    err = capsys.readouterr().err
    assert ("perplexity: 100%" in err and f"{bar} [" in err) if bar else err == ""


def test_stream_shorter_than_one_window_is_a_clear_error():
    with pytest.raises(ValueError, match="fewer than one window of seq_len=32"):
        perplexity(tiny_model(), list(range(20)), seq_len=32, progress=False)


def test_wikitext2_text_is_the_gptq_join_of_hf_rows():
    text = wikitext2_text()
    # HF rows: "", " = Robert Boulter = \n", "", " Robert Boulter is ..."
    assert text.startswith("\n\n = Robert Boulter = \n\n\n\n\n Robert Boulter is an English film")
    assert "\n\n \n\n" not in text  # no empty row is left as the raw file's " \n"


@pytest.mark.parametrize("seq_len", [128, 65])  # 65: one position past the context is clamped too
def test_seq_len_beyond_the_model_context_warns_and_is_clamped(seq_len):
    model = tiny_model(max_position_embeddings=64)
    with pytest.warns(UserWarning, match=f"seq_len={seq_len} exceeds the model's context") as record:
        out = wikitext2_perplexity(model, ByteTokenizer(), seq_len=seq_len, max_tokens=200, progress=False)
    assert record[0].filename == __file__  # its fixed stacklevel named wikitext2_perplexity's call of perplexity
    assert out["seq_len"] == 64 and out["windows"] == 3  # 200 tokens -> 3 windows, 8-token tail dropped

    ids = ByteTokenizer().encode(wikitext2_text())[:200]
    assert out["nll"] == pytest.approx(hand_nll(model, ids, 64)[0], rel=1e-5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a window exactly the context runs as given
        at_context = wikitext2_perplexity(model, ByteTokenizer(), seq_len=64, max_tokens=200, progress=False)
    assert at_context["seq_len"] == 64 and at_context["nll"] == out["nll"]


def test_default_seq_len_is_the_context_capped_at_2048_and_at_max_tokens():
    tok = ByteTokenizer()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no clamping warning on the default path
        small = wikitext2_perplexity(tiny_model(max_position_embeddings=64), tok, max_tokens=130, progress=False)
        out = wikitext2_perplexity(tiny_model(max_position_embeddings=4096), tok, max_tokens=100, progress=False)
    assert small["seq_len"] == 64 and small["windows"] == 2
    assert out["seq_len"] == 100 and out["windows"] == 1


def test_the_default_window_is_2048_where_the_context_and_the_stream_are_longer():
    """The published protocol's window: a model of a longer context is not scored on longer (easier) windows."""
    assert default_seq_len(tiny_model(max_position_embeddings=4096), 10_000) == 2048
    assert default_seq_len(tiny_model(max_position_embeddings=1024), 10_000) == 1024
    assert default_seq_len(tiny_model(max_position_embeddings=4096), 1500) == 1500


def test_wikitext2_is_tokenized_once_as_a_whole_with_the_tokenizers_special_tokens():
    """The protocol tokenizes the whole split once with the tokenizer's defaults (a Llama tokenizer's BOS first);
    the byte tokenizer of the other tests ignores the flag."""
    calls = []

    class BosTokenizer:
        def encode(self, text, add_special_tokens=True):
            calls.append((len(text), add_special_tokens))
            return [1] * add_special_tokens + list(text.encode("utf-8"))

    out = wikitext2_perplexity(tiny_model(), BosTokenizer(), seq_len=16, max_tokens=64, progress=False)
    assert calls == [(len(wikitext2_text()), True)] and out["windows"] == 4


def test_missing_data_file_names_the_file_the_folders_and_the_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("NIBBLE_DATA", str(tmp_path / "nowhere"))
    monkeypatch.setattr(data, "_REPO", tmp_path / "repo")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as err:
        wikitext2_text()
    msg = str(err.value)
    assert "wikitext2/wiki.test.raw" in msg
    assert str(tmp_path / "nowhere") in msg and str(tmp_path / "shared" / "data") not in msg
    assert "set NIBBLE_DATA" in msg and "only it is searched while NIBBLE_DATA is set" in msg
    monkeypatch.delenv("NIBBLE_DATA")
    with pytest.raises(FileNotFoundError) as err:
        wikitext2_text()
    msg = str(err.value)
    assert str(tmp_path / "shared" / "data") in msg and "set NIBBLE_DATA" in msg
    # an installed nibble has no checkout whose ../shared/data to search or to name in the fix
    assert "checkout" not in msg
    assert data.search_dirs() == [tmp_path.parent / "shared" / "data", tmp_path / "shared" / "data"]
    (tmp_path / "repo" / "nibble").mkdir(parents=True)
    (tmp_path / "repo" / "pyproject.toml").write_text("")
    with pytest.raises(FileNotFoundError, match="next to the nibble checkout"):
        wikitext2_text()


def test_nibble_data_env_is_searched_first(monkeypatch, tmp_path):
    (tmp_path / "wikitext2").mkdir()
    (tmp_path / "wikitext2" / "wiki.test.raw").write_text(" \n = A = \n \n b c \n", encoding="utf-8")
    monkeypatch.setenv("NIBBLE_DATA", str(tmp_path))
    assert wikitext2_text() == "\n\n".join(["", " = A = \n", "", " b c \n"])


def test_a_copy_with_windows_line_ends_reads_as_the_same_text_and_an_empty_one_is_named(monkeypatch, tmp_path):
    """CRLF rows kept their "\\r" (15.75 for 15.15); an empty file was "seq_len must be at least 2 ..., got 0"."""
    rows = " \n = A = \n \n b c\rd \n"  # a lone \r inside a row is the row's own
    (tmp_path / "wikitext2").mkdir()
    monkeypatch.setenv("NIBBLE_DATA", str(tmp_path))
    path = tmp_path / "wikitext2" / "wiki.test.raw"
    path.write_bytes(rows.encode())
    lf = wikitext2_text()
    path.write_bytes(rows.replace("\n", "\r\n").encode())
    assert wikitext2_text() == lf and "b c\rd" in lf
    for empty in ("", " \n \n"):
        path.write_text(empty)
        with pytest.raises(DataFormatError, match="wiki.test.raw: no text in it"):
            wikitext2_perplexity(tiny_model(), ByteTokenizer(), progress=False)


def test_an_empty_batch_or_a_stream_too_short_to_predict_a_token_is_a_clear_error(monkeypatch):
    monkeypatch.setattr("nibble.eval.perplexity.wikitext2_text", lambda: "no file read")
    with pytest.raises(ValueError, match="batch_size must be an integer >= 1, got 0"):
        perplexity(tiny_model(), list(range(40)), seq_len=16, batch_size=0, progress=False)
    for n in (0, 1):  # it was "seq_len must be at least 2 ..., got 0": the window max_tokens shrank it to
        with pytest.raises(ValueError, match=rf"max_tokens must be an integer >= 2, got {n}"):
            wikitext2_perplexity(tiny_model(), ByteTokenizer(), max_tokens=n, progress=False)


@pytest.mark.parametrize("kwargs", [dict(seq_len=16.0), dict(max_tokens=512.0), dict(seq_len=1), dict(seq_len=True),
                                    dict(batch_size=1.5)])
def test_a_window_or_batch_that_is_not_a_whole_count_is_named(monkeypatch, kwargs):
    """seq_len=256.0 or max_tokens=512.0 failed as the slice's bare "slice indices must be integers"; they are
    refused by name, before the text is tokenized."""
    monkeypatch.setattr("nibble.eval.perplexity.wikitext2_text", lambda: "no file read")
    (name, value), = kwargs.items()
    least = 1 if name == "batch_size" else 2
    with pytest.raises(ValueError, match=rf"^{name} must be an integer >= {least}, got {value!r}$"):
        wikitext2_perplexity(tiny_model(), ByteTokenizer(), progress=False, **kwargs)
    if name != "max_tokens":
        with pytest.raises(ValueError, match=rf"^{name} must be an integer >= {least}, got {value!r}$"):
            perplexity(tiny_model(), list(range(40)), **{"seq_len": 16, **kwargs}, progress=False)


@pytest.mark.parametrize("ids, message", [
    (list(range(300)), r"^the stream's token ids run from 0 to 299, but the model's vocabulary has 256 tokens: "),
    ([-1] * 40, r"^the stream's token ids run from -1 to -1, but the model's vocabulary has 256"),
    ([1.7] * 40, r"^token_ids must be integer token ids, got torch.float32$"),
    (torch.ones(40, dtype=torch.bool), r"^token_ids must be integer token ids, got torch.bool$"),
])
def test_ids_outside_the_vocabulary_or_not_integers_are_named(ids, message):
    """Ids past the vocabulary failed as the embedding's "IndexError: index out of range in self"; float ids were
    truncated to integers and scored."""
    with pytest.raises(ValueError, match=message):
        perplexity(tiny_model(), ids, seq_len=16, progress=False)


@pytest.mark.parametrize("device, message", [
    ("gpu", "device 'gpu' is not a device torch knows"),
    pytest.param("cuda", "device 'cuda' asked for, but no CUDA GPU is visible",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without a GPU")),
])
def test_a_device_is_resolved_as_every_entry_point_resolves_it(device, message):
    """perplexity took its device as torch.device(device): "gpu" gave torch's list of every device type, and "cuda"
    without a GPU "Torch not compiled with CUDA enabled"."""
    with pytest.raises(ValueError, match=message):
        perplexity(tiny_model(), list(range(40)), seq_len=16, device=device, progress=False)


def test_nibble_data_is_the_only_folder_searched_where_it_is_set(monkeypatch, tmp_path):
    """A NIBBLE_DATA that lacks a file (or is no folder: a typo) had the copy further down the search read, with a
    warning lost among progress bars; it is now an error naming it, as a missing file is."""
    env, fallback = tmp_path / "env", tmp_path / "shared" / "data"
    (fallback / "wikitext2").mkdir(parents=True)
    (fallback / "wikitext2" / "wiki.test.raw").write_text(" b c \n", encoding="utf-8")
    env.mkdir()
    monkeypatch.setattr(data, "_REPO", tmp_path / "repo")
    monkeypatch.chdir(tmp_path)
    for named in (env, tmp_path / "nowhere"):
        monkeypatch.setenv("NIBBLE_DATA", str(named))
        with pytest.raises(FileNotFoundError, match=f"Searched:\n  {named}  \\(NIBBLE_DATA\\)"):
            data.data_file("wikitext2/wiki.test.raw")
    monkeypatch.setenv("NIBBLE_DATA", str(fallback))
    assert data.data_file("wikitext2/wiki.test.raw") == fallback / "wikitext2" / "wiki.test.raw"
    monkeypatch.delenv("NIBBLE_DATA")
    assert data.data_file("wikitext2/wiki.test.raw") == fallback / "wikitext2" / "wiki.test.raw"


class Logits(torch.nn.Module):
    """Not a Hugging Face model: token 0 predicts itself at logit 0 and token 1 at ``gap``, so every prediction of a
    stream of zeros costs log(1 + e^gap), about ``gap`` nats."""

    def __init__(self, gap):
        super().__init__()
        self.gap = gap

    def forward(self, input_ids):
        logits = torch.zeros(*input_ids.shape, 2)
        logits[..., 1] = self.gap
        return logits


@pytest.mark.parametrize("gap", [705.0, 709.7, 710.0])
def test_a_mean_nll_just_inside_the_range_of_exp_is_a_finite_perplexity(gap):
    """Only past float64's largest exp (log(1.797e308) = 709.78) is a perplexity infinite: 705 or 709.7 a token is
    a finite one, exp of the mean NLL."""
    out = perplexity(Logits(gap), [0] * 32, seq_len=16, progress=False)
    assert out["nll"] == pytest.approx(gap, rel=1e-6)
    if gap < 709.78:
        assert math.isfinite(out["ppl"]) and out["ppl"] == pytest.approx(math.exp(out["nll"]), rel=1e-9)
    else:
        assert out["ppl"] == math.inf


def test_a_module_that_returns_a_models_output_is_scored_by_its_logits():
    """A wrapper that is no PreTrainedModel (a PEFT model after QAT) returns the model's output object, not a tensor:
    its ``logits`` are scored, as the wrapped model's."""

    class Wrapper(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, input_ids):
            return self.inner(input_ids)

    model = tiny_model()
    ids = torch.randint(0, 256, (40,)).tolist()
    wrapped = perplexity(Wrapper(model), ids, seq_len=16, progress=False)
    assert wrapped["nll"] == pytest.approx(perplexity(model, ids, seq_len=16, progress=False)["nll"], rel=1e-6)


def test_a_hugging_face_model_is_run_without_a_kv_cache():
    """Each window is scored once: a KV cache filled alongside (a 2048-token batch of a 7B model: GBs) is never read."""
    model, calls = tiny_model(), []
    forward = model.forward
    model.forward = lambda *args, **kwargs: calls.append(kwargs.get("use_cache")) or forward(*args, **kwargs)
    perplexity(model, list(range(40)), seq_len=16, batch_size=2, progress=False)
    assert calls == [False]


def test_the_input_ids_go_to_the_device_of_the_models_first_parameter():
    meta = torch.nn.Linear(2, 2, device="meta")
    assert model_device(meta) == torch.device("meta")
    assert model_device(Logits(1.0)) == torch.device("cpu")  # no parameters: the CPU


@pytest.fixture(scope="module")
def letter_tokenizer():
    """A `tokenizers.Tokenizer` of one token a letter, and the same one as a Hugging Face tokenizer of a 4-token
    context."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    raw = Tokenizer(models.WordLevel({**{chr(97 + i): i for i in range(26)}, "[UNK]": 26}, unk_token="[UNK]"))
    raw.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return raw, PreTrainedTokenizerFast(tokenizer_object=raw, model_max_length=4)


def test_a_tokenizers_tokenizer_encodes_to_its_ids_as_the_hugging_face_one(letter_tokenizer):
    raw, hf = letter_tokenizer
    ids = encode(raw, "abcz", add_special_tokens=False)
    assert ids == encode(hf, "abcz", add_special_tokens=False) == [0, 1, 2, 25]


def test_encoding_a_text_longer_than_the_tokenizers_context_says_nothing(letter_tokenizer):
    """A corpus is one text, cut into windows afterwards: transformers' "Token indices sequence length is longer than
    the specified maximum sequence length ... will result in indexing errors" would only mislead."""
    import logging

    from transformers.utils import logging as hf_logging

    _, hf = letter_tokenizer
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = hf_logging.get_logger("transformers.tokenization_utils_base")
    logger.addHandler(handler)
    try:
        assert encode(hf, "abcdefghij", add_special_tokens=False) == list(range(10))
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in records] == []


def test_windows_are_scored_with_dropout_off_without_autograd_and_the_callers_mode_is_kept():
    """Scored right after QAT, a model in training mode had its attention dropout on; the caller's mode comes back
    after, and no autograd graph is kept of the forward passes."""
    model = tiny_model(attention_dropout=0.5)
    ids = torch.randint(0, 256, (48,)).tolist()
    in_inference = []
    model.register_forward_hook(lambda module, args, out: in_inference.append(torch.is_inference_mode_enabled()))
    scored = perplexity(model, ids, seq_len=16, progress=False)["nll"]
    assert not model.training and in_inference == [True] * 3
    model.train()
    assert perplexity(model, ids, seq_len=16, progress=False)["nll"] == pytest.approx(scored, rel=1e-6)
    assert model.training
    with torch.no_grad():  # it is on: a training-mode forward is another one
        assert not torch.equal(model(torch.tensor([ids[:16]])).logits, model.eval()(torch.tensor([ids[:16]])).logits)


def test_a_stream_given_as_a_batch_of_one_row_is_scored_as_the_flat_stream():
    """`tokenizer(text, return_tensors="pt").input_ids` is [1, n]: its windows are those of the n tokens, the tail
    dropped as well."""
    model = tiny_model()
    ids = torch.randint(0, 256, (50,))
    flat = perplexity(model, ids.tolist(), seq_len=16, progress=False)
    assert perplexity(model, ids[None], seq_len=16, progress=False) == flat and flat["windows"] == 3


def test_the_bar_counts_windows_whatever_the_batch_and_wikitext2_passes_its_batch_and_progress_on(capsys, monkeypatch):
    """3 windows in batches of 2 are 3 windows done (not 2 passes); `wikitext2_perplexity` runs the batches it is
    given (one forward pass each) and shows no bar where it is told not to."""
    perplexity(tiny_model(), list(range(48)), seq_len=16, batch_size=2)
    err = capsys.readouterr().err
    assert "perplexity: 100%" in err and " 3/3 [" in err
    monkeypatch.setattr("nibble.eval.perplexity.wikitext2_text", lambda: "abcdefgh" * 8)
    model, rows = tiny_model(), []
    model.register_forward_hook(lambda module, args, out: rows.append(len(out.logits)))
    out = wikitext2_perplexity(model, ByteTokenizer(), seq_len=16, batch_size=3, progress=False)
    assert out["windows"] == 4 and rows == [3, 1] and capsys.readouterr().err == ""


@pytest.mark.parametrize("dtype,windows,length,rel", [(torch.float32, 40, 8, 1e-12), (torch.bfloat16, 4, 16, 1e-9)])
def test_each_windows_loss_is_taken_in_float32_and_summed_in_float64(dtype, windows, length, rel):
    """A 16-bit model's logits are cast to float32 for the cross-entropy (bf16's 8 bits of mantissa rounded each
    window's summed loss by up to 0.4%), and the windows' losses are summed in float64 (over the thousands of
    windows of WikiText-2 a float32 sum drifts in the 7th digit): to the last bit a float64 sum leaves."""
    model = tiny_model(dtype=dtype)
    ids = torch.randint(0, 256, (windows * length,))
    rows = ids.view(windows, length)
    with torch.no_grad():
        logits = model(rows).logits
    by_hand = sum(torch.nn.functional.cross_entropy(row[:-1].float(), w[1:], reduction="sum").double().item()
                  for row, w in zip(logits, rows))
    out = perplexity(model, ids, seq_len=length, batch_size=windows, progress=False)
    assert out["nll"] == pytest.approx(by_hand / (windows * (length - 1)), rel=rel, abs=0)


def test_the_logits_memory_is_counted_in_the_models_dtype_and_a_model_without_one_is_not_checked(monkeypatch):
    """3 windows of 16 tokens of a 256-token vocabulary are 24 KiB of bfloat16 logits (48 KiB of float32 ones). A
    module with a config's vocabulary but no dtype is not checked, as one without a config."""
    import nibble.eval.perplexity as ppl

    ids = torch.randint(0, 256, (48,))
    model = tiny_model(dtype=torch.bfloat16)
    monkeypatch.setattr(ppl, "memory_bound", lambda device: (3 * 16 * 256 * 2, "a test's bytes"))
    assert perplexity(model, ids, seq_len=16, batch_size=3, progress=False)["windows"] == 3
    monkeypatch.setattr(ppl, "memory_bound", lambda device: (3 * 16 * 256 * 2 - 1, "a test's bytes"))
    with pytest.raises(ValueError, match=r"makes 24.00 KiB of logits \(256 bfloat16 values a token\)"):
        perplexity(model, ids, seq_len=16, batch_size=3, progress=False)
    no_dtype = Logits(1.0)
    no_dtype.config = type("Config", (), {"vocab_size": 2})()
    assert perplexity(no_dtype, [0] * 48, seq_len=16, batch_size=3, progress=False)["windows"] == 3


def test_a_memory_that_holds_exactly_one_windows_logits_asks_for_a_smaller_batch(monkeypatch):
    """One window fits (its logits equal the bound, not more): the fix is a smaller batch, not a shorter window."""
    import nibble.eval.perplexity as ppl

    monkeypatch.setattr(ppl, "memory_bound", lambda device: (16 * 256 * 4, "a test's bytes"))
    with pytest.raises(ValueError, match=r"give a smaller batch_size \(each of the windows: 16.00 KiB\)$"):
        perplexity(tiny_model(), list(range(48)), seq_len=16, batch_size=3, progress=False)
    assert perplexity(tiny_model(), list(range(48)), seq_len=16, batch_size=1, progress=False)["windows"] == 3


def test_a_copy_without_its_last_line_end_keeps_its_last_row_and_one_of_empty_lines_is_named(monkeypatch, tmp_path):
    """The last row of a copy whose final newline was lost is read as the row it is; a file of line ends alone holds no
    text, as an empty one."""
    (tmp_path / "wikitext2").mkdir()
    monkeypatch.setenv("NIBBLE_DATA", str(tmp_path))
    path = tmp_path / "wikitext2" / "wiki.test.raw"
    path.write_text(" \n = A = \n b c", encoding="utf-8")
    assert wikitext2_text() == "\n\n".join(["", " = A = \n", " b c"])
    path.write_text("\n\n\n", encoding="utf-8")
    with pytest.raises(DataFormatError, match="wiki.test.raw: no text in it"):
        wikitext2_text()


def test_a_default_window_for_a_model_without_a_context_asks_for_seq_len():
    with pytest.raises(ValueError, match=r"^The model has no config.max_position_embeddings; pass seq_len explicitly"):
        default_seq_len(Logits(1.0), 1000)


def test_a_cut_shorter_than_the_window_it_would_score_is_refused_in_the_callers_names():
    """The window is seq_len clamped to the context: a cut of exactly one window scores it, one token less scores
    nothing. Without a window or a cut there is nothing to check."""
    names = ("--seq-len", "--max-tokens")
    for seq_len, max_tokens, context in [(None, 10, 64), (64, None, 32), (None, None, None), (64, 64, None),
                                         (64, 32, 32), (64, 64, 128)]:
        check_window(seq_len, max_tokens, names, context)
    with pytest.raises(ValueError, match=r"^--max-tokens 63 is fewer tokens than one window of --seq-len 64: no window "
                                         r"would be scored; give --max-tokens >= 64, or a shorter --seq-len$"):
        check_window(64, 63, names)
    with pytest.raises(ValueError, match=r"^max_tokens 31 is fewer tokens than one window of seq_len 64 \(clamped to "
                                         r"the model's context, 32\): no window would be scored; give max_tokens >= 32, "):
        check_window(64, 31, context=32)


def test_a_models_window_is_checked_against_the_context_its_config_says(monkeypatch):
    """Read from its config before the model loads, and only where there is a window and a cut to check."""
    import nibble.models.loading as loading

    read = []
    monkeypatch.setattr(loading, "model_context", lambda path: read.append(path) or 32)
    check_model_window("a/model", 64, 32, ("seq_len", "max_tokens"))  # one window of the 32-token context
    with pytest.raises(ValueError, match=r"max_tokens 31 .* \(clamped to the model's context, 32\)"):
        check_model_window("a/model", 64, 31, ("seq_len", "max_tokens"))
    check_model_window("a/model", 64, None, ("seq_len", "max_tokens"))
    check_model_window("a/model", None, 31, ("seq_len", "max_tokens"))
    assert read == ["a/model", "a/model"]
