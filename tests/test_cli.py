"""The `nibble` command end to end on a tiny local model directory (no network, seconds)."""
import json
import math
import re
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import tiny_model
from nibble.cli import build_parser, main


def _tiny_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator(["the capital of france is paris", "a haiku about the sea", "[INST] [/INST]"] * 20,
                            trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def test_a_chat_prompt_holds_one_bos_when_the_template_and_the_tokenizer_both_write_it():
    """Llama's and Mistral's tokenizers add BOS to every text and their templates begin with it: the rendered
    template, tokenized again with the tokenizer's own, gave the model two."""
    from tokenizers import processors

    from nibble.cli import _prompt_ids
    tok = _tiny_tokenizer()
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}")
    chat = _prompt_ids(tok, "the capital of france", chat=True)
    assert chat == list(tok.apply_chat_template([{"role": "user", "content": "the capital of france"}],
                                                add_generation_prompt=True, tokenize=True, return_dict=False))
    assert chat.count(tok.bos_token_id) == 1
    assert _prompt_ids(tok, "the capital", chat=False)[0] == tok.bos_token_id  # no template: the tokenizer's BOS


def test_a_prompt_past_the_tokenizers_maximum_is_tokenized_without_transformers_warning():
    """transformers logged "Token indices sequence length is longer than the specified maximum ... will result in
    indexing errors" before nibble's own one-line refusal of a prompt that fills the context."""
    import logging

    from nibble.cli import _prompt_ids
    tok = _tiny_tokenizer()
    tok.model_max_length = 4
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("transformers").addHandler(handler)
    try:
        ids = _prompt_ids(tok, "the capital of france is a city", chat=False)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    assert len(ids) > 4 and ids == tok("the capital of france is a city").input_ids and not said, said


@pytest.mark.parametrize("template", ["{% if messages %}{{ messages[0]['content'] }}",  # does not compile
                                      "{{ raise_exception('roles must alternate') }}"])  # raises, as Mistral's do
def test_a_chat_template_that_fails_is_said_with_the_way_around_it(template):
    """jinja's TemplateSyntaxError, or the template's own TemplateError, was a traceback at the first prompt."""
    from nibble.cli import _prompt_ids
    tok = _tiny_tokenizer()
    tok.chat_template = template
    with pytest.raises(ValueError, match=r"the model's chat template fails \(.+\): fix it, or prompt without it "
                                         "with --no-chat"):
        _prompt_ids(tok, "the capital", chat=True)
    assert _prompt_ids(tok, "the capital", chat=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tok = _tiny_tokenizer()
    d = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    tiny_model(vocab_size=len(tok)).save_pretrained(d)
    tok.save_pretrained(d)
    return d


def test_generate_quantize_info_roundtrip(model_dir, tmp_path, capsys):
    main(["generate", "the capital", "--model", str(model_dir), "--device", "cpu", "--group-size", "32",
          "--max-new-tokens", "4", "--no-chat"])
    assert capsys.readouterr().out.strip()
    out = tmp_path / "q"
    main(["quantize", "--model", str(model_dir), "--device", "cpu", "--group-size", "32", "--out", str(out)])
    said = capsys.readouterr().out  # 4 bits + fp16 scale and zero per 32 weights = 0.3125x
    # the 2 layers' linears: 98,304 weights, 0.1875 MiB in 16 bits
    assert said == f"saved {out}: quantized linears 0.1 MiB (0.312x of 0.2 MiB in 16 bits)\n", said
    main(["info", str(out)])
    info = json.loads(capsys.readouterr().out)
    assert info["quantization_config"]["group_size"] == 32 and info["bytes_saved"] > 0
    assert info["ratio"] == 0.3125  # to 4 places, as the saved line's 0.312x (2 places said 0.31)
    assert next(iter(info)) == "checkpoint_format" and info["checkpoint_format"] == "nibble"
    # the tied lm_head counted once, as the file holds it (it was counted twice: SmolLM2's 173 MB read as 286)
    size = (out / "model.safetensors").stat().st_size
    assert info["total_state_bytes"] < size < 1.2 * info["total_state_bytes"]
    assert info["weight_file_bytes"] == size and info["dtype"] == "float32"
    main(["generate", "the capital", "--model", str(out), "--device", "cpu", "--max-new-tokens", "3", "--no-chat"])
    assert capsys.readouterr().out.strip()


def test_home_relative_paths_after_an_equals_sign_are_expanded(model_dir, tmp_path, monkeypatch, capsys):
    """A shell leaves "~" as it is in "--model=~/ckpt": the CLI's checks read it as a folder named "~" (a quantized
    checkpoint was taken for a float model)."""
    import shutil
    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(model_dir, tmp_path / "m")
    main(["quantize", "--model=~/m", "--device", "cpu", "--group-size", "32", "--out=~/q"])
    main(["generate", "the capital", "--model=~/q", "--device", "cpu", "--max-new-tokens", "2", "--no-chat"])
    assert (tmp_path / "q" / "model.safetensors").exists() and capsys.readouterr().out.strip()


def test_awq_and_gptq_checkpoints_are_written_and_run_from_the_cli(model_dir, tmp_path, capsys):
    from nibble import load_quantized

    awq, gptq = tmp_path / "awq", tmp_path / "gptq"
    main(["quantize", "--model", str(model_dir), "--device", "cpu", "--group-size", "32", "--format", "awq",
          "--out", str(awq)])
    capsys.readouterr()
    assert json.loads((awq / "config.json").read_text())["quantization_config"]["quant_method"] == "awq"
    main(["info", str(awq)])
    info = json.loads(capsys.readouterr().out)
    assert info["quantization_config"]["imported_from"]["quant_method"] == info["checkpoint_format"] == "awq"
    main(["generate", "the capital", "--model", str(awq), "--device", "cpu", "--max-new-tokens", "3", "--no-chat"])
    assert capsys.readouterr().out.strip()
    # a quantized --model is written in the other format as it is, not quantized again
    main(["quantize", "--model", str(awq), "--device", "cpu", "--format", "gptq", "--out", str(gptq)])
    ids = torch.randint(0, 300, (1, 9))
    with torch.no_grad():
        assert torch.equal(load_quantized(awq)[0](ids).logits, load_quantized(gptq)[0](ids).logits)
    with pytest.raises(SystemExit, match="nibble quantize: --format awq holds W4A16 weights"):
        main(["quantize", "--model", str(model_dir), "--quant", "w4a4", "--format", "awq", "--out", str(tmp_path / "x")])


@pytest.mark.parametrize("fmt", ["nibble", "awq"])
def test_info_reads_no_tokenizer(model_dir, tmp_path, capsys, fmt):
    """It prints what the weights hold, yet loaded the tokenizer too, and refused a checkpoint whose tokenizer.json
    was damaged."""
    out = tmp_path / "q"
    main(["quantize", "--model", str(model_dir), "--device", "cpu", "--group-size", "32", "--format", fmt,
          "--out", str(out)])
    capsys.readouterr()
    (out / "tokenizer.json").write_text("{")
    main(["info", str(out)])
    assert json.loads(capsys.readouterr().out)["quantization_config"]["group_size"] == 32


@pytest.mark.parametrize("damage", ['{"eos_token_id": [2, ', "[2, 7]"])
def test_info_reports_beside_a_damaged_generation_config(model_dir, tmp_path, capsys, damage):
    """info prints what the weights hold, yet a cut generation_config.json failed it, and one holding a list with a
    TypeError traceback; it reads the weights' headers alone now, so it does not read that file at all (the load
    says it in a warning)."""
    import warnings
    out = tmp_path / "q"
    main(["quantize", "--model", str(model_dir), "--device", "cpu", "--group-size", "32", "--out", str(out)])
    capsys.readouterr()
    (out / "generation_config.json").write_text(damage)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        main(["info", str(out)])
    assert json.loads(capsys.readouterr().out)["quantization_config"]["group_size"] == 32


def test_quantize_lm_head_from_the_cli(model_dir, tmp_path, capsys):
    out = tmp_path / "q"
    main(["quantize", "--model", str(model_dir), "--device", "cpu", "--group-size", "32", "--quantize-lm-head",
          "--out", str(out)])
    assert "the tied lm_head as 0" in capsys.readouterr().out  # what the 16-bit figure holds of the head
    main(["info", str(out)])
    info = json.loads(capsys.readouterr().out)
    assert info["quantized_linears"] == 2 * 7 + 1 and info["quantization_config"]["modules_to_not_convert"] == []
    # the head adds its quantized bytes to the model (the embedding keeps the tied table): less saved, not more
    main(["quantize", "--model", str(model_dir), "--device", "cpu", "--group-size", "32", "--out", str(tmp_path / "p")])
    capsys.readouterr()
    main(["info", str(tmp_path / "p")])
    plain = json.loads(capsys.readouterr().out)
    added = info["total_state_bytes"] - plain["total_state_bytes"]
    assert added > 0 and info["bytes_saved"] == plain["bytes_saved"] - added


def test_w4a4_with_rotation_from_the_cli(model_dir, capsys, monkeypatch):
    from nibble.models import convert

    configs, quantize = [], convert.quantize_model
    monkeypatch.setattr(convert, "quantize_model", lambda model, config, **kw: configs.append(config) or
                        quantize(model, config, **kw))
    main(["generate", "the sea", "--model", str(model_dir), "--device", "cpu", "--quant", "w4a4", "--rotate",
          "--max-new-tokens", "3", "--no-chat"])
    assert capsys.readouterr().out.strip()
    assert [(c.mode, c.rotation) for c in configs] == [("w4a4", "hadamard")]  # what the flags asked for


def _count_engine_generates(monkeypatch):
    from nibble.eval.engine import Engine

    calls, stream = [], Engine.stream
    monkeypatch.setattr(Engine, "stream", lambda self, *a, **k: calls.append(1) or stream(self, *a, **k))
    return calls


def test_generate_runs_on_nibbles_engine_and_says_what_transformers_says(model_dir, monkeypatch, capsys):
    calls = _count_engine_generates(monkeypatch)
    args = ["generate", "the capital", "--model", str(model_dir), "--device", "cpu", "--group-size", "32",
            "--max-new-tokens", "8", "--no-chat"]
    main(args)
    by_engine = capsys.readouterr().out
    assert calls == [1]
    main(args + ["--hf-generate"])
    assert calls == [1] and capsys.readouterr().out == by_engine and by_engine.strip()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_generate_on_the_gpu_decodes_with_the_engines_cuda_graphs(model_dir, monkeypatch, capsys):
    from nibble.eval import engine

    calls, captures, capture = _count_engine_generates(monkeypatch), [], engine.capture_graph
    monkeypatch.setattr(engine, "capture_graph", lambda *a, **k: captures.append(1) or capture(*a, **k))
    main(["generate", "the capital", "--model", str(model_dir), "--device", "cuda", "--group-size", "32",
          "--max-new-tokens", "20", "--no-chat"])
    assert calls == [1] and len(captures) >= 1 and capsys.readouterr().out.strip()


class RecordingStreamer:
    """What transformers' generate calls on a streamer: put(tokens) then end()."""

    def __init__(self):
        self.puts, self.ends = [], 0

    def put(self, tokens):
        self.puts.append(tokens.reshape(-1).tolist())

    def end(self):
        self.ends += 1


def test_a_streamer_gets_the_prompt_then_the_new_tokens_as_they_come_from_either_way(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nibble.cli import generate_text

    model, tok = AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    prompt_ids = tok("the capital").input_ids
    seen = {}
    for engine in (True, False):
        streamer = RecordingStreamer()
        text = generate_text(model, tok, "the capital", 10, chat=False, engine=engine, streamer=streamer)
        assert streamer.puts[0] == prompt_ids and streamer.ends == 1
        assert len(streamer.puts) == 1 + 10  # on the CPU the engine hands over every token as it comes
        seen[engine] = (text, sum(streamer.puts[1:], []))
    assert seen[True] == seen[False]


def test_several_prompts_run_as_ragged_batches_and_each_gets_what_it_gets_alone(model_dir, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nibble.cli import generate_text, generate_texts

    model, tok = AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    prompts = ["the capital", "a haiku about the sea of france", "the", "paris is"]
    alone = [generate_text(model, tok, p, 6, chat=False) for p in prompts]
    assert len({len(tok(p).input_ids) for p in prompts}) == 4 and len(set(alone)) > 1
    for batch_size in (4, 3, 1):  # one batch, a full and a partial one, one at a time
        assert list(generate_texts(model, tok, prompts, 6, chat=False, batch_size=batch_size)) == alone
    for batch_size in (4, 3):  # transformers' generate, the batches padded on the left
        assert list(generate_texts(model, tok, prompts, 6, chat=False, engine=False,
                                   batch_size=batch_size)) == alone
    listed = tmp_path / "prompts.txt"
    listed.write_text("a haiku about the sea of france\n\nthe\n")
    main(["generate", "the capital", "--prompts-file", str(listed), "--model", str(model_dir), "--device", "cpu",
          "--quant", "none", "--max-new-tokens", "6", "--no-chat", "--batch-size", "2"])
    assert capsys.readouterr().out == "".join(f"[{i}] {p}\n{t}\n\n" for i, (p, t) in
                                              enumerate(zip(prompts[:3], alone[:3]), 1))


class _FlushedOut:
    """A stdout that shows what was written only when it is flushed, as a pipe's buffer does."""

    def __init__(self):
        self.pending, self.shown = "", ""

    def write(self, text):
        self.pending += text

    def flush(self):
        self.shown, self.pending = self.shown + self.pending, ""


@pytest.mark.parametrize("hf_generate", [False, True])
def test_several_prompts_are_printed_batch_by_batch_as_each_completes(model_dir, monkeypatch, hf_generate):
    """With several prompts every answer was printed after the last batch: a user saw nothing for minutes. Each
    batch's answers now show (flushed) before the next batch runs, in the prompts' order."""
    import sys

    import nibble.cli as cli
    from nibble.eval.engine import Engine

    out, shown_at_batches = _FlushedOut(), []

    def recorded(run):
        def run_and_record(*args, **kwargs):
            shown_at_batches.append(out.shown)
            return run(*args, **kwargs)
        return run_and_record
    if hf_generate:
        monkeypatch.setattr(cli, "_transformers_tokens", recorded(cli._transformers_tokens))
    else:
        monkeypatch.setattr(Engine, "generate", recorded(Engine.generate))
    monkeypatch.setattr(sys, "stdout", out)
    prompts = ["the capital", "a haiku", "the sea", "paris is", "the"]
    main(["generate", *prompts, "--model", str(model_dir), "--device", "cpu", "--quant", "none", "--max-new-tokens",
          "3", "--no-chat", "--batch-size", "2"] + ["--hf-generate"] * hf_generate)
    out.flush()
    answers = re.split(r"(?m)^\[\d\] ", out.shown)[1:]
    assert [a.split("\n", 1)[0] for a in answers] == prompts
    starts = [out.shown.index(f"[{i}] ") for i in range(1, 6)]
    # before each batch: every answer of the batches before it, and none of its own
    assert shown_at_batches == ["", out.shown[:starts[2]], out.shown[:starts[4]]]


@pytest.mark.parametrize("content, message", [
    (b"ok\n\xff\xfe\n", r"--prompts-file .*p\.txt is not UTF-8 text \(invalid start byte at byte 3\): save it as UTF-8"),
    (b"\n  \n", r"--prompts-file .*p\.txt holds no prompt \(one a line; blank lines are skipped\)")])
def test_a_prompts_file_that_is_not_text_or_holds_no_prompt_is_named(content, message, tmp_path, monkeypatch):
    """A file not in UTF-8 gave the codec's bare message; one of blank lines said "give ... --prompts-file"."""
    import nibble.cli as cli

    (tmp_path / "p.txt").write_bytes(content)
    monkeypatch.setattr(cli, "load", lambda *a: pytest.fail("loaded the model before checking the flags"))
    with pytest.raises(SystemExit, match=r"^nibble generate: " + message + r"\n\(NIBBLE_TRACEBACK=1"):
        main(["generate", "--model", "nowhere", "--prompts-file", str(tmp_path / "p.txt")])


def test_a_prompts_file_saved_with_a_byte_order_mark_and_windows_line_ends_reads_as_its_text(model_dir, tmp_path,
                                                                                            monkeypatch, capsys):
    """Notepad's UTF-8 begins with a byte order mark, which went into the first prompt (an invisible first token)."""
    import nibble.cli as cli

    given = []
    monkeypatch.setattr(cli, "generate_texts", lambda model, tok, prompts, *a, **k: given.extend(prompts) or
                        ["" for _ in prompts])
    (tmp_path / "p.txt").write_bytes("\ufeffthe capital\r\nthe sea\r\n".encode())
    main(["generate", "--prompts-file", str(tmp_path / "p.txt"), "--model", str(model_dir), "--device", "cpu",
          "--quant", "none"])
    assert given == ["the capital", "the sea"] and capsys.readouterr().out.startswith("[1] the capital\n")


@pytest.mark.parametrize("flags, message", [([], "give a prompt"), (["x", "--batch-size", "0"], "batch-size must be"),
                                            (["--prompts-file", "/nonexistent/p.txt"], "cannot read --prompts-file"),
                                            (["a", "b", "--stats"], "--stats times one prompt"),
                                            (["a", ""], "prompt 2 of the 2 given is empty: give its text"),
                                            ([" \t"], "the prompt is blank: give its text")])
def test_generate_refuses_a_missing_prompt_or_batch_before_loading_the_model(flags, message, monkeypatch):
    import nibble.cli as cli

    monkeypatch.setattr(cli, "load", lambda *a: pytest.fail("loaded the model before checking the flags"))
    with pytest.raises(SystemExit, match=message):
        main(["generate", "--model", "nowhere"] + flags)


@pytest.mark.parametrize("engine", [True, False])
def test_a_prompt_of_no_token_is_refused_in_words(model_dir, engine):
    """An empty prompt, which a tokenizer that adds no BOS makes no token of: the engine refused it in tensor terms
    ("got torch.float32 of shape [1, 0]"), transformers' generate raised from a reshape."""
    from transformers import AutoTokenizer

    from nibble.cli import generate_text, generate_texts
    model, tok = tiny_model(vocab_size=300), AutoTokenizer.from_pretrained(model_dir)
    with pytest.raises(ValueError, match=r"the prompt '' is no token to the tokenizer.*give it some text"):
        generate_text(model, tok, "", 2, chat=False, engine=engine)
    with pytest.raises(ValueError, match="the prompt '' is no token"):
        list(generate_texts(model, tok, ["the capital", ""], 2, chat=False, engine=engine))


def test_the_engines_tokens_stop_at_the_end_of_sequence(model_dir, monkeypatch, capsys):
    from nibble.eval.engine import Engine

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    a, b = tok("the capital").input_ids[:2]
    monkeypatch.setattr(Engine, "stream", lambda self, ids, n, stop_tokens, **sampling: iter([torch.tensor([[a, tok.eos_token_id, b]])]))
    main(["generate", "x", "--model", str(model_dir), "--device", "cpu", "--quant", "none", "--no-chat"])
    assert capsys.readouterr().out.strip() == tok.decode([a]).strip()


@pytest.fixture(scope="module")
def poisoned_dir(tmp_path_factory):
    """(a tiny model directory whose logits turn NaN at a later step of `generate "the capital"`, that step): the
    embedding of a token it makes then (and never before, nor `generate "a haiku"`) is NaN, its lm_head untied."""
    from nibble.eval.engine import Engine

    tok = _tiny_tokenizer()
    torch.manual_seed(1)
    model = tiny_model(vocab_size=len(tok), tie_word_embeddings=False, initializer_range=0.2)
    capital, haiku = (tok(p).input_ids for p in ("the capital", "a haiku about the sea"))
    made = [Engine(model, max_seq_len=32).generate([ids], 12)[0].tolist() for ids in (capital, haiku)]
    fed = {0, tok.eos_token_id} | set(capital) | set(haiku) | set(made[1])
    step = next(k + 1 for k in range(1, 10) if made[0][k] not in fed | set(made[0][:k]) and
                tok.eos_token_id not in made[0][:k])  # where it stops no more steps run
    model.model.embed_tokens.weight.data[made[0][step - 1]] = torch.nan
    d = tmp_path_factory.mktemp("poisoned")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d, step


@pytest.mark.parametrize("hf_generate", [[], ["--hf-generate"]])
def test_generate_says_logits_that_are_not_finite_in_one_line_and_status_1(poisoned_dir, capsys, hf_generate):
    """It printed the text of the tokens picked from NaN logits (the first NaN's index: an empty line, where that is
    the end of sequence), status 0; with transformers' generate too."""
    d, step = poisoned_dir
    argv = ["generate", "the capital", "--model", str(d), "--device", "cpu", "--quant", "none", "--no-chat"]
    argv += hf_generate
    said = (rf"^nibble generate: the model's logits held NaN or infinite values at decode step {step} \(new token "
            rf"{step + 1}\)(?P<batch>.*): the tokens picked from them are garbage\. Likely causes: a corrupt "
            r"checkpoint or a broken layer \(weights holding NaN or Inf\), or activations past float32's range\n"
            r"\(NIBBLE_TRACEBACK=1 shows where it was raised\)$")
    main(argv + ["--max-new-tokens", str(step)])  # up to the step that feeds the token: no NaN
    before = capsys.readouterr().out
    assert before.strip()
    with pytest.raises(SystemExit) as e:
        main(argv + ["--max-new-tokens", "12"])
    assert isinstance(e.value.code, str) and re.match(said, e.value.code)[1] == ""  # a message: status 1
    assert capsys.readouterr().out == before  # the tokens before it, streamed: their line ended
    with pytest.raises(SystemExit) as e:  # several prompts: the batch's answers are not printed
        main(argv + ["a haiku about the sea", "--max-new-tokens", "12", "--batch-size", "2"])
    assert re.match(said, e.value.code)[1] == " of sequence 0 of the batch" and capsys.readouterr().out == ""


@pytest.mark.parametrize("engine", [True, False])
def test_generate_text_raises_on_logits_that_are_not_finite(poisoned_dir, engine):
    """transformers' generate (engine False) took the NaN's index, greedy, without a word."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nibble.cli import generate_text, generate_texts

    model, tok = AutoModelForCausalLM.from_pretrained(poisoned_dir[0]), AutoTokenizer.from_pretrained(poisoned_dir[0])
    with pytest.raises(FloatingPointError, match=rf"at decode step {poisoned_dir[1]} "):
        generate_text(model, tok, "the capital", 12, chat=False, engine=engine)
    texts = generate_texts(model, tok, ["a haiku about the sea", "the capital"], 12, chat=False, batch_size=1,
                           engine=engine)
    assert next(texts)  # the first batch's answer, then the second's error
    with pytest.raises(FloatingPointError, match=rf"at decode step {poisoned_dir[1]} "):
        next(texts)


def test_generate_samples_with_a_seed_and_top_k_1_is_greedy(model_dir, capsys):
    args = ["generate", "the capital", "--model", str(model_dir), "--device", "cpu", "--group-size", "32",
            "--max-new-tokens", "12", "--no-chat"]

    def text(*flags):
        main(args + list(flags))
        return capsys.readouterr().out

    greedy = {way: text(*way) for way in ((), ("--hf-generate",))}
    assert greedy[()] == greedy["--hf-generate",]
    for way in greedy:
        assert text(*way, "--temperature", "3", "--top-k", "1") == greedy[way]
        seeded = [text(*way, "--temperature", "1.5", "--top-p", "0.9", "--seed", "7") for _ in range(2)]
        assert seeded[0] == seeded[1] != greedy[way]
        # --top-k 0 is no top-k filter, as transformers takes it (it was refused, naming Python's None)
        assert text(*way, "--temperature", "1.5", "--top-k", "0", "--seed", "7") == \
            text(*way, "--temperature", "1.5", "--seed", "7")


def test_generate_takes_prompts_before_between_and_after_the_options(model_dir, capsys):
    """argparse took one run of positionals: a prompt after an option was "unrecognized arguments"."""
    flags = ["--model", str(model_dir), "--device", "cpu", "--quant", "none", "--max-new-tokens", "3", "--no-chat"]
    main(["generate", "the capital", "a haiku"] + flags)
    together = capsys.readouterr().out
    main(["generate", "the capital"] + flags[:4] + ["a haiku"] + flags[4:])
    assert capsys.readouterr().out == together
    main(["generate", "the capital"] + flags + ["- a list item"])  # a prompt, as argparse reads it
    assert "- a list item" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["generate", "the capital"] + flags + ["--bogus", "x"])
    err = capsys.readouterr().err
    assert "usage: nibble generate" in err and "unrecognized arguments: --bogus x" in err


@pytest.mark.parametrize("way", [[], ["--hf-generate"]])
def test_generate_warns_that_top_k_and_top_p_without_a_temperature_are_ignored(model_dir, way, monkeypatch):
    """The engine warned; transformers' generate (--hf-generate) ran greedily without a word. Said in the options'
    names, as shown on stderr (the library's "top_k / top_p ... temperature" was, session 71)."""
    import warnings

    shown = []
    monkeypatch.setattr(warnings, "showwarning", lambda message, category, filename, lineno, file=None, line=None:
                        shown.append(warnings.formatwarning(message, category, filename, lineno, line)))
    for flags in (["--top-k", "5"], ["--top-p", "0.5"]):
        shown.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            main(["generate", "the capital", "--model", str(model_dir), "--device", "cpu", "--quant", "none",
                  "--max-new-tokens", "2", "--no-chat"] + flags + way)
        assert shown == ["nibble generate: warning: --top-k / --top-p filter sampled tokens only: with --temperature 0 "
                         "decoding is greedy and they are ignored; give a --temperature > 0 to sample\n"], shown


@pytest.mark.parametrize("flags, ignored", [
    (["--seed", "1"], "--seed repeats sampled tokens only"),
    (["--seed", "1", "--temperature", "0.7", "--top-k", "1"], "--seed repeats sampled tokens only"),
    (["--seed", "1", "--temperature", "0.7", "--top-k", "1"], "give --top-k > 1 (or 0, off) to sample"),
    (["--batch-size", "4"], "--batch-size sets how many of several prompts run at once: with one prompt"),
    (["--seed", "1", "--temperature", "0.7"], None), (["another prompt", "--batch-size", "4"], None)])
def test_generate_warns_that_a_seed_without_sampling_and_a_batch_size_for_one_prompt_are_ignored(flags, ignored,
                                                                                                  monkeypatch):
    """They were accepted without a word, where --top-k / --top-p without a temperature warn; said before the model
    loads, and not where they apply."""
    import warnings

    import nibble.cli as cli

    class Loading(Exception):
        pass

    def load_for_command(*args):
        raise Loading
    monkeypatch.setattr(cli, "load_for_command", load_for_command)
    with warnings.catch_warnings(record=True) as said, pytest.raises(Loading):
        warnings.simplefilter("always")
        main(["generate", "a prompt", "--model", "nowhere"] + flags)
    said = [str(w.message) for w in said]
    assert len(said) == (ignored is not None) and all(ignored in message for message in said), said
    if "--top-k" in flags:  # the temperature was given: the hint was "give a --temperature > 0"
        assert "--temperature" not in said[0]


@pytest.mark.parametrize("way", [[], ["--hf-generate"]])
def test_generate_stats_say_how_many_tokens_came_and_how_fast(model_dir, capsys, way):
    main(["generate", "the capital", "--model", str(model_dir), "--device", "cpu", "--quant", "none",
          "--max-new-tokens", "5", "--no-chat", "--stats"] + way)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(r"nibble: \d+ prompt tokens, \d new in [\d.]+ s \([\d.]+ tokens/s\); [\d.]+ tokens/s after "
                        r"the first 1, which include the prefill \(and, on a GPU, the engine's graph capture\)", err), err


def test_timed_streamer_counts_the_prompt_apart_and_passes_everything_on(monkeypatch):
    from nibble.cli import TimedStreamer

    seen = []
    inner = SimpleNamespace(put=seen.append, end=lambda: seen.append("end"))
    clock = iter([10.0, 11.0, 11.5, 12.0])
    monkeypatch.setattr("nibble.cli.time.perf_counter", lambda: next(clock))
    timed = TimedStreamer(inner)
    for value in (torch.zeros(1, 7), torch.zeros(16), torch.zeros(16), torch.zeros(4)):
        timed.put(value)
    timed.end()
    assert len(seen) == 5 and seen[-1] == "end"
    assert timed.summary() == ("7 prompt tokens, 36 new in 2.00 s (18.0 tokens/s); 20.0 tokens/s after the first 16, "
                               "which include the prefill (and, on a GPU, the engine's graph capture)")
    slow = TimedStreamer(inner)  # 8 tokens in 239 s printed "0.0 tokens/s"
    clock = iter([0.0, 200.0, 239.0])
    for value in (torch.zeros(1, 35), torch.zeros(1), torch.zeros(7)):
        slow.put(value)
    assert slow.summary().startswith("35 prompt tokens, 8 new in 239.00 s (0.033 tokens/s); 0.18 tokens/s after the "
                                     "first 1,")
    only_prompt = TimedStreamer(inner)
    monkeypatch.setattr("nibble.cli.time.perf_counter", lambda: 20.0)
    only_prompt.put(torch.zeros(1, 3))
    assert only_prompt.summary() == "3 prompt tokens, no new token"


def test_transformers_generate_sampling_from_logits_that_are_not_finite_says_so(poisoned_dir):
    """It failed inside torch ("probability tensor contains either inf, nan or element < 0"): a prompt holding the
    poisoned token makes the prefill's logits NaN, whatever is drawn."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nibble.cli import _transformers_tokens
    from nibble.eval.engine import Sampling

    model, tok = AutoModelForCausalLM.from_pretrained(poisoned_dir[0]), AutoTokenizer.from_pretrained(poisoned_dir[0])
    poisoned = model.model.embed_tokens.weight.isnan().any(-1).nonzero().item()
    prompts = [tok("a haiku").input_ids, tok("the").input_ids + [poisoned]]
    with pytest.raises(FloatingPointError, match=r"values at the prefill \(the first new token's logits\) of "
                                                 r"sequence 1 of the batch: "):
        _transformers_tokens(model, tok, prompts, 4, Sampling(1.0, None, 1.0))


# by the options' names: Sampling's messages named its parameters ("top_p must be in (0, 1]")
@pytest.mark.parametrize("flags, message", [(["--temperature", "-1"], r"^nibble generate: --temperature must be a "),
                                            (["--temperature", "nan"], r"^nibble generate: --temperature must be"),
                                            (["--top-p", "0"], r"^nibble generate: --top-p must be in \(0, 1\]"),
                                            (["--top-k", "-1"], "--top-k must be >= 1, or 0 for every token"),
                                            (["--max-new-tokens", "0"], "max-new-tokens must be"),
                                            (["--seed", str(2**64)],
                                             r"--seed must be an integer from -2\*\*63 to 2\*\*64 - 1")])
def test_generate_refuses_bad_settings_before_loading_the_model(flags, message, monkeypatch):
    import nibble.cli as cli

    monkeypatch.setattr(cli, "load", lambda *a: pytest.fail("loaded the model before checking the flags"))
    with pytest.raises(SystemExit, match=message):
        main(["generate", "x", "--model", "nowhere"] + flags)


@pytest.mark.parametrize("seed", [-2**63 - 1, -2**63, -1, 0, 2**64 - 1, 2**64])
def test_the_command_line_takes_the_seeds_the_library_takes(seed):
    """`cli.check_seed` refused -1 and every negative seed, which `config.checked_seed` (a rotation's) takes."""
    from nibble.cli import check_seed
    from nibble.config import checked_seed

    try:
        checked_seed("seed", seed)
    except ValueError:
        with pytest.raises(ValueError, match=r"^--seed must be an integer from -2\*\*63 to 2\*\*64 - 1"):
            check_seed(seed)
    else:
        check_seed(seed)


def test_max_new_tokens_no_prompt_leaves_room_for_is_refused_before_the_model_loads(model_dir, monkeypatch):
    """--max-new-tokens 1000000000: a minute, then a 32 GB allocation traceback (the engine's cache and rotary table
    sized for it); a value past the context ran, warned, on positions the model never learned."""
    import nibble.cli as cli

    monkeypatch.setattr(cli, "load", lambda *a, **k: pytest.fail("loaded the model before checking the flags"))
    for command in (["generate", "x"], ["demo"]):
        with pytest.raises(SystemExit, match=rf"^nibble {command[0]}: --max-new-tokens=1000000000 leaves no room for "
                                             r"a prompt in the model's context \(256 tokens, .*\): give at most 255, "
                                             "less the prompt's tokens"):
            main(command + ["--model", str(model_dir), "--max-new-tokens", "1000000000"])


@pytest.mark.parametrize("hf_generate", [[], ["--hf-generate"]])
def test_max_new_tokens_past_the_context_after_the_prompt_is_refused_before_a_token(model_dir, hf_generate, capsys):
    """Refused, both ways of generating, before the first token (of several prompts, before the first batch), saying
    the largest that fits; that one runs."""
    argv = ["generate", "--model", str(model_dir), "--device", "cpu", "--quant", "none", "--no-chat"] + hf_generate
    with pytest.raises(SystemExit) as refused:
        main(argv + ["the capital", "--max-new-tokens", "255"])
    said = re.match(r"nibble generate: a prompt of (\d+) tokens and --max-new-tokens=255 exceed the model's context "
                    r"\(256 tokens, .*\): give at most (\d+), or a shorter prompt", str(refused.value))
    assert said and int(said[1]) + int(said[2]) == 256, refused.value
    with pytest.raises(SystemExit, match=r"a prompt of \d+ tokens and --max-new-tokens=255 exceed"):
        main(argv + ["the capital", "a haiku about the sea", "--max-new-tokens", "255"])
    assert capsys.readouterr().out == ""  # nothing generated
    main(argv + ["the capital", "--max-new-tokens", said[2]])
    assert capsys.readouterr().out.strip()


def test_generate_text_refuses_a_prompt_and_max_new_tokens_past_the_context_in_its_parameters_names():
    """The Python helpers under `nibble generate` refuse as `Engine.generate` does past its cache (the context, by
    default): they ran past the context with a warning (and sized the engine's cache for any request)."""
    from nibble.cli import generate_text, generate_texts

    tok = _tiny_tokenizer()
    model = tiny_model(vocab_size=len(tok), max_position_embeddings=32)
    with pytest.raises(ValueError, match=r"^a prompt of \d+ tokens and max_new_tokens=40 exceed the model's context "
                                         r"\(32 tokens"):
        generate_text(model, tok, "the capital", 40, chat=False)
    with pytest.raises(ValueError, match=r"^a prompt of \d+ tokens and max_new_tokens=31 exceed"):
        generate_texts(model, tok, ["the capital", "a haiku about the sea"], 31, chat=False)


def test_options_named_says_a_library_refusal_in_the_commands_options():
    """The one rewrite of the library's parameter names that the commands apply where they call it: whole names only,
    the key of a settings dict too; the exception keeps its type."""
    from nibble.cli import options_named

    with pytest.raises(ValueError) as e:
        with options_named(lr="--lr", quant_lr="--quant-lr", rank="--rank"):
            raise ValueError("lr must be > 0; other settings ({'rank': (2, 4), 'alpha': 4}); lower lr / quant_lr, "
                             "as --lr says; the LoRA ranks")
    assert str(e.value) == ("--lr must be > 0; other settings ({--rank: (2, 4), 'alpha': 4}); lower --lr / --quant-lr, "
                            "as --lr says; the LoRA ranks")
    with pytest.raises(ValueError, match="^/runs/seed/qat-state holds a run: pass --seed or --resume$"):
        with options_named(seed="--seed", **{"resume=True": "--resume"}):  # a folder of a path keeps its name
            raise ValueError("/runs/seed/qat-state holds a run: pass seed or resume=True")
    with pytest.raises(FloatingPointError, match="^PE-QAT diverged at step 3; lower --lr / --quant-lr$"):
        with options_named(lr="--lr", quant_lr="--quant-lr"):
            raise FloatingPointError("PE-QAT diverged at step 3; lower lr / quant_lr")


def test_a_calibration_text_too_short_for_the_windows_asked_is_said_in_the_options(model_dir, tmp_path, monkeypatch):
    """It said "too short for n_samples=64 windows of seq_len=32 ... Use fewer samples", no option's name."""
    from nibble.quantize import calibration

    monkeypatch.setattr(calibration, "calibration_text", lambda source: "the capital of france is paris. " * 20)
    with pytest.raises(SystemExit, match=r"^nibble quantize: calibration source 'c4' has \d+ tokens, too short for "
                                         r"--calib-samples=64 windows of --calib-seq-len=32: .* Use fewer samples "
                                         r"\(it holds --calib-samples=\d+ at this --calib-seq-len\)"):
        main(["quantize", "--model", str(model_dir), "--device", "cpu", "--group-size", "32", "--method", "gptq",
              "--calib-samples", "64", "--calib-seq-len", "32", "--out", str(tmp_path / "q")])


@pytest.mark.parametrize("command", [["quantize", "--out", "nowhere"], ["eval", "ppl"], ["generate", "x"]])
# said as the options: QuantConfig's messages named its fields ("w4a4 supports method='rtn' or 'gptq'",
# "(symmetric=True, group_size=-1) ... a new QuantConfig(mode='w4a4') resolves them")
@pytest.mark.parametrize("flags, message", [
    (["--quant", "w4a4", "--method", "awq"], "--method awq is for --quant w4a16: AWQ's per-channel scales"),
    (["--quant", "w4a16", "--rotate"], "--rotate is for --quant w4a4"),
    (["--quant", "w4a4", "--group-size", "64"], "--group-size shapes W4A16's groups, and --quant w4a4 quantizes each "
                                                "output channel whole and symmetric"),
    (["--quant", "w4a4", "--group-size", "-1", "--float-zero"], "--group-size and --float-zero shape W4A16's groups")])
def test_quantization_flags_a_config_refuses_are_said_before_loading_the_model(command, flags, message, monkeypatch):
    import nibble.cli as cli

    monkeypatch.setattr(cli, "load", lambda *a, **k: pytest.fail("loaded the model before checking the flags"))
    with pytest.raises(SystemExit, match=message):
        main(command + ["--model", "nowhere"] + flags)


def test_a_model_the_engine_cannot_run_falls_back_to_transformers_generate(model_dir, monkeypatch, capsys):
    from nibble.eval import engine

    def refuse(self, model, **kwargs):
        raise ValueError("max_seq_len=20 exceeds the model's sliding window (16)")
    monkeypatch.setattr(engine.Engine, "__init__", refuse)
    main(["generate", "the sea", "--model", str(model_dir), "--device", "cpu", "--quant", "none",
          "--max-new-tokens", "4", "--no-chat"])
    out = capsys.readouterr()
    assert out.out.strip() and "sliding window" in out.err and "transformers' generate" in out.err


def test_qat_from_gptq_end_to_end_writes_a_w4a4_checkpoint_that_loads(model_dir, tmp_path, capsys):
    from nibble.models.serialization import load_quantized

    out = tmp_path / "qat"
    main(["qat", "--model", str(model_dir), "--device", "cpu", "--recipe", "hadamard", "--init", "gptq", "--steps", "2",
          "--seq-len", "32", "--batch-size", "2", "--out", str(out)])
    assert "saved the W4A4 model" in capsys.readouterr().out
    model, _ = load_quantized(out)
    config = model.config.quantization_config
    assert config["mode"] == "w4a4" and config["rotation"] == "hadamard" and config["qat"]["init"] == "gptq"
    # its saved state is not resumed from another start, said as the option (run_qat's settings key was 'init')
    with pytest.raises(SystemExit, match=r"other settings \(--init saved 'gptq', now 'rtn'\)"):
        main(["qat", "--model", str(model_dir), "--device", "cpu", "--recipe", "hadamard", "--steps", "2",
              "--seq-len", "32", "--batch-size", "2", "--out", str(out), "--resume"])


def test_qat_eval_ppl_scores_as_many_tokens_as_max_tokens_says(model_dir, tmp_path, capsys, monkeypatch):
    """`qat --eval-ppl` scored the whole WikiText-2 split: no cut of the stream, which `eval ppl` has (--max-tokens)."""
    from nibble.models import loading

    main(["qat", "--model", str(model_dir), "--device", "cpu", "--steps", "1", "--seq-len", "16", "--batch-size", "1",
          "--out", str(tmp_path / "qat"), "--eval-ppl", "--ppl-max-tokens", "64"])
    printed = capsys.readouterr().out
    scored = json.loads(printed[printed.index("{"):])
    assert scored["windows"] == 1 and scored["seq_len"] == 64  # one window of the 64 tokens, as `eval ppl` scores
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("loaded the model before the checks"))
    args = ["qat", "--model", str(model_dir), "--device", "cpu", "--out", "unused"]
    with pytest.raises(SystemExit, match=r"^nibble qat: --ppl-max-tokens must be >= 2, got 1"):
        main(args + ["--eval-ppl", "--ppl-max-tokens", "1"])
    with pytest.raises(SystemExit, match=r"^nibble qat: --ppl-max-tokens cuts the WikiText-2 stream that --eval-ppl "
                                         r"scores, and no --eval-ppl was given: drop --ppl-max-tokens, or add "
                                         r"--eval-ppl"):
        main(args + ["--ppl-max-tokens", "64"])


def test_a_reader_that_leaves_the_pipe_is_no_traceback(model_dir, tmp_path):
    """`nibble info ... | head -1`: the print into the closed pipe was a BrokenPipeError traceback."""
    import subprocess
    import sys

    out = tmp_path / "q"
    main(["quantize", "--model", str(model_dir), "--device", "cpu", "--group-size", "32", "--out", str(out)])
    run = subprocess.Popen([sys.executable, "-m", "nibble", "info", str(out)], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, cwd=Path(__file__).parents[1])
    run.stdout.close()  # the reader leaves before the first line
    err = run.stderr.read().decode()
    assert run.wait(timeout=120) == 141 and "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="no /dev/full (Linux's always-full device)")
@pytest.mark.parametrize("unbuffered", ["", "1"])
def test_a_full_disk_under_the_output_is_one_line_and_status_1(model_dir, tmp_path, unbuffered):
    """`nibble info DIR > /dev/full` was an OSError traceback (raised by the print, unbuffered), or Python's "Exception
    ignored" at its exit flush, status 120 (buffered)."""
    import os
    import subprocess
    import sys

    out = tmp_path / "q"
    main(["quantize", "--model", str(model_dir), "--device", "cpu", "--group-size", "32", "--out", str(out)])
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONUNBUFFERED", "NIBBLE_TRACEBACK")}
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "nibble", "info", str(out)], stdout=full, stderr=subprocess.PIPE,
                              text=True, cwd=Path(__file__).parents[1], env=env | {"PYTHONUNBUFFERED": unbuffered},
                              timeout=120)
    assert done.returncode == 1 and done.stderr == ("nibble info: [Errno 28] No space left on device\n"
                                                    "(NIBBLE_TRACEBACK=1 shows where it was raised)\n"), done.stderr


def test_a_command_line_argparse_cannot_read_exits_2_and_a_mistake_1_as_the_readme_says(capsys):
    """The README said every mistake exits with status 1; argparse's usage errors exit 2 (the Unix convention)."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    assert "exit status 1" in readme and "said with the command's usage, exit status 2" in readme
    for argv in (["generate", "x", "--max-new-tokens", "many"], ["quantize"], ["generate", "x", "--no-such-option"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2 and "usage: nibble " in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["generate", "x", "--max-new-tokens", "0"])
    assert str(e.value).startswith("nibble generate: --max-new-tokens must be >= 1")  # status 1: a message, not a code


def test_ctrl_c_is_one_line_and_status_130(tmp_path, monkeypatch, capsys):
    """Ctrl-C in any command was a traceback of wherever the work was; now one line and the shell's status for it."""
    from nibble import cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "cmd_info", interrupted)
    with pytest.raises(SystemExit) as stopped:
        main(["info", str(tmp_path)])
    assert stopped.value.code == 130
    assert capsys.readouterr().err.strip() == "nibble info: interrupted"
    monkeypatch.setenv("NIBBLE_TRACEBACK", "1")
    with pytest.raises(KeyboardInterrupt):
        main(["info", str(tmp_path)])


def test_the_command_line_and_its_help_import_neither_torch_nor_transformers():
    """`import nibble` imported the engine, serialization, transformers and accelerate, and cli.py torch (~4 s on a
    laptop): `nibble --help` waited for them, and a Ctrl-C in those seconds, before `main` was there to catch it, was
    a 40-line traceback. A command's modules are imported when it runs; what its options name (quantize's formats,
    eval's and report's tasks, report's speed models) lives in light modules (`nibble.formats`, `nibble.eval`,
    `nibble.eval.report_command`), so every command's help answers without them too (quantize, eval and report took
    ~4 s). An import added back at the top of cli.py or of those modules fails this."""
    import subprocess
    import sys

    import nibble

    code = ("import sys\nfrom nibble.cli import main\n"
            "for argv in (['--help'], ['generate', '--help'], ['info', '--help'], ['demo', '--help'],\n"
            "             ['qat', '--help'], ['quantize', '--help'], ['eval', '--help'], ['eval', 'ppl', '--help'],\n"
            "             ['eval', 'tasks', '--help'], ['report', '--help'], ['build-kernels', '--help']):\n"
            "    try:\n        main(argv)\n    except SystemExit as e:\n        assert e.code == 0, (argv, e.code)\n"
            "print(sorted({'torch', 'transformers', 'accelerate', 'nibble.config'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(nibble.__file__).parents[1], capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "usage: nibble demo" in done.stdout and "usage: nibble report" in done.stdout
    assert done.stdout.splitlines()[-1] == "[]"


def test_qat_calibrates_gptq_on_as_many_windows_as_asked_and_refuses_sizes_for_rtn(model_dir, monkeypatch, capsys):
    from nibble.models import loading
    from nibble.quantize import calibration

    asked = []

    def batches(tokenizer, n_samples=128, seq_len=512, **kwargs):
        asked.append((n_samples, seq_len))
        raise KeyboardInterrupt  # seen what it asks for (Ctrl-C before training: said as such)

    monkeypatch.setattr(calibration, "calibration_batches", batches)
    args = ["qat", "--model", str(model_dir), "--device", "cpu", "--steps", "1", "--out", "unused"]
    with pytest.raises(SystemExit) as stopped:
        main(args + ["--init", "gptq", "--calib-samples", "4", "--calib-seq-len", "32"])
    assert stopped.value.code == 130
    last_line = capsys.readouterr().err.splitlines()[-1]  # after the model load's progress bar
    assert last_line == "nibble qat: interrupted before training began; nothing was written to unused"
    assert asked == [(4, 32)]
    with pytest.raises(SystemExit):  # --calib-samples alone: 512-token windows, past the tiny model's context of 256
        main(args + ["--init", "gptq", "--calib-samples", "4"])
    assert asked[-1] == (4, 256)  # cut to the context, as `nibble quantize` and run_qat's default cut them
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("loaded the model before the checks"))
    with pytest.raises(SystemExit, match="^nibble qat: --calib-samples sizes the calibration of --init gptq; --init "
                                         "rtn calibrates nothing: drop it"):
        main(args + ["--calib-samples", "4"])
    with pytest.raises(SystemExit, match="^nibble qat: --calib-seq-len must be >= 2, got 1"):
        main(args + ["--init", "gptq", "--calib-seq-len", "1"])


@pytest.mark.parametrize("command", [["generate", "x"], ["eval", "ppl"], ["qat", "--steps", "1", "--out", "unused"]])
def test_asking_for_cuda_without_a_gpu_is_a_clear_error(command, model_dir, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match=f"^nibble {command[0]}: device 'cuda' asked for, but no CUDA GPU is visible"):
        main(command + ["--model", str(model_dir), "--device", "cuda"])


def test_a_model_quantized_for_a_gpu_is_read_into_host_memory_and_quantized_onto_it(model_dir, monkeypatch):
    """The CLI never puts the 16-bit model on the GPU: it loads it on the CPU, in bf16, and hands quantize_model
    the GPU (which moves the layers one at a time; tests/models/test_convert.py checks that on a GPU)."""
    from nibble.models import convert

    seen = []

    def spy(model, config, calibration=None, device=None, **kwargs):
        seen.append((next(model.parameters()).device.type, next(model.parameters()).dtype, device, config.mode))
        raise KeyboardInterrupt  # stop here: this machine may have no GPU to go on with

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(convert, "quantize_model", spy)
    with pytest.raises(SystemExit, match="^130$"):  # Ctrl-C's status
        main(["quantize", "--model", str(model_dir), "--device", "cuda", "--quant", "w4a4", "--out", "unused"])
    assert seen == [("cpu", torch.bfloat16, "cuda", "w4a4")]


@pytest.mark.parametrize("command, message", [
    (["generate", "x", "--model", "/nonexistent/model"], "is not a local .gguf file or directory"),
    (["info", "{tmp}"], "not a nibble, AutoAWQ or GPTQ checkpoint directory"),
    (["info", "TheBloke/Llama-2-7B-GPTQ"], "is not a local checkpoint directory. nibble never downloads models"),
    (["info", "{model}/config.json"], "is a file: a checkpoint is the directory"),
    (["quantize", "--model", "{model}", "--quant", "w4a16", "--group-size", "48", "--out", "{tmp}/q"],
     "not divisible by --group-size=48"),  # said as the option (QuantLinear's check names group_size)
])
def test_a_users_mistake_is_one_line_not_a_traceback(command, message, model_dir, tmp_path, monkeypatch):
    """What the user gave that cannot work is said as ``nibble <command>: <what to fix>`` (exit status 1,
    no traceback), unless NIBBLE_TRACEBACK=1 asks for the exception itself."""
    argv = [a.format(tmp=tmp_path, model=model_dir) for a in command] + ["--device", "cpu"] * (command[0] != "info")
    with pytest.raises(SystemExit, match=f"^nibble {command[0]}: .*{message}") as exit_:
        main(argv)
    assert "NIBBLE_TRACEBACK=1" in str(exit_.value)
    monkeypatch.setenv("NIBBLE_TRACEBACK", "1")
    with pytest.raises(Exception, match=message) as raised:
        main(argv)
    assert not isinstance(raised.value, SystemExit)


def test_quantize_without_a_quant_mode_is_refused(model_dir, tmp_path, capsys):
    """--quant none (run in 16 bits) is for the commands that run a model: quantize neither offers nor takes it."""
    assert "none" not in re.search(r"--quant \{([^}]*)\}", build_parser().commands["quantize"].format_help())[1]
    with pytest.raises(SystemExit):
        main(["quantize", "--model", str(model_dir), "--quant", "none", "--device", "cpu", "--out", str(tmp_path)])
    assert "--quant: invalid choice: 'none'" in capsys.readouterr().err


def test_the_demo_refuses_a_model_that_is_already_quantized(model_dir, tmp_path, capsys):
    """It compares a 16-bit model with its W4A16 copy; a quantized directory as its "16-bit" side would
    compare the checkpoint with itself requantized, under the wrong labels."""
    main(["quantize", "--model", str(model_dir), "--device", "cpu", "--group-size", "32", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="^nibble demo: .* is already quantized"):
        main(["demo", "--model", str(tmp_path), "--device", "cpu"])


@pytest.mark.parametrize("tokens, bars", [(64, 0), (512, 2)])  # one window of 64 tokens, or two of the 256 context
def test_the_demo_says_it_is_scoring_and_shows_the_bars_of_several_windows(tokens, bars, model_dir, capsys):
    """Its two perplexities ran with no output: minutes on a CPU. One window each, the default, is one forward pass,
    whose bar sat at 0/1 for all of it: the demo says what it scores as it starts."""
    main(["demo", "--model", str(model_dir), "--device", "cpu", "--max-new-tokens", "1", "--ppl-tokens", str(tokens)])
    out, err = capsys.readouterr()
    assert f"scoring the 16-bit and the W4A16 model on the first {tokens} WikiText-2 test tokens ..." in out
    assert f"WikiText-2 test perplexity, first {tokens} tokens" in out
    # one window each: no bar at all (it sat at 0/1 for the whole pass)
    assert len(re.findall(r"perplexity: 100%[^\r\n]*\n", err)) == bars and ("perplexity:" in err) == bool(bars)
    assert "dequantized Q4_1" not in out  # the default model's note, untrue of another --model


def test_the_demo_says_how_many_tokens_it_scored(model_dir, capsys):
    """It printed the count asked for: --ppl-tokens 300 over 256-token windows scores one window, 256 tokens read,
    of which the first predicts none (it said "first 256 tokens" alone, where `eval ppl` says 255)."""
    main(["demo", "--model", str(model_dir), "--device", "cpu", "--max-new-tokens", "1", "--ppl-tokens", "300"])
    assert "WikiText-2 test perplexity, first 256 tokens (255 predicted): " in capsys.readouterr().out


def test_build_kernels_builds_every_library_of_the_arch(monkeypatch, capsys):
    """`nibble build-kernels --arch 90` compiles the five libraries, the Hopper GEMMs for sm_90a, and
    prints where each lies; for another arch the sm_90a ones are left out (nvcc stubbed)."""
    from nibble.kernels import cuda_build

    built = []
    monkeypatch.setattr(cuda_build, "find_nvcc", lambda: "nvcc")
    monkeypatch.setattr(cuda_build, "build",
                        lambda name, arch, nvcc=None, quiet=False: built.append((name, arch, quiet)) or f"/c/{name}")
    main(["build-kernels", "--arch", "90", "--jobs", "2"])
    assert sorted(built) == sorted((n, "90a" if hopper else "90", True) for n, hopper in cuda_build.LIBRARIES.items())
    assert capsys.readouterr().out.splitlines() == [f"{n}: /c/{n}" for n in cuda_build.LIBRARIES]
    built.clear()
    main(["build-kernels", "--arch", "80"])
    assert sorted(built) == sorted((n, "80", True) for n, hopper in cuda_build.LIBRARIES.items() if not hopper)


def test_build_kernels_says_what_it_needs(monkeypatch):
    from nibble.kernels import cuda_build

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="^nibble build-kernels: .*pass --arch"):
        main(["build-kernels"])
    with pytest.raises(SystemExit, match="^nibble build-kernels: --arch must be a compute capability as digits, "
                                         "e.g. 90 for H100/H200 .*got 'sm_90'"):  # said as the option, not "arch"
        main(["build-kernels", "--arch", "sm_90"])
    # taken: --jobs 0 as the CPUs, --arch 70 failing in nvcc ("Unsupported gpu architecture")
    with pytest.raises(SystemExit, match="^nibble build-kernels: --jobs must be >= 1, got 0"):
        main(["build-kernels", "--arch", "90", "--jobs", "0"])
    with pytest.raises(SystemExit, match="^nibble build-kernels: nibble's CUDA kernels need compute capability 8.0 .*: "
                                         "--arch 70 lacks"):
        main(["build-kernels", "--arch", "70"])
    with pytest.raises(ValueError, match="^jobs must be an integer >= 1, got -3"):
        cuda_build.prebuild("90", jobs=-3)
    monkeypatch.setattr(cuda_build, "find_nvcc", lambda: None)
    with pytest.raises(SystemExit, match="^nibble build-kernels: .*need nvcc"):
        main(["build-kernels", "--arch", "90"])


@pytest.mark.parametrize("flags, message", [
    (["ppl", "--limit", "3"], "--limit belongs to `nibble eval tasks`; `eval ppl` takes --seq-len, --max-tokens and "
                              "--batch-size: drop --limit"),
    (["ppl", "--tasks", "piqa", "--limit", "3"], "--tasks and --limit belong to `nibble eval tasks`"),
    (["tasks", "--max-tokens", "512", "--seq-len", "64"], "--seq-len and --max-tokens belong to `nibble eval ppl`; "
                                                          "`eval tasks` takes --tasks, --limit"),
    (["tasks", "--limit", "0"], "--limit must be >= 1, got 0"),
    (["ppl", "--batch-size", "0"], "--batch-size must be >= 1, got 0"),
    (["tasks", "--batch-size", "-1"], "--batch-size must be >= 1, got -1"),
    (["ppl", "--max-tokens", "0"], "--max-tokens must be >= 2, got 0"),
    (["ppl", "--seq-len", "1"], "--seq-len must be >= 2, got 1")])
def test_eval_refuses_options_it_would_ignore_or_fail_on_before_loading_the_model(flags, message, monkeypatch):
    """`eval ppl --limit N` ran the whole split; `eval tasks --limit 0` printed "acc": NaN (not JSON) and exited 0."""
    import nibble.cli as cli

    monkeypatch.setattr(cli, "load", lambda *a, **k: pytest.fail("loaded the model before checking the flags"))
    with pytest.raises(SystemExit, match="^nibble eval: " + re.escape(message)):
        main(["eval"] + flags + ["--model", "nowhere", "--quant", "none"])


@pytest.fixture(scope="module")
def short_context_dir(tmp_path_factory):
    """A tiny model of a 32-token context."""
    tok = _tiny_tokenizer()
    d = tmp_path_factory.mktemp("short")
    tiny_model(vocab_size=len(tok), max_position_embeddings=32).save_pretrained(d)
    tok.save_pretrained(d)
    return d


WINDOW_OPTIONS = {"eval": ["eval", "ppl", "--quant", "none", "--seq-len", "{seq}", "--max-tokens", "{cut}"],
                  "report": ["report", "--configs", "bf16", "--limit", "1", "--tasks", "boolq",
                             "--ppl-seq-len", "{seq}", "--ppl-max-tokens", "{cut}", "--out", "{tmp}/r"]}


def _window_command(command, seq, cut, tmp, model):
    return [a.format(seq=seq, cut=cut, tmp=tmp) for a in WINDOW_OPTIONS[command]] + ["--model", str(model)]


@pytest.mark.parametrize("command", ["eval", "report"])
@pytest.mark.parametrize("model, seq, cut, window", [(None, 256, 100, ""),
                                                     ("short", 64, 20, r" \(clamped to the model's context, 32\)")])
def test_a_token_cut_shorter_than_one_window_is_refused_before_the_model_loads(
        command, model, seq, cut, window, short_context_dir, monkeypatch, tmp_path):
    """It scored nothing, and said so only once the model was loaded (and, in a report, quantized, for each config):
    the window as given where no context can be read (no model there), else clamped to it, as it is scored."""
    import nibble.cli as cli
    import nibble.models.loading as loading

    monkeypatch.setattr(cli, "load", lambda *a, **k: pytest.fail("loaded the model before checking the window"))
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("loaded the model before the window"))
    with pytest.raises(SystemExit, match=f"^nibble {command}: .*max.tokens {cut} is fewer tokens than one window of "
                                         f".*seq.len {seq}{window}: no window would be scored"):
        main(_window_command(command, seq, cut, tmp_path, short_context_dir if model else tmp_path))


@pytest.mark.parametrize("command", ["eval", "report"])
def test_a_window_longer_than_the_context_is_clamped_not_refused(command, short_context_dir, tmp_path, capsys):
    """Issue 5: a model of a shorter context than the window is scored on windows of its context, with a warning;
    a cut of one such window was refused (the check took the window before the clamp)."""
    with pytest.warns(UserWarning, match=r"seq_len=64 exceeds the model's context \(32 "):
        assert not main(_window_command(command, 64, 40, tmp_path, short_context_dir))
    if command == "eval":
        out = json.loads(capsys.readouterr().out)
    else:
        out = json.loads((tmp_path / "r" / "report.json").read_text())["configs"]["bf16"]["perplexity"]
    assert (out["seq_len"], out["windows"], out["tokens"]) == (32, 1, 31) and out["ppl"] > 1


def test_a_warning_is_said_in_the_options_the_command_took(short_context_dir, tmp_path):
    """`nibble eval ppl --seq-len 64` on a model of 32 tokens warned "seq_len=64 exceeds the model's context", the
    Python parameter's name, where the refusals name the options (`options_named`)."""
    import os
    import subprocess
    import sys

    import nibble

    done = subprocess.run([sys.executable, "-m", "nibble", *_window_command("eval", 64, 40, tmp_path, short_context_dir),
                           "--device", "cpu"], cwd=Path(nibble.__file__).parents[1], capture_output=True, text=True,
                          timeout=300, env={k: v for k, v in os.environ.items() if k != "PYTHONWARNINGS"})
    assert done.returncode == 0, done.stderr
    assert "nibble eval: warning: --seq-len=64 exceeds the model's context (32 " in done.stderr


def test_a_command_reads_whether_its_model_is_quantized_once(model_dir, tmp_path, monkeypatch, capsys):
    """The checks, load_for_command and load each read --model's config.json again: four reads a command."""
    from nibble.models import checkpoint_files

    reads, read = [], checkpoint_files.quantized_checkpoint
    monkeypatch.setattr(checkpoint_files, "quantized_checkpoint", lambda model: reads.append(model) or read(model))
    out = str(tmp_path / "q")
    main(["quantize", "--model", str(model_dir), "--device", "cpu", "--group-size", "32", "--out", out])
    main(["generate", "hi", "--model", out, "--device", "cpu", "--max-new-tokens", "1"])
    assert reads == [str(model_dir), out]


@pytest.fixture
def quantized_dir(tmp_path):
    """What `quantized_checkpoint` reads of a nibble checkpoint: its config's quantization_config."""
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "nibble"}}))
    return tmp_path


@pytest.mark.parametrize("command, used", [(["quantize", "--out", "unused"], "its weights are written as they are"),
                                           (["generate", "x"], "it runs as it is"),
                                           (["eval", "ppl"], "it runs as it is")])
@pytest.mark.parametrize("flags, named", [
    (["--group-size", "32"], "--group-size does not apply; drop it"),
    (["--quant", "w4a4", "--rotate"], "--quant, --rotate do not apply; drop them"),
    (["--method", "gptq", "--calib-samples", "8"], "--method, --calib-samples do")])
def test_quantization_flags_given_with_an_already_quantized_model_are_refused(command, used, flags, named,
                                                                              quantized_dir, monkeypatch):
    """They were silently ignored: `quantize --model <checkpoint> --group-size 32` wrote the checkpoint's own groups."""
    import nibble.cli as cli

    monkeypatch.setattr(cli, "load", lambda *a, **k: pytest.fail("loaded the model before checking the flags"))
    with pytest.raises(SystemExit, match=f"^nibble {command[0]}: {quantized_dir} is already quantized: {used}.* "
                                         f"{named}"):
        main(command + ["--model", str(quantized_dir)] + flags)


@pytest.mark.parametrize("settings, holds", [
    (dict(modules_to_not_convert=[]), r"a 4-bit lm_head \(--quantize-lm-head\): re-quantize its 16-bit model without "
                                      r"--quantize-lm-head, or write --format nibble"),
    (dict(zero_point="float"), r"float zero points \(--float-zero\): re-quantize its 16-bit model without "
                               "--float-zero"),
    (dict(mode="w4a4"), r"W4A4 weights \(--quant w4a4\)")])
def test_a_quantized_model_an_export_cannot_hold_is_refused_in_the_options_before_it_loads(settings, holds, tmp_path,
                                                                                           monkeypatch):
    """The export's refusal came once the checkpoint had loaded, in QuantConfig's terms: "quantize with
    modules_to_not_convert=['lm_head']", "Re-quantize with zero_point='int'"."""
    import nibble.cli as cli
    from nibble.config import QuantConfig

    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text(json.dumps({"quantization_config": QuantConfig(**settings).to_dict()}))
    monkeypatch.setattr(cli, "load", lambda *a, **k: pytest.fail("loaded the model before the check"))
    for fmt in ("awq", "gptq"):
        with pytest.raises(SystemExit, match=f"^nibble quantize: --format {fmt} holds W4A16 weights with integer zero "
                                             f"points and a 16-bit lm_head, and {checkpoint} holds {holds}"):
            main(["quantize", "--model", str(checkpoint), "--format", fmt, "--out", str(tmp_path / "out")])


@pytest.mark.parametrize("flags, message", [
    (["--quant", "none", "--rotate"], "--rotate sets how to quantize, and --quant none runs the model unquantized"),
    (["--quant", "none", "--method", "gptq"], "--method sets how to quantize, and --quant none runs the model"),
    (["--quant", "none", "--group-size", "32", "--float-zero"], "--group-size, --float-zero set how to quantize"),
    (["--quant", "w4a4", "--float-zero"], "--float-zero shapes W4A16's groups, and --quant w4a4 quantizes each output "
                                          "channel whole and symmetric"),  # QuantConfig's rule, said as the options
    (["--group-size", "0"], "--group-size must be -1 (one group per output channel) or a positive multiple of 8"),
    (["--calib-samples", "8"], "--calib-samples sizes the calibration of --method gptq / awq; RTN calibrates "
                               "nothing: drop it"),
    (["--method", "gptq", "--calib-seq-len", "1"], "--calib-seq-len must be >= 2, got 1"),
    (["--method", "awq", "--calib-samples", "0"], "--calib-samples must be >= 1, got 0"),
    (["--method", "gptq", "--clip-search"], "--clip-search is RTN's clipping search, and --method gptq runs its own"),
    (["--method", "awq", "--clip-search"], "--clip-search is RTN's clipping search, and --method awq runs its own")])
def test_quantization_flags_that_would_be_ignored_are_refused_before_loading_the_model(flags, message, monkeypatch):
    """`--quant none --rotate` and `--quant w4a4 --float-zero` ran without them; `--group-size 0` became 128 (and the
    error then blamed 128)."""
    import nibble.cli as cli

    monkeypatch.setattr(cli, "load", lambda *a, **k: pytest.fail("loaded the model before checking the flags"))
    for command in (["generate", "x"], ["eval", "ppl"]):
        with pytest.raises(SystemExit, match=f"^nibble {command[0]}: {re.escape(message)}"):
            main(command + ["--model", "nowhere"] + flags)


def test_calibration_windows_past_the_models_context_are_refused_before_it_loads(model_dir, monkeypatch):
    """quantize_model refused them only after the model loaded and the calibration text was tokenized."""
    import nibble.cli as cli

    monkeypatch.setattr(cli, "load", lambda *a, **k: pytest.fail("loaded the model before checking the flags"))
    with pytest.raises(SystemExit, match=r"calibration windows of --calib-seq-len=300 exceed the model's context "
                                         r"\(256 = config.max_position_embeddings\)"):
        main(["quantize", "--model", str(model_dir), "--method", "gptq", "--calib-seq-len", "300", "--out", "unused"])


def test_quantize_calibrates_on_as_many_windows_of_as_many_tokens_as_asked(model_dir, tmp_path, monkeypatch, capsys):
    from nibble.quantize import calibration

    asked = []

    def batches(tokenizer, n_samples=128, seq_len=512, **kwargs):
        asked.append((n_samples, seq_len))
        if len(asked) > 1:
            raise KeyboardInterrupt  # seen what it asks for: GPTQ on 128 x 512 tokens would take a while
        return torch.randint(0, 256, (n_samples, seq_len))
    monkeypatch.setattr(calibration, "calibration_batches", batches)
    argv = ["quantize", "--model", str(model_dir), "--device", "cpu", "--group-size", "32", "--method", "gptq"]
    main(argv + ["--calib-samples", "4", "--calib-seq-len", "16", "--out", str(tmp_path / "a")])
    assert "saved" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="^130$"):  # Ctrl-C's status
        main(argv + ["--out", str(tmp_path / "b")])  # the defaults: calibration_batches' own, 512 tokens cut to the
    assert asked == [(4, 16), (128, 256)]  # model's context of 256 (quantize_model refuses windows past it)


def test_qat_refuses_bad_counts_before_loading_the_model(monkeypatch):
    from nibble.models import loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("loaded the model before the check"))
    for flag, value, least in (("--steps", "0", 1), ("--seq-len", "1", 2), ("--batch-size", "0", 1),
                               ("--save-every", "0", 1)):
        with pytest.raises(SystemExit, match=f"^nibble qat: {flag} must be >= {least}, got {value}"):
            main(["qat", "--out", "unused", "--device", "cpu", flag, value])
    # said as the options, not run_qat's lr / quant_lr; past float32's largest, AdamW failed once the model was prepared
    for flag, value in (("--lr", "nan"), ("--quant-lr", "-5"), ("--lr", "1e39"), ("--quant-lr", "1e300")):
        with pytest.raises(SystemExit, match=f"^nibble qat: {flag} must be a finite number > 0"):
            main(["qat", "--out", "unused", "--device", "cpu", flag, value])


@pytest.mark.parametrize("argv, says", [
    (["--quant", "w4a16"], "--quant: nibble qat trains and exports W4A4 alone: drop --quant"),  # "--quant-lr: invalid"
    (["--quant", "4"], "--quant: nibble qat trains and exports W4A4 alone"),  # it trained at --quant-lr 4
    (["--rotate"], "--rotate: nibble qat rotates with --recipe hadamard"),
    (["--method", "gptq"], "--method: nibble qat starts from RTN's or GPTQ's weights with --init rtn|gptq"),
])
def test_qat_names_its_own_option_for_another_commands(argv, says, monkeypatch, capsys):
    """`--quant` was read as an abbreviation of --quant-lr; --rotate and --method were unrecognized arguments."""
    from nibble.models import loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    with pytest.raises(SystemExit) as e:
        main(["qat", "--out", "unused", "--device", "cpu", *argv])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "usage: nibble qat" in err and f"nibble qat: error: {says}" in err
    assert "--quant " not in build_parser().commands["qat"].format_help()  # hidden


def test_qat_refuses_a_seed_torch_cannot_take_before_the_model_loads(monkeypatch):
    """The run refuses it too, in the option's words, but only once the model (GBs, minutes) was loaded."""
    from nibble.models import loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("loaded the model before the check"))
    with pytest.raises(SystemExit, match=r"^nibble qat: --seed must be an integer from -2\*\*63 to"):
        main(["qat", "--out", "unused", "--device", "cpu", "--seed", str(2**64)])


def test_qat_says_a_lora_rank_past_the_model_as_its_option(monkeypatch, tmp_path):
    """run_qat's refusal says rank=...: `nibble qat` has no such argument, --rank it has."""
    from nibble.models import loading

    torch.manual_seed(0)
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: (tiny_model(), None))
    with pytest.raises(SystemExit, match=r"^nibble qat: --rank=1000 exceeds what LoRA can use on this model: .* give "
                                         r"--rank <= \d+\n"):
        main(["qat", "--out", str(tmp_path / "q"), "--device", "cpu", "--rank", "1000"])


def test_qat_without_out_is_a_usage_error_before_the_model_loads(monkeypatch, capsys):
    """--out is where the model and the resumable state go: a run without one trained for hours, then had nowhere to
    write them."""
    from nibble.models import loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    with pytest.raises(SystemExit) as e:
        main(["qat", "--device", "cpu", "--steps", "1"])
    assert e.value.code == 2 and "the following arguments are required: --out" in capsys.readouterr().err


@pytest.mark.parametrize("trained", [False, True])
def test_qat_from_a_quantized_checkpoint_names_the_16_bit_model_and_a_runs_resume(trained, tmp_path, monkeypatch):
    """It was the loader's refusal, which said to load the checkpoint with nibble.load_quantized."""
    from nibble.models import loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("loaded the model"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "nibble"}}))
    if trained:  # a PE-QAT export: its run goes on with --resume
        (tmp_path / "qat-state").mkdir()
        (tmp_path / "qat-state" / "state.pt").write_bytes(b"")
    again = f"; this is a PE-QAT run's export: to train it on, give that model with --out {tmp_path} --resume" * trained
    with pytest.raises(SystemExit, match=f"^nibble qat: --model {tmp_path} is a quantized checkpoint, and PE-QAT "
                                         r"trains the 16-bit model: give --model the float model it was quantized "
                                         rf"from \(an HF dir or a .gguf\){again}\n"):
        main(["qat", "--model", str(tmp_path), "--out", str(tmp_path / "new"), "--device", "cpu"])


def test_an_out_holding_a_quantized_checkpoint_is_written_again(quantized_dir, tmp_path):
    import shutil
    from nibble.cli import check_out
    check_out(str(quantized_dir), None)
    check_out(str(quantized_dir), str(quantized_dir))  # a checkpoint written again in place, as save_quantized's
    # and one whose save was interrupted before config.json (written last): the retry was refused as another model
    shutil.copytree(quantized_dir, tmp_path / "cut")
    (tmp_path / "cut" / "config.json").unlink()
    check_out(str(tmp_path / "cut"), None)


def test_an_out_that_cannot_be_written_is_refused_before_the_work(model_dir, tmp_path, monkeypatch):
    """A read-only --out, or a file, failed with a traceback once GPTQ or a whole report had run; --out naming the
    --model folder replaced the 16-bit source."""
    import nibble.cli as cli

    monkeypatch.setattr(cli, "load", lambda *a, **k: pytest.fail("loaded the model before checking --out"))
    file = tmp_path / "file"
    file.write_text("")
    dangling = tmp_path / "link"
    dangling.symlink_to(tmp_path / "nowhere")
    other = tmp_path / "other"  # another 16-bit model: its weights, config and tokenizer were replaced
    tiny_model().save_pretrained(other)
    for out, message in ((file, "is a file: give a folder"), (file / "q", "cannot be created: .* is a file"),
                         (model_dir, f"is the folder the model comes from \\({model_dir}\\): writing the checkpoint "
                                     "there would replace its float weights"),
                         (dangling, "is a link to .*nowhere, which does not"),
                         (other, "holds a model that is not a quantized checkpoint")):
        with pytest.raises(SystemExit, match=f"^nibble quantize: --out {out} {message}"):
            main(["quantize", "--model", str(model_dir), "--quant", "w4a16", "--out", str(out)])
    with pytest.raises(SystemExit, match="^nibble quantize: --out is empty"):  # an unset "$OUTDIR"
        main(["quantize", "--model", str(model_dir), "--quant", "w4a16", "--out", ""])
    with pytest.raises(SystemExit, match="^nibble quantize: --out is empty"):  # "$OUTDIR " quoted: a name of a space
        main(["quantize", "--model", str(model_dir), "--quant", "w4a16", "--out", " "])
    with pytest.raises(SystemExit, match=r"^nibble qat: --seed must be an integer from -2\*\*63 to"):
        main(["qat", "--model", str(model_dir), "--out", str(tmp_path / "qat"), "--seed", str(2**64)])
    if Path("/proc/self").is_dir():  # no file can be made there, even by root (whom os.access always let through)
        with pytest.raises(SystemExit, match=r"^nibble quantize: --out /proc/x cannot be written: creating a "
                                                 r"file in /proc failed \("):
            main(["quantize", "--model", str(model_dir), "--quant", "w4a16", "--out", "/proc/x"])

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(cli.tempfile, "TemporaryFile", refused)
    with pytest.raises(SystemExit, match=r"^nibble report: --out .* cannot be written: creating a file in "
                                         r".* failed \(Permission denied\)"):
        main(["report", "--model", str(model_dir), "--out", str(tmp_path / "r")])


def test_eval_says_what_it_measured(model_dir, capsys):
    """--quant defaults to w4a16: the printed numbers did not say which model, quantization, dtype or device."""
    for quant, want in (([], "w4a16"), (["--quant", "none"], None)):
        main(["eval", "ppl", "--model", str(model_dir), "--device", "cpu", "--max-tokens", "64", "--seq-len", "32"]
             + quant)
        out = json.loads(capsys.readouterr().out)
        setup = out["setup"]
        assert out["ppl"] > 1 and setup["model"] == str(model_dir)
        assert (setup["dtype"], setup["device"]) == ("float32", "cpu") and setup["git_commit"]
        assert (setup["quantization"]["mode"] if want else setup["quantization"]) == (want or "none (16-bit)")
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    assert "(default: w4a16)" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("what, scored, says", [
    ("ppl", dict(ppl=math.nan, nll=math.nan), r"^nibble eval: ppl is NaN \(null in the JSON\): the model's logits "
                                             "were not finite: its weights hold NaN or Inf, or its activations "
                                             "overflowed float32"),
    ("tasks", {"piqa": dict(acc=0.5, acc_stderr=0.5, acc_norm=math.nan, n=2), "boolq": dict(acc=1.0, acc_stderr=math.nan,
                                                                                          n=1)},
     r"^nibble eval: piqa acc_norm is NaN \(null in the JSON\)"),
    ("ppl", dict(ppl=math.inf, nll=1234.5), None), ("tasks", {"boolq": dict(acc=1.0, acc_stderr=math.nan, n=1)}, None)])
def test_eval_says_what_a_null_score_means(what, scored, says, model_dir, monkeypatch, capsys):
    """A NaN score (logits not finite) and an infinite perplexity were printed as a bare null, status 0: the first is
    the command's error, status 1, after the JSON, the second a warning; a standard error of one document (lm-eval's
    N/A) is neither."""
    import nibble.eval.perplexity
    import nibble.eval.tasks

    target = (nibble.eval.perplexity, "wikitext2_perplexity") if what == "ppl" else (nibble.eval.tasks, "evaluate_tasks")
    monkeypatch.setattr(*target, lambda *a, **k: {**scored, "average": {"acc": 0.75}} if what == "tasks" else scored)
    argv = ["eval", what, "--model", str(model_dir), "--device", "cpu", "--quant", "none"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if says:
            with pytest.raises(SystemExit, match=says):
                main(argv)
        else:
            main(argv)
    assert json.loads(capsys.readouterr().out)["setup"]  # the numbers are printed all the same
    infinite = "the perplexity is infinite (null in the JSON): its mean NLL, 1234 a token, is past the range of exp"
    assert any(infinite in str(w.message) for w in caught) == (scored.get("ppl") == math.inf)


def test_eval_without_a_model_says_it_measured_the_default_one(monkeypatch, capsys):
    """The setup's "model" of a run without --model: null said nothing of which model was measured."""
    import nibble.cli as cli
    import nibble.eval.perplexity

    monkeypatch.setattr(cli, "load_for_command", lambda *a: (tiny_model(), None))
    monkeypatch.setattr(nibble.eval.perplexity, "wikitext2_perplexity", lambda *a, **k: dict(ppl=2.0, nll=0.7))
    main(["eval", "ppl", "--device", "cpu", "--quant", "none"])
    assert json.loads(capsys.readouterr().out)["setup"]["model"] == "default (SmolLM2-135M-Instruct)"


def test_a_missing_module_is_the_commands_one_line_error(model_dir, monkeypatch):
    """An optional package not installed (ModuleNotFoundError) is said in one line, not as a traceback."""
    import nibble.cli as cli

    def missing(*args):
        raise ModuleNotFoundError("No module named 'gguf'")
    monkeypatch.setattr(cli, "load_for_command", missing)
    with pytest.raises(SystemExit, match="^nibble eval: No module named 'gguf'\n"):
        main(["eval", "ppl", "--model", str(model_dir), "--device", "cpu", "--quant", "none"])


def test_demo_refuses_bad_counts_and_warnings_are_one_line(monkeypatch, capsys):
    import warnings

    import nibble.cli as cli

    monkeypatch.setattr(cli, "load", lambda *a, **k: pytest.fail("loaded the model before checking the counts"))
    with pytest.raises(SystemExit, match="^nibble demo: --max-new-tokens must be >= 1, got 0"):
        main(["demo", "--max-new-tokens", "0"])
    with pytest.raises(SystemExit, match="^nibble demo: --ppl-tokens must be >= 2, got 1"):  # 1 token predicts none
        main(["demo", "--ppl-tokens", "1"])

    def warn(args):
        warnings.warn("the cache is cold", stacklevel=1)

    monkeypatch.setattr(cli, "cmd_info", warn)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        monkeypatch.setattr(warnings, "showwarning", lambda *a, **k: print(warnings.formatwarning(*a), end=""))
        main(["info", "x"])
    assert capsys.readouterr().out == "nibble info: warning: the cache is cold\n"


def test_the_command_line_works_without_peft_and_nibble_qat_names_the_extra():
    """Building the parser imported nibble.qat.train, hence peft (the `qat` extra): without it every command, --help
    included, was a traceback."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['peft'] = None\n"
            "from nibble.cli import main\n"
            "try:\n    main(['info', '--help'])\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
            "try:\n    main(['qat', '--out', 'nowhere'])\nexcept SystemExit as e:\n    print(e)\n"
            "try:\n    import nibble.nn.lora\nexcept ModuleNotFoundError as e:\n    print(e)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "usage: nibble info" in done.stdout
    assert "nibble qat: nibble qat (LoRA adapters) needs peft, which is not installed: pip install 'nibble[qat]'" \
        in done.stdout
    assert done.stdout.splitlines()[-1] == ("LoRA on nibble layers (nibble.nn.lora) needs peft, which is not "
                                            "installed: pip install 'nibble[qat]'")


@pytest.mark.parametrize("command, missing", [
    (["eval", "ppl"], "'wikitext2/wiki.test.raw'"),
    (["eval", "tasks", "--tasks", "piqa,boolq"], "'piqa/valid.jsonl', 'piqa/valid-labels.lst', 'boolq/val.jsonl'"),
    (["quantize", "--method", "gptq", "--out", "{tmp}/q"], "'c4/c4_demo.jsonl'"),
    (["demo"], "'wikitext2/wiki.test.raw'"),
    (["qat", "--out", "{tmp}/q", "--eval-ppl"], "'c4/c4_demo.jsonl', 'gutenberg/pg1342_pride_and_prejudice.txt', "
                                                "'wikitext2/wiki.test.raw'"),
    # GPTQ's calibration text too, whatever the training texts: it was found missing once the model had loaded
    (["qat", "--out", "{tmp}/q", "--init", "gptq", "--calib", "gutenberg"],
     "'gutenberg/pg1342_pride_and_prejudice.txt', 'c4/c4_demo.jsonl'"),
    (["report", "--out", "{tmp}/r", "--configs", "bf16", "w4a16-gptq", "--tasks", "boolq", "--no-speed"],
     "'wikitext2/wiki.test.raw', 'boolq/val.jsonl', 'c4/c4_demo.jsonl'"),
])
def test_missing_data_is_said_before_the_model_loads(command, missing, tmp_path, monkeypatch):
    """The data files were found missing after the model loaded and quantized: `nibble demo` after 3.5 minutes."""
    import nibble.eval.data as data
    import nibble.models.loading as loading

    monkeypatch.setattr(data, "search_dirs", lambda: [tmp_path / "no-data"])
    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    with pytest.raises(SystemExit, match=f"Evaluation data files? {re.escape(missing)} not found"):
        main([a.format(tmp=tmp_path) for a in command] + ["--device", "cpu"])


def test_version(capsys):
    import nibble

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.strip() == f"nibble {nibble.__version__}"


def test_python_dash_m_nibble_runs_the_nibble_command():
    """`python -m nibble` said "'nibble' is a package and cannot be directly executed" (no __main__.py)."""
    import subprocess
    import sys

    import nibble

    root = Path(nibble.__file__).parent.parent  # this checkout's nibble, which `-m` finds in its working folder
    done = subprocess.run([sys.executable, "-m", "nibble", "--help"], cwd=root, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: nibble ") and "generate,quantize,info,eval,report,qat" in done.stdout


def test_a_qat_calibration_file_that_is_not_there_is_said_before_the_model_loads(tmp_path, monkeypatch):
    import nibble.models.loading as loading

    monkeypatch.setattr(loading, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    with pytest.raises(SystemExit, match=r"calibration source '\S+no-such.txt': neither one of \['c4', 'gutenberg'\] "
                                         "nor a file"):
        main(["qat", "--out", str(tmp_path / "q"), "--calib", f"c4,{tmp_path / 'no-such.txt'}", "--device", "cpu"])
    with pytest.raises(SystemExit, match="--calib ',' names no training text"):  # it failed in torch.cat, late
        main(["qat", "--out", str(tmp_path / "q"), "--calib", ",", "--device", "cpu"])
    with pytest.raises(SystemExit, match="--calib names 'c4' more than once: name each text once"):  # after the load
        main(["qat", "--out", str(tmp_path / "q"), "--calib", "c4,gutenberg,c4", "--device", "cpu"])


@pytest.mark.parametrize("command", [["generate", "hello"], ["eval", "ppl"]])
def test_a_checkpoint_saved_without_a_tokenizer_is_refused_before_it_loads(tmp_path, command, monkeypatch):
    """save_quantized's tokenizer is optional: generate and eval failed on the first prompt with "'NoneType' object has
    no attribute 'chat_template'" (or 'encode'), as a traceback."""
    import nibble.cli as cli
    from nibble import QuantConfig, quantize_model, save_quantized

    save_quantized(quantize_model(tiny_model(), QuantConfig(group_size=32), progress=False), tmp_path)
    monkeypatch.setattr(cli, "load", lambda *a, **k: pytest.fail("loaded the model before checking its tokenizer"))
    with pytest.raises(SystemExit, match=f"^nibble {command[0]}: {tmp_path} holds no tokenizer .* save it there with "
                                         r"tokenizer\.save_pretrained\(DIR\)"):
        main(command + ["--model", str(tmp_path)])


@pytest.mark.parametrize("files", [("tokenizer.model",), ("vocab.json", "merges.txt")])
def test_a_checkpoint_whose_tokenizer_has_no_tokenizer_json_is_let_through_to_its_load(tmp_path, files):
    """The check held tokenizer.json or tokenizer_config.json alone for a tokenizer: a checkpoint with the
    sentencepiece tokenizer.model of an older Llama, or vocab.json and merges.txt, was refused as holding none, which
    a load reads (`loading.holds_tokenizer`: the check and the loaders ask it alike)."""
    import argparse

    from nibble.cli import check_tokenizer

    for name in files:
        (tmp_path / name).write_bytes(b"")
    check_tokenizer(argparse.Namespace(quantized=True, model=str(tmp_path), command="generate"))


def test_tasks_are_named_by_comma_in_eval_and_report_and_by_space_in_report(capsys):
    """`nibble eval` took "piqa,boolq" and `nibble report` "piqa boolq", each refusing the other's form. eval's takes
    one value: more would swallow its positional where it comes after."""
    assert build_parser().parse_args(["eval", "--tasks", "piqa,boolq", "tasks"]).what == "tasks"
    for command in (["eval", "tasks"], ["report"]):
        forms = ((["piqa,boolq"], ["piqa", "boolq"], ["piqa,", "boolq,piqa"]) if command == ["report"]
                 else (["piqa,boolq,piqa"],))
        for given in forms:
            assert build_parser().parse_args([*command, "--tasks", *given]).tasks == ["piqa", "boolq"]
        with pytest.raises(SystemExit):
            build_parser().parse_args([*command, "--tasks", "piqa,hellaswagg"])
        assert "--tasks: unknown task 'hellaswagg': choose from piqa, " in capsys.readouterr().err
        with pytest.raises(SystemExit):  # "--tasks ," names none: it ran every task
            build_parser().parse_args([*command, "--tasks", ","])
        assert "--tasks: no task named: choose from piqa, " in capsys.readouterr().err


@pytest.mark.parametrize("argv,fix", [
    (["eval", "ppl", "--batch-size", "16"], "is free: give a smaller --batch-size (now 16) or --seq-len, or stop what"),
    (["eval", "ppl", "--method", "gptq", "--calib-samples", "64"],
     "is free: give a smaller --batch-size (now 8), --seq-len, --calib-samples (now 64) or --calib-seq-len, or stop"),
    (["info", "somewhere"], "is free: stop what else holds the GPU's memory (nvidia-smi lists it)")])
def test_running_out_of_gpu_memory_is_one_line_naming_the_options_that_take_less(monkeypatch, argv, fix):
    """torch's OutOfMemoryError was a long traceback whose advice was about the allocator, not the command's
    --batch-size (the commands refuse a batch whose logits alone do not fit, not one whose activations do not)."""
    import torch

    import nibble.cli as cli

    def runs_out(args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
                                     "79.19 GiB of which 1.20 GiB is free. Including non-PyTorch memory, this process "
                                     "has 78.00 GiB memory in use. If reserved but unallocated memory is large ...")
    monkeypatch.setattr(cli, "cmd_eval", runs_out)
    monkeypatch.setattr(cli, "cmd_info", runs_out)
    monkeypatch.delenv("NIBBLE_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as e:
        main(argv)
    said = str(e.value)
    assert said.startswith(f"nibble {argv[0]}: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
                           "capacity of 79.19 GiB of which 1.20 GiB is free: ") and fix in said, said
    assert "Including non-PyTorch" not in said and said.endswith("(NIBBLE_TRACEBACK=1 shows where it was raised)")
    monkeypatch.setenv("NIBBLE_TRACEBACK", "1")
    with pytest.raises(torch.OutOfMemoryError):
        main(argv)
    monkeypatch.setattr(cli, "cmd_eval", lambda args: 1 / 0)  # any other error is not said as memory
    monkeypatch.setattr(cli, "cmd_info", lambda args: 1 / 0)
    monkeypatch.delenv("NIBBLE_TRACEBACK")
    with pytest.raises(ZeroDivisionError):
        main(argv)


def test_several_prompts_run_eight_at_a_time_unless_batch_size_says(model_dir, monkeypatch, capsys):
    """--batch-size's help promises GENERATE_BATCH_SIZE (8) prompts a batch where it is not given."""
    from nibble.eval.engine import Engine

    sizes, run = [], Engine.generate
    monkeypatch.setattr(Engine, "generate", lambda self, prompts, *a, **k: sizes.append(len(prompts)) or
                        run(self, prompts, *a, **k))
    main(["generate", *[f"the sea {i}" for i in range(9)], "--model", str(model_dir), "--device", "cpu", "--quant",
          "none", "--max-new-tokens", "2", "--no-chat"])
    assert sizes == [8, 1] and capsys.readouterr().out.count("[9] the sea 8\n") == 1


@pytest.mark.parametrize("message, said", [
    ("CUDA out of memory. Tried to allocate 2.00 GiB.\nCUDA kernel errors might be asynchronously reported",
     "CUDA out of memory. Tried to allocate 2.00 GiB"),
    ("", "out of memory")])
def test_running_out_of_memory_says_torchs_first_line_or_that_it_ran_out(monkeypatch, message, said):
    """The one line is torch's first (its notes follow on the next ones), and an error without a message still says
    what happened."""
    import torch

    import nibble.cli as cli

    def runs_out(args):
        raise torch.OutOfMemoryError(message)
    monkeypatch.setattr(cli, "cmd_info", runs_out)
    monkeypatch.delenv("NIBBLE_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as e:
        main(["info", "somewhere"])
    assert str(e.value).startswith(f"nibble info: {said}: stop what else holds the GPU's memory"), str(e.value)


@pytest.mark.parametrize("argv, defaults", [
    (["generate", "x"], dict(quant="w4a16", method="rtn", max_new_tokens=64, temperature=0.0, top_k=None, top_p=1.0,
                             batch_size=None, seed=None, no_chat=False)),
    (["quantize", "--out", "q"], dict(quant="w4a16", format="nibble", group_size=None, method="rtn")),
    (["eval", "ppl"], dict(quant="w4a16", batch_size=8, seq_len=None, max_tokens=None)),
    (["demo"], dict(max_new_tokens=16, ppl_tokens=1024)),
    (["report"], dict(out="report", configs=["bf16", "w4a16", "w4a4", "w4a4-hadamard"], limit=None, tasks=None))])
def test_each_command_takes_the_defaults_its_help_and_the_readme_give(argv, defaults):
    """A default is what a run measures unless told otherwise (`nibble eval` quantizes to W4A16; the demo's 16 new
    tokens and 1024 WikiText-2 tokens are its minute on a CPU)."""
    args = build_parser().parse_args(argv)
    assert {name: getattr(args, name) for name in defaults} == defaults


def _readme_command_lines():
    """(command, options its comment names) for each command of the README's CLI block; a comment runs on over the
    lines below it that hold a comment alone."""
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    block = readme.split("## CLI\n\n```bash\n", 1)[1].split("```", 1)[0]
    lines = []
    for line in block.splitlines():
        command, _, comment = line.partition("  #")
        if command.strip():
            lines.append([command.strip(), comment])
        else:
            lines[-1][1] += " " + comment
    return [(command, set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", comment))) for command, comment in lines]


def test_every_command_and_option_the_readme_shows_is_the_clis(capsys):
    """Docs that match the code: each command line of the README's CLI block parses as written, and each option its
    comments name is one of that command's (`nibble generate`'s, `python -m nibble.bench kernels`'s, ...)."""
    import shlex

    from nibble.bench.__main__ import main as bench_main

    parser, checked = build_parser(), 0
    for command, options in _readme_command_lines():
        words = shlex.split(command)
        if words[:3] == ["python", "-m", "nibble.bench"]:
            with pytest.raises(SystemExit) as done:
                bench_main([words[3], "--help"])
            assert done.value.code == 0
            known = capsys.readouterr().out
            named = options | set(re.findall(r"--[a-z-]+", command))
            assert all(re.search(rf"{option}\b", known) for option in named), command
        else:
            argv = words[3:] if words[:3] == ["python", "-m", "nibble"] else words[1:]
            assert words[0] in ("nibble", "python"), command
            parser.parse_args(argv)  # a usage error exits 2, failing here with the command's message on stderr
            known = {flag for action in parser.commands[argv[0]]._actions for flag in action.option_strings}
            assert options <= known, (command, options - known)
        checked += len(options)
    assert checked > 20  # the block was found and its comments read


def test_quantize_takes_no_quant_none_and_the_other_commands_do():
    parser = build_parser()
    assert parser.parse_args(["generate", "x", "--quant", "none"]).quant == "none"
    with pytest.raises(SystemExit):
        parser.parse_args(["quantize", "--out", "q", "--quant", "none"])


def test_a_seed_of_0_seeds_the_samples_as_any_other(model_dir, capsys):
    args = ["generate", "the capital", "--model", str(model_dir), "--device", "cpu", "--quant", "none",
            "--max-new-tokens", "12", "--no-chat", "--temperature", "2", "--seed", "0"]
    texts = []
    for state in (1, 2):  # whatever the generators held before, --seed 0 sets them
        torch.manual_seed(state)
        main(args)
        texts.append(capsys.readouterr().out)
    assert texts[0] == texts[1] and texts[0].strip()


@pytest.mark.parametrize("max_new_tokens, prompt_tokens, says", [
    (32, None, "max_new_tokens=32 leaves no room for a prompt in the model's context (32 tokens, the prompt's and "
               "the new ones together): give at most 31, less the prompt's tokens"),
    (1, 32, "a prompt of 32 tokens fills the model's context (32 tokens) before any new one: give a shorter prompt"),
    (3, 30, "a prompt of 30 tokens and max_new_tokens=3 exceed the model's context (32 tokens, the prompt's and the "
            "new ones together): give at most 2, or a shorter prompt")])
def test_a_request_one_token_past_the_context_is_refused_and_one_within_it_taken(max_new_tokens, prompt_tokens, says):
    from nibble.cli import check_fits_context

    with pytest.raises(ValueError, match=f"^{re.escape(says)}$"):
        check_fits_context(max_new_tokens, 32, prompt_tokens)
    if prompt_tokens is None or prompt_tokens < 32:
        check_fits_context(max_new_tokens - 1, 32, prompt_tokens)
    else:
        check_fits_context(max_new_tokens, 32, prompt_tokens - 1)


def test_the_help_adds_a_default_only_where_one_is_set_and_unsaid(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    said = " ".join(capsys.readouterr().out.split())
    assert "(default: 64)" in said and "(default: 1.0)" in said
    # a flag's False, an unset None, and the temperature whose text says its default already
    assert "(default: False)" not in said and "(default: None)" not in said and "(default: 0.0)" not in said


@pytest.mark.parametrize("flags, want", [
    ([], dict(mode="w4a16", group_size=128, method="rtn", rotation="none", clip_search=False, zero_point="int",
              modules_to_not_convert=("lm_head",))),
    (["--float-zero", "--clip-search", "--group-size", "64", "--quantize-lm-head", "--method", "gptq"],
     dict(group_size=64, zero_point="float", clip_search=True, modules_to_not_convert=(), method="gptq")),
    (["--quant", "w4a4", "--rotate"], dict(mode="w4a4", rotation="hadamard", group_size=-1, clip_search=True))])
def test_the_quantization_options_make_the_quant_config_they_name(flags, want):
    from nibble.cli import config_from_args

    cfg = config_from_args(build_parser().parse_args(["quantize", "--out", "q", *flags]), None)
    assert {name: getattr(cfg, name) for name in want} == want


def test_several_prompts_size_the_engine_for_no_more_than_they_are(model_dir, monkeypatch):
    """Its cache is allocated for max_batch sequences up front: two prompts took the memory of eight."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nibble.cli import generate_texts
    from nibble.eval.engine import Engine

    sized, init = [], Engine.__init__
    monkeypatch.setattr(Engine, "__init__", lambda self, model, **k: sized.append(k["max_batch"]) or
                        init(self, model, **k))
    model, tok = AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert len(list(generate_texts(model, tok, ["the capital", "the sea"], 2, chat=False, batch_size=8))) == 2
    assert len(list(generate_texts(model, tok, ["the capital", "the sea", "a"], 2, chat=False, batch_size=2))) == 3
    assert sized == [2, 2]


def test_eval_tasks_scores_as_many_requests_a_pass_as_batch_size_says(model_dir, monkeypatch, capsys):
    import nibble.eval.tasks

    taken = []
    monkeypatch.setattr(nibble.eval.tasks, "evaluate_tasks", lambda model, tok, tasks, **k: taken.append((tasks, k))
                        or {"piqa": dict(acc=0.5, n=2), "average": {"acc": 0.5}})
    main(["eval", "tasks", "--tasks", "piqa", "--limit", "2", "--batch-size", "3", "--model", str(model_dir),
          "--device", "cpu", "--quant", "none"])
    assert taken == [(["piqa"], dict(limit=2, batch_size=3))] and json.loads(capsys.readouterr().out)["piqa"]


@pytest.mark.parametrize("init, fix", [("gptq", "--batch-size (now 4), --seq-len (now 256), --calib-samples (now 64) or "
                                                "--calib-seq-len"), ("rtn", "--batch-size (now 4) or --seq-len (now 256)")])
def test_qat_out_of_memory_names_the_calibration_options_where_it_starts_from_gptq(init, fix):
    from nibble.cli import out_of_memory

    args = SimpleNamespace(command="qat", init=init, batch_size=4, seq_len=256, calib_samples=64, calib_seq_len=None)
    said = out_of_memory(args, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB."))
    assert said.startswith(f"nibble qat: CUDA out of memory. Tried to allocate 1.00 GiB: give a smaller {fix}, or "), said


def test_an_out_after_an_equals_sign_that_names_the_model_folder_is_refused(model_dir, tmp_path, monkeypatch):
    """"--out=~/m" is the folder "--model=~/m" names: writing there replaced the 16-bit source."""
    import shutil
    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(model_dir, tmp_path / "m")
    with pytest.raises(SystemExit, match="^nibble quantize: --out "):
        main(["quantize", "--model=~/m", "--device", "cpu", "--group-size", "32", "--out=~/m"])
    assert not (tmp_path / "m" / "quantize_config.json").exists() and "quantization_config" not in \
        (tmp_path / "m" / "config.json").read_text()


def test_generate_texts_refuses_a_batch_of_no_prompt_and_a_longest_prompt_past_the_context(model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nibble.cli import generate_texts

    model, tok = AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    with pytest.raises(ValueError, match="^batch_size must be >= 1, got 0$"):
        generate_texts(model, tok, ["the sea"], 2, chat=False, batch_size=0)
    short, long = tok("the").input_ids, tok("a haiku about the sea " * 8).input_ids
    room = 256 - len(long)  # the longest prompt's, and not the shortest's, is what the context holds
    with pytest.raises(ValueError, match=rf"^a prompt of {len(long)} tokens and max_new_tokens={room + 1} exceed"):
        generate_texts(model, tok, ["the", "a haiku about the sea " * 8], room + 1, chat=False)
    assert len(short) < len(long)


@pytest.mark.parametrize("flags, drop", [(["--quantize-lm-head"], "--quantize-lm-head"),
                                         (["--float-zero", "--quantize-lm-head"], "--float-zero / --quantize-lm-head")])
def test_an_export_of_a_float_model_refuses_the_options_it_cannot_hold_before_it_loads(flags, drop, monkeypatch):
    import nibble.cli as cli

    monkeypatch.setattr(cli, "load", lambda *a, **k: pytest.fail("loaded the model before the check"))
    with pytest.raises(SystemExit, match=f"^nibble quantize: --format awq holds W4A16 weights with integer zero points "
                                         f"and a 16-bit lm_head: drop {drop}, or write --format nibble"):
        main(["quantize", "--format", "awq", "--out", "unused", *flags])


def test_clip_search_with_a_calibrated_method_is_taken_for_a_quantized_head():
    """RTN quantizes the head of --quantize-lm-head, whatever --method does to the other layers."""
    from nibble.cli import check_quant_args

    args = build_parser().parse_args(["quantize", "--out", "q", "--method", "gptq", "--clip-search",
                                      "--quantize-lm-head"])
    args.quantized = False
    check_quant_args(args)
    args.quantize_lm_head = False
    with pytest.raises(ValueError, match="^--clip-search is RTN's clipping search, and --method gptq runs its own"):
        check_quant_args(args)
