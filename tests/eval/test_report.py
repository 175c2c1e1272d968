"""The report: a real (tiny) accuracy + memory run on the CPU, and the speed tables/plots on fabricated numbers."""
import argparse
import io
import json
import math
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import tiny_model
from nibble.bench.timing import json_text
from nibble.eval import ALL_TASKS, report, report_command


class ByteTokenizer:
    """One token per UTF-8 byte (matches the 256-token tiny model)."""

    bos_token_id = None
    eos_token_id = 0

    def encode(self, text, add_special_tokens=True):
        return list(text.encode("utf-8"))


def tiny_loader():
    torch.manual_seed(0)
    return tiny_model(), ByteTokenizer()


def test_config_names_map_to_quant_configs():
    assert report.quant_config("bf16") is None
    assert report.quant_config("w4a16").group_size == 128
    assert report.quant_config("w4a16", tiny_model(hidden_size=96, intermediate_size=192)).group_size == 32
    assert report.quant_config("w4a16-g64").group_size == 64
    qc = report.quant_config("w4a4-hadamard")
    assert (qc.mode, qc.rotation, qc.group_size, qc.symmetric) == ("w4a4", "hadamard", -1, True)
    assert report.quant_config("w4a16", clip_search=False).clip_search is False
    assert report.quant_config("w4a16").modules_to_not_convert == ("lm_head",)
    qc = report.quant_config("w4a4-hadamard-lmhead")
    assert (qc.mode, qc.rotation, qc.modules_to_not_convert) == ("w4a4", "hadamard", ())
    assert report.quant_config("w4a16-lmhead-g64").group_size == 64
    assert report._describe({"quant_config": qc.to_dict()}) == "w4a4 per-channel rtn hadamard +lm_head"
    assert report._describe({"quant_config": report.quant_config("w4a16").to_dict()}) == "w4a16 g128 rtn noclip"
    qc = report.quant_config("w4a4-hadamard-gptq")
    assert (qc.mode, qc.rotation, qc.method) == ("w4a4", "hadamard", "gptq")
    assert report._describe({"quant_config": qc.to_dict()}) == "w4a4 per-channel gptq hadamard"
    assert report.quant_config("w4a4-hadamard-gptq", method="rtn").method == "rtn"  # what the speed models take
    assert (report.quant_config("w4a16-g64-awq").method, report.quant_config("w4a16-g64-awq").group_size) == ("awq", 64)
    # no layer is RTN's, whose clip search "noclip" says was off: AWQ ran its own
    assert report._describe({"quant_config": report.quant_config("w4a16-g64-awq").to_dict()}) == "w4a16 g64 awq"


@pytest.mark.parametrize("name, message", [
    ("w4a16-g7", "group_size must be -1 (one group per output channel) or a positive multiple of 8"),  # QuantConfig's
    ("w4a4-awq", "unknown part -awq: w4a4 takes -hadamard, -gptq, -lmhead"),
    ("w4a4-g64", "unknown part -g64: w4a4 takes -hadamard, -gptq, -lmhead"),  # its channels are its groups
    ("w4a16-foo", "unknown part -foo: w4a16 takes -gN (group size), -gptq, -awq, -lmhead"),
    ("w4a16-g\u00b2", "unknown part -g\u00b2: w4a16 takes -gN (group size), -gptq, -awq, -lmhead"),  # isdigit, not int
    ("w3a16", "unknown config; use bf16, w4a16"), ("bf16-lmhead", "the 16-bit baseline takes no suffix: use bf16"),
    # a part that repeats a choice: the last one won without a word (w4a16-awq-gptq ran GPTQ under that name)
    ("w4a16-awq-gptq", "-awq and -gptq both choose the method: give one"),
    ("w4a16-g64-g32", "-g64 and -g32 both choose the group size: give one"),
    ("w4a4-hadamard-hadamard", "-hadamard given twice"), ("w4a16-lmhead-lmhead", "-lmhead given twice")])
def test_every_refused_config_name_is_said_with_the_name(name, message, tmp_path):
    """QuantConfig's refusal of ``w4a16-g7`` was said bare ("group_size must be -1 ..."), where the others named the
    config: a report of several left the reader to guess which one."""
    with pytest.raises(ValueError, match=f"^config {name}: {re.escape(message)}"):
        report.quant_config(name)
    with pytest.raises(ValueError, match=f"^config {name}: {re.escape(message)}"):
        report.run_report(None, tmp_path / "report", configs=("bf16", name), speed=False, loader=tiny_loader,
                          log=lambda *_: None)


def test_report_on_a_tiny_model_writes_markdown_json_and_plots(tmp_path):
    logs = []
    report.run_report(None, tmp_path, configs=("bf16", "w4a16", "w4a4"), tasks_limit=2,
                      ppl_max_tokens=300, loader=tiny_loader, progress=False, log=logs.append)

    written = {p.name for p in tmp_path.iterdir()}
    assert written >= {"report.md", "report.json", "vram.png", "accuracy.png"}
    data = json.loads((tmp_path / "report.json").read_text())
    # a speed plot only where something was timed (CUDA): on the CPU it was an empty chart
    timed = any(report._rows(r) for r in data["configs"].values()) or any(
        "skipped" not in v for v in data["speed_models"].values())
    assert ("speedup.png" in written) == timed
    assert set(data) >= {"meta", "configs", "speed_models", "summary"}
    assert "partial" not in data["meta"]  # a run that completes is whole (it was written partial after each config)
    assert list(data["configs"]) == ["bf16", "w4a16", "w4a4"]
    for name, r in data["configs"].items():
        assert "error" not in r, r.get("error")
        assert r["perplexity"]["tokens"] == 255 and r["perplexity"]["ppl"] > 1
        assert set(r["tasks"]) == set(ALL_TASKS) | {"average"}
        assert all(r["tasks"][t]["n"] == 2 for t in ALL_TASKS)
        assert set(r["weights"]["kinds"]) == {"embeddings", "attention", "mlp", "lm_head", "norms", "other"}
    assert data["configs"]["bf16"]["quant_config"] is None
    assert data["configs"]["w4a16"]["quant_config"]["group_size"] == 64  # the tiny model's 64-wide linears
    # the quantized linears shrink; accuracy of a random model is whatever it is, but it is there
    s = data["summary"]["model"]
    # against their bytes in 16 bits, though this float32 run holds 4 bytes a weight: 4 bits + a 16-bit scale and
    # zero per 64 weights = 0.28125x
    assert data["configs"]["bf16"]["dtype"] == "float32"
    assert s["w4a16"]["linear_bytes_ratio"] == pytest.approx(0.28125) and s["bf16"]["linear_bytes_ratio"] == 1.0
    assert s["bf16"]["weight_bytes_ratio"] == 1.0 and 0.28125 < s["w4a16"]["weight_bytes_ratio"] < 1
    if not torch.cuda.is_available():
        assert "skipped" in data["configs"]["bf16"]["peak"] and "CUDA" in data["configs"]["bf16"]["speed"]["skipped"]
        assert data["speed_models"]["llama-2-7b"] == {"skipped": report.NO_GPU}
        assert any("no CUDA GPU" in line for line in logs)
    # the baseline ran in float32 here: its lines said "[bf16]"
    assert [line.split("]")[0] for line in logs if "WikiText-2 ppl" in line] == ["[bf16 in float32", "[w4a16", "[w4a4"]
    md = (tmp_path / "report.md").read_text()
    assert "| metric | bf16 | w4a16 | w4a4 |" in md
    assert "WikiText-2 ppl" in md and "piqa acc" in md and "peak MiB" in md
    # what was measured, said beside the numbers (a --limit run read as a full one), each acc with its stderr
    piqa = data["configs"]["w4a16"]["tasks"]["piqa"]
    assert "| piqa acc | " in md and f"{piqa['acc']:.4f} ± {piqa['acc_stderr']:.4f}" in md
    assert ("on the first 2 documents of each task (--limit: a subset, for testing; n = 2)" in md
            and f"average: the mean acc of {', '.join(ALL_TASKS)}" in md)
    assert "token-level (GPTQ's protocol, not lm-eval's word perplexity) on the first 300 tokens of the test set, " \
           "in 1 non-overlapping window of 256 tokens (255 predicted)" in md


def test_the_report_shows_its_quantization_and_its_lines_as_they_come(tmp_path, monkeypatch, capsys):
    """Each config was quantized without a bar (W4A4 + Hadamard: minutes on a CPU with no sign of life), and the log
    lines, printed block-buffered into a file or a pipe (`> log`, `| tee`), reached it only when the run ended."""
    written = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(written, encoding="utf-8"))  # buffered, as into a file
    run = dict(configs=("w4a16",), accuracy=False, speed=False, loader=tiny_loader)
    report.run_report(None, tmp_path, **run)
    assert f"wrote {tmp_path / 'report.md'}" in written.getvalue().decode()  # no flush of the run's own
    assert "quantizing w4a16" in capsys.readouterr().err
    report.run_report(None, tmp_path, progress=False, **run)
    assert "quantizing" not in capsys.readouterr().err


def test_calibrated_configs_are_calibrated_on_the_c4_excerpt(tmp_path, monkeypatch):
    from nibble.quantize import calibration

    sources = []
    batches = calibration.calibration_batches
    monkeypatch.setattr(calibration, "calibration_batches",
                        lambda tok, *a, **k: sources.append(k.get("source", "c4")) or batches(tok, *a, **k))
    results = report.run_report(None, tmp_path, configs=("w4a4-hadamard", "w4a4-hadamard-gptq"), tasks_limit=1,
                                ppl_max_tokens=300, speed=False, loader=tiny_loader, progress=False,
                                log=lambda *a: None)
    rtn, gptq = (results["configs"][c] for c in ("w4a4-hadamard", "w4a4-hadamard-gptq"))
    assert "error" not in gptq, gptq.get("error")
    assert gptq["quant_config"]["method"] == "gptq" and rtn["quant_config"]["method"] == "rtn"
    assert gptq["perplexity"]["ppl"] != rtn["perplexity"]["ppl"]  # other weights
    assert sources == ["c4"]  # calibrated once, for the GPTQ config only


def test_reports_of_separate_runs_merge_into_one(tmp_path):
    """One config per run (as on a time-limited device), merged: same rows, ratios against the bf16 of the
    other run, each run's identity kept; a config measured twice is refused."""
    runs = [report.run_report(None, tmp_path / c, configs=(c,), tasks_limit=1, ppl_max_tokens=100, speed=False,
                              loader=tiny_loader, progress=False, log=lambda *a: None) for c in ("bf16", "w4a16")]
    merged = report.merge_reports(runs)
    assert list(merged["configs"]) == merged["meta"]["configs"] == ["bf16", "w4a16"]
    assert merged["configs"]["w4a16"] == runs[1]["configs"]["w4a16"]
    assert [m["configs"] for m in merged["meta"]["merged_from"]] == [["bf16"], ["w4a16"]]
    assert [m["source_sha256"] for m in merged["meta"]["merged_from"]] == [r["meta"]["source_sha256"] for r in runs]
    ratio = merged["summary"]["model"]["w4a16"]["linear_bytes_ratio"]
    assert ratio == pytest.approx(0.28125) and merged["summary"]["model"]["bf16"]["linear_bytes_ratio"] == 1.0
    assert "w4a16" not in runs[1]["summary"].get("model", {})  # alone, w4a16 had no bf16 to compare with
    report.write_markdown(merged, tmp_path / "merged.md")
    assert "| metric | bf16 | w4a16 |" in (tmp_path / "merged.md").read_text()
    with pytest.raises(ValueError, match="more than one"):
        report.merge_reports([runs[0], runs[0]])
    # a config that failed in one run is measured again in another: the rerun's results are kept
    failed = {**runs[0], "configs": {"w4a16": {"config": "w4a16", "error": "RuntimeError: out of time"}}}
    assert report.merge_reports([failed, runs[1]])["configs"]["w4a16"] == runs[1]["configs"]["w4a16"]
    # report.md says once how the accuracy rows were measured: a run of another --limit is refused, not mislabelled
    other = json.loads(json.dumps(runs[1], default=str))
    other["meta"]["tasks_limit"] = 100
    with pytest.raises(ValueError, match="measured accuracy differently .* merge runs of one protocol"):
        report.merge_reports([runs[0], other])


def test_source_hash_follows_the_sources_only(tmp_path):
    """The report's ``source_sha256``: changes with any .py / .cu / .cuh byte or path, not with other files."""
    from nibble.bench.timing import env_meta, source_hash

    (tmp_path / "kernels").mkdir()
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "kernels" / "k.cu").write_text("// kernel\n")
    first = source_hash(tmp_path)
    assert len(first) == 16 and first == source_hash(tmp_path)
    (tmp_path / "notes.md").write_text("not code")
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "a.py").write_text("stale")
    assert source_hash(tmp_path) == first
    (tmp_path / "kernels" / "k.cu").write_text("// kernel, edited\n")
    edited = source_hash(tmp_path)
    assert edited != first
    (tmp_path / "kernels" / "k.cu").rename(tmp_path / "k.cu")
    moved = source_hash(tmp_path)
    assert moved != edited
    (tmp_path / "kernels" / "shared.cuh").write_text("// a header the kernels include\n")
    assert source_hash(tmp_path) != moved
    assert env_meta()["source_sha256"] == source_hash()


def test_the_commit_is_nibbles_own_checkouts_never_a_repository_around_an_installed_nibble(tmp_path, monkeypatch):
    """An installed nibble inside a project's .venv recorded that project's HEAD (and its -dirty) as nibble's."""
    import subprocess

    monkeypatch.delenv("NIBBLE_GIT_COMMIT", raising=False)

    from nibble.bench.timing import env_meta, git_commit

    def repo(path):
        path.mkdir(parents=True)
        git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
        subprocess.run(["git", "init", "-q"], cwd=path, check=True)
        (path / "nibble").mkdir(exist_ok=True)
        (path / "nibble" / "a.py").write_text("x = 1\n")
        subprocess.run([*git, "add", "-A"], cwd=path, check=True)
        subprocess.run([*git, "commit", "-qm", "c"], cwd=path, check=True)
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=path, capture_output=True, text=True).stdout.strip()

    head = repo(tmp_path / "checkout")
    assert git_commit(tmp_path / "checkout" / "nibble") == head
    (tmp_path / "checkout" / "nibble" / "a.py").write_text("x = 2\n")
    assert git_commit(tmp_path / "checkout" / "nibble") == head + "-dirty"
    repo(tmp_path / "project")
    installed = tmp_path / "project" / ".venv" / "site-packages" / "nibble"
    installed.mkdir(parents=True)
    assert git_commit(installed) == "no-commit"
    assert env_meta()["nibble"] == __import__("nibble").__version__


def test_an_untracked_file_in_the_checkout_leaves_its_commit_clean(tmp_path, monkeypatch):
    """-dirty says a tracked source differs from the commit; a results file or a scratch script beside the sources
    (untracked) does not change which code ran."""
    import subprocess

    from nibble.bench.timing import git_commit

    monkeypatch.delenv("NIBBLE_GIT_COMMIT", raising=False)
    checkout = tmp_path / "checkout"
    (checkout / "nibble").mkdir(parents=True)
    (checkout / "nibble" / "a.py").write_text("x = 1\n")
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q"], cwd=checkout, check=True)
    subprocess.run([*git, "add", "-A"], cwd=checkout, check=True)
    subprocess.run([*git, "commit", "-qm", "c"], cwd=checkout, check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=checkout, capture_output=True, text=True).stdout.strip()
    (checkout / "nibble" / "scratch.py").write_text("y = 2\n")
    assert git_commit(checkout / "nibble") == head


def test_the_commit_a_device_run_is_given_is_the_one_recorded(tmp_path, monkeypatch):
    """A copy of the working tree on a GPU machine carries a stale .git: its JSON named a commit (85c2cda-dirty) whose
    sources were not the ones that ran. device_suite.sh gives the commit the copy was made from."""
    from nibble.bench.timing import env_meta, git_commit

    monkeypatch.setenv("NIBBLE_GIT_COMMIT", "c0dc84a")
    assert git_commit() == "c0dc84a" and env_meta()["git_commit"] == "c0dc84a"
    monkeypatch.setenv("NIBBLE_GIT_COMMIT", "")
    assert git_commit() != ""


def test_a_failing_config_is_reported_not_fatal(tmp_path):
    def loader():
        model, tok = tiny_loader()
        if loader.calls == 1:
            raise RuntimeError("boom")
        loader.calls += 1
        return model, tok
    loader.calls = 0
    results = report.run_report(None, tmp_path, configs=("bf16", "w4a16"), tasks_limit=1, ppl_max_tokens=300,
                                speed_models=(), tasks=("boolq",), loader=loader, progress=False, log=lambda *_: None)
    assert "perplexity" in results["configs"]["bf16"]
    assert results["configs"]["w4a16"]["error"] == "RuntimeError: boom"
    assert "**w4a16 failed**" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("configs", [["bf16"], ["bf16", "w4a16"]])
@pytest.mark.parametrize("model, says", [("missing", "is not a local .gguf file or directory"),
                                         ("empty", "is not a Hugging Face model directory: it has no config.json")])
def test_a_model_path_that_holds_no_model_is_refused_before_any_config(model, says, configs, tmp_path, capsys):
    """`nibble report --model` of a path that was not there (or held no model) ran each config into it, and wrote a
    report of as many failures of the same error: it is said once, as the other commands say it, and nothing is
    written."""
    from nibble.cli import main

    (tmp_path / "empty").mkdir()
    out = tmp_path / "report"
    with pytest.raises(SystemExit, match=f"^nibble report: .*{model}'? {says}"):
        main(["report", "--model", str(tmp_path / model), "--out", str(out), "--configs", *configs, "--no-speed",
              "--limit", "1", "--tasks", "boolq", "--ppl-max-tokens", "300", "--device", "cpu"])
    assert not out.exists()


def test_the_command_fails_when_any_config_failed_and_says_which(tmp_path, monkeypatch, capsys):
    """What succeeded is written, and the exit status is 1 with the failed config named at the end (it was 0
    unless every config failed)."""
    from nibble.cli import main

    def loader():
        model, tok = tiny_loader()
        loader.calls += 1
        if loader.calls == 2:
            raise RuntimeError("boom")
        return model, tok
    loader.calls = 0
    monkeypatch.setattr(report, "_default_loader", lambda *a: loader)
    argv = ["report", "--out", str(tmp_path), "--configs", "bf16", "w4a16", "--limit", "1", "--tasks", "boolq",
            "--ppl-max-tokens", "300", "--speed-models", "--device", "cpu"]
    assert main(argv) == 1
    assert capsys.readouterr().err.strip().endswith("1 config failed (the others are in "
                                                    f"{tmp_path / 'report.md'}): w4a16: RuntimeError: boom")
    assert "perplexity" in json.loads((tmp_path / "report.json").read_text())["configs"]["bf16"]
    loader.calls = -5  # no failure
    assert main(argv) == 0
    def failing():
        raise RuntimeError("boom")
    monkeypatch.setattr(report, "_default_loader", lambda *a: failing)  # every config fails: no others in report.md
    assert main(argv) == 1
    assert capsys.readouterr().err.strip().endswith(f"2 configs failed (every one; {tmp_path / 'report.md'} says so): "
                                                    "bf16: RuntimeError: boom; w4a16: RuntimeError: boom")


@pytest.mark.parametrize("kwargs, message", [(dict(tasks_limit=0), "tasks_limit must be an integer >= 1, got 0"),
                                             (dict(tasks_limit=2.5), "tasks_limit must be an integer >= 1, got 2.5"),
                                             (dict(batch_size=0), "batch_size must be an integer >= 1"),
                                             (dict(ppl_max_tokens=1), "ppl_max_tokens must be an integer >= 2"),
                                             (dict(speed_rounds=0), "speed_rounds must be an integer >= 1")])
def test_counts_that_would_fail_every_config_are_refused_before_any_work(kwargs, message, tmp_path):
    def no_loader():
        raise AssertionError("the model must not be loaded")

    with pytest.raises(ValueError, match=message):
        report.run_report(None, tmp_path, configs=("bf16",), speed=False, loader=no_loader, log=lambda *_: None,
                          **kwargs)


def test_an_interrupted_report_keeps_the_configs_that_finished_marked_partial(tmp_path, monkeypatch, capsys):
    """Ctrl-C threw away every config that finished (all was written after the last) and left an empty --out. The
    report is written after each config, so a run killed part way keeps them too; on Ctrl-C once more, marked
    interrupted, with its plots, and the command exits 130 with one line saying so."""
    from nibble.cli import main

    out = tmp_path / "report"
    out.mkdir()
    for name in report.PLOTS:
        (out / name).write_bytes(b"an earlier run's plot")
    evaluate = report._evaluate_config

    def second_interrupted(name, *args):
        if name == "w4a16":
            # what a run killed here leaves: the first config's report, partial, and no plot of the earlier run
            data = json.loads((out / "report.json").read_text())
            assert data["meta"]["partial"] == {"state": "running", "configs_left": ["w4a16", "w4a4"],
                                               "speed_models_left": []}
            assert data["meta"]["configs"] == list(data["configs"]) == ["bf16"] and not list(out.glob("*.png"))
            assert "**Partial report**, written while the run went on" in (out / "report.md").read_text()
            raise KeyboardInterrupt
        return evaluate(name, *args)
    monkeypatch.setattr(report, "_evaluate_config", second_interrupted)
    monkeypatch.setattr(report, "_default_loader", lambda *a: tiny_loader)
    argv = ["report", "--out", str(out), "--configs", "bf16", "w4a16", "w4a4", "--limit", "1", "--tasks", "boolq",
            "--ppl-max-tokens", "300", "--speed-models"]
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 130
    assert capsys.readouterr().err.endswith(f"nibble report: interrupted; {out / 'report.md'} and report.json hold "
                                            "what finished, marked partial: w4a16 and w4a4 not measured\n")
    data = report.read_json(out / "report.json")
    assert data["meta"]["partial"] == {"state": "interrupted", "configs_left": ["w4a16", "w4a4"],
                                       "speed_models_left": []}
    assert "perplexity" in data["configs"]["bf16"] and data["meta"]["configs"] == ["bf16"]
    md = (out / "report.md").read_text()
    assert "**Partial report**, interrupted (Ctrl-C): w4a16 and w4a4 not measured." in md
    assert "| metric | bf16 |" in md
    assert {p.name for p in out.glob("*.png")} == {"vram.png", "accuracy.png"}
    assert (out / "vram.png").read_bytes() != b"an earlier run's plot"
    # the rest, run apart and merged, is whole: the merge is not partial, its sources say which one was
    merged = report.merge_reports([data, {**data, "meta": {**data["meta"], "partial": None}, "configs": {}}])
    assert "partial" not in merged["meta"] and merged["meta"]["merged_from"][0]["partial"]["state"] == "interrupted"

    # stopped before any config finished: nothing written, no folder left (as a refused report leaves none)
    def first_interrupted(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(report, "_evaluate_config", first_interrupted)
    fresh = tmp_path / "fresh"
    with pytest.raises(SystemExit) as stopped:
        main(["report", "--out", str(fresh), "--configs", "w4a16", "bf16", "--no-accuracy", "--speed-models"])
    assert stopped.value.code == 130 and not fresh.exists()
    assert capsys.readouterr().err.endswith(f"nibble report: interrupted before any config finished; nothing was "
                                            f"written to {fresh}\n")
    monkeypatch.setenv("NIBBLE_TRACEBACK", "1")  # kept as the exception, as every command's Ctrl-C (it was ignored)
    with pytest.raises(report.ReportInterrupted, match="^interrupted before any config finished"):
        main(["report", "--out", str(fresh), "--configs", "w4a16", "bf16", "--no-accuracy", "--speed-models"])


def test_speed_models_alone_interrupted_keep_the_one_that_finished(tmp_path, monkeypatch):
    """--no-model: a speed model timed before Ctrl-C is kept, marked partial, as a config of the model is (no config
    finished: it was said as nothing finished, and thrown away)."""
    def measure(sm, *args):
        if sm == "llama-3-8b":
            raise KeyboardInterrupt
        return {"bf16": {"config": "bf16", "error": "RuntimeError: boom"}}
    gpu = SimpleNamespace(cuda=SimpleNamespace(is_available=lambda: True))  # the speed models run on a GPU only
    monkeypatch.setattr(report, "torch", gpu)
    monkeypatch.setattr(report.speed_mod, "device_ceilings", lambda: {})
    monkeypatch.setattr(report, "measure_speed_models", measure)
    with pytest.raises(report.ReportInterrupted, match="^interrupted; .* marked partial: the speed model llama-3-8b "
                                                       "not measured"):
        report.run_report(None, tmp_path, configs=("bf16",), model=False, speed_models=("llama-2-7b", "llama-3-8b"),
                          log=lambda *_: None)
    assert report.read_json(tmp_path / "report.json")["meta"]["speed_models"] == ["llama-2-7b"]


def test_a_run_without_accuracy_does_not_check_a_perplexity_window_it_would_not_score(tmp_path, monkeypatch):
    """--no-accuracy runs no perplexity: its window (here a cut shorter than one window) is not checked."""
    tiny_model().save_pretrained(tmp_path / "m")  # its config: the context the window is checked against
    monkeypatch.setattr(report, "_default_loader", lambda *a: tiny_loader)
    results = report.run_report(str(tmp_path / "m"), tmp_path / "out", configs=("bf16",), accuracy=False, speed=False,
                                ppl_seq_len=64, ppl_max_tokens=32, progress=False, log=lambda *_: None)
    assert "weights" in results["configs"]["bf16"]


def test_a_target_met_exactly_passes():
    """w4a16's peak at exactly half of bf16's meets "<= 0.5"."""
    gib = 2**30
    seven = {"bf16": {"weights": fake_weights(12 * gib, 13 * gib), "peak": {"peak_bytes": 14 * gib}},
             "w4a16": {"weights": fake_weights(3 * gib, 4 * gib), "peak": {"peak_bytes": 7 * gib}}}
    results = {"meta": {"configs": list(seven)}, "configs": {}, "speed_models": {"llama-2-7b": seven}}
    t = report.summarize(results)["targets_llama-2-7b"]
    assert t["w4a16 peak memory / bf16"] == {"value": 0.5, "target": "<= 0.5", "pass": True}


def test_an_unknown_speed_model_is_refused_before_any_work(tmp_path):
    with pytest.raises(ValueError, match=r"^unknown speed model\(s\) \['llama-9'\]; choose from \['llama-2-7b'"):
        report.run_report(None, tmp_path / "out", configs=("bf16",), speed_models=("llama-9",), loader=tiny_loader,
                          log=lambda *_: None)
    assert not (tmp_path / "out").exists()


def test_a_report_may_be_written_into_the_model_folder(tmp_path, monkeypatch):
    """report.md is no checkpoint: the --model folder as --out replaces nothing (quantize's refusal of it is not
    report's)."""
    from nibble.cli import main

    tiny_model().save_pretrained(tmp_path)
    monkeypatch.setattr(report, "run_report", lambda *a, **k: {"configs": {}, "speed_models": {}})
    assert main(["report", "--model", str(tmp_path), "--out", str(tmp_path), "--no-speed"]) == 0


def test_a_ratio_to_nothing_is_no_ratio():
    """A 16-bit baseline of 0 bytes (or none measured): no ratio, not a ZeroDivisionError."""
    assert report._ratio(3, 0) is None and report._ratio(None, 2) is None and report._ratio(3, 2) == 1.5


def test_a_refused_report_leaves_no_out_folder(tmp_path):
    """run_report made its folder before its checks: a refused `nibble report` left an empty report/ behind."""
    def rotation_refused():
        return tiny_model(intermediate_size=1888), ByteTokenizer()

    out = tmp_path / "report"
    for configs, kwargs, message in ((("w4a8",), {}, "unknown config"), (("bf16", "fp16"), {}, "more than once"),
                                     (("bf16",), dict(tasks_limit=0), "tasks_limit must be an integer >= 1"),
                                     (("w4a4-hadamard",), dict(loader=rotation_refused), "cannot rotate")):
        with pytest.raises(ValueError, match=message):
            report.run_report(None, out, configs=configs, speed=False, log=lambda *_: None,
                              **{"loader": tiny_loader, **kwargs})
        assert not out.exists()


def test_a_config_the_model_cannot_take_is_refused_before_any_config_runs(tmp_path, monkeypatch):
    """w4a4-hadamard on a model the rotation cannot take (no Hadamard matrix of size 1888) failed at its turn, after
    the configs before it had run, minutes each on a real model; a group size no layer takes, likewise."""
    def loader():
        loader.calls += 1
        return tiny_model(intermediate_size=1888), ByteTokenizer()
    loader.calls = 0
    evaluate = report._evaluate_config
    monkeypatch.setattr(report, "_evaluate_config", lambda *a: pytest.fail("a config ran before every one was checked"))
    for configs, message in ((("bf16", "w4a16", "w4a4-hadamard"), "config w4a4-hadamard: cannot rotate this model: its "
                                                                  "intermediate_size is 1888. no Hadamard matrix"),
                             (("w4a4", "w4a16-g128"), "config w4a16-g128: model.layers.0.self_attn.q_proj: "
                                                      "in_features=64 is not divisible by group_size=128")):
        with pytest.raises(ValueError, match=f"^{re.escape(message)}"):
            report.run_report(None, tmp_path, configs=configs, speed=False, loader=loader, log=lambda *_: None)
    assert loader.calls == 2  # one model each, for the checks
    monkeypatch.setattr(report, "_evaluate_config", evaluate)
    loader.calls = 0
    report.run_report(None, tmp_path, configs=("bf16", "w4a16"), accuracy=False, speed=False, loader=loader,
                      log=lambda *_: None)
    assert loader.calls == 2  # the model loaded for the checks is the first config's


def test_a_loaders_model_has_its_window_checked_against_its_context_once_loaded(tmp_path, monkeypatch):
    """run_report cannot read a loader's model's context before it loads: a window longer than it is clamped and
    scored, as the perplexity does (it was refused before the load), and a cut too short even for the clamped window
    is refused once the model is loaded, before the quantization."""
    def short_context():
        torch.manual_seed(0)
        return tiny_model(max_position_embeddings=64), ByteTokenizer()

    run = dict(configs=("w4a16",), tasks=("boolq",), tasks_limit=1, ppl_seq_len=128, loader=short_context,
               speed=False, progress=False, log=lambda *_: None)
    with pytest.warns(UserWarning, match="seq_len=128 exceeds the model's context"):
        ppl = report.run_report(None, tmp_path, ppl_max_tokens=100, **run)["configs"]["w4a16"]["perplexity"]
    assert (ppl["seq_len"], ppl["windows"]) == (64, 1)
    monkeypatch.setattr(report.speed_mod, "quantize_in_place", lambda *a: pytest.fail("quantized before the check"))
    error = report.run_report(None, tmp_path, ppl_max_tokens=50, **run)["configs"]["w4a16"]["error"]
    assert error == ("ValueError: ppl_max_tokens 50 is fewer tokens than one window of ppl_seq_len 128 (clamped to the "
                     "model's context, 64): no window would be scored; give ppl_max_tokens >= 64, or a shorter "
                     "ppl_seq_len")


def fake_speed_rows(config: str, prefill_ms: dict, decode_tps: dict) -> list[dict]:
    rows = [dict(phase="prefill", batch=b, tokens=t, ms=ms, tflops=100.0, pct_bf16_peak=12.0)
            for (b, t), ms in prefill_ms.items()]
    rows += [dict(phase="decode", batch=b, tokens=128, prompt=128, ms_per_step=1000 * b / tps, tokens_per_s=tps,
                  weight_gbps=3000.0, total_gbps=3200.0, pct_copy_roofline=70.0) for b, tps in decode_tps.items()]
    return rows


def fake_weights(linear_bytes: int, total_bytes: int) -> dict:
    kinds = {k: {"bytes": 0, "quantized_bytes": 0, "dense_bytes": 0} for k in report.mem_mod.KINDS}
    kinds["attention"]["bytes"] = linear_bytes // 3
    kinds["mlp"]["bytes"] = linear_bytes - linear_bytes // 3
    kinds["embeddings"]["bytes"] = total_bytes - linear_bytes
    return {"kinds": kinds, "total_bytes": total_bytes, "quantized_bytes": 0, "dense_bytes": total_bytes,
            "tied_lm_head": False}


def test_speed_tables_targets_and_plots_from_measured_numbers(tmp_path, monkeypatch):
    """The CUDA half of the report (tables, speedups, target checks, plots) on fabricated measurements."""
    gib = 2**30
    seven = {
        "bf16": {"weights": fake_weights(12 * gib, 13 * gib), "peak": {"peak_bytes": 14 * gib},
                 "speed": fake_speed_rows("bf16", {(1, 128): 10.0, (1, 512): 30.0}, {1: 100.0})},
        "w4a16": {"weights": fake_weights(int(3.2 * gib), int(4.2 * gib)), "peak": {"peak_bytes": 5 * gib},
                  "speed": fake_speed_rows("w4a16", {(1, 128): 9.0, (1, 512): 29.0}, {1: 300.0})},
        "w4a4": {"weights": fake_weights(3 * gib, 4 * gib), "peak": {"peak_bytes": 5 * gib},
                 "speed": fake_speed_rows("w4a4", {(1, 128): 5.0, (1, 512): 20.0}, {1: 250.0})},
        "w4a4-hadamard": {"error": "ModuleNotFoundError: nibble.models.rotation"},
    }
    results = {"meta": {"configs": list(seven), "tasks": list(ALL_TASKS), "model": "fake", "gpu": "NVIDIA H200",
                        "ceilings": {"copy_gbps": 4300.0, "bf16_tflops": 780.0}},
               "configs": {}, "speed_models": {"llama-2-7b": seven}}
    results["summary"] = report.summarize(results)

    t = results["summary"]["targets_llama-2-7b"]
    assert t["w4a16 decode speedup (batch 1)"] == {"value": 3.0, "target": ">= 2.5", "pass": True}
    assert t["w4a4 prefill speedup (batch 1, 128 tokens)"]["value"] == pytest.approx(2.0)
    assert t["w4a4 prefill speedup (batch 1, 512 tokens)"]["pass"] is False  # 1.5 < 1.6
    assert t["w4a16 quantized-linear bytes / bf16"]["value"] == pytest.approx(3.2 / 12)
    assert t["w4a16 peak memory / bf16"]["value"] == pytest.approx(5 / 14)

    report.write_markdown(results, tmp_path / "report.md")
    md = (tmp_path / "report.md").read_text()
    assert "## llama-2-7b (random weights): memory and speed" in md
    assert "5.00 ms **2.00x** (100 TFLOP/s)" in md
    assert "300 tok/s **3.00x** (3000 GB/s, 70% roofline)" in md
    shapes = re.findall(r"^\| (prefill b=1 T=\d+|decode b=1) \|", md, re.M)
    assert shapes == ["prefill b=1 T=128", "prefill b=1 T=512", "decode b=1"]  # prefill first, by prompt length
    assert "**w4a4-hadamard failed**" in md and "| w4a4 prefill speedup (batch 1, 512 tokens) | 1.500 | >= 1.6 | **no** |" in md
    plots = report.write_plots(results, tmp_path, log=lambda *_: None)
    # speed models only (no config scored the tasks): no empty accuracy chart
    assert [p.rsplit("/", 1)[-1] for p in plots] == ["speedup.png", "vram.png"]
    assert all((tmp_path / p).stat().st_size > 1000 for p in ("speedup.png", "vram.png"))
    figures = []  # the speedup panel's lines and the memory panel's bars are named in their legends
    monkeypatch.setattr(report, "_save", lambda fig, path: figures.append(fig) or str(path))
    report.write_plots(results, tmp_path, log=lambda *_: None)
    speedup, memory = ([t.get_text() for t in f.axes[0].get_legend().get_texts()] for f in figures)
    assert speedup == ["w4a16 b=1", "w4a4 b=1"] and "peak (512 + 128 tokens)" in memory


def test_speed_models_alternate_the_config_order_and_keep_the_median_round(monkeypatch):
    """Each config is rebuilt and timed in every round, the order alternating (bf16 not always first);
    memory is measured once; each row is the round with the median time, all rounds' times kept;
    a config that fails is reported and not tried again."""
    order, peaks = [], []
    prefill_ms = {"bf16": iter([10.0, 12.0, 11.0]), "w4a4": iter([6.0, 7.0, 5.0])}
    monkeypatch.setattr(report.speed_mod, "random_model", lambda name: torch.nn.Linear(2, 2))
    monkeypatch.setattr(report.speed_mod, "quantize_in_place", lambda model, qc: 0.0)
    monkeypatch.setattr(report.mem_mod, "weight_memory", lambda model: {"total_bytes": 1})
    monkeypatch.setattr(report.mem_mod, "peak_memory", lambda model: peaks.append(1) or {"peak_bytes": 2})
    monkeypatch.setattr(report.speed_mod, "release", lambda *a: None)

    def speed_benchmark(model, label, log=print):
        name = label.split("/")[1].split(" ")[0]
        order.append(name)
        if name == "w4a4-hadamard":
            raise RuntimeError("no kernel")
        ms = next(prefill_ms[name])
        return [dict(model=label, phase="prefill", batch=1, tokens=128, ms=ms),
                dict(model=label, phase="decode", batch=1, ms_per_step=ms / 10)]

    monkeypatch.setattr(report.speed_mod, "speed_benchmark", speed_benchmark)
    res = report.measure_speed_models("llama-2-7b", ["bf16", "w4a4-hadamard", "w4a4"], rounds=3, log=lambda *_: None)
    assert order == ["bf16", "w4a4-hadamard", "w4a4", "w4a4", "bf16", "bf16", "w4a4"]
    assert list(res) == ["bf16", "w4a4-hadamard", "w4a4"] and len(peaks) == 3
    assert res["w4a4-hadamard"]["error"] == "RuntimeError: no kernel"
    assert [r["ms"] for r in res["bf16"]["speed"] if r["phase"] == "prefill"] == [11.0]
    assert res["bf16"]["speed"][0]["round_ms"] == [10.0, 12.0, 11.0]
    assert res["bf16"]["speed"][0]["model"] == "llama-2-7b/bf16" and res["w4a4"]["speed"][1]["ms_per_step"] == 0.6
    assert res["w4a4"]["speed_rounds"] == 3


def test_report_cli_arguments_reach_run_report(tmp_path, monkeypatch):
    parser = report_command.add_report_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--out", str(tmp_path), "--configs", "bf16", "--limit", "1", "--tasks", "piqa",
                              "--ppl-max-tokens", "300", "--speed-models"])
    assert args.speed_models == [] and args.limit == 1
    monkeypatch.setattr(report, "_default_loader", lambda *a: tiny_loader)
    assert report_command.report_main(args) == 0
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["configs"]["bf16"]["tasks"]["piqa"]["n"] == 1 and data["meta"]["tasks_limit"] == 1
    taken = {}  # options left out (None, so that a refusal can tell them from given ones) are run_report's defaults
    monkeypatch.setattr(report, "run_report", lambda *a, **k: taken.update(k) or {"configs": {}, "speed_models": {}})
    assert report_command.report_main(parser.parse_args(["--out", str(tmp_path), "--no-speed"])) == 0
    assert taken.keys().isdisjoint({"tasks", "batch_size", "speed_models", "speed_rounds"}) and taken["speed"] is False
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # --speed-rounds is refused without a GPU
    assert report_command.report_main(parser.parse_args(["--out", str(tmp_path), "--speed-rounds", "3"])) == 0
    assert taken["speed_rounds"] == 3


def test_a_config_that_failed_on_a_speed_model_fails_the_command_and_is_named(tmp_path, monkeypatch, capsys):
    """A speed model's failed config (its error in results["speed_models"]) fails the command as the model's does."""
    parser = report_command.add_report_arguments(argparse.ArgumentParser())
    speed = {"llama-2-7b": {"bf16": {"config": "bf16", "speed": []},
                            "w4a16": {"config": "w4a16", "error": "RuntimeError: boom"}}}
    monkeypatch.setattr(report, "run_report", lambda *a, **k: {"configs": {"bf16": {}}, "speed_models": speed})
    assert report_command.report_main(parser.parse_args(["--out", str(tmp_path)])) == 1
    where = tmp_path / "report.md"
    assert capsys.readouterr().err.strip() == (f"nibble report: 1 config failed (the others are in {where}): "
                                               "llama-2-7b/w4a16: RuntimeError: boom")


def test_the_accuracy_plot_sets_each_configs_bars_side_by_side(tmp_path, monkeypatch):
    """Two configs' bars of a task: each 0.4 wide, the second beside the first, not over it."""
    figures, logs = [], []
    monkeypatch.setattr(report, "_save", lambda fig, path: figures.append(fig) or str(path))
    report.run_report(None, tmp_path, configs=("bf16", "w4a16"), tasks=("boolq",), tasks_limit=1, ppl_max_tokens=300,
                      speed=False, loader=tiny_loader, progress=False, log=logs.append)
    assert sum("] tasks average acc " in line for line in logs) == 2  # each config's, as it finishes
    (ax,) = [f.axes[0] for f in figures if f.axes[0].get_title().startswith("zero-shot accuracy")]
    # boolq's and the average's bars of bf16, then w4a16's
    assert [(round(p.get_x(), 3), round(p.get_width(), 3)) for p in ax.patches] == [(-0.2, 0.4), (0.8, 0.4),
                                                                                    (0.2, 0.4), (1.2, 0.4)]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the speed models would run for minutes")
def test_without_the_model_only_the_speed_models_run(tmp_path):
    def no_loader():
        raise AssertionError("the real model must not be loaded")

    results = report.run_report(None, tmp_path, configs=("bf16", "w4a16-lmhead"), loader=no_loader, model=False,
                                log=lambda *_: None)
    assert results["configs"] == {} and results["speed_models"] == {"llama-2-7b": {"skipped": report.NO_GPU}}
    assert results["meta"]["model"] == "none (speed models only)" and (tmp_path / "report.md").exists()
    # the configs are the speed models' columns: kept, where the real model measured none
    assert results["meta"]["configs"] == ["bf16", "w4a16-lmhead"]


def test_a_rerun_into_the_same_folder_leaves_no_plot_of_the_earlier_run(tmp_path):
    """A run without accuracy kept the earlier run's accuracy.png (of other configs) beside its report."""
    for name in report.PLOTS:
        (tmp_path / name).write_bytes(b"an earlier run's plot")
    logs = []
    results = report.run_report(None, tmp_path, configs=("bf16",), accuracy=False, speed=False, loader=tiny_loader,
                                progress=False, log=logs.append)
    if not torch.cuda.is_available():  # it said "running accuracy and weight bytes" with the accuracy skipped
        assert any(line.endswith("running weight bytes on the CPU") for line in logs)
    assert {p.name for p in tmp_path.glob("*.png")} == {"vram.png"} and results["plots"] == [str(tmp_path / "vram.png")]
    # nor a speed model in its meta: speed=False timed none (it named llama-2-7b)
    assert results["meta"]["speed_models"] == [] and results["speed_models"] == {}
    assert (tmp_path / "vram.png").read_bytes() != b"an earlier run's plot"


@pytest.mark.parametrize("flags, message", [
    (["--no-model", "--model", "x"], "--no-model skips the model that --model names"),
    (["--no-model", "--no-speed"], "leaves nothing to measure"),
    (["--no-accuracy", "--limit", "3", "--tasks", "piqa"], "--limit and --tasks set the accuracy runs that "
                                                           "--no-accuracy skips"),
    (["--no-model", "--ppl-max-tokens", "100"], "--ppl-max-tokens sets the accuracy runs that --no-model skips"),
    (["--no-speed", "--speed-rounds", "9"], "--speed-rounds sets the speed runs that --no-speed skips: drop it or "
                                            "--no-speed"),
    (["--no-speed", "--speed-models", "llama-3-8b", "--speed-rounds", "7"], "--speed-models and --speed-rounds set the "
                                                                           "speed runs that --no-speed skips: drop them"),
    # given at the default's value, they were taken as left out, and ignored; --batch-size was never checked
    (["--no-speed", "--speed-models", "llama-2-7b", "--speed-rounds", "3"], "--speed-models and --speed-rounds set the "
                                                                           "speed runs that --no-speed skips"),
    (["--no-accuracy", "--tasks", *ALL_TASKS], "--tasks sets the accuracy runs that --no-accuracy skips"),
    (["--no-accuracy", "--batch-size", "16"], "--batch-size sets the accuracy runs that --no-accuracy skips"),
    (["--no-model", "--batch-size", "4"], "--batch-size sets the accuracy runs that --no-model skips"),
    (["--no-model", "--device", "cpu"], "--no-model skips the model that --device places: drop one of them"),
    # by the options' names: run_report's named its parameters ("tasks_limit must be >= 1" for --limit 0)
    (["--limit", "0"], "--limit must be >= 1, got 0"), (["--speed-rounds", "0"], "--speed-rounds must be >= 1"),
    (["--ppl-seq-len", "1"], "--ppl-seq-len must be >= 2"), (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--model", "{out}", "--ppl-seq-len", "64", "--ppl-max-tokens", "32"], "--ppl-max-tokens 32 is fewer tokens than "
                                                                            "one window of --ppl-seq-len 64")])
def test_report_refuses_options_it_would_ignore(flags, message, monkeypatch, tmp_path):
    monkeypatch.setattr(report, "run_report", lambda *a, **k: pytest.fail("ran with options it ignores"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # the GPU's refusals; without one, the next test
    args = report_command.add_report_arguments(argparse.ArgumentParser()).parse_args(
        ["--out", str(tmp_path)] + [f.format(out=tmp_path) for f in flags])
    with pytest.raises(ValueError, match=message):
        report_command.report_main(args)


def test_report_refuses_a_quantized_model_before_any_config_runs(monkeypatch, tmp_path):
    """Every config failed to load it as a 16-bit model, one after another, each told to use nibble.load_quantized."""
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "nibble"}}))
    monkeypatch.setattr(report, "run_report", lambda *a, **k: pytest.fail("ran on a quantized model"))
    args = report_command.add_report_arguments(argparse.ArgumentParser()).parse_args(["--model", str(tmp_path)])
    with pytest.raises(ValueError, match=f"{tmp_path} is already quantized, and the report quantizes a 16-bit model "
                                         f"each config's way: .* `nibble eval ppl --model {tmp_path}`"):
        report_command.report_main(args)


def test_report_without_a_gpu_refuses_speed_options(monkeypatch, tmp_path):
    """--speed-models / --speed-rounds on a machine without CUDA were taken, and the run exited 0 with its speed
    "skipped" in report.json alone; the flag alone, which skips the speed models, is no speed option."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    parse = report_command.add_report_arguments(argparse.ArgumentParser()).parse_args
    for speed_models in ("llama-3-8b", "llama-2-7b"):  # the default's value too: it was taken, and ignored
        with pytest.raises(ValueError, match="^--speed-models sets the speed runs, which are timed on a CUDA GPU, and "
                                             "none is visible: drop it$"):
            report_command.check_report_args(parse(["--out", str(tmp_path), "--speed-models", speed_models]))
    with pytest.raises(ValueError, match="^--speed-rounds sets the speed runs"):
        report_command.check_report_args(parse(["--out", str(tmp_path), "--speed-rounds", "3"]))
    report_command.check_report_args(parse(["--out", str(tmp_path), "--speed-models"]))


def test_report_without_a_gpu_refuses_to_run_the_speed_models_alone(monkeypatch, tmp_path):
    """--no-model on a machine without CUDA measured nothing, said it ran accuracy on the CPU and exited 0."""
    monkeypatch.setattr(report, "run_report", lambda *a, **k: pytest.fail("ran with nothing to measure"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    args = report_command.add_report_arguments(argparse.ArgumentParser()).parse_args(
        ["--out", str(tmp_path), "--no-model"])
    with pytest.raises(ValueError, match="--no-model runs the speed models alone, which are timed on a CUDA GPU"):
        report_command.report_main(args)


def test_config_names_are_filed_as_one_spelling_and_each_measured_once(tmp_path):
    """``BF16`` / ``fp16`` were a baseline no ratio was taken against (every "/ bf16" cell read "-"), and a name given
    twice was measured twice and shown in two columns holding the second run's numbers."""
    results = report.run_report(None, tmp_path, configs=("FP16", "W4A16"), accuracy=False, speed=False,
                                loader=tiny_loader, progress=False, log=lambda *_: None)
    assert results["meta"]["configs"] == list(results["configs"]) == ["bf16", "w4a16"]
    assert results["summary"]["model"]["w4a16"]["linear_bytes_ratio"] == pytest.approx(0.28125)
    md = (tmp_path / "report.md").read_text()
    assert "| decoder linears / bf16 (float32 counted as 16-bit) | 1.000 | 0.281 |" in md

    def no_loader():
        raise AssertionError("the model must not be loaded")

    for configs, said in ((("bf16", "w4a16", "bf16"), "config bf16 named more than once"),
                          (("bf16", "16bit"), "config bf16 named more than once"),
                          (("w4a16", "W4A16"), "config w4a16 named more than once"),
                          # one QuantConfig, two spellings: measured twice all the same
                          (("w4a16-g64-gptq", "w4a16-gptq-g64"), "configs w4a16-g64-gptq and w4a16-gptq-g64 are one "
                           "config (the same QuantConfig)"),
                          (("w4a16", "w4a16-g128"), "configs w4a16 and w4a16-g128 are one config")):
        with pytest.raises(ValueError, match=re.escape(said)):
            report.run_report(None, tmp_path, configs=configs, speed=False, loader=no_loader, log=lambda *_: None)
    # the default group size is the model's: this one's widths take 32, which w4a16 names
    model = tiny_model(hidden_size=96, intermediate_size=192)
    with pytest.raises(ValueError, match="configs w4a16 and w4a16-g32 are one config for this model"):
        report.run_report(None, tmp_path, configs=("w4a16", "w4a16-g32"), speed=False,
                          loader=lambda: (model, ByteTokenizer()), log=lambda *_: None)


def test_a_nan_score_is_nan_in_report_md_and_null_in_strict_report_json(tmp_path):
    """A model whose logits went NaN had "-" (what the table writes for "not measured") in report.md, and a bare NaN
    (Python's json default, which jq and JavaScript reject) in report.json: a NaN score is now "nan" in the table and
    null in the JSON, read back as NaN, so a merged report's table says "nan" as the run's own did."""
    def loader():
        model, tok = tiny_loader()
        with torch.no_grad():
            model.model.norm.weight.fill_(float("nan"))
        return model, tok

    report.run_report(None, tmp_path, configs=("bf16",), tasks=("boolq",), tasks_limit=1, ppl_max_tokens=300,
                      speed=False, loader=loader, progress=False, log=lambda *_: None)
    assert "| WikiText-2 ppl | nan |" in (tmp_path / "report.md").read_text()
    text = (tmp_path / "report.json").read_text()
    strict = json.loads(text, parse_constant=lambda name: pytest.fail(f"{name} in report.json"))
    bf16 = strict["configs"]["bf16"]
    assert bf16["perplexity"]["ppl"] is None and bf16["tasks"]["boolq"]["acc"] is None
    assert strict["meta"]["ppl_seq_len"] is None  # a setting left unset stays None
    back = report.read_json(tmp_path / "report.json")
    scores = back["configs"]["bf16"]
    assert math.isnan(scores["perplexity"]["ppl"]) and math.isnan(scores["tasks"]["average"]["acc"])
    assert back["meta"]["ppl_seq_len"] is None and back["configs"]["bf16"]["quant_config"] is None
    report.write_markdown(report.merge_reports([back]), tmp_path / "merged.md")
    assert (tmp_path / "merged.md").read_text() == (tmp_path / "report.md").read_text()  # "| WikiText-2 ppl | nan |"
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        json_text(object(), default=lambda _: float("inf"))  # one the conversion cannot see fails loudly


def test_a_task_of_one_document_has_no_standard_error_in_report_md_or_json(tmp_path):
    """One document leaves no spread to estimate a standard error from (lm-eval writes "N/A"): the table read
    "1.0000 ± 0.0000", an exact score. Now "± N/A", null in report.json, and the same from a report read back."""
    report.run_report(None, tmp_path, configs=("bf16",), tasks=("piqa",), tasks_limit=1, ppl_max_tokens=300,
                      speed=False, loader=tiny_loader, progress=False, log=lambda *_: None)
    md = (tmp_path / "report.md").read_text()
    piqa = json.loads((tmp_path / "report.json").read_text())["configs"]["bf16"]["tasks"]["piqa"]
    assert piqa["n"] == 1 and piqa["acc_stderr"] is None and piqa["acc_norm_stderr"] is None
    for metric in ("acc", "acc_norm"):
        assert f"| piqa {metric} | {piqa[metric]:.4f} ± N/A |" in md
    report.write_markdown(report.merge_reports([report.read_json(tmp_path / "report.json")]), tmp_path / "merged.md")
    assert (tmp_path / "merged.md").read_text() == md


def test_the_memory_plot_names_the_dtype_its_bars_were_measured_in(tmp_path, monkeypatch):
    """On the CPU every config runs in float32: the bar named bf16 showed 4 bytes a weight, twice bf16's."""
    figures = []
    monkeypatch.setattr(report, "_save", lambda fig, path: figures.append(fig) or str(path))
    report.run_report(None, tmp_path, configs=("bf16", "w4a16"), accuracy=False, speed=False, loader=tiny_loader,
                      progress=False, log=lambda *_: None)
    (ax,) = figures[0].axes
    assert ax.get_title() == "model: memory"
    assert [t.get_text() for t in ax.get_xticklabels()] == ["bf16\n(float32)", "w4a16\n(float32)"]


def test_the_memory_rows_name_the_dtype_they_compare(tmp_path):
    """On the CPU every config runs in float32: the MiB rows held float32 bytes and the "/ bf16" ratio beside them
    counted 16-bit ones (0.281, where the MiB rows read ~0.14), with nothing in the labels to tell them apart."""
    results = report.run_report(None, tmp_path, configs=("bf16", "w4a16"), accuracy=False, speed=False,
                                loader=tiny_loader, progress=False, log=lambda *_: None)
    md = (tmp_path / "report.md").read_text()
    assert "| attention MiB (float32) | 0.1 | 0.0 |" in md and "| weights total MiB (float32) | 0.4 |" in md
    assert "| decoder linears / bf16 (float32 counted as 16-bit) | 1.000 | 0.281 |" in md
    if not torch.cuda.is_available():  # and why its peak rows are empty
        assert "\nPeak memory and speed skipped: the model is not on a CUDA GPU" in md
    for r in results["configs"].values():  # a GPU run's: the bytes are bf16 bytes, as the labels said before
        r["dtype"] = "bfloat16"
    report.write_markdown(results, tmp_path / "bf16.md")
    md = (tmp_path / "bf16.md").read_text()
    assert "| attention MiB | " in md and "| weights total MiB | " in md and "| decoder linears / bf16 | " in md


def test_the_accuracy_plot_of_a_limit_run_says_so(tmp_path, monkeypatch):
    """report.md says the tasks were a --limit subset; accuracy.png, shown alone, read as a full run's."""
    titles = []
    monkeypatch.setattr(report, "_save", lambda fig, path: titles.append(fig.axes[0].get_title()) or str(path))
    results = report.run_report(None, tmp_path, configs=("bf16",), tasks=("boolq",), tasks_limit=2,
                                ppl_max_tokens=300, speed=False, loader=tiny_loader, progress=False, log=lambda *_: None)
    results["meta"]["tasks_limit"] = None  # as a full run's
    report.write_plots(results, tmp_path, log=lambda *_: None)
    assert titles[1::2] == ["zero-shot accuracy per task (first 2 documents of each)", "zero-shot accuracy per task"]


def test_the_header_says_the_device_the_model_ran_on(tmp_path):
    """A --device cpu run on a GPU host was headed "GPU: NVIDIA H200", its accuracy rows measured on the CPU."""
    results = {"meta": {"configs": ["bf16"], "tasks": [], "model": "m", "gpu": "NVIDIA H200", "device": "cpu"},
               "configs": {}, "speed_models": {}}
    report.write_markdown(results, tmp_path / "report.md")
    assert (tmp_path / "report.md").read_text().splitlines()[2].startswith("model on cpu · GPU: NVIDIA H200 · torch")


def test_a_write_stopped_half_way_keeps_the_last_whole_report(tmp_path, monkeypatch):
    """run_report writes report.json and report.md again after each config: a kill during a write left them
    truncated, where the last whole report was."""
    from pathlib import Path

    results = {"meta": {"model": "m", "configs": []}, "configs": {}, "speed_models": {}}
    report.write_json(results, tmp_path / "report.json")
    report.write_markdown(results, tmp_path / "report.md")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    write_text = Path.write_text

    def stopped_half_way(path, text, *args, **kwargs):
        write_text(path, text[:len(text) // 2])
        raise KeyboardInterrupt
    monkeypatch.setattr(Path, "write_text", stopped_half_way)
    results["meta"]["model"] = "another"
    for write, name in ((report.write_json, "report.json"), (report.write_markdown, "report.md")):
        with pytest.raises(KeyboardInterrupt):
            write(results, tmp_path / name)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


@pytest.mark.filterwarnings("ignore:'nibble.eval.report' found in sys.modules")  # imported above, not under -m
def test_python_m_nibble_eval_report_is_nibble_report(tmp_path, monkeypatch):
    """`python -m nibble.eval.report` (older results' commands) had a parser of its own: an error was a traceback, and
    `--out <a file>` loaded and scored the model before failing. It is `nibble report` now, refusing at once. Run in
    this process (runpy, as `-m` does): a child process importing torch and transformers took past two minutes beside
    a GPU suite's 16 workers."""
    import runpy

    def scored(args):
        raise AssertionError("the report ran before --out was checked")
    monkeypatch.setattr(report_command, "report_main", scored)
    a_file = tmp_path / "f"
    a_file.write_text("")
    monkeypatch.setattr(sys, "argv", ["report.py", "--out", str(a_file), "--no-speed"])
    with pytest.raises(SystemExit) as stopped:
        runpy.run_module("nibble.eval.report", run_name="__main__")
    assert str(stopped.value.code).startswith(f"nibble report: --out {a_file} is a file"), stopped.value.code


def test_the_readme_smollm2_accuracy_table_is_its_reports_rounded_once():
    """The README's SmolLM2 table is the committed reports' acc to 3 decimals; its averages were rounded from
    report.md's 4 (0.41049 -> .4105 -> .411, 0.39947 -> .3995 -> .400), one in the third decimal off."""
    root = Path(__file__).parents[2]
    results = root / "benchmarks" / "results"
    main = json.loads((results / "report-smollm2-h200" / "report.json").read_text())["configs"]
    lm_head = json.loads((results / "lm-head-decode-h200" / "smollm2-accuracy" / "w4a16-lmhead-report.json")
                         .read_text())["configs"]["w4a16-lmhead"]["tasks"]
    gptq = json.loads((results / "ptq-w4a4-smollm2-h200" / "ptq-smollm2-w4a4-hadamard-gptq-tasks-h200.json")
                      .read_text())["rows"][0]["tasks"]  # {task: acc}
    columns = [main["bf16"]["tasks"], main["w4a16"]["tasks"], lm_head, main["w4a4"]["tasks"],
               main["w4a4-hadamard"]["tasks"]]
    columns = [{t: c[t]["acc"] for t in (*ALL_TASKS, "average")} for c in columns] + [gptq]
    readme = (root / "README.md").read_text()
    for label, tasks in (("piqa / hellaswag / winogrande", ALL_TASKS[:3]),
                         ("arc_e / arc_c / boolq / obqa", ALL_TASKS[3:]), ("seven-task average acc", ("average",))):
        row = re.search(rf"^\| {re.escape(label)} \|(.*)\|$", readme, re.M).group(1)
        want = [" / ".join(f"{c[t]:.3f}".removeprefix("0") for t in tasks) for c in columns]
        assert [cell.strip() for cell in row.split("|")] == want, label


def test_of_an_even_count_of_rounds_the_upper_median_row_is_kept():
    rounds = [[dict(phase="prefill", batch=1, tokens=8, ms=ms), dict(phase="decode", batch=1, ms_per_step=ms / 4)]
              for ms in (12.0, 9.0, 15.0, 10.0)]
    rows = report._median_rows(rounds)
    assert [rows[0]["ms"], rows[1]["ms_per_step"]] == [12.0, 3.0]  # of 9, 10, 12, 15: 12
    assert rows[0]["round_ms"] == [12.0, 9.0, 15.0, 10.0] and rows[1]["round_ms"] == [3.0, 2.25, 3.75, 2.5]


def test_the_peak_memory_of_a_model_on_a_gpu_is_measured(tmp_path, monkeypatch):
    """Measured where the model is on CUDA (faked here: the CPU has none), skipped with the reason elsewhere."""
    monkeypatch.setattr(report, "_on_cuda", lambda model: True)
    monkeypatch.setattr(report.mem_mod, "peak_memory", lambda model: {"peak_bytes": 3 * 2**20})
    res = report.run_report(None, tmp_path / "r", configs=("bf16",), accuracy=False, speed=False, loader=tiny_loader,
                            progress=False, log=lambda *_: None)
    assert res["configs"]["bf16"]["peak"] == {"peak_bytes": 3 * 2**20}
    assert "| peak MiB (512 prefill + 128 decode) | 3.0 |" in (tmp_path / "r" / "report.md").read_text()


def test_the_accuracy_table_has_an_acc_norm_row_only_for_the_tasks_that_score_one(tmp_path):
    tasks = {"boolq": {"acc": 0.625, "n": 8}, "piqa": {"acc": 0.5, "acc_norm": 0.75, "n": 8}, "average": {"acc": 0.5625}}
    results = {"meta": {"configs": ["bf16"], "tasks": ["boolq", "piqa"], "model": "fake", "tasks_limit": 8,
                        "ppl_max_tokens": 4096},
               "configs": {"bf16": {"dtype": "bfloat16", "weights": fake_weights(2**20, 2**21), "tasks": tasks,
                                    "perplexity": {"ppl": 9.5, "windows": 2, "seq_len": 2048, "tokens": 4094}}}}
    report.write_markdown(results, tmp_path / "report.md")
    md = (tmp_path / "report.md").read_text()
    assert re.findall(r"^\| (\w+ acc\w*) \|", md, re.M) == ["boolq acc", "piqa acc", "piqa acc_norm", "average acc"]
    assert "| piqa acc_norm | 0.7500 |" in md
    assert ("on the first 4,096 tokens of the test set, in 2 non-overlapping windows of 2,048 tokens (4,094 predicted)"
            in md)
    results["summary"] = report.summarize(results)  # no speed model timed: no target has a value
    report.write_markdown(results, tmp_path / "report.md")
    assert "Targets" not in (tmp_path / "report.md").read_text()
    # every config failed: no chart of nothing (the accuracy one neither)
    failed = {**results, "configs": {"bf16": {"config": "bf16", "error": "RuntimeError: boom"}}}
    assert report.write_plots(failed, tmp_path, log=lambda *_: None) == []


def test_every_config_failing_is_said_so_beside_speed_models_skipped_without_a_gpu(tmp_path, monkeypatch, capsys):
    """A speed model skipped (no GPU) is no run whose results report.md holds."""
    from nibble.cli import main

    def failing():
        raise RuntimeError("boom")
    monkeypatch.setattr(report, "_default_loader", lambda *a: failing)
    monkeypatch.setattr(report.torch.cuda, "is_available", lambda: False)
    assert main(["report", "--out", str(tmp_path), "--configs", "bf16", "--no-accuracy", "--device", "cpu"]) == 1
    assert json.loads((tmp_path / "report.json").read_text())["speed_models"] == {"llama-2-7b": {"skipped": report.NO_GPU}}
    assert capsys.readouterr().err.strip().endswith(f"1 config failed (every one; {tmp_path / 'report.md'} says so): "
                                                    "bf16: RuntimeError: boom")


def test_a_report_without_accuracy_reads_no_evaluation_data(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "require_data", lambda files: files and pytest.fail(f"required {files}"))
    res = report.run_report(None, tmp_path, configs=("bf16", "w4a16"), accuracy=False, speed=False, loader=tiny_loader,
                            progress=False, log=lambda *_: None)
    assert list(res["configs"]) == ["bf16", "w4a16"] and "perplexity" not in res["configs"]["bf16"]


def test_a_nibble_outside_any_repository_or_without_git_has_no_commit(tmp_path, monkeypatch):
    """A folder git does not know is "no-commit" (wherever the process runs: here from the folder's parent), and a
    machine without git says "unknown" rather than failing the run."""
    from nibble.bench.timing import git_commit

    monkeypatch.delenv("NIBBLE_GIT_COMMIT", raising=False)
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    (tmp_path / "nibble").mkdir()
    monkeypatch.chdir(tmp_path)
    assert git_commit(tmp_path / "nibble") == "no-commit"
    monkeypatch.setenv("PATH", str(tmp_path / "no-git-here"))
    assert git_commit(tmp_path / "nibble") == "unknown"


def test_source_hash_does_not_follow_the_order_the_filesystem_lists_files(tmp_path, monkeypatch):
    """Two copies of the same sources hash alike whatever order their folders list the files in."""
    import pathlib

    from nibble.bench.timing import source_hash

    for name in ("a.py", "b.py", "c.cu"):
        (tmp_path / name).write_text(f"# {name}\n")
    first = source_hash(tmp_path)
    rglob = pathlib.Path.rglob
    monkeypatch.setattr(pathlib.Path, "rglob", lambda self, pattern: reversed(list(rglob(self, pattern))))
    assert source_hash(tmp_path) == first
