"""What the benchmarks write: `nibble.bench.timing.write_results`, and the W4A4 suite's files (on the CPU, its
timing replaced by fixed rows)."""
import builtins
import json
import os

import matplotlib.axes
import pytest
import torch

from nibble.bench import timing, w4a4


def _rows(ops, M=(1, 16)):
    return [dict(N=64, K=64, M=m, op=op, us=10.0 if op == "bf16" else 5.0, speedup=1.0 if op == "bf16" else 2.0)
            for m in M for op in ops]


def _drawn(monkeypatch) -> list[str]:
    """The labels of the lines the PNG draws."""
    labels, plot = [], matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda ax, *a, **k: labels.append(k.get("label")) or
                        plot(ax, *a, **k))
    return labels


def test_the_baseline_is_kept_in_the_json_and_left_out_of_the_plot(tmp_path, monkeypatch):
    """Its speedup is 1 by definition: the dashed line at 1 is its line."""
    drawn = _drawn(monkeypatch)
    paths = timing.write_results(_rows(("bf16", "w4a4")), {"gpu": "x"}, tmp_path, "r", baseline="bf16")
    assert [r["op"] for r in json.loads((tmp_path / "r.json").read_text())["rows"]] == ["bf16", "w4a4"] * 2
    assert drawn == ["w4a4"] and paths == {"json": str(tmp_path / "r.json"), "png": str(tmp_path / "r.png")}


def test_the_w4a4_benchmark_writes_its_json_once_with_every_row_and_plots_the_ops_against_bf16(tmp_path,
                                                                                                monkeypatch):
    """It wrote the JSON without the bf16 rows, then wrote it again with them."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H100")
    monkeypatch.setattr(w4a4, "bench_shape", lambda N, K, ms, ops, **k: _rows(ops, ms))
    monkeypatch.setattr(w4a4, "env_meta", lambda **meta: meta)  # no GPU to describe
    writes, write_text, open_ = [], timing.Path.write_text, builtins.open

    def opened(file, mode="r", *args, **kwargs):
        if "w" in mode:
            writes.append(os.path.basename(file))
        return open_(file, mode, *args, **kwargs)
    monkeypatch.setattr(builtins, "open", opened)
    monkeypatch.setattr(timing.Path, "write_text", lambda p, *a, **k: writes.append(p.name) or write_text(p, *a, **k))
    drawn = _drawn(monkeypatch)
    assert w4a4.main(["--out", str(tmp_path), "--shapes", "64,64", "--ms", "1", "16", "--ops", "bf16", "w4a4",
                      "--procs", "0"]) == 0
    saved = json.loads((tmp_path / "w4a4-h100.json").read_text())
    assert saved["rows"] == _rows(("bf16", "w4a4")) and saved["meta"]["ops"] == ["bf16", "w4a4"]
    assert not (tmp_path / "w4a4-partial.json").exists()  # its running copy (benchmarks/results: "not kept")
    assert [w for w in writes if w.endswith(".json")] == ["w4a4-partial.json", "w4a4-h100.json"] and drawn == ["w4a4"] and (tmp_path / "w4a4-h100.png").is_file()


def test_the_w4a4_benchmark_runs_the_quick_suite_and_records_its_summary(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    timed = []
    monkeypatch.setattr(w4a4, "bench_shape", lambda N, K, ms, ops, **k: timed.append((N, K, ms, ops)) or _rows(ops, ms))
    monkeypatch.setattr(w4a4, "env_meta", lambda **meta: meta)
    assert w4a4.main(["--out", str(tmp_path), "--quick", "--procs", "0", "--ops", "bf16", "w4a4"]) == 0
    assert timed == [(N, K, w4a4.QUICK_MS, ("bf16", "w4a4")) for N, K in w4a4.QUICK_SHAPES]
    meta = json.loads((tmp_path / "w4a4-h200.json").read_text())["meta"]
    assert [s["M"] for s in meta["summary"]] == w4a4.QUICK_MS
    assert all(s["geomean_vs_bf16"] == pytest.approx(2.0) for s in meta["summary"])


def test_both_kernel_benchmarks_name_their_files_by_one_gpu_tag(monkeypatch):
    # the W4A4 benchmark named an H100's files w4a4-h100-80gb-hbm3 beside W4A16's w4a16-h100 (session 67)
    names = {"NVIDIA H200": "h200", "NVIDIA H100 80GB HBM3": "h100", "NVIDIA A100-SXM4-80GB": "a100-sxm4-80gb",
             "NVIDIA GeForce RTX 4090": "geforce-rtx-4090"}
    for device, tag in names.items():
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, name=device: name)
        assert timing.gpu_tag() == tag


@pytest.mark.parametrize("argv, says", [(["--shapes", "4096"], "--shapes: a shape is N,K"),
                                        (["--shapes", "4096,0"], "--shapes: a shape is N,K"),
                                        (["--shapes", "a,b"], "--shapes: a shape is N,K"),
                                        (["--shapes", "4096,\u00b2"], "--shapes: a shape is N,K"),
                                        (["--shapes", "4096,4096,1"], "--shapes: a shape is N,K"),
                                        (["--ms", "0"], "--ms: a token count M is a whole number above 0"),
                                        (["--ms", "-16"], "--ms: a token count M"),
                                        (["--ops", "w4a4", "int4"], "--ops: invalid choice: 'int4'")])
def test_the_w4a4_benchmark_refuses_a_malformed_shape_count_or_op_as_a_usage_error(argv, says, capsys):
    """A malformed --shapes was a traceback once the GPU was set up, an --ms of 0 reached the kernels, and an
    unknown --ops name was timed as nothing, its column left out without a word: each is said as the option's,
    exit status 2, before any GPU work (here, where there is no GPU, before the refusal for that)."""
    with pytest.raises(SystemExit) as exit_:
        w4a4.main(argv)
    assert exit_.value.code == 2 and says in capsys.readouterr().err


@pytest.mark.parametrize("suite", ["nibble.bench.kernels", "nibble.bench.w4a4"])
def test_the_benchmarks_refuse_an_out_they_could_not_write_before_any_timing(suite, tmp_path, capsys):
    """An --out that is a file was found at the first write: a traceback after the first shape's timing (W4A4's after
    its pre-compilation too). It is a usage error, as the library's `nibble` commands say it, before any GPU work."""
    import importlib

    (tmp_path / "results").write_text("")
    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(suite).main(["--out", str(tmp_path / "results" / "sub")])
    assert exit_.value.code == 2
    assert f"--out {tmp_path / 'results' / 'sub'} cannot be created: {tmp_path / 'results'} is a file" \
        in capsys.readouterr().err


def test_json_text_writes_every_nan_and_infinity_as_null_at_any_depth():
    """Strict JSON (jq, JavaScript's JSON.parse): infinities too, in dicts, lists and tuples."""
    inf, nan = float("inf"), float("nan")
    text = timing.json_text({"a": [inf, -inf, nan, 1.5], "b": (nan, {"c": (2.0, -inf)}), "d": 3})
    assert json.loads(text) == {"a": [None, None, None, 1.5], "b": [None, {"c": [2.0, None]}], "d": 3}


def test_shape_list_reads_the_scripts_shapes():
    assert timing.shape_list("4096x4096,1x128") == [(4096, 4096), (1, 128)]
    assert timing.shape_list("8x4096x11008") == [(8, 4096, 11008)]


def test_env_meta_without_a_gpu_says_none_and_takes_the_callers_fields(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("NIBBLE_GIT_COMMIT", "c0dc84a")
    meta = timing.env_meta(benchmark="w4a4", rounds=3)
    assert meta["gpu"] is None and meta["benchmark"] == "w4a4" and meta["rounds"] == 3
    assert meta["git_commit"] == "c0dc84a" and meta["torch"] == torch.__version__


def _figure(monkeypatch):
    """The figure `write_results` saves, kept for a look at its panels."""
    import matplotlib.figure

    saved, savefig = [], matplotlib.figure.Figure.savefig
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, *a, **k: saved.append(fig) or savefig(fig, *a, **k))
    return saved


def test_the_plot_has_a_panel_per_shape_of_sorted_log2_lines_against_a_dashed_one(tmp_path, monkeypatch):
    """Four panels a row; each panel's x (M) on a log2 axis, its points in order of M whatever the rows' order, the
    dashed line at 1 (the baseline); a shape whose rows have no ``y`` gets no panel; ``title`` is the figure's."""
    saved = _figure(monkeypatch)
    rows = [dict(N=n, K=64, M=m, op="w4a4", speedup=s) for n in (64, 128, 192, 256, 320)
            for m, s in ((16, 2.0), (1, 1.5), (4, 1.8))]
    rows += [dict(N=384, K=64, M=1, op="w4a4", speedup=None)]  # not timed: no panel for it
    timing.write_results(rows, {"gpu": "x"}, tmp_path, "r", title="W4A4 speedup")
    (fig,) = saved
    axes = fig.axes
    assert len(axes) == 8 and axes[3].get_subplotspec().colspan.start == 3  # 2 rows of 4 panels
    drawn = [ax for ax in axes if ax.axison]
    assert [ax.get_title() for ax in drawn] == [f"N={n} K=64" for n in (64, 128, 192, 256, 320)]
    for ax in drawn:
        assert ax.get_xscale() == "log" and ax.xaxis.get_transform().base == 2
        line, one = ax.get_lines()
        assert list(line.get_xdata()) == [1, 4, 16] and list(line.get_ydata()) == [1.5, 1.8, 2.0]
        assert list(one.get_ydata()) == [1.0, 1.0] and one.get_linestyle() == "--"
    assert fig._suptitle.get_text() == "W4A4 speedup"


def test_a_shape_with_some_rows_untimed_draws_the_timed_points_only(tmp_path, monkeypatch):
    saved = _figure(monkeypatch)
    rows = [dict(N=64, K=64, M=1, op="w4a4", speedup=2.0), dict(N=64, K=64, M=16, op="w4a4", speedup=None),
            dict(N=64, K=64, M=16, op="int8", speedup=None)]
    timing.write_results(rows, {"gpu": "H200"}, tmp_path, "r")
    (fig,) = saved
    (ax,) = fig.axes
    assert [line.get_label() for line in ax.get_lines()[:-1]] == ["w4a4"]
    assert list(ax.get_lines()[0].get_xdata()) == [1]
    assert fig._suptitle.get_text() == "r (H200)"


def test_a_token_sweep_script_times_the_tokens_asked_and_writes_meta_and_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    asked = []

    def rows_for(tokens):
        asked.append(tokens)
        return [dict(M=m, us=float(m)) for m in tokens]
    monkeypatch.setattr("sys.argv", ["sweep.py", "--json", str(tmp_path / "out.json"), "--tokens", "1,16"])
    timing.token_sweep_main("A sweep.\n\nMore.", [1, 8, 64], rows_for)
    saved = json.loads((tmp_path / "out.json").read_text())
    assert asked == [[1, 16]] and saved["rows"] == [dict(M=1, us=1.0), dict(M=16, us=16.0)]
    assert saved["meta"]["gpu"] is None and "source_sha256" in saved["meta"]
    monkeypatch.setattr("sys.argv", ["sweep.py"])
    timing.token_sweep_main("A sweep.", [1, 8, 64], rows_for)
    assert asked[-1] == [1, 8, 64]


def test_the_w4a16_benchmark_names_its_fp16_files_apart_and_records_its_command(tmp_path, monkeypatch):
    """bf16 and fp16 activations are two result files of one GPU (w4a16-h200.json, w4a16-h200-fp16.json), each
    with the command that made it."""
    from nibble.bench import kernels

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    timed = []

    def bench_shape(N, K, ms, dtype, rounds):
        timed.append((N, K, tuple(ms), dtype, rounds))
        base = "fp16" if dtype == torch.float16 else "bf16"
        return [dict(op=op, M=m, N=N, K=K, us=us, speedup=12.0 / us) for m in ms for op, us in ((base, 12.0),
                                                                                                 ("nibble", 6.0))]
    monkeypatch.setattr(kernels, "bench_shape", bench_shape)
    monkeypatch.setattr(kernels, "env_meta", lambda **meta: meta)
    assert kernels.main(["--out", str(tmp_path), "--quick", "--dtype", "float16", "--rounds", "2"]) == 0
    assert timed == [(N, K, tuple(kernels.QUICK_MS), torch.float16, 2) for N, K in kernels.QUICK_SHAPES]
    meta = json.loads((tmp_path / "w4a16-h200-fp16.json").read_text())["meta"]
    assert meta["command"] == "python -m nibble.bench kernels --quick --dtype float16 --rounds 2"
    assert meta["activations"] == "float16" and meta["rounds"] == 2 and not meta.get("partial")
    assert [s["baseline"] for s in meta["summary"]] == ["fp16"] * len(kernels.QUICK_MS)
    assert kernels.main(["--out", str(tmp_path), "--quick"]) == 0
    assert (tmp_path / "w4a16-h200.json").is_file() and (tmp_path / "w4a16-h200.png").is_file()


def test_json_text_refuses_a_non_finite_number_a_default_hook_returns():
    """What `_finite` cannot see (a ``default`` hook's value) fails here, not in a strict reader of the file."""
    with pytest.raises(ValueError, match="not JSON compliant"):
        timing.json_text({"a": object()}, default=lambda o: float("nan"))


def test_write_results_writes_values_json_cannot_as_their_text_and_no_png_without_a_timed_row(tmp_path):
    """The meta may hold a dtype or a path (``default=str``); rows whose ``y`` was never timed give no figure."""
    rows = [dict(N=64, K=64, M=1, op="w4a4", speedup=None), dict(N=64, K=64, M=1, op="bf16")]
    paths = timing.write_results(rows, {"dtype": torch.float16, "out": tmp_path}, tmp_path, "r")
    assert paths == {"json": str(tmp_path / "r.json")} and not (tmp_path / "r.png").exists()
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved["meta"] == {"dtype": "torch.float16", "out": str(tmp_path)} and saved["rows"][0]["speedup"] is None


def test_env_meta_on_a_gpu_says_which_one_and_the_triton_that_ran(monkeypatch):
    """On the CPU, with a made-up GPU: its name, SM count, L2 and compute capability (major.minor), the current
    GPU's, and the triton version beside torch's."""
    from types import SimpleNamespace

    props = SimpleNamespace(name="NVIDIA H200", multi_processor_count=132, L2_cache_size=60 << 20, major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props if index == 1 else None)
    meta = timing.env_meta()
    assert {k: meta[k] for k in ("gpu", "sm_count", "l2_bytes", "capability")} == dict(
        gpu="NVIDIA H200", sm_count=132, l2_bytes=60 << 20, capability="9.0")
    triton = pytest.importorskip("triton")
    assert meta["triton"] == triton.__version__


def test_tee_prints_each_line_and_has_it_in_its_file_at_once(tmp_path, capsys):
    """A device run cut off at its time limit keeps every line said so far: each is in the file before the next."""
    say = timing.tee(tmp_path / "run.log")
    say("M=1", 2.5, "us")
    assert (tmp_path / "run.log").read_text() == "M=1 2.5 us\n"
    say("done")
    assert (tmp_path / "run.log").read_text() == "M=1 2.5 us\ndone\n"
    assert capsys.readouterr().out == "M=1 2.5 us\ndone\n"
