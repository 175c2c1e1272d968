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
