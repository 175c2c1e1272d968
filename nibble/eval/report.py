"""``nibble report``: accuracy, memory and speed of several quantization configs, side by side.

For each config (``bf16``, ``w4a16``, ``w4a4``, ``w4a4-hadamard``; also ``w4a16-g64`` style group
sizes, and ``-gptq`` / ``-awq`` for calibrated weights) the real model is loaded fresh, converted, and measured:

- accuracy: WikiText-2 test perplexity (whole test set unless ``ppl_max_tokens``) and the seven
  zero-shot tasks (``tasks_limit`` documents each) - runs on the CPU too, slowly;
- memory: weight bytes by module kind (CPU too), and on CUDA the peak memory of a 512-token
  prefill + 128-token decode;
- speed (CUDA only): prefill latency and decode tokens/s through ``nibble.eval.engine`` with their
  rooflines, on the real model and on random-weight models shaped as `speed.SPEED_MODELS` lists them
  (Llama-2-7B, Llama-3-8B, Llama-3.2-1B; Llama-2-7B alone by default).

The command line (its options, their checks, `report_main`) is `report_command.py`, which imports no torch.

Writes ``report.json`` (everything), ``report.md`` (tables, configs side by side) and
``speedup.png`` (where speed was timed) / ``vram.png`` / ``accuracy.png`` (where tasks were scored). Without
CUDA the speed and memory-peak parts are skipped with a message saying so. The JSON and Markdown are written after
each config and each speed model, marked partial until the last (meta's ``partial``, report.md's header), so that
a run stopped part way (Ctrl-C, a kill, a machine's time limit) keeps what it measured.

``report.json`` is strict JSON: a NaN or infinite number is written as ``null`` (Python's json writes a bare
``NaN``, which jq and JavaScript reject). A score, the perplexity (``ppl``, ``nll``) or a task's metric, is ``null``
where it was NaN (a model whose logits went NaN; a standard error, also where its task had one document: lm-eval's
"N/A"); any other ``null`` is a setting left unset (meta's
``tasks_limit``) or a figure with nothing to take it from (a ratio without a bf16 run). `read_json` reads a
report.json back with those scores NaN again, as `run_report` returned them (report.md writes "nan", not "-",
which is "not measured").
"""
from __future__ import annotations

import json
import math
import time
import traceback
from pathlib import Path
from typing import Callable

import torch

from nibble.bench.timing import json_text
from nibble.config import QuantConfig, check_count, resolve_device
from nibble.eval import ALL_TASKS, DEFAULT_CONFIGS, DEFAULT_SPEED_MODELS, SPEED_ROUNDS, TASKS_BATCH_SIZE
from nibble.eval import memory as mem_mod
from nibble.eval import speed as speed_mod
from nibble.eval.data import require_data
from nibble.eval.perplexity import WIKITEXT2_TEST, check_model_window, check_window, context_length
from nibble.eval.tasks import task_files
from nibble.models.checkpoint_files import atomic_write
from nibble.models.convert import check_quantizable, default_group_size
from nibble.quantize.calibration import calibration_files, calibration_for

WINDOW_NAMES = ("ppl_seq_len", "ppl_max_tokens")  # how a refused perplexity window names them (`check_window`)
NO_CUDA = "skipped: the model is not on a CUDA GPU (speed and peak memory are measured on the GPU only)"
NO_GPU = "skipped: no CUDA GPU visible (the speed models are built and timed on the GPU only)"


def say(line: str) -> None:
    """The report's log: a line on stdout, flushed. Into a file or a pipe (`> log`, `| tee`) stdout is block-buffered,
    and a run of many minutes showed none of its lines until it ended."""
    print(line, flush=True)


# Targets from the issue, checked on the Llama-2-7B-shaped model: label -> (config, summary key, op, bound).
TARGETS = {
    "w4a16 quantized-linear bytes / bf16": ("w4a16", "linear_bytes_ratio", "<=", 0.30),
    "w4a16 peak memory / bf16": ("w4a16", "peak_ratio", "<=", 0.50),
    "w4a16 decode speedup (batch 1)": ("w4a16", "decode_speedup_b1", ">=", 2.5),
    "w4a4 prefill speedup (batch 1, 128 tokens)": ("w4a4", "prefill_speedup_b1_t128", ">=", 1.8),
    "w4a4 prefill speedup (batch 1, 512 tokens)": ("w4a4", "prefill_speedup_b1_t512", ">=", 1.6),
}


def quant_config(name: str, model=None, **overrides) -> QuantConfig | None:
    """The QuantConfig a report config name stands for (``None`` for the 16-bit baseline ``bf16``).

    ``w4a16`` uses group size 128, or the largest of 64 / 32 that divides every linear's in_features
    of ``model`` (SmolLM2's 576 needs 64); ``w4a16-g64`` names it explicitly. ``-lmhead`` on a quantized
    config quantizes lm_head too (``w4a16-lmhead``, ``w4a4-hadamard-lmhead``). ``-gptq`` (both modes) and
    ``-awq`` (W4A16) pick the calibrated method (``w4a16-g64-awq``, ``w4a4-hadamard-gptq``). A name it refuses
    (ValueError) is said first, ``config w4a16-g7: ...``: QuantConfig's own refusals ("group_size must be ...")
    named no config, where a report of several left the reader to guess which.
    """
    try:
        return _quant_config(name, model, overrides)
    except ValueError as e:
        raise ValueError(f"config {name}: {e}") from None


# what each part of a quantized config's name sets, said when a name repeats one (the last one won, without a word)
_PART_CHOICES = {"group_size": "group size", "method": "method", "modules_to_not_convert": "lm_head's quantization",
                 "rotation": "rotation"}
_MODE_PARTS = {"w4a16": "-gN (group size), -gptq, -awq, -lmhead", "w4a4": "-hadamard, -gptq, -lmhead"}


def _quant_config(name: str, model, overrides: dict) -> QuantConfig | None:
    parts = name.lower().split("-")
    if parts[0] in ("bf16", "fp16", "16bit"):
        if len(parts) > 1:
            raise ValueError(f"the 16-bit baseline takes no suffix: use {parts[0]} alone")
        return None
    mode = parts[0]
    if mode not in _MODE_PARTS:
        raise ValueError("unknown config; use bf16, w4a16, w4a16-gN, w4a4, w4a4-hadamard (a quantized config takes "
                         "-lmhead to quantize lm_head too, and -gptq, or -awq for w4a16)")
    kw, given = {}, {}
    for p in parts[1:]:
        if p == "lmhead":
            field, value = "modules_to_not_convert", []
        elif mode == "w4a16" and p.startswith("g") and p[1:].isdecimal():
            field, value = "group_size", int(p[1:])
        elif p == "gptq" or (mode == "w4a16" and p == "awq"):
            field, value = "method", p
        elif mode == "w4a4" and p == "hadamard":
            field, value = "rotation", p
        else:
            raise ValueError(f"unknown part -{p}: {mode} takes {_MODE_PARTS[mode]}")
        if field in given:
            raise ValueError(f"-{p} given twice" if given[field] == p else
                             f"-{given[field]} and -{p} both choose the {_PART_CHOICES[field]}: give one")
        given[field], kw[field] = p, value
    if mode == "w4a16" and "group_size" not in kw and model is not None:
        kw["group_size"] = default_group_size(model)
    return QuantConfig(mode=mode, **{**kw, **overrides})


def check_distinct(configs: list[str], model=None) -> None:
    """Refuse two names of one model, as `quant_config` resolves them (for ``model``: SmolLM2's w4a16 is w4a16-g64),
    which would be measured twice, for minutes each, and shown twice; the spelling alone let w4a16-g64-gptq and
    w4a16-gptq-g64 through."""
    resolved = []
    for name in configs:
        qc = quant_config(name, model)
        same = [other for other, oqc in resolved if oqc == qc]
        if same and same[0] == name:  # as spelled, or as an alias of bf16 (`config_name` filed it so)
            raise ValueError(f"config {name} named more than once: name each config once")
        if same:
            raise ValueError(f"configs {same[0]} and {name} are one config{' for this model' if model else ''} "
                             "(the same QuantConfig): name each config once")
        resolved.append((name, qc))


def config_name(name: str) -> str:
    """``name`` as the report files it: lower case, the 16-bit baseline (``fp16``, ``16bit``) as ``bf16``, the name
    the ratios and speedups are taken against (``BF16`` or ``fp16`` had none: every "/ bf16" cell read "-"). An
    unknown name is refused (ValueError)."""
    name = name.lower()
    return "bf16" if quant_config(name) is None else name


def _default_loader(model_name_or_path, device, dtype) -> Callable:
    def load():
        from nibble.models.loading import load_model
        return load_model(model_name_or_path, dtype=dtype, device=device)
    return load


def _checked_loader(loader: Callable, configs: list[str]) -> Callable:
    """``loader`` once every config that quantizes has checked the model it loads (`check_quantizable`, the
    refusals ``quantize_model`` says before any work, and `quant_config`'s choice of a group size), so that a config
    the model cannot take is refused before the first config's work: w4a4-hadamard on a model the rotation cannot
    take failed at its turn, after the configs before it had run for minutes each. The model loaded for the checks
    is the first config's. A loader that fails on what it was given (OSError, ValueError: no model at the path, a
    file that is not one, a damaged one) is refused here, as every config would fail the same way: `nibble report
    --model` of a path that was not there ran each config into it and wrote a report of its failures. Another failure
    is left to fail in each config, reported as before (the speed models run all the same)."""
    try:
        model, tokenizer = loader()
    except (OSError, ValueError):
        raise
    except Exception:
        return loader
    check_distinct(configs, model)
    for name in configs:
        qc = quant_config(name, model)  # its refusal names the config (a default group size no width takes)
        try:
            if qc is not None:
                check_quantizable(model, qc)
        except ValueError as e:
            raise ValueError(f"config {name}: {e} (or leave {name} out of the configs)") from None
    loaded = [(model, tokenizer)]
    return lambda: loaded.pop() if loaded else loader()


def _on_cuda(model) -> bool:
    return next(model.parameters()).is_cuda


# ---- the real model: accuracy, memory, speed per config ---------------------------------------
def _evaluate_config(name, loader, tasks, tasks_limit, ppl_max_tokens, ppl_seq_len, batch_size, accuracy, speed,
                     progress, log) -> dict:
    from nibble.eval.perplexity import wikitext2_perplexity
    from nibble.eval.tasks import evaluate_tasks

    model, tokenizer = loader()
    if accuracy:  # before the quantization (minutes with GPTQ): run_report could not read a loader's context
        check_window(ppl_seq_len, ppl_max_tokens, WINDOW_NAMES, context_length(model))
    qc = quant_config(name, model)
    res = {"config": name, "quant_config": qc.to_dict() if qc else None,
           "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
           "device": str(next(model.parameters()).device)}
    # the baseline where it is not bfloat16 (float32 on a CPU) said so, as report.md's "quantization" row does
    label = f"{name} in {res['dtype']}" if qc is None and res["dtype"] != "bfloat16" else name
    # the longest step on a CPU (W4A4 + Hadamard: minutes), with a bar where the other steps show theirs
    res["quantize_s"] = speed_mod.quantize_in_place(model, qc, calibration_for(qc, tokenizer, model), progress=progress)
    if accuracy:
        t0 = time.perf_counter()
        res["perplexity"] = wikitext2_perplexity(model, tokenizer, seq_len=ppl_seq_len, max_tokens=ppl_max_tokens,
                                                 progress=progress)
        log(f"[{label}] WikiText-2 ppl {res['perplexity']['ppl']:.3f} ({res['perplexity']['tokens']} tokens)")
        res["tasks"] = evaluate_tasks(model, tokenizer, tasks, limit=tasks_limit, batch_size=batch_size,
                                      progress=progress)
        log(f"[{label}] tasks average acc {res['tasks']['average']['acc']:.4f}")
        res["accuracy_s"] = time.perf_counter() - t0
    res["weights"] = mem_mod.weight_memory(model)
    on_cuda = _on_cuda(model)
    res["peak"] = mem_mod.peak_memory(model) if on_cuda else {"skipped": NO_CUDA}
    if speed:
        res["speed"] = speed_mod.speed_benchmark(model, f"model/{name}", log=log) if on_cuda else {"skipped": NO_CUDA}
    del model
    speed_mod.release()
    return res


# ---- random-weight 7B/8B-shaped models: memory and speed per config ---------------------------


def measure_speed_models(model_name: str, configs, rounds: int = SPEED_ROUNDS, clip_search: bool = False,
                         log=say) -> dict:
    """{config: memory and speed} of every config on the random-weight ``model_name`` (CUDA only).

    One model is on the GPU at a time (the peak counts everything allocated), rebuilt for each of
    ``rounds`` rounds whose config order alternates (as given, then reversed); memory is measured
    in the first, and each speed row is the round with the median time (all rounds' times kept in
    ``round_ms``). Measured once each, one after another with bf16 first, the ratios moved with
    the run: on an H200, bf16 prefilled 1 x 512 tokens of Llama-2-7B in 10.67 ms where rounds
    alternating in one process right after read 11.06-11.70 ms, so W4A4 read 1.56x against 1.67x
    (benchmarks/results/prefill-repeats-report-machine-llama2-7b-h200.json). A config that fails is
    reported with its error and left out of the later rounds."""
    res: dict = {}
    runs: dict = {name: [] for name in configs}
    for r in range(rounds):
        for name in speed_mod.round_order(list(configs), r):
            if "error" in res.get(name, {}):
                continue
            model = None
            try:
                model = speed_mod.random_model(model_name)
                qc = quant_config(name, model, clip_search=clip_search, method="rtn")
                quantize_s = speed_mod.quantize_in_place(model, qc)
                if r == 0:
                    log(f"[{model_name}/{name}] built and quantized in {quantize_s:.1f} s (RTN, clip_search={clip_search})")
                    res[name] = {"speed_model": model_name, "config": name, "quant_config": qc.to_dict() if qc else None,
                                 "dtype": "bfloat16", "quantize_s": quantize_s, "weights": mem_mod.weight_memory(model),
                                 "peak": mem_mod.peak_memory(model)}
                    log(f"[{model_name}/{name}] weights {mem_mod.format_bytes(res[name]['weights']['total_bytes'])}, "
                        f"peak (512 prefill + 128 decode) {mem_mod.format_bytes(res[name]['peak']['peak_bytes'])}")
                log(f"[{model_name}/{name}] speed, round {r + 1} of {rounds}")
                runs[name].append(speed_mod.speed_benchmark(model, f"{model_name}/{name}", log=log))
            except Exception as e:
                log(f"[{model_name}/{name}] FAILED: {type(e).__name__}: {e}\n{traceback.format_exc()}")
                res[name] = {"config": name, "error": f"{type(e).__name__}: {e}"}
            finally:
                del model
                speed_mod.release()
    for name in configs:
        if "error" not in res[name]:
            res[name]["speed"] = _median_rows(runs[name])
            res[name]["speed_rounds"] = len(runs[name])
    return {name: res[name] for name in configs}


def _median_rows(runs: list[list[dict]]) -> list[dict]:
    """Row by row over the rounds' `speed_benchmark` rows (same shapes, same order): the round whose
    time is the median (the upper one of an even count), with every round's time in ``round_ms``."""
    out = []
    for rows in zip(*runs):
        key = "ms" if rows[0]["phase"] == "prefill" else "ms_per_step"
        ranked = sorted(rows, key=lambda row: row[key])
        out.append({**ranked[len(ranked) // 2], "round_ms": [row[key] for row in rows]})
    return out


def _ratio(a, b):
    return a / b if a is not None and b else None


def _bytes_16bit(r: dict, kinds=mem_mod.KINDS) -> float:
    """Bytes of ``kinds`` of one config's weights, its dense tensors counted at 16 bits (2 bytes an element)
    whatever dtype the config ran in; the quantized buffers (INT4 codes, 16-bit scales and zeros) as they are.

    So the "/ bf16" ratios say what their label says on either device: on the CPU every config runs in float32
    (`default_dtype`: most CPUs lack fast bf16 matmuls), where the baseline's linears hold 4 bytes a weight
    and W4A16 g64 read 0.14 instead of ~0.28. Loading only the baseline in bf16 instead would measure its
    accuracy in other numerics than the quantized configs' beside it. The MiB rows stay the bytes measured,
    and `_byte_labels` names their dtype and the ratio's. (Dense integer buffers, an act-order permutation, are
    rescaled alike: a few bytes a layer.)"""
    size = getattr(torch, r.get("dtype", "bfloat16")).itemsize
    k = r["weights"]["kinds"]
    dense = sum(k[x]["dense_bytes"] for x in kinds)
    return sum(k[x]["bytes"] for x in kinds) - dense + dense * 2 / size


def summarize(results: dict) -> dict:
    """Ratios vs bf16 per speed model (and the real model), and the issue's targets on llama-2-7b."""
    summary = {}
    groups = dict(results.get("speed_models", {}))
    groups["model"] = {c: r for c, r in results.get("configs", {}).items() if "error" not in r}
    for group, by_config in groups.items():
        base = by_config.get("bf16")
        if not base or "error" in base or "weights" not in base:
            continue
        out = {}
        for name, r in by_config.items():
            if "error" in r or "weights" not in r:
                continue
            linears = mem_mod.LINEAR_KINDS
            s = {"linear_bytes_ratio": _ratio(_bytes_16bit(r, linears), _bytes_16bit(base, linears)),
                 "weight_bytes_ratio": _ratio(_bytes_16bit(r), _bytes_16bit(base))}
            if "peak_bytes" in r.get("peak", {}) and "peak_bytes" in base.get("peak", {}):
                s["peak_ratio"] = _ratio(r["peak"]["peak_bytes"], base["peak"]["peak_bytes"])
            if _rows(r) and _rows(base):
                b_rows = {(x["phase"], x["batch"], x["tokens"]): x for x in _rows(base)}
                for x in _rows(r):
                    b = b_rows.get((x["phase"], x["batch"], x["tokens"]))
                    if b is None:
                        continue
                    if x["phase"] == "prefill":
                        s[f"prefill_speedup_b{x['batch']}_t{x['tokens']}"] = b["ms"] / x["ms"]
                    else:
                        s[f"decode_speedup_b{x['batch']}"] = x["tokens_per_s"] / b["tokens_per_s"]
            out[name] = s
        summary[group] = out
    seven = summary.get("llama-2-7b", {})
    checks = {}
    for target, (cfg, key, op, bound) in TARGETS.items():
        value = seven.get(cfg, {}).get(key)
        ok = None if value is None else (value <= bound if op == "<=" else value >= bound)
        checks[target] = {"value": value, "target": f"{op} {bound}", "pass": ok}
    summary["targets_llama-2-7b"] = checks
    return summary


_RUN_KEYS = ("date", "git_commit", "source_sha256", "configs", "speed_models", "tasks_limit", "partial")
_PROTOCOL_KEYS = ("tasks", "tasks_limit", "ppl_max_tokens", "ppl_seq_len")


def merge_reports(reports: list[dict]) -> dict:
    """One results dict from runs that measured different configs (one device call per config when one
    call would not fit the device's time limit): configs and speed models united in order, the summary
    recomputed; meta from the first run, plus ``merged_from`` (date, commit, sources, configs of each run, and its
    ``partial`` where it stopped part way: the merge is whatever the runs hold, the rest of a stopped run's configs
    run apart, not partial itself)."""
    meta = dict(reports[0]["meta"])
    meta.pop("partial", None)
    # the accuracy rows sit side by side and report.md says once how they were measured: the same way, or refused
    protocols = {tuple(str(r["meta"].get(k)) for k in _PROTOCOL_KEYS) for r in reports}
    if len(protocols) > 1:
        raise ValueError(f"the reports measured accuracy differently ({', '.join(_PROTOCOL_KEYS)}: "
                         f"{sorted(protocols)}): merge runs of one protocol")
    configs, speed = {}, {}
    for r in reports:
        for name, res in r.get("configs", {}).items():
            if name in configs and "error" not in configs[name]:
                raise ValueError(f"config {name!r} was measured in more than one of the reports")
            configs[name] = res
        for model, by_config in r.get("speed_models", {}).items():
            speed.setdefault(model, {}).update(by_config)
    meta.update(configs=list(configs), speed_models=list(speed),
                merged_from=[{k: r["meta"].get(k) for k in _RUN_KEYS} for r in reports])
    merged = {"meta": meta, "configs": configs, "speed_models": speed}
    merged["summary"] = summarize(merged)
    return merged


# ---- writing ---------------------------------------------------------------------------------
def write_json(results: dict, path: Path) -> None:
    """report.json: strict JSON, a NaN as null (see the module docstring). Atomic, as report.md: `run_report` writes
    them again after each config, and a run killed during a write kept a truncated file, not the last whole one."""
    text = json_text(results, indent=1, default=str)
    atomic_write(path, lambda tmp: tmp.write_text(text))


def read_json(path: Path) -> dict:
    """A report.json as `run_report` returned its results: a score written as null (a NaN) is NaN again."""
    results = json.loads(Path(path).read_text())
    for r in results.get("configs", {}).values():
        for scores in (r.get("perplexity", {}), *r.get("tasks", {}).values()):
            scores.update({k: math.nan for k, v in scores.items() if v is None})
    return results


def _fmt(v, spec=".3f"):
    # "-" is "not measured" only: a NaN perplexity (a model whose logits went NaN) read as a run that never scored
    return "-" if v is None else format(v, spec)


def _with_stderr(task: dict, metric: str) -> str:
    """``0.6470 ± 0.0112``: a task's metric beside its standard error (lm-eval prints both); ``1.0000 ± N/A`` where
    the stderr alone is NaN, a task of one document (lm-eval's N/A)."""
    value, stderr = task.get(metric), task.get(f"{metric}_stderr")
    if value is None or stderr is None:  # not measured, or a report from before the stderrs
        return _fmt(value, ".4f")
    return _fmt(value, ".4f") + (" ± N/A" if math.isnan(stderr) and not math.isnan(value) else f" ± {stderr:.4f}")


def _accuracy_protocol(results: dict) -> str:
    """What the accuracy rows measured, which report.json holds and the table does not say: a --limit run looked
    like a full one, and "WikiText-2 ppl" like lm-eval's word perplexity."""
    meta, runs = results["meta"], [r for r in results["configs"].values() if "perplexity" in r]
    ppl = runs[0]["perplexity"]
    docs = sorted({r["tasks"][t]["n"] for r in runs for t in meta["tasks"] if t in r.get("tasks", {})})
    limit = (f"the first {meta['tasks_limit']} documents of each task (--limit: a subset, for testing; "
             f"n = {', '.join(map(str, docs))})" if meta.get("tasks_limit") else "every document of each task")
    cut = f"the first {meta['ppl_max_tokens']:,} tokens of " if meta.get("ppl_max_tokens") else ""
    stderr = any("acc_stderr" in r.get("tasks", {}).get(t, {}) for r in runs for t in meta["tasks"])  # older: none
    return (f"Accuracy: zero-shot, lm-eval's formats and metrics{', ± its standard error' * stderr}, on {limit}; "
            f"average: the mean acc of {', '.join(meta['tasks'])}. WikiText-2 ppl: token-level (GPTQ's protocol, "
            f"not lm-eval's word perplexity) on {cut}the test set, in {ppl['windows']:,} non-overlapping "
            f"window{'s' * (ppl['windows'] != 1)} of {ppl['seq_len']:,} tokens ({ppl['tokens']:,} predicted).")


def _mib(n):
    return "-" if n is None else f"{n / 2**20:,.1f}"


def _describe(r: dict) -> str:
    """'w4a16 g64 rtn' style summary of a config's QuantConfig (and the dtype it ran in)."""
    if "error" in r:
        return "failed"
    qc = r.get("quant_config")
    if not qc:
        return r.get("dtype", "16-bit")
    g = "per-channel" if qc["group_size"] == -1 else f"g{qc['group_size']}"
    rot = " hadamard" if qc.get("rotation") == "hadamard" else ""
    head = "" if "lm_head" in qc.get("modules_to_not_convert", ["lm_head"]) else " +lm_head"
    # None: no layer was RTN's, whose search clip_search is (GPTQ and AWQ clip by their own)
    return f"{qc['mode']} {g} {qc['method']}{rot}" + (" noclip" if qc.get("clip_search") is False else "") + head


def _byte_labels(by_config: dict, configs: list[str]) -> tuple[str, str]:
    """(after "MiB", after "decoder linears / bf16") in the memory rows' labels: the dtype the configs' weights
    were measured in, where it is not bfloat16 (as vram.png names it under a bar), and that the ratio counts them
    at 16 bits (`_bytes_16bit`). On the CPU every config runs in float32: a "MiB" row of float32 bytes beside a
    ratio that did not match them read as bf16 bytes."""
    dtypes = list(dict.fromkeys(by_config[n].get("dtype", "bfloat16") for n in configs
                                if "weights" in by_config.get(n, {})))
    if set(dtypes) <= {"bfloat16"}:
        return "", ""
    return f" ({', '.join(dtypes)})", f" ({', '.join(dtypes)} counted as 16-bit)"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def _rows(r: dict) -> list[dict]:
    """The speed rows of one config's results ([] when skipped or failed)."""
    rows = r.get("speed") if isinstance(r, dict) else None
    return rows if isinstance(rows, list) else []


def _speed_cells(by_config: dict, configs: list[str]) -> list[list[str]]:
    """One table row per (phase, batch, tokens): each config's time, its speedup vs bf16 and its roofline figure."""
    rows_of = {n: {(x["phase"], x["batch"], x["tokens"]): x for x in _rows(by_config.get(n, {}))} for n in configs}
    keys = sorted({k for rows in rows_of.values() for k in rows}, key=lambda k: (k[0] != "prefill", k[1], k[2]))
    base = rows_of.get("bf16", {})
    table = []
    for key in keys:
        phase, b, t = key
        row = [f"prefill b={b} T={t}" if phase == "prefill" else f"decode b={b}"]
        for name in configs:
            x, bx = rows_of[name].get(key), base.get(key)
            if x is None:
                row.append("-")
            elif phase == "prefill":
                sp = f" **{bx['ms'] / x['ms']:.2f}x**" if bx and name != "bf16" else ""
                row.append(f"{x['ms']:.2f} ms{sp} ({x['tflops']:.0f} TFLOP/s)")
            else:
                sp = f" **{x['tokens_per_s'] / bx['tokens_per_s']:.2f}x**" if bx and name != "bf16" else ""
                row.append(f"{x['tokens_per_s']:.0f} tok/s{sp} ({x['weight_gbps']:.0f} GB/s, "
                           f"{x['pct_copy_roofline']:.0f}% roofline)")
        table.append(row)
    return table


def write_markdown(results: dict, path: Path) -> None:
    configs = results["meta"]["configs"]
    cr = results.get("configs", {})
    L = [f"# nibble report: {results['meta'].get('model')}", ""]
    meta = results["meta"]
    partial = meta.get("partial")
    if partial:  # first: the tables below lack these, which read as a report of fewer configs
        how = ("interrupted (Ctrl-C)" if partial["state"] == "interrupted" else "written while the run went on (a "
               "run that completes writes it whole; one stopped without a word, killed or out of time, leaves it so)")
        L += [f"**Partial report**, {how}: {_not_measured(meta)} not measured.", ""]
    # the device apart from the GPU: a --device cpu run on a GPU host was headed by the GPU's name alone
    L.append(f"model on {meta.get('device', '-')} · GPU: {meta.get('gpu') or 'none'} · torch {meta.get('torch')} · "
             f"triton {meta.get('triton')} · commit {meta.get('git_commit')} · sources {meta.get('source_sha256', '-')} · "
             f"{meta.get('date')}")
    if meta.get("ceilings"):
        c = meta["ceilings"]
        L.append(f"Rooflines measured on this device: copy {c['copy_gbps']:.0f} GB/s (read + write), "
                 f"bf16 matmul {c['bf16_tflops']:.0f} TFLOP/s.")
    L.append("")
    failed = [f"- **{n} failed**: `{r['error']}`" for n, r in cr.items() if "error" in r]
    L += failed + ([""] if failed else [])
    if cr:
        L += ["## Model: accuracy and memory", ""]
        ratios = results.get("summary", {}).get("model", {})
        rows = [["quantization"] + [_describe(cr.get(n, {})) for n in configs]]
        if any("perplexity" in r for r in cr.values()):
            rows.append(["WikiText-2 ppl"] + [_fmt(cr.get(n, {}).get("perplexity", {}).get("ppl")) for n in configs])
            task_names = [t for t in results["meta"]["tasks"]] + ["average"]
            for t in task_names:
                for metric in ("acc", "acc_norm"):
                    cells = [_with_stderr(cr.get(n, {}).get("tasks", {}).get(t, {}), metric) for n in configs]
                    if metric == "acc" or any(c != "-" for c in cells):
                        rows.append([f"{t} {metric}"] + cells)
        mib, as_16bit = _byte_labels(cr, configs)
        for kind in mem_mod.KINDS:
            rows.append([f"{kind} MiB{mib}"] + [_mib(cr.get(n, {}).get("weights", {}).get("kinds", {}).get(kind, {})
                                                     .get("bytes")) for n in configs])
        rows.append([f"weights total MiB{mib}"] + [_mib(cr.get(n, {}).get("weights", {}).get("total_bytes"))
                                                   for n in configs])
        rows.append([f"decoder linears / bf16{as_16bit}"] + [_fmt(ratios.get(n, {}).get("linear_bytes_ratio"))
                                                            for n in configs])
        rows.append(["peak MiB (512 prefill + 128 decode)"] +
                    [_mib(cr.get(n, {}).get("peak", {}).get("peak_bytes")) for n in configs])
        rows.append(["peak / bf16"] + [_fmt(ratios.get(n, {}).get("peak_ratio")) for n in configs])
        L += _table(["metric"] + list(configs), rows)
        if any("perplexity" in r for r in cr.values()):
            L += ["", _accuracy_protocol(results)]
        skipped = next((r["peak"]["skipped"] for r in cr.values() if "skipped" in r.get("peak", {})), None)
        if skipped:
            L += ["", f"Peak memory and speed {skipped}."]
        L.append("")
        if any(_rows(r) for r in cr.values()):
            L += ["## Model: speed", ""] + _table(["shape"] + list(configs), _speed_cells(cr, configs)) + [""]
    for sm, by_config in results.get("speed_models", {}).items():
        L += [f"## {sm} (random weights): memory and speed", ""]
        if "skipped" in by_config:
            L += [by_config["skipped"], ""]
            continue
        failed = [f"- **{n} failed**: `{r['error']}`" for n, r in by_config.items() if "error" in r]
        L += failed + ([""] if failed else [])
        ratios = results.get("summary", {}).get(sm, {})
        mib, as_16bit = _byte_labels(by_config, configs)
        rows = [["quantization"] + [_describe(by_config.get(n, {})) for n in configs],
                [f"decoder linears MiB{mib}"] + [_mib(mem_mod.linear_bytes(by_config[n]["weights"]))
                                                 if "weights" in by_config.get(n, {}) else "-" for n in configs],
                [f"decoder linears / bf16{as_16bit}"] + [_fmt(ratios.get(n, {}).get("linear_bytes_ratio"))
                                                        for n in configs],
                [f"weights total MiB{mib}"] + [_mib(by_config.get(n, {}).get("weights", {}).get("total_bytes"))
                                               for n in configs],
                ["peak MiB (512 prefill + 128 decode)"] + [_mib(by_config.get(n, {}).get("peak", {}).get("peak_bytes"))
                                                          for n in configs],
                ["peak / bf16"] + [_fmt(ratios.get(n, {}).get("peak_ratio")) for n in configs]]
        L += _table(["metric"] + list(configs), rows + _speed_cells(by_config, configs)) + [""]
    checks = results.get("summary", {}).get("targets_llama-2-7b", {})
    if any(c["value"] is not None for c in checks.values()):
        L += ["## Targets (llama-2-7b-shaped)", ""]
        L += _table(["target", "value", "bound", "pass"],
                    [[t, _fmt(c["value"]), c["target"], {True: "yes", False: "**no**", None: "-"}[c["pass"]]]
                     for t, c in checks.items()]) + [""]
    atomic_write(path, lambda tmp: tmp.write_text("\n".join(L) + "\n"))


def _save(fig, path: Path) -> str:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return str(path)


PLOTS = ("speedup.png", "vram.png", "accuracy.png")


def write_plots(results: dict, out: Path, log=say) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # pragma: no cover - matplotlib is in the report extra
        log(f"plots skipped: matplotlib unavailable ({e}); pip install matplotlib")
        return []
    configs = results["meta"]["configs"]
    written = []
    groups = dict(results.get("speed_models", {}))
    groups = {k: v for k, v in groups.items() if "skipped" not in v}
    if any(_rows(r) for r in results.get("configs", {}).values()):
        groups = {"model": results["configs"], **groups}

    # 1. prefill speedup vs prompt length (decode speedups are in the tables), one panel per model; none where
    # nothing was timed (no CUDA): an empty plot would read as a failed run
    fig, axes = plt.subplots(1, max(1, len(groups)), figsize=(5 * max(1, len(groups)), 3.8), squeeze=False)
    for ax, (g, by_config) in zip(axes.flat, groups.items()):
        base = {(x["phase"], x["batch"], x["tokens"]): x for x in _rows(by_config.get("bf16", {}))}
        for name in configs:
            rows = _rows(by_config.get(name, {}))
            if name == "bf16" or not rows:
                continue
            for b in sorted({x["batch"] for x in rows if x["phase"] == "prefill"}):
                pts = sorted((x["tokens"], base[("prefill", b, x["tokens"])]["ms"] / x["ms"]) for x in rows
                             if x["phase"] == "prefill" and x["batch"] == b and ("prefill", b, x["tokens"]) in base)
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=f"{name} b={b}")
        ax.axhline(1.0, color="gray", ls="--", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel("prefill speedup vs bf16")
        ax.set_title(g, fontsize=10)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    if groups:
        written.append(_save(fig, out / "speedup.png"))
    else:
        plt.close(fig)

    # 2. VRAM: weights (stacked by kind) and peak, per config, one panel per model
    mgroups = {"model": results.get("configs", {}), **{k: v for k, v in results.get("speed_models", {}).items()
                                                        if "skipped" not in v}}
    mgroups = {g: by_config for g, by_config in mgroups.items()
               if any("weights" in by_config.get(n, {}) for n in configs)}  # no empty axes
    fig, axes = plt.subplots(1, max(1, len(mgroups)), figsize=(5 * max(1, len(mgroups)), 3.8), squeeze=False)
    for ax, (g, by_config) in zip(axes.flat, mgroups.items()):
        names = [n for n in configs if "weights" in by_config.get(n, {})]
        bottom = [0.0] * len(names)
        for kind in mem_mod.KINDS:
            vals = [by_config[n]["weights"]["kinds"][kind]["bytes"] / 2**30 for n in names]
            if any(vals):
                ax.bar(names, vals, bottom=bottom, label=kind, width=0.6)
                bottom = [b + v for b, v in zip(bottom, vals)]
        peaks = [by_config[n].get("peak", {}).get("peak_bytes") for n in names]
        if any(p is not None for p in peaks):
            ax.scatter([n for n, p in zip(names, peaks) if p is not None],
                       [p / 2**30 for p in peaks if p is not None], marker="_", s=900, color="black",
                       label="peak (512 + 128 tokens)", zorder=3)
        # the bytes as measured: on the CPU every config runs in float32, so a bar named bf16 held 4 bytes a weight
        ax.set_xticks(range(len(names)), [n if by_config[n].get("dtype", "bfloat16") == "bfloat16"
                                          else f"{n}\n({by_config[n]['dtype']})" for n in names])
        ax.set_ylabel("GiB")
        ax.set_title(f"{g}: memory", fontsize=10)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3, axis="y")
    if mgroups:
        written.append(_save(fig, out / "vram.png"))
    else:
        plt.close(fig)

    # 3. accuracy per task, grouped bars (where any config was scored)
    cr = results.get("configs", {})
    tasks = list(results["meta"]["tasks"]) + ["average"]
    names = [n for n in configs if "tasks" in cr.get(n, {})]
    if not names:
        return written
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(tasks)), 3.8))
    width = 0.8 / max(1, len(names))
    for i, n in enumerate(names):
        ax.bar([j + i * width for j in range(len(tasks))], [cr[n]["tasks"].get(t, {}).get("acc", 0) for t in tasks],
               width=width, label=n)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(tasks))], tasks, rotation=20, fontsize=8)
    ax.set_ylabel("acc")
    limit = results["meta"].get("tasks_limit")  # a --limit run's chart, shown alone, read as a full run's
    ax.set_title("zero-shot accuracy per task" + (f" (first {limit} documents of each)" if limit else ""))
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    written.append(_save(fig, out / "accuracy.png"))
    return written


# ---- the entry point -------------------------------------------------------------------------
def run_report(model_name_or_path=None, out_dir="report", configs=DEFAULT_CONFIGS, tasks_limit=None,
               speed_models=DEFAULT_SPEED_MODELS, *, tasks=ALL_TASKS, ppl_max_tokens=None, ppl_seq_len=None,
               batch_size=TASKS_BATCH_SIZE, device=None, dtype=None, model=True, accuracy=True, speed=True,
               speed_clip_search=False, speed_rounds=SPEED_ROUNDS, loader: Callable | None = None, progress=True,
               log=say) -> dict:
    """Measure every config in ``configs`` and write report.md / report.json / PNGs to ``out_dir``.

    ``loader()`` -> (model, tokenizer) overrides loading ``model_name_or_path`` (it is called once per
    config: quantization is in place); ``model=False`` skips the real model (its accuracy, memory and
    speed), so that only the speed models run. Speed models are quantized with RTN without the clipping
    search (``speed_clip_search``), those of calibrated configs too (the same format and kernels): their
    weights are random, so only the time would change; each is timed in ``speed_rounds`` rounds of
    alternating config order (`measure_speed_models`). A config the real model cannot take (a rotation, a group size)
    is refused before any config runs (`_checked_loader`), and so is a model the loader cannot read from what it was
    given; one that fails later is reported with its error.
    Returns the results dict (also in report.json).

    The report is written after each config and each speed model (`_write_report`), so that a run stopped part way
    keeps what finished: one killed, or out of a machine's time, leaves the last such report, marked partial; on
    Ctrl-C it is written once more, marked interrupted, with its plots, and `ReportInterrupted` (a
    KeyboardInterrupt) says what it holds. ``out_dir`` is made at the first write: a run refused, or stopped before
    any config finished, leaves none.
    """
    from nibble.bench.timing import env_meta

    out = Path(out_dir)
    configs = [config_name(c) for c in configs]  # unknown names fail before any work
    check_distinct(configs)  # and again with the model, once it is loaded (`_checked_loader`)
    for name, value, least in (("tasks_limit", tasks_limit, 1), ("batch_size", batch_size, 1),
                               ("ppl_max_tokens", ppl_max_tokens, 2), ("ppl_seq_len", ppl_seq_len, 2),
                               ("speed_rounds", speed_rounds, 1)):
        if value is not None:  # else every config would fail the same way, after loading
            check_count(name, value, least)
    if model and accuracy and loader is None:  # a loader's model is checked once it is loaded
        check_model_window(model_name_or_path, ppl_seq_len, ppl_max_tokens, WINDOW_NAMES)
    unknown = [m for m in speed_models if m not in speed_mod.SPEED_MODELS]
    if unknown:
        raise ValueError(f"unknown speed model(s) {unknown}; choose from {list(speed_mod.SPEED_MODELS)}")
    if model:  # the files the model's runs read, checked before the first config loads it
        require_data(([WIKITEXT2_TEST] + task_files(tasks)) * accuracy
                     + [f for c in configs for f in calibration_files(getattr(quant_config(c), "method", None))])
    device = resolve_device(device)
    model_label = "none (speed models only)" if not model else str(model_name_or_path) if model_name_or_path else (
        "custom loader" if loader else "default (SmolLM2-135M-Instruct)")
    loader = loader or _default_loader(model_name_or_path, device, dtype)
    if model:
        loader = _checked_loader(loader, configs)
    meta = env_meta(model=model_label, configs=configs,
                    tasks=list(tasks), tasks_limit=tasks_limit, ppl_max_tokens=ppl_max_tokens, ppl_seq_len=ppl_seq_len,
                    device=str(device),
                    # none under --no-speed: report.json named llama-2-7b as timed where nothing was
                    speed_models=list(speed_models) if speed else [], speed_clip_search=speed_clip_search,
                    speed_rounds=speed_rounds)
    cuda = torch.cuda.is_available()
    if cuda and speed:
        meta["ceilings"] = speed_mod.device_ceilings()
    if not cuda:
        log("no CUDA GPU visible: peak memory and speed are skipped (they are measured on the GPU only); "
            f"running {'accuracy and ' * accuracy}weight bytes on the CPU")
    results = {"meta": meta, "configs": {}, "speed_models": {}}
    asked = {"configs": configs if model else [], "speed_models": list(speed_models) if speed else []}
    try:
        for name in asked["configs"]:
            t0 = time.perf_counter()
            try:
                results["configs"][name] = _evaluate_config(name, loader, tasks, tasks_limit, ppl_max_tokens,
                                                            ppl_seq_len, batch_size, accuracy, speed, progress, log)
            except Exception as e:
                log(f"[{name}] FAILED: {type(e).__name__}: {e}\n{traceback.format_exc()}")
                results["configs"][name] = {"config": name, "error": f"{type(e).__name__}: {e}"}
                speed_mod.release()
            results["configs"][name]["wall_s"] = time.perf_counter() - t0
            _write_report(results, out, asked, "running", log)
        for sm in asked["speed_models"]:
            results["speed_models"][sm] = (measure_speed_models(sm, configs, speed_rounds, speed_clip_search, log)
                                           if cuda else {"skipped": NO_GPU})
            _write_report(results, out, asked, "running", log)
    except KeyboardInterrupt:  # Ctrl-C: what finished is kept, said so (it was all thrown away, --out left empty)
        if not (results["configs"] or results["speed_models"]):
            raise ReportInterrupted(f"interrupted before any config finished; nothing was written to {out}") from None
        _write_report(results, out, asked, "interrupted", log)
        left = _not_measured(results["meta"])
        raise ReportInterrupted(f"interrupted; {out / 'report.md'} and report.json hold what finished"
                                + (f", marked partial: {left} not measured" if left else " (all of it)")) from None
    _write_report(results, out, asked, "complete", log)
    log(f"wrote {out / 'report.md'}, {out / 'report.json'} and {len(results['plots'])} plots")
    return results


class ReportInterrupted(KeyboardInterrupt):
    """Ctrl-C in `run_report`: its message says what it kept (`nibble report` prints it as its one line)."""


def _write_report(results: dict, out: Path, asked: dict, state: str, log=say) -> None:
    """Write ``results`` as they stand to ``out`` (made here, at the first write): report.json, report.md and, but
    while ``state`` is "running", the plots. ``state``: "running" (`run_report` writes after each config and each
    speed model, and goes on: a report found so was killed, or ran out of a machine's time), "interrupted" (Ctrl-C)
    or "complete".

    What of ``asked`` (the configs the real model runs, the speed models) the results lack yet is meta's
    ``partial``, with the ``state``; a report that holds them all has none. meta's ``configs`` and ``speed_models``
    are those the report holds. An earlier run's plots in ``out`` are removed: beside this report they would read
    as this run's."""
    meta = results["meta"]
    if asked["configs"]:  # else (the speed models alone) every config is a column of each speed model's table
        meta["configs"] = list(results["configs"])
    meta["speed_models"] = list(results["speed_models"])
    left = {f"{part}_left": [n for n in names if n not in results[part]] for part, names in asked.items()}
    meta.pop("partial", None)
    if any(left.values()):
        meta["partial"] = {"state": state, **left}
    results["summary"] = summarize(results)
    out.mkdir(parents=True, exist_ok=True)
    write_json(results, out / "report.json")
    write_markdown(results, out / "report.md")
    results["plots"] = [] if state == "running" else write_plots(results, out, log)
    for stale in PLOTS:
        if str(out / stale) not in results["plots"]:
            (out / stale).unlink(missing_ok=True)


def _not_measured(meta: dict) -> str:
    """What a partial report (meta's ``partial``) lacks, ``"w4a4, w4a4-hadamard and the speed model llama-2-7b"``;
    "" where it lacks nothing."""
    partial = meta.get("partial", {})
    names = partial.get("configs_left", []) + [f"the speed model {m}" for m in partial.get("speed_models_left", [])]
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else "".join(names)


if __name__ == "__main__":  # `python -m nibble.eval.report` (older results' commands): `nibble report` itself, its
    # checks, one-line errors and Ctrl-C included (it had its own parser, which said errors as tracebacks)
    import sys

    from nibble.cli import main

    raise SystemExit(main(["report", *sys.argv[1:]]))
