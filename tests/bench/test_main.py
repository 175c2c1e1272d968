"""``python -m nibble.bench``: the suite chooser in front of the kernel benchmarks (on the CPU: the suites' own
``main`` replaced where one would run)."""
import pytest

from nibble.bench import __main__ as bench_main


@pytest.mark.parametrize("suite", ["kernels", "w4a4"])
def test_a_suite_gets_the_options_after_its_name(suite, monkeypatch):
    import importlib

    seen = []
    monkeypatch.setattr(importlib.import_module(f"nibble.bench.{suite}"), "main", lambda argv: seen.append(argv) or 0)
    assert bench_main.main([suite, "--quick", "--rounds", "5"]) == 0
    assert seen == [["--quick", "--rounds", "5"]]


@pytest.mark.parametrize("argv, status", [(["-h"], 0), (["--help"], 0), ([], 2)])
def test_help_is_a_success_and_no_suite_a_usage_error(argv, status, capsys):
    assert bench_main.main(argv) == status
    assert "usage: python -m nibble.bench {kernels,w4a4}" in capsys.readouterr().out


def test_an_unknown_suite_is_a_usage_error_that_names_the_suites(capsys):
    assert bench_main.main(["w4a8"]) == 2
    assert "unknown benchmark suite 'w4a8'; available: kernels, w4a4" in capsys.readouterr().err
