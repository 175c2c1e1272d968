"""`bench_rounds` on the CPU, with a stand-in for `bench_us`: which arm runs when, and what a failing
arm leaves behind. (The kernel benchmarks take each cell's median of these rounds.)"""
import pytest

from nibble.bench.timing import bench_rounds


def _recorder(fail=()):
    calls = []

    def measure(factory, n_rot, **timing):
        name = factory(0)()
        calls.append((name, n_rot, timing))
        if name in fail:
            raise RuntimeError(f"{name} does not run here")
        return 10.0 * len(calls)
    return measure, calls


def _arms(*names):
    return {name: ((lambda i, name=name: (lambda: name)), k + 1) for k, name in enumerate(names)}


def test_each_round_starts_one_arm_later_and_every_arm_runs_once_a_round():
    measure, calls = _recorder()
    times = bench_rounds(_arms("bf16", "tinygemm", "nibble"), 4, measure=measure, reps=7)
    assert [c[0] for c in calls] == ["bf16", "tinygemm", "nibble", "tinygemm", "nibble", "bf16",
                                     "nibble", "bf16", "tinygemm", "bf16", "tinygemm", "nibble"]
    assert all(c[2] == {"reps": 7} for c in calls)  # bench_us's keywords pass through
    assert {c[0]: c[1] for c in calls} == {"bf16": 1, "tinygemm": 2, "nibble": 3}
    assert times == {"bf16": [10.0, 60.0, 80.0, 100.0], "tinygemm": [20.0, 40.0, 90.0, 110.0],
                     "nibble": [30.0, 50.0, 70.0, 120.0]}


def test_an_optional_arm_that_fails_is_tried_once_and_said():
    measure, calls = _recorder(fail={"tinygemm"})
    said = []
    times = bench_rounds(_arms("bf16", "tinygemm", "nibble"), 3, optional=("tinygemm",), measure=measure,
                         log=said.append)
    assert [c[0] for c in calls].count("tinygemm") == 1
    assert times["tinygemm"] == [] and len(times["bf16"]) == len(times["nibble"]) == 3
    assert len(said) == 1 and "tinygemm unavailable" in said[0] and "does not run here" in said[0]


def test_a_required_arm_that_fails_raises():
    measure, _ = _recorder(fail={"nibble"})
    with pytest.raises(RuntimeError, match="nibble does not run here"):
        bench_rounds(_arms("bf16", "nibble"), 3, optional=("tinygemm",), measure=measure)


def test_no_arms_no_rounds():
    measure, calls = _recorder()
    assert bench_rounds({}, 3, measure=measure) == {} and calls == []


@pytest.mark.parametrize("main", ["nibble.bench.kernels", "nibble.bench.w4a4"])
@pytest.mark.parametrize("bad", ["0", "-2", "two"])
def test_the_benchmarks_refuse_fewer_than_one_round(main, bad, capsys):
    import importlib

    with pytest.raises(SystemExit) as exit_:
        importlib.import_module(main).main(["--rounds", bad])
    assert exit_.value.code == 2 and "--rounds" in capsys.readouterr().err


def test_sized_calls_fill_a_replay_in_whole_rounds_of_the_input_sets(monkeypatch):
    # on the CPU: no synchronize, and an eager round of 3 sets timed at 0.3 ms (0.1 ms a call)
    from nibble.bench import timing

    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(timing, "_event_time_ms", lambda fn: (fn(), 0.3)[1])
    made = []
    round_robin, calls = timing.sized_calls(lambda i: (lambda: made.append(i)), 3, target_replay_ms=2.0)
    assert calls == 21  # 2 ms / 0.1 ms = 20 calls, up to whole rounds of 3 sets
    assert made == [0, 1, 2, 0, 1, 2]  # each set's first call, then the timed round
    made.clear()
    round_robin(5)()
    assert made == [0, 1, 2, 0, 1]
    assert timing.sized_calls(lambda i: (lambda: None), 3, max_calls_per_replay=10)[1] == 12  # capped, whole rounds


def test_time_against_gives_each_arm_its_median_and_its_ratio_to_the_base(monkeypatch):
    from nibble.bench import timing
    per_round = {"base": iter([10.0, 12.0, 11.0]), "half": iter([5.0, 6.0, 4.0])}
    monkeypatch.setattr(timing, "bench_us", lambda factory, n_rot: next(per_round[factory(0)()]))
    said = []
    rows = timing.time_against({"base": lambda: "base", "half": lambda: "half"}, "base", 3,
                               log=lambda *parts: said.append(" ".join(parts)), M=8)
    assert [(r["op"], r["M"], r["us"], r["vs_base"]) for r in rows] == [("base", 8, 11.0, 1.0), ("half", 8, 5.0, 2.2)]
    assert rows[1]["rounds"] == [5.0, 6.0, 4.0]
    assert len(said) == 2 and "2.200x base" in said[1]


def test_add_rounds_argument_defaults_to_rounds_and_takes_a_count():
    """``--rounds`` left out is ROUNDS (what the docs and the results' ``rounds`` say a cell's median is over)."""
    import argparse

    from nibble.bench import timing

    parser = argparse.ArgumentParser()
    timing.add_rounds_argument(parser)
    assert parser.parse_args([]).rounds == timing.ROUNDS == 3
    assert parser.parse_args(["--rounds", "5"]).rounds == 5


def test_an_optional_arm_that_fails_in_a_later_round_keeps_none_of_its_earlier_rounds():
    """Its list stays empty: a median over the rounds it ran before it failed would stand beside the others' medians
    over every round."""
    runs = []

    def measure(factory, n_rot):
        name = factory(0)()
        runs.append(name)
        if name == "tinygemm" and runs.count("tinygemm") == 2:
            raise RuntimeError("out of memory")
        return 1.0
    said = []
    times = bench_rounds(_arms("bf16", "tinygemm"), 3, optional=("tinygemm",), measure=measure, log=said.append)
    assert times == {"bf16": [1.0, 1.0, 1.0], "tinygemm": []}
    assert runs.count("tinygemm") == 2 and len(said) == 1


def test_rotations_make_the_working_set_several_l2s_up_to_a_cap(monkeypatch):
    """Enough input sets that they hold at least ``factor`` (4) times the L2 together, rounded up, at least one and at
    most ``max_sets``."""
    from nibble.bench import timing

    monkeypatch.setattr(timing, "l2_bytes", lambda: 1000)
    assert timing.rotations(300) == 14  # 4000 / 300 = 13.3: 13 sets would hold less than 4 L2s
    assert timing.rotations(1000) == 4 and timing.rotations(3000) == 2
    assert timing.rotations(10 ** 9) == 1
    assert timing.rotations(1) == 64 and timing.rotations(1, max_sets=8) == 8
    assert timing.rotations(300, factor=1.0) == 4


def _fake_gpu_timing(monkeypatch, replay_ms, capture_fails=False):
    """`bench_us` on the CPU: no synchronize, one call timed eagerly at 0.1 ms (so 20 calls fill a 2 ms replay),
    then every replay timed at the next of ``replay_ms``; the graph replays are counted."""
    from nibble.bench import timing

    monkeypatch.setattr(timing.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: None)
    times = iter([0.1, *replay_ms])
    monkeypatch.setattr(timing, "_event_time_ms", lambda fn: (fn(), next(times))[1])
    replays = []

    class Graph:
        def replay(self):
            replays.append(1)

    def capture(body, warmup=None):
        if capture_fails:
            raise RuntimeError("operation not permitted when stream is capturing")
        return Graph(), None
    monkeypatch.setattr(timing, "capture_graph", capture)
    return timing, replays


def test_bench_us_is_the_median_replay_over_its_calls_and_says_how_it_ran(monkeypatch):
    # the first replay sizes the warm-up (25 ms / 2 ms: 12 replays), then 5 timed replays
    timing, replays = _fake_gpu_timing(monkeypatch, [2.0, 2.0, 4.0, 3.0, 10.0, 2.5])
    made = []
    r = timing.bench_us(lambda i: (lambda: made.append(i)), 1, reps=5, return_all=True)
    assert r["calls_per_replay"] == 20 and r["n_rot"] == 1 and r["mode"] == "graph"
    assert r["us"] == pytest.approx(3.0 * 1000 / 20) and r["min_us"] == pytest.approx(2.0 * 1000 / 20)
    assert r["replay_ms"] == [2.0, 4.0, 3.0, 10.0, 2.5]
    assert len(replays) == 1 + 12 + 5


def test_bench_us_times_eagerly_where_the_capture_fails_and_says_so(monkeypatch):
    timing, replays = _fake_gpu_timing(monkeypatch, [2.0] * 7, capture_fails=True)
    made = []
    r = timing.bench_us(lambda i: (lambda: made.append(i)), 2, reps=5, return_all=True)
    assert r["mode"] == "eager" and not replays
    assert r["calls_per_replay"] == 40 and r["us"] == pytest.approx(2.0 * 1000 / 40)  # 0.1 ms a round of 2 sets
    assert made.count(0) == made.count(1) > 40


def test_bench_us_times_a_slow_op_at_least_five_times(monkeypatch):
    """A replay of 100 ms: ``max_total_ms`` (300) would allow 3 timed replays; five are the least."""
    timing, _ = _fake_gpu_timing(monkeypatch, [100.0] * 7)
    r = timing.bench_us(lambda i: (lambda: None), 1, reps=30, return_all=True)
    assert len(r["replay_ms"]) == 5


def test_bench_us_refuses_without_a_gpu(monkeypatch):
    from nibble.bench import timing

    monkeypatch.setattr(timing.torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="bench_us needs a CUDA device"):
        timing.bench_us(lambda i: (lambda: pytest.fail("ran without a GPU")))


def test_bench_us_captures_a_replay_of_all_its_calls_warmed_up_by_one_round_of_the_sets(monkeypatch):
    """The graph holds ``calls_per_replay`` calls round-robin over the sets; its warm-up (compilation, handles) is one
    call of each set, not a whole replay."""
    timing, _ = _fake_gpu_timing(monkeypatch, [2.0] * 7)
    made, captured = [], {}

    class Graph:
        def replay(self):
            pass

    def capture(body, warmup=None):
        for part, fn in (("warmup", warmup), ("body", body)):
            made.clear()
            fn()
            captured[part] = list(made)
        return Graph(), None
    monkeypatch.setattr(timing, "capture_graph", capture)
    r = timing.bench_us(lambda i: (lambda: made.append(i)), 2, reps=5, return_all=True)
    assert r["mode"] == "graph" and r["calls_per_replay"] == 40  # 0.1 ms a round of 2 sets: 40 calls in 2 ms
    assert captured == {"warmup": [0, 1], "body": [0, 1] * 20}


def test_bench_us_without_a_graph_times_eager_rounds_of_all_its_calls(monkeypatch):
    """``graph=False``: no capture, each timed body the ``calls_per_replay`` calls themselves, and the result says
    so."""
    timing, replays = _fake_gpu_timing(monkeypatch, [2.0] * 7)
    monkeypatch.setattr(timing, "capture_graph", lambda *a, **k: pytest.fail("captured with graph=False"))
    made = []
    r = timing.bench_us(lambda i: (lambda: made.append(i)), 2, graph=False, reps=5, return_all=True)
    assert r["mode"] == "eager" and r["calls_per_replay"] == 40 and not replays
    # each set's first call and a sizing round, then the body (40 calls) once to size the warm-up, 12 warm-ups, 5 timed
    assert made == [0, 1] * (2 + 20 * (1 + 12 + 5))


def test_bench_us_warms_a_slow_op_up_at_least_once(monkeypatch):
    """A replay of 100 ms is longer than ``warmup_ms`` (25): one warm-up replay still runs before the timed ones."""
    timing, replays = _fake_gpu_timing(monkeypatch, [100.0] * 7)
    timing.bench_us(lambda i: (lambda: None), 1, reps=30)
    assert len(replays) == 1 + 1 + 5  # sizing the warm-up, the warm-up, five timed


def test_bench_us_without_return_all_is_the_median_microseconds_of_one_call(monkeypatch):
    timing, _ = _fake_gpu_timing(monkeypatch, [2.0, 2.0, 4.0, 3.0, 10.0, 2.5])
    us = timing.bench_us(lambda i: (lambda: None), 1, reps=5)
    assert isinstance(us, float) and us == pytest.approx(3.0 * 1000 / 20)


def test_time_against_times_the_rounds_asked_and_takes_medians_not_means(monkeypatch):
    """Five rounds, one slow outlier each: the figures are the medians over all five."""
    from nibble.bench import timing
    per_round = {"base": iter([10.0, 30.0, 11.0, 12.0, 10.5]), "fast": iter([5.0, 5.5, 4.0, 20.0, 6.0])}
    monkeypatch.setattr(timing, "bench_us", lambda factory, n_rot: next(per_round[factory(0)()]))
    rows = timing.time_against({"base": lambda: "base", "fast": lambda: "fast"}, "base", 5, log=lambda *parts: None)
    assert [(r["op"], r["us"], r["vs_base"]) for r in rows] == [("base", 11.0, 1.0), ("fast", 5.5, 2.0)]
    assert [len(r["rounds"]) for r in rows] == [5, 5]


def test_rotations_are_one_set_at_least_and_a_set_of_no_bytes_is_not_a_division_by_zero(monkeypatch):
    from nibble.bench import timing

    monkeypatch.setattr(timing, "l2_bytes", lambda: 1000)
    assert timing.rotations(300, factor=0.0) == 1
    assert timing.rotations(0) == 64 and timing.rotations(0, max_sets=8) == 8


def test_l2_bytes_is_the_gpus_own_and_the_h200s_without_one(monkeypatch):
    """The L2 the rotating sets must exceed: read from the current GPU (the H100's 50 MB is not the H200's 60), else
    60 MiB."""
    from types import SimpleNamespace

    from nibble.bench import timing

    monkeypatch.setattr(timing.torch.cuda, "is_available", lambda: False)
    assert timing.l2_bytes() == 60 * 1024 * 1024
    monkeypatch.setattr(timing.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(timing.torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(timing.torch.cuda, "get_device_properties",
                        lambda index: SimpleNamespace(L2_cache_size=50 * 1024 * 1024 if index == 1 else 0))
    assert timing.l2_bytes() == 50 * 1024 * 1024


def test_sized_calls_of_an_op_too_fast_to_time_fill_the_cap(monkeypatch):
    """An eager round timed at 0 ms (below the events' resolution) is not a division by zero: the replay gets
    ``max_calls_per_replay`` calls."""
    from nibble.bench import timing

    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(timing, "_event_time_ms", lambda fn: (fn(), 0.0)[1])
    assert timing.sized_calls(lambda i: (lambda: None), 1)[1] == 1000
    assert timing.sized_calls(lambda i: (lambda: None), 3, max_calls_per_replay=500)[1] == 501


def test_side_stream_is_one_per_gpu_for_the_process(monkeypatch):
    """On the CPU, with streams replaced: the same stream for every capture on a GPU (a new one per capture held one
    more cuBLAS workspace), another for another GPU, and ``None`` / "cuda" is the current GPU."""
    from nibble.bench import timing

    made = []
    monkeypatch.setattr(timing, "_SIDE_STREAMS", {})
    monkeypatch.setattr(timing.torch.cuda, "Stream", lambda device: made.append(device) or object())
    monkeypatch.setattr(timing.torch.cuda, "current_device", lambda: 1)
    one = timing.side_stream("cuda:1")
    assert timing.side_stream() is one and timing.side_stream("cuda") is one
    assert timing.side_stream(timing.torch.device("cuda", 1)) is one
    zero = timing.side_stream("cuda:0")
    assert zero is not one and timing.side_stream("cuda:0") is zero
    assert made == [1, 0]


@pytest.mark.parametrize("text", ["two", "+3", " 3", "3.0", "0", "-2", "\u00b2"])
def test_a_count_that_is_not_a_whole_number_above_0_is_refused_as_what_it_counts(text):
    """The benchmarks' count options refuse a count by what it counts, never with argparse's generic "invalid parse
    value" (what a ValueError from ``int`` gives); a sign, spaces, a decimal point or a superscript digit
    (``str.isdigit`` takes "²", ``int`` does not) are no whole number either."""
    import argparse
    import re

    from nibble.bench import timing

    says = re.escape(f"a number of rounds is a whole number above 0; got {text!r}")
    with pytest.raises(argparse.ArgumentTypeError, match=says):
        timing.whole_number("a number of rounds")(text)
    assert timing.whole_number("a number of rounds")("12") == 12


def test_capture_graph_warms_up_on_the_side_stream_then_captures_the_body_once_there(monkeypatch):
    """On the CPU, with CUDA's streams and graphs replaced: ``warmups`` eager calls of ``warmup`` (default: the body)
    on the device's side stream, then the body captured once on that same stream; its output comes back."""
    from contextlib import contextmanager

    from nibble.bench import timing

    said, on, asked = [], [], []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            said.append(f"{self.name} waits for {other.name}")
    side, current = Stream("side"), Stream("current")

    @contextmanager
    def stream(s):
        on.append(s.name)
        yield
        on.pop()

    @contextmanager
    def graph(g, stream):
        said.append(f"capture into {g} on {stream.name}")
        on.append("capture")
        yield
        on.pop()
    monkeypatch.setattr(timing, "side_stream", lambda device=None: asked.append(device) or side)
    monkeypatch.setattr(timing.torch.cuda, "current_stream", lambda: current)
    monkeypatch.setattr(timing.torch.cuda, "stream", stream)
    monkeypatch.setattr(timing.torch.cuda, "CUDAGraph", lambda: "graph")
    monkeypatch.setattr(timing.torch.cuda, "graph", graph)

    def body():
        said.append(f"body ({on[-1]})")
        return "out"
    assert timing.capture_graph(body, "cuda:1", warmups=2, warmup=lambda: said.append(f"warm-up ({on[-1]})")) == \
        ("graph", "out")
    assert said == ["side waits for current", "warm-up (side)", "warm-up (side)", "current waits for side",
                    "capture into graph on side", "body (capture)"]
    said.clear()
    assert timing.capture_graph(body) == ("graph", "out")
    assert said == ["side waits for current", "body (side)", "current waits for side", "capture into graph on side",
                    "body (capture)"]
    assert asked == ["cuda:1", None]
