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
