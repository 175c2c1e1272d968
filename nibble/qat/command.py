"""`nibble qat` (wired by nibble/cli.py): its options, and the run that trains, exports and evaluates. Apart from
`train.py` so that the command line builds without peft (the `qat` extra), which only the run needs."""
from __future__ import annotations

import argparse

from nibble.qat import DEFAULT_SOURCES, INITS, OBJECTIVES, RECIPES

# The other commands' options for what `nibble qat` sets otherwise, and what to give it instead. `--quant w4a16` was
# read as an abbreviation of --quant-lr ("argument --quant-lr: invalid float value: 'w4a16'"; `--quant 4` trained
# at quant_lr 4), and the others were unrecognized arguments that named no option of this command.
OTHER_COMMANDS_OPTIONS = {
    "--quant": "nibble qat trains and exports W4A4 alone: drop --quant (a W4A16 model needs no training: nibble "
               "quantize --quant w4a16, --method gptq or awq for calibrated weights)",
    "--rotate": "nibble qat rotates with --recipe hadamard: give that instead",
    "--method": "nibble qat starts from RTN's or GPTQ's weights with --init rtn|gptq: give that instead",
}


class _OtherCommandsOption(argparse.Action):
    """One of `OTHER_COMMANDS_OPTIONS`, refused with its usage error (exit status 2), whatever value it is given."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string}: {OTHER_COMMANDS_OPTIONS[option_string]}")


def add_qat_arguments(parser) -> None:
    """The `nibble qat` options (it owns --model and --device too)."""
    for option in OTHER_COMMANDS_OPTIONS:  # hidden, and no attribute of the parsed arguments
        parser.add_argument(option, action=_OtherCommandsOption, nargs="?", default=argparse.SUPPRESS,
                            help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help="HF dir or .gguf (default: embedded SmolLM2-135M)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    # hadamard by default: unrotated W4A4 collapses on small models (SmolLM2: per-token PE-QAT at perplexity 1,867,
    # hadamard at 41, docs/RESULTS.md), so the default run gives the model a user can deploy
    parser.add_argument("--recipe", choices=RECIPES, default="hadamard",
                        help="hadamard (default): rotate first, clip ratios fixed; per-token: no rotation, learned "
                             "weight clipping (on SmolLM2 it recovers far less: docs/RESULTS.md); per-channel: the "
                             "original PE-QAT (fake quant only, not exportable)")
    parser.add_argument("--init", choices=INITS, default="rtn",
                        help="rtn: quantize from the 16-bit weights; gptq: start from GPTQ's weights (calibrated on "
                             "128 x 512 tokens of the C4 excerpt), so step 0 is the W4A4 GPTQ model")
    parser.add_argument("--calib-samples", type=int, default=None,
                        help="--init gptq: GPTQ's calibration windows of the C4 excerpt (default: 128; fewer: faster)")
    parser.add_argument("--calib-seq-len", type=int, default=None,
                        help="--init gptq: tokens per calibration window, at most the model's context (default: "
                             "512, or the context where shorter)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
    parser.add_argument("--lr", type=float, default=1e-3, help="LoRA learning rate")
    parser.add_argument("--quant-lr", type=float, default=None,
                        help="learning rate of the clip/smoothing parameters that --recipe per-token and per-channel "
                             "learn (default: 1e-2; hadamard learns none)")
    parser.add_argument("--seq-len", type=int, default=512,
                        help="tokens per training window (beyond the model's context: clamped to it, with a warning)")
    parser.add_argument("--batch-size", type=int, default=8,
                        help="windows per step (beyond the training text's windows: clamped to them, with a warning)")
    parser.add_argument("--rank", type=int, default=16,
                        help="LoRA rank (alpha = 2 * rank), at most the largest min(in_features, out_features) of "
                             "the model's linears")
    parser.add_argument("--objective", choices=OBJECTIVES, default="kl",
                        help="kl: match the 16-bit model's next-token distribution (default); ce: next-token CE on the "
                             "training text; ce+kl: their sum")
    parser.add_argument("--calib", default=",".join(DEFAULT_SOURCES),
                        help="comma-separated training texts: c4, gutenberg or .txt/.jsonl paths (a .jsonl: one "
                             "{\"text\": ...} object a line)")
    parser.add_argument("--save-every", type=int, default=50, help="checkpoint period in steps")
    parser.add_argument("--seed", type=int, default=0, help="seeds the LoRA init and the data order")
    parser.add_argument("--out", required=True,
                        help="where the W4A4 model (and the resumable state) goes; one that holds a run's state needs "
                             "--resume")
    parser.add_argument("--resume", action="store_true", help="continue the run saved in --out")
    parser.add_argument("--eval-ppl", action="store_true", help="print WikiText-2 perplexity of the exported model")
    parser.add_argument("--ppl-max-tokens", type=int, default=None,
                        help="--eval-ppl: cut the WikiText-2 token stream, as `nibble eval ppl --max-tokens` and "
                             "`nibble report --ppl-max-tokens` do (quick runs; the training's tokens are --steps x "
                             "--batch-size x --seq-len)")


# run_qat's parameters and the options that set them, as `nibble.cli.options_named` says them in its refusals: a
# resume's other settings ({'rank': (2, 4)} -> {--rank: (2, 4)}), "lr must be ...", "lower lr / quant_lr", "pass
# resume=True to go on from it" (a flag: given without a value)
RUN_OPTIONS = {**{name: "--" + name.replace("_", "-") for name in (
    "lr", "quant_lr", "rank", "seq_len", "batch_size", "steps", "seed", "recipe", "init", "objective", "save_every")},
    "sources": "--calib", "resume=True": "--resume"}


def qat_main(args) -> None:
    # imported here, not above: `nibble qat --help` needs the options alone, not torch's ~3 s of imports
    import torch

    from nibble.config import optional_dependency, resolve_device

    with optional_dependency("peft", "qat", "nibble qat (LoRA adapters)"):
        from nibble.qat.export import export
        from nibble.qat.train import (GPTQ_START, QatInterrupted, check_learning_rates, check_new_run, check_recipe,
                                      checked_quant_lr, run_qat, state_path, training_sources)
    from nibble.cli import (CALIBRATION_OPTIONS, calibration_sizes, check_calibration_sizes, check_least, check_seed,
                            options_named)
    from nibble.eval.data import require_data
    from nibble.eval.perplexity import WIKITEXT2_TEST
    from nibble.models.checkpoint_files import quantized_checkpoint
    from nibble.models.loading import load_model
    from nibble.quantize.calibration import calibration_files, calibration_for, source_data_files
    # their refusals said as the options: "lr must be > 0", a recipe the start cannot take, a run already in --out, a
    # text named twice, a resume's other settings, a run that diverged or was interrupted; and their warnings: a
    # --quant-lr the recipe does not use, a --seq-len or --batch-size clamped
    check_learning_rates, check_recipe, checked_quant_lr, check_new_run, training_sources, run_qat = (
        options_named(**RUN_OPTIONS)(f)
        for f in (check_learning_rates, check_recipe, checked_quant_lr, check_new_run, training_sources, run_qat))

    device = resolve_device(args.device)
    # said before the model loads (run_qat checks steps too, but only once it has the model)
    check_least(args, (("steps", 1), ("seq_len", 2), ("batch_size", 1), ("save_every", 1), ("rank", 1),
                       ("ppl_max_tokens", 2)))  # a window of 2 tokens predicts one, as `eval ppl` refuses fewer
    check_learning_rates(args.lr, args.quant_lr)
    check_seed(args.seed)
    check_calibration_sizes(args, args.init == "gptq", "--init gptq", f"--init {args.init}")
    check_recipe(args.recipe, args.init)
    quant_lr = checked_quant_lr(args.recipe, args.quant_lr)  # one the recipe does not use: warned of here, not again
    if quantized_checkpoint(args.model):  # the loader's refusal said "load it with nibble.load_quantized"
        again = (f"; this is a PE-QAT run's export: to train it on, give that model with --out {args.model} --resume"
                 if state_path(args.model).exists() else "")
        raise ValueError(f"--model {args.model} is a quantized checkpoint, and PE-QAT trains the 16-bit model: give "
                         f"--model the float model it was quantized from (an HF dir or a .gguf){again}")
    if not args.resume:  # run_qat's refusal too, said here before the model loads
        check_new_run(args.out)
    if args.eval_ppl and args.recipe == "per-channel":  # it trained, then returned without a perplexity or a word
        raise ValueError("--eval-ppl measures the exported W4A4 model, and --recipe per-channel exports none (fake "
                         "quant only): drop --eval-ppl, or train --recipe per-token or hadamard")
    if args.ppl_max_tokens is not None and not args.eval_ppl:  # it would be ignored
        raise ValueError("--ppl-max-tokens cuts the WikiText-2 stream that --eval-ppl scores, and no --eval-ppl was "
                         "given: drop --ppl-max-tokens, or add --eval-ppl")
    sources = tuple(s for s in args.calib.split(",") if s)
    if not sources:  # it failed after the model loaded, in torch.cat
        raise ValueError(f"--calib {args.calib!r} names no training text: give c4, gutenberg or .txt / .jsonl paths")
    training_sources(sources)  # run_qat's refusal of a text named twice, said here before the model loads
    require_data(source_data_files(sources) + calibration_files("gptq" if args.init == "gptq" else None)
                 + [WIKITEXT2_TEST] * args.eval_ppl)
    # what Ctrl-C leaves, said for each stage (the training's own, QatInterrupted, says which state it holds)
    stopped = f"interrupted before training began; nothing was written to {args.out}"  # loading, reading the texts
    try:
        model, tokenizer = load_model(args.model, dtype=torch.float32, device=device)
        calibration = None  # --init gptq's: as run_qat would make it (cut to a shorter context), in the sizes asked
        if args.init == "gptq":
            with options_named(**CALIBRATION_OPTIONS):  # a text too short for them
                calibration = calibration_for(GPTQ_START, tokenizer, model, **calibration_sizes(args))
        model = run_qat(model, tokenizer, args.recipe, args.steps, args.lr, args.seq_len, args.batch_size, args.out,
                        resume=args.resume, device=device, objective=args.objective, rank=args.rank,
                        quant_lr=quant_lr, save_every=args.save_every, seed=args.seed,
                        sources=sources, init=args.init, calibration=calibration)
        if args.recipe != "per-channel":  # which exports nothing (fake quant only): said below
            stopped = (f"interrupted while exporting; {state_path(args.out)} holds the finished run: the same command "
                       "with --resume exports it again, without training")
            export(model, args.out, tokenizer)
    except KeyboardInterrupt as e:  # Ctrl-C: what is kept and how to go on, said by cli.main in one line
        if isinstance(e, QatInterrupted):  # the training's own, which says which state it holds
            raise
        raise KeyboardInterrupt(stopped) from e
    if args.recipe == "per-channel":
        print(f"trained {args.recipe} (fake quant only: per-channel activation scales have no W4A4 kernel); "
              f"state in {state_path(args.out)}")
        return
    print(f"saved the W4A4 model to {args.out} (load it with nibble.load_quantized or `nibble eval ppl --model "
          f"{args.out}`)")
    if args.eval_ppl:
        import json

        from nibble.eval.perplexity import wikitext2_perplexity
        from nibble.models.serialization import load_quantized
        qmodel, _ = load_quantized(args.out, device=device)
        print(json.dumps(wikitext2_perplexity(qmodel, tokenizer, max_tokens=args.ppl_max_tokens), indent=2))
