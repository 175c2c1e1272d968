"""`nibble report` (wired by nibble/cli.py; `python -m nibble.eval.report` runs it too): its options, their checks, and
the run. Apart from report.py, which imports torch and transformers, so that the command line builds without them:
the run imports them."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from nibble.eval import ALL_TASKS, DEFAULT_CONFIGS, DEFAULT_SPEED_MODELS, SPEED_MODELS, SPEED_ROUNDS, TASKS_BATCH_SIZE


class TaskNames(argparse.Action):
    """--tasks of `nibble eval tasks` and `nibble report`: names separated by commas in both, and by spaces too in
    report (the two commands had taken one form each, and refused the other's; eval's takes one value, since more
    would swallow its positional `ppl` / `tasks` where it comes after), each one of the seven."""

    def __call__(self, parser, namespace, values, option_string=None):
        names = [name for value in ([values] if isinstance(values, str) else values) for name in value.split(",")
                 if name]
        unknown = [name for name in names if name not in ALL_TASKS]
        if unknown or not names:
            said = f"unknown task {unknown[0]!r}" if unknown else "no task named"
            raise argparse.ArgumentError(self, f"{said}: choose from {', '.join(ALL_TASKS)}")
        setattr(namespace, self.dest, list(dict.fromkeys(names)))


def add_report_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `nibble report` options, added to ``parser``, which is returned."""
    parser.add_argument("--model", default=None,
                        help="a .gguf file or local HF directory (default: the embedded SmolLM2-135M)")
    parser.add_argument("--out", default="report", help="output folder for report.md, report.json and the PNGs "
                        "(written after each config, marked partial until the last: Ctrl-C keeps what finished)")
    parser.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS),
                        help="bf16, w4a16 (or w4a16-g64 ...), w4a4, w4a4-hadamard; -gptq (or -awq, w4a16) for "
                             "calibrated weights (speed models: RTN), -lmhead to quantize lm_head too")
    parser.add_argument("--limit", type=int, default=None, help="documents per task (default: all)")
    # the options of a part the run may skip default to None, so that check_report_args tells one given from one
    # left out: `--no-speed --speed-rounds 3` (the default's value) was taken, and ignored
    parser.add_argument("--tasks", nargs="+", action=TaskNames, default=None,
                        help="zero-shot tasks, by space or comma, e.g. piqa boolq (default: all seven)")
    parser.add_argument("--ppl-max-tokens", type=int, default=None, help="score only the first N WikiText-2 tokens")
    parser.add_argument("--ppl-seq-len", type=int, default=None,
                        help="perplexity window (default: min(context, 2048, --ppl-max-tokens); a longer one than the "
                             "context is cut to it, with a warning)")
    parser.add_argument("--batch-size", type=int, default=None,
                        help=f"task scoring batch size (default: {TASKS_BATCH_SIZE})")
    parser.add_argument("--speed-models", nargs="*", default=None, choices=list(SPEED_MODELS),
                        help="random-weight models for speed and memory (CUDA only; default: "
                             f"{' '.join(DEFAULT_SPEED_MODELS)}); the flag alone skips them")
    parser.add_argument("--speed-rounds", type=int, default=None,
                        help="rounds of alternating config order on each speed model, the median row kept "
                             f"(default: {SPEED_ROUNDS})")
    parser.add_argument("--no-speed", action="store_true", help="skip every speed measurement")
    parser.add_argument("--no-accuracy", action="store_true", help="skip perplexity and tasks")
    parser.add_argument("--no-model", action="store_true",
                        help="skip the real model (accuracy, memory, speed): only the speed models")
    parser.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    return parser


def check_report_args(args: argparse.Namespace) -> None:
    """Refuse options this run would ignore (or a run with nothing to measure), before anything loads, as the
    other commands do: it exited 0 with an empty report and a blank plot. Then what `run_report` refuses, said by
    the options' names (it named its parameters: ``tasks_limit`` for --limit), and a quantized --model, which every
    config failed to load as a 16-bit one."""
    import torch

    from nibble.cli import check_least
    from nibble.eval.perplexity import check_model_window
    from nibble.models.checkpoint_files import quantized_checkpoint

    accuracy_options = [flag for flag, value in (("--limit", args.limit), ("--tasks", args.tasks),
                                                 ("--ppl-max-tokens", args.ppl_max_tokens),
                                                 ("--ppl-seq-len", args.ppl_seq_len), ("--batch-size", args.batch_size))
                        if value is not None]
    for flag, value, does in (("--model", args.model, "names"), ("--device", args.device, "places")):
        if args.no_model and value is not None:  # --device: the speed models are built on the GPU whatever it says
            raise ValueError(f"--no-model skips the model that {flag} {does}: drop one of them")
    if args.no_model and args.no_speed:
        raise ValueError("--no-model with --no-speed leaves nothing to measure: drop one of them")
    for skip, why in (("--no-model", args.no_model), ("--no-accuracy", args.no_accuracy)):
        if why and accuracy_options:
            several = len(accuracy_options) > 1
            raise ValueError(f"{' and '.join(accuracy_options)} set{'' if several else 's'} the accuracy runs that "
                             f"{skip} skips: drop {'them' if several else 'it'} or {skip}")
    if args.no_model and not torch.cuda.is_available():
        raise ValueError("--no-model runs the speed models alone, which are timed on a CUDA GPU, and none is visible: "
                         "drop --no-model to measure the model's accuracy and weights here")
    check_least(args, (("limit", 1), ("batch_size", 1), ("ppl_max_tokens", 2), ("ppl_seq_len", 2),
                       ("speed_rounds", 1)))
    speed_options = [flag for flag, given in (("--speed-models", args.speed_models),  # the flag alone skips them
                                              ("--speed-rounds", args.speed_rounds is not None)) if given]
    them, sets = ("them", "set") if len(speed_options) > 1 else ("it", "sets")
    if speed_options and args.no_speed:  # taken, and the run exited 0 with its speed "skipped" in report.json alone
        raise ValueError(f"{' and '.join(speed_options)} {sets} the speed runs that --no-speed skips: drop {them} or "
                         "--no-speed")
    if speed_options and not torch.cuda.is_available():
        raise ValueError(f"{' and '.join(speed_options)} {sets} the speed runs, which are timed on a CUDA GPU, and "
                         f"none is visible: drop {them}")
    if quantized_checkpoint(args.model):
        raise ValueError(f"{args.model} is already quantized, and the report quantizes a 16-bit model each config's "
                         "way: give it the 16-bit model (an HF dir or a .gguf), or measure this one with `nibble eval "
                         f"ppl --model {args.model}` / `nibble eval tasks --model {args.model}`")
    check_model_window(args.model, args.ppl_seq_len, args.ppl_max_tokens, ("--ppl-seq-len", "--ppl-max-tokens"))


def report_main(args: argparse.Namespace) -> int:
    """Run the report ``args`` ask for (`report.run_report`); the exit status: 1 where a config failed, else 0."""
    from nibble.eval.report import run_report

    check_report_args(args)
    given = {name: getattr(args, name) for name in ("tasks", "batch_size", "speed_models", "speed_rounds")
             if getattr(args, name) is not None}  # the others left to run_report's defaults
    # Ctrl-C: `ReportInterrupted`, whose message (what was kept) cli.main says in one line, exit status 130
    results = run_report(args.model, args.out, configs=args.configs, tasks_limit=args.limit,
                         ppl_max_tokens=args.ppl_max_tokens, ppl_seq_len=args.ppl_seq_len, device=args.device,
                         model=not args.no_model, accuracy=not args.no_accuracy, speed=not args.no_speed, **given)
    # what succeeded is written; a config that failed (on the model or a speed model) still fails the command
    failed = [(n, r["error"]) for n, r in results["configs"].items() if "error" in r]
    failed += [(f"{sm}/{n}", r["error"]) for sm, by_config in results["speed_models"].items()
               for n, r in by_config.items() if isinstance(r, dict) and "error" in r]
    if failed:
        runs = len(results["configs"]) + sum(len(by_config) for by_config in results["speed_models"].values()
                                             if "skipped" not in by_config)
        where = Path(args.out) / "report.md"  # "the others" where there were none read as results written
        said = f"the others are in {where}" if len(failed) < runs else f"every one; {where} says so"
        print(f"nibble report: {len(failed)} config{'s' * (len(failed) > 1)} failed ({said}): "
              + "; ".join(f"{n}: {e}" for n, e in failed), file=sys.stderr)
        return 1
    return 0
