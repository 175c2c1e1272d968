"""Shared GPU timing machinery for nibble's kernel benchmarks.

Small API, used by every kernel family's benchmark:

- ``bench_us(fn_factory, n_rot=1, ...)`` -> median microseconds of one call.
  ``fn_factory(i)`` returns a zero-argument callable that works on the i-th of ``n_rot`` input
  sets (rotating copies of the weights, so that repeated calls do not time the 60 MB L2).
  Calls are captured into a CUDA graph (many launches per replay, launch gaps shrink to the
  device's), replays are timed with CUDA events after a warm-up, and the median is returned.
- ``sized_calls(fn_factory, n_rot)`` -> (round_robin, calls): the body `bench_us` captures, sized to
  a ~2 ms replay, for scripts that replay a graph of their own.
- ``bench_rounds(arms, rounds)`` -> {arm: [us per round]}: several ops timed by ``bench_us`` in
  interleaved rounds, each round in another order; a cell's figure is the median over its rounds
  (``add_rounds_argument``: the benchmarks' ``--rounds``); ``time_against(arms, base)``: the same as
  result rows with each arm's ratio to one of them.
- ``ClockSampler()``: ``nvidia-smi`` sampling the SM clock and board power while a ``with`` block runs
  (what a measurement ran at, under the H200's power cap).
- ``rotations(bytes_per_set)`` -> how many input sets make the working set exceed the L2
  several times over.
- ``capture_graph(body, ...)`` -> (graph, output): ``body`` warmed up and captured on the device's
  side stream (``bench_us``, the engine's decode graphs and the speed benchmark capture through it).
- ``env_meta()`` -> dict with GPU name, torch / triton / CUDA versions, git commit, date.
- ``token_sweep_main(doc, tokens, rows_for)``: the command line of a script that sweeps token counts.
- ``write_results(rows, meta, out_dir, name)`` -> writes ``name.json`` (meta + rows) and
  ``name.png`` (speedup vs M, one panel per (N, K) shape, one line per op).
- ``json_text(value, **kwargs)``: ``json.dumps`` as strict JSON, NaN and infinities as null (the bench suites'
  JSON files and report.json).

Everything imports without CUDA (and without matplotlib); only calling ``bench_us`` needs a GPU.
"""
from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import os
import platform
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

L2_BYTES_DEFAULT = 60 * 1024 * 1024  # H100/H200 L2 is 50/60 MB; read from the device when possible


def l2_bytes() -> int:
    if torch.cuda.is_available():
        try:
            return int(torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size)
        except Exception:  # pragma: no cover - very old torch
            pass
    return L2_BYTES_DEFAULT


def rotations(bytes_per_set: int, factor: float = 4.0, max_sets: int = 64) -> int:
    """Number of input sets so that ``n * bytes_per_set >= factor * L2`` (at least 1, at most max_sets)."""
    need = factor * l2_bytes()
    return int(max(1, min(max_sets, math.ceil(need / max(1, bytes_per_set)))))


def _event_time_ms(fn: Callable[[], None]) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def sized_calls(fn_factory: Callable[[int], Callable[[], object]], n_rot: int = 1, target_replay_ms: float = 2.0,
                max_calls_per_replay: int = 1000) -> tuple[Callable[[int], Callable[[], None]], int]:
    """(round_robin, calls): ``round_robin(k)`` is a body making k calls of ``fn_factory(i)()`` round-robin
    over the ``n_rot`` input sets, and ``calls`` (a multiple of n_rot) the number that fills a replay of
    ~``target_replay_ms``, from an eager timing of one round after each callable's first call
    (compilation, handle creation). What `bench_us` captures, and any script that replays its own graph."""
    fns = [fn_factory(i) for i in range(n_rot)]
    for f in fns:
        f()
    torch.cuda.synchronize()

    def round_robin(k: int) -> Callable[[], None]:
        def run():
            for j in range(k):
                fns[j % n_rot]()
        return run

    # Rough per-call time (eager, cycling all sets) to size the graph.
    est_ms = _event_time_ms(round_robin(n_rot)) / n_rot
    calls = max(n_rot, int(target_replay_ms / max(est_ms, 1e-4)))
    calls = min(max(calls, n_rot), max(max_calls_per_replay, n_rot))
    return round_robin, int(math.ceil(calls / n_rot) * n_rot)


def bench_us(fn_factory: Callable[[int], Callable[[], object]], n_rot: int = 1, *, graph: bool = True,
             target_replay_ms: float = 2.0, max_calls_per_replay: int = 1000, warmup_ms: float = 25.0,
             reps: int = 30, max_total_ms: float = 300.0, return_all: bool = False):
    """Median time of one call in microseconds.

    fn_factory(i) for i in range(n_rot) must return a zero-arg callable (e.g. a lambda closing over
    the i-th weight copy). The callables are invoked round-robin. With ``graph=True`` a CUDA graph
    of ``calls`` launches is captured (calls chosen so a replay lasts ~target_replay_ms and is a
    multiple of n_rot), replayed for ``warmup_ms``, then ``reps`` replays are timed one by one with
    events; the result is median(replay) / calls. If capture fails (an op that cannot be captured)
    it falls back to eager timing and says so in the returned dict when ``return_all``.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("bench_us needs a CUDA device")
    round_robin, calls = sized_calls(fn_factory, n_rot, target_replay_ms, max_calls_per_replay)

    mode = "graph"
    body: Callable[[], None]
    if graph:
        try:
            g, _ = capture_graph(round_robin(calls), warmup=round_robin(n_rot))
            torch.cuda.synchronize()
            body = g.replay
        except Exception:  # capture not supported by this op: fall back to eager launches
            mode = "eager"
            torch.cuda.synchronize()
            body = round_robin(calls)
    else:
        mode = "eager"
        body = round_robin(calls)

    # Warm-up by time; slow ops (many ms per replay) get fewer timed replays (at least 5).
    t_one = _event_time_ms(body)
    for _ in range(max(1, int(warmup_ms / max(t_one, 1e-3)))):
        body()
    torch.cuda.synchronize()
    reps = max(5, min(reps, int(max_total_ms / max(t_one, 1e-3))))
    times = [_event_time_ms(body) for _ in range(reps)]
    med_us = statistics.median(times) * 1000.0 / calls
    if return_all:
        return {"us": med_us, "min_us": min(times) * 1000.0 / calls, "calls_per_replay": calls,
                "n_rot": n_rot, "mode": mode, "replay_ms": times}
    return med_us


ROUNDS = 3  # interleaved rounds per benchmark cell (bench_rounds says why)


def parse_bench_args(parser: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """``parser.parse_args(argv)`` of a benchmark whose ``--out`` folder it writes, refusing one it could not write
    (a file, a folder it may not create files in) as a usage error: the run found out at its first write, a traceback
    after minutes of timing (the W4A4 suite's, after its pre-compilation too)."""
    from nibble.cli import check_out

    args = parser.parse_args(argv)
    try:
        check_out(args.out, None, writes_model=False)
    except ValueError as e:
        parser.error(str(e))
    return args


def whole_number(what: str) -> Callable[[str], int]:
    """An argparse type for a benchmark's count option: a whole number above 0, refused as ``what`` it is (e.g. "a
    token count M") otherwise."""
    def parse(text: str) -> int:
        if not text.isdecimal() or int(text) < 1:
            raise argparse.ArgumentTypeError(f"{what} is a whole number above 0; got {text!r}")
        return int(text)
    return parse


def add_rounds_argument(parser) -> None:
    """``--rounds R`` (default ROUNDS, at least 1) on a benchmark's command line, for `bench_rounds`."""
    parser.add_argument("--rounds", type=whole_number("a number of rounds"), default=ROUNDS,
                        help=f"interleaved rounds per cell, its figure their median (default {ROUNDS})")


def bench_rounds(arms: dict, rounds: int = ROUNDS, optional=(), measure: Callable[..., float] | None = None,
                 log=print, **timing) -> dict:
    """{arm: [microseconds, one per round]} for ``arms`` ({name: (fn_factory, n_rot)}, what
    `bench_us` takes), timed in ``rounds`` interleaved rounds: round r times every arm once, starting
    at the r-th (so each arm runs early and late). Why rounds: one `bench_us` window lasts ~50 ms,
    and under compute-bound products the H200 draws up to its 700 W cap, its SM clock moving between
    ~1450 and 1950 MHz from one 100 ms sample to the next (benchmarks/results/power-cap-order-h200.log
    and its -smi- log): one window per op put up to +-10% of noise on a ratio of two ops; medians
    over interleaved rounds share the clock's phases between the ops. An arm named in ``optional`` that
    raises (an op this shape or GPU does not run) is tried once: its list stays empty and ``log``
    says why; any other arm's error propagates. ``measure`` (default `bench_us`) and ``timing`` (its
    keywords) time one arm once."""
    measure = measure or bench_us
    names = list(arms)
    times: dict = {name: [] for name in names}
    failed: set = set()
    for r in range(rounds if names else 0):
        for name in names[r % len(names):] + names[:r % len(names)]:
            if name in failed:
                continue
            try:
                times[name].append(measure(*arms[name], **timing))
            except Exception as e:
                if name not in optional:
                    raise
                failed.add(name)
                times[name] = []
                log(f"  {name} unavailable: {type(e).__name__}: {str(e)[:160]}")
    return times


def time_against(arms: dict, base: str, rounds: int = ROUNDS, log=print, **labels) -> list[dict]:
    """``arms`` ({name: zero-argument callable}, one input set each) timed by `bench_rounds`; a row per arm:
    ``labels``, op, us (the median over the rounds), rounds, vs_base (``arms[base]``'s us over the arm's:
    above 1, faster than it), each also said through ``log``."""
    times = bench_rounds({name: (lambda i, fn=fn: fn, 1) for name, fn in arms.items()}, rounds)
    ref = statistics.median(times[base])
    rows = []
    for name, t in times.items():
        us = statistics.median(t)
        rows.append(dict(labels, op=name, us=us, rounds=t, vs_base=ref / us))
        log(" ".join(f"{k}={v}" for k, v in labels.items()), f"{name:18s} {us:8.2f} us ({ref / us:.3f}x {base})")
    return rows


class ClockSampler:
    """``nvidia-smi`` sampling the GPU's SM clock, board power and temperature every ``period_ms`` while the
    ``with`` block runs (a copy of its CSV at ``log_path`` if given); then `during` says what a span of the
    block, between two ``datetime.datetime.now()`` stamps, ran at. Used by the power-cap scripts
    (benchmarks/scripts/power_cap_*.py, benchmarks/notes-w4a16.md session 40)."""

    QUERY = "timestamp,clocks.sm,power.draw,temperature.gpu"

    def __init__(self, period_ms: int = 50, log_path: str | os.PathLike | None = None):
        self.period_ms, self.log_path = period_ms, log_path
        self.samples: list = []  # (datetime, MHz, W, degrees C)

    def __enter__(self) -> "ClockSampler":
        self._log = open(self.log_path, "w+") if self.log_path else tempfile.TemporaryFile("w+")
        self._smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={self.QUERY}", "--format=csv,noheader,nounits",
                                      "-lms", str(self.period_ms)], stdout=self._log)
        return self

    def __exit__(self, *exc) -> None:
        self._smi.terminate()
        self._smi.wait()
        self._log.seek(0)
        for line in self._log.read().splitlines():
            stamp, *values = [v.strip() for v in line.split(",")]
            self.samples.append((datetime.datetime.strptime(stamp, "%Y/%m/%d %H:%M:%S.%f"), *map(float, values)))
        self._log.close()

    def during(self, begin: datetime.datetime, end: datetime.datetime) -> dict:
        """Median SM MHz and board watts of the samples between ``begin`` and ``end`` (None without any)."""
        inside = [(mhz, watts) for t, mhz, watts, _ in self.samples if begin <= t <= end]
        return dict(samples=len(inside), sm_mhz=statistics.median(m for m, _ in inside) if inside else None,
                    watts=statistics.median(w for _, w in inside) if inside else None)


def git_commit(package: Path = Path(__file__).resolve().parents[1]) -> str:
    """The commit of nibble's own checkout (``package`` is its nibble/ folder), "-dirty" if it has changes;
    "no-commit" for an installed nibble, whose folder a repository around it (a project's .venv) answered for.
    $NIBBLE_GIT_COMMIT, where set, answers instead: a copy of the working tree on a GPU machine carries a stale
    .git, and benchmarks/scripts/device_suite.sh sets it to the commit the copy was made from."""
    if os.environ.get("NIBBLE_GIT_COMMIT"):
        return os.environ["NIBBLE_GIT_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--show-toplevel", "HEAD"], cwd=package, capture_output=True,
                             text=True, timeout=5)
        if out.returncode != 0:
            return "no-commit"
        top, commit = (out.stdout.split("\n") + ["", ""])[:2]
        if Path(top).resolve() != package.resolve().parent:
            return "no-commit"
        commit = commit.strip() or "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=package,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return commit + ("-dirty" if dirty else "")
    except Exception:
        return "unknown"


def source_hash(root: str | os.PathLike | None = None) -> str:
    """sha256 (first 16 hex digits) of the package's sources (.py, .cu and .cuh, with their paths; ``root``
    defaults to the package): which code ran, even where a copy of the working tree carries a stale
    or dirty git commit."""
    root = Path(root) if root is not None else Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cu", ".cuh") and "__pycache__" not in p.parts):
        h.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


_SIDE_STREAMS: dict = {}


def capture_graph(body: Callable[[], object], device=None, warmups: int = 1,
                  warmup: Callable[[], object] | None = None):
    """(graph, output): ``body()`` captured into a CUDA graph, after ``warmups`` eager calls of
    ``warmup`` (default: ``body``; Triton compilation, cuBLAS handles, allocator) on the device's side
    stream, which the capture then runs on too. The same stream matters: scratch kept per stream
    (`launch.split_counters`: split-K counters, the spread decode kernel's exchange slots) then exists
    before the capture, instead of being allocated and zeroed by a memset recorded into the graph."""
    stream = side_stream(device)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmups):
            (warmup or body)()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        out = body()
    return graph, out


def side_stream(device=None) -> "torch.cuda.Stream":
    """The side stream of ``device`` (default: the current one) on which CUDA graphs are warmed up and
    captured (``capture_graph``), one per device for the process. Not a fresh stream per capture: PyTorch keeps a
    cuBLAS workspace (32 MiB on the H200) per (handle, stream) for the life of the process, so each new
    stream that runs a cuBLAS call holds one more; the report's peak memory grew by 224 MiB per config
    measured that way (H200, session 21)."""
    device = torch.device("cuda" if device is None else device)
    index = torch.cuda.current_device() if device.index is None else device.index
    if index not in _SIDE_STREAMS:
        _SIDE_STREAMS[index] = torch.cuda.Stream(device=index)
    return _SIDE_STREAMS[index]


def shape_list(text: str) -> list[tuple[int, ...]]:
    """"4096x4096,1x128" -> [(4096, 4096), (1, 128)]: the shapes the benchmark scripts take on the command line."""
    return [tuple(int(v) for v in item.split("x")) for item in text.split(",")]


def gpu_tag() -> str:
    """The GPU in a results file's name: "h200", "h100", else the device name without its vendor, dashed."""
    name = torch.cuda.get_device_name().lower()
    for tag in ("h200", "h100"):
        if tag in name:
            return tag
    return name.replace("nvidia", "").strip().replace(" ", "-")


def env_meta(**extra) -> dict:
    from nibble import __version__

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "nibble": __version__,
        "git_commit": git_commit(),
        "source_sha256": source_hash(),
    }
    try:
        import triton
        meta["triton"] = triton.__version__
    except Exception:
        meta["triton"] = None
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        meta.update(gpu=p.name, sm_count=p.multi_processor_count, l2_bytes=int(getattr(p, "L2_cache_size", 0)),
                    capability=f"{p.major}.{p.minor}")
    else:
        meta["gpu"] = None
    meta.update(extra)
    return meta


def tee(path: str | os.PathLike) -> Callable[..., None]:
    """A print that also writes each line to the file at `path`, flushed at once: the log of a long
    device run survives its time limit."""
    f = open(path, "w")

    def say(*parts) -> None:
        line = " ".join(str(p) for p in parts)
        print(line, flush=True)
        f.write(line + "\n")
        f.flush()
    return say


def json_text(value, **kwargs) -> str:
    """``json.dumps(value, **kwargs)`` with every NaN or infinite float written as null. Python's default writes a
    bare ``NaN`` / ``Infinity``, which is not JSON: jq, JavaScript's JSON.parse and strict parsers reject the whole
    file (a geomean over no shape is NaN, and so is the perplexity of a model whose logits went NaN).
    ``allow_nan=False``: a non-finite number this misses (one a ``default`` hook returns) fails here, not in a
    reader."""
    return json.dumps(_finite(value), allow_nan=False, **kwargs)


def _finite(value):
    """``value`` with NaN and infinities, at any depth of dicts, lists and tuples, as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def token_sweep_main(doc: str, default_tokens: Sequence[int], rows_for: Callable[[list[int]], list[dict]]) -> None:
    """The command line of a benchmark script that sweeps token counts: ``--tokens`` (comma-separated,
    default ``default_tokens``) and ``--json`` (the rows ``rows_for(tokens)`` times, with `env_meta`)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--tokens", default=",".join(map(str, default_tokens)))
    args = ap.parse_args()
    rows = rows_for([int(t) for t in args.tokens.split(",")])
    if args.json:
        Path(args.json).write_text(json_text({"meta": env_meta(), "rows": rows}, indent=1))


def write_results(rows: Sequence[dict], meta: dict, out_dir: str | os.PathLike, name: str, *,
                  x: str = "M", y: str = "speedup", series: str = "op", panel: Iterable[str] = ("N", "K"),
                  title: str | None = None, baseline: str | None = None) -> dict:
    """Write ``out_dir/name.json`` (``{"meta": meta, "rows": rows}``) and ``out_dir/name.png``.

    The PNG has one panel per distinct value of the ``panel`` keys, ``y`` against ``x`` (log2 x axis)
    with one line per ``series`` value and a dashed line at y = 1; the ``baseline`` series (the one every ``y`` is
    relative to) is that dashed line, so its rows are kept in the JSON but not drawn. Returns the paths written.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    jpath = out / f"{name}.json"
    jpath.write_text(json_text({"meta": meta, "rows": list(rows)}, indent=1, default=str))
    paths = {"json": str(jpath)}
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return paths
    panel = tuple(panel)
    rows = [r for r in rows if baseline is None or r[series] != baseline]
    keys = sorted({tuple(r[k] for k in panel) for r in rows if y in r and r[y] is not None})
    if not keys:
        return paths
    ncol = min(4, len(keys))
    nrow = math.ceil(len(keys) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(4.2 * ncol, 3.3 * nrow), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        sel = [r for r in rows if tuple(r[k] for k in panel) == key and r.get(y) is not None]
        for s in sorted({r[series] for r in sel}):
            pts = sorted((r[x], r[y]) for r in sel if r[series] == s)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=str(s))
        ax.axhline(1.0, color="gray", ls="--", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(" ".join(f"{k}={v}" for k, v in zip(panel, key)), fontsize=9)
        ax.set_xlabel(x)
        ax.set_ylabel(y)
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=7)
    fig.suptitle(title or f"{name} ({meta.get('gpu')})", fontsize=11)
    fig.tight_layout()
    ppath = out / f"{name}.png"
    fig.savefig(ppath, dpi=110)
    plt.close(fig)
    paths["png"] = str(ppath)
    return paths


# the issues' bars at M = 1 / 16 / 128 are geomeans over the shapes that hold at least this much 16-bit weight (all of
# the W4A16 issue's but 4096 x 4096): there the weight's bytes, not a launch's fixed cost, decide the time
BIG_WEIGHT_BYTES = 64 << 20


def holds_big_weight(n: int, k: int) -> bool:
    """Whether an n x k layer holds at least `BIG_WEIGHT_BYTES` of 16-bit weight (the bars' shapes)."""
    return n * k * 2 >= BIG_WEIGHT_BYTES


def geomean(values: Iterable[float]) -> float:
    vals = [v for v in values if v is not None and v > 0]
    return math.exp(sum(math.log(v) for v in vals) / len(vals)) if vals else float("nan")
