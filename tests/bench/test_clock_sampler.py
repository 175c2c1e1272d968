"""`ClockSampler` on the CPU, with a stand-in `nvidia-smi` on the PATH that prints fixed samples: the CSV it
reads back and the medians of a span."""
import datetime
import os
import stat
import time

from nibble.bench.timing import ClockSampler

SAMPLES = """2026/12/02 15:08:05.470, 1980, 153.46, 39
2026/12/02 15:08:05.570, 1650, 202.20, 40
2026/12/02 15:08:05.671, 1500, 663.00, 53
2026/12/02 15:08:05.772, 1700, 690.50, 54
"""


def test_samples_come_back_and_a_span_takes_their_medians(tmp_path, monkeypatch):
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/sh\ncat <<'END'\n" + SAMPLES + "END\nexec sleep 30\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    log = tmp_path / "smi.csv"
    with ClockSampler(period_ms=50, log_path=log) as clocks:
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=10)
        while log.read_text().count("\n") < 4 and datetime.datetime.now() < deadline:
            pass
    assert [s[1:] for s in clocks.samples] == [(1980, 153.46, 39), (1650, 202.2, 40), (1500, 663.0, 53),
                                               (1700, 690.5, 54)]
    begin, end = datetime.datetime(2026, 12, 2, 15, 8, 5, 500000), datetime.datetime(2026, 12, 2, 15, 8, 5, 800000)
    assert clocks.during(begin, end) == dict(samples=3, sm_mhz=1650, watts=663.0)
    assert clocks.during(end, end + datetime.timedelta(seconds=1)) == dict(samples=0, sm_mhz=None, watts=None)


def test_a_span_takes_the_samples_at_its_ends():
    """``begin`` and ``end`` are inclusive: a span from one sample's stamp to another's holds both."""
    clocks = ClockSampler()
    stamps = [datetime.datetime(2026, 12, 2, 15, 8, 5, 100000 * i) for i in range(4)]
    clocks.samples = [(t, mhz, watts, 40.0) for t, mhz, watts in zip(stamps, (1980, 1650, 1500, 1700),
                                                                      (150.0, 200.0, 660.0, 690.0))]
    assert clocks.during(stamps[1], stamps[2]) == dict(samples=2, sm_mhz=1575.0, watts=430.0)
    assert clocks.during(stamps[0], stamps[0]) == dict(samples=1, sm_mhz=1980, watts=150.0)


def test_without_a_log_nvidia_smi_is_asked_for_the_csv_then_stopped_and_read_back(tmp_path, monkeypatch):
    """No ``log_path``: the CSV goes to a temporary file and still comes back. nvidia-smi is asked for the timestamp,
    SM clock, power and temperature every ``period_ms`` as bare CSV, and stopped when the block ends."""
    fake = tmp_path / "nvidia-smi"
    fake.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > '{tmp_path}/args'\ncat <<'END'\n{SAMPLES}END\n"
                    f"trap 'kill $!; touch \"{tmp_path}/stopped\"; exit 0' TERM\ntouch '{tmp_path}/printed'\n"
                    "sleep 30 &\nwait\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with ClockSampler(period_ms=20) as clocks:
        deadline = datetime.datetime.now() + datetime.timedelta(seconds=10)
        while not (tmp_path / "printed").exists() and datetime.datetime.now() < deadline:
            time.sleep(0.01)
    assert (tmp_path / "stopped").exists()  # terminated, not left to run (or waited for) until it ends
    assert (tmp_path / "args").read_text().splitlines() == [
        "--query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits", "-lms", "20"]
    assert [s[1:] for s in clocks.samples] == [(1980, 153.46, 39), (1650, 202.2, 40), (1500, 663.0, 53),
                                               (1700, 690.5, 54)]
    assert clocks.samples[0][0] == datetime.datetime(2026, 12, 2, 15, 8, 5, 470000)
