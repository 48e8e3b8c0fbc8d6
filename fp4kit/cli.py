"""fp4kit command line: a thin layer over the library functions.

Defaults and choices are read from the modules that own them (recipe, quantize, formats.arith,
kernels.backend, evaluate). Those import torch, so a subcommand's arguments are built only when
that subcommand runs, and `fp4kit --help` starts without torch.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r} is not of the form 1024x1024") from None
    if not dims or any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(f"shape {text!r} must have positive dims")
    return dims


def _err(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


# --------------------------------------------------------------------------------------------
# fp4kit error
# --------------------------------------------------------------------------------------------
def _add_error(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", type=_parse_shape, default=(1024, 1024), help="synthetic tensor shape, e.g. 1024x1024")
    p.add_argument("--dist", choices=("randn", "student-t"), default="randn")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--file", help="a .safetensors file to read the tensor from")
    p.add_argument("--tensor", help="tensor name inside --file")


def _cmd_error(args: argparse.Namespace) -> int:
    import torch

    from .formats import nvfp4
    from .formats.metrics import sqnr_db

    if args.file:
        from safetensors import safe_open

        with safe_open(args.file, framework="pt") as f:
            if args.tensor not in f.keys():
                return _err(f"tensor {args.tensor!r} is not in {args.file}", 2)
            w = f.get_tensor(args.tensor)
        source = f"{args.file}:{args.tensor}"
    else:
        g = torch.Generator().manual_seed(args.seed)
        w = torch.randn(*args.shape, generator=g)
        if args.dist == "student-t":
            torch.manual_seed(args.seed)  # StudentT draws from the global generator: seed it, as --seed says
            w = torch.distributions.StudentT(3.0).sample(args.shape)
        w = w.to(torch.bfloat16)
        source = f"{args.dist} {'x'.join(map(str, args.shape))} bf16 (seed {args.seed})"
    x = w.float()
    rows = []
    for rule in nvfp4.SCALE_RULES:
        q, choice = nvfp4.quantize(w, scale_rule=rule, return_choice=True)
        w_hat = q.dequantize()
        rows.append((rule, (w_hat - x).pow(2).mean().item(), sqnr_db(x, w_hat), choice.float().mean().item()))
    print(f"NVFP4 weight error on {source}")
    print(f"{'rule':<6}{'MSE':>14}{'SQNR dB':>10}{'blocks->4':>11}")
    for rule, mse, sqnr, frac in rows:
        print(f"{rule:<6}{mse:>14.6e}{sqnr:>10.2f}{frac:>11.1%}")
    print(f"4/6 MSE / plain MSE = {rows[1][1] / rows[0][1]:.4f}")
    return 0


# --------------------------------------------------------------------------------------------
# fp4kit quantize
# --------------------------------------------------------------------------------------------
def _add_quantize(p: argparse.ArgumentParser) -> None:
    from .formats.arith import ARITH_MODES, DEFAULT_ARITH
    from .kernels.backend import BACKENDS
    from .quantize import DEFAULT_CALIB, EMBEDDED_CALIB, QuantizeJob
    from .recipe import DEFAULT_RECIPE, available_recipes

    job = QuantizeJob()
    p.add_argument("--model", help="model folder or hub id (default: the embedded tiny Nemotron-H)")
    p.add_argument("--recipe", default=DEFAULT_RECIPE, help=f"recipe name ({', '.join(available_recipes())}) or a YAML file")
    p.add_argument("--calib", help=f"calibration set NxL, e.g. 1000x32k (default: {EMBEDDED_CALIB} for the embedded model, else {DEFAULT_CALIB})")
    p.add_argument("--dataset", help="calibration text: hub dataset id, .txt/.jsonl/.parquet file or folder (default: bundled corpus)")
    p.add_argument("-o", "--output", help="output folder (default: <model>-<recipe>)")
    p.add_argument("--overwrite", action="store_true", help="replace the output folder if it exists")
    p.add_argument("--seed", type=int, default=job.seed)
    p.add_argument("--device", default=job.device, help="cpu, cuda, cuda:N, or auto (accelerate device_map)")
    p.add_argument("--backend", choices=BACKENDS, help="weight quantizer (default: triton on CUDA, torch on CPU)")
    p.add_argument("--batch-size", type=int, default=job.batch_size, help="calibration samples per forward pass")
    p.add_argument("--allow-repeat", action="store_true", help="reuse calibration text when the source is smaller than N x L")
    p.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code to run (off by default)")
    p.add_argument("--allow-pickle", action="store_true", help="accept pickle (.bin) weights; they can run code when loaded")
    p.add_argument(
        "--arith", choices=ARITH_MODES, default=DEFAULT_ARITH,
        help="reproduce nvidia-modelopt's bytes as it computes them on CUDA (cuda) or on the CPU (cpu); "
             f"default {DEFAULT_ARITH}",
    )
    p.add_argument("--resume", action="store_true", help="continue a killed run's calibration from its last snapshot")
    p.add_argument("--checkpoint-every", type=int, default=job.checkpoint_every, metavar="N",
                   help="snapshot calibration statistics every N batches (for --resume)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _cmd_quantize(args: argparse.Namespace) -> int:
    from .export.card import role_rows, summary_table
    from .quantize import QuantizeJob, run, validate_job

    job = QuantizeJob(
        model=args.model, recipe=args.recipe, calib=args.calib, dataset=args.dataset, output=args.output,
        overwrite=args.overwrite, seed=args.seed, device=args.device, backend=args.backend,
        batch_size=args.batch_size, allow_repeat=args.allow_repeat, trust_remote_code=args.trust_remote_code, allow_pickle=args.allow_pickle,
        progress=not args.no_progress, resume=args.resume, checkpoint_every=args.checkpoint_every,
        arith=args.arith,
    )
    try:
        validate_job(job)
    except (ValueError, OSError) as exc:
        return _err(str(exc), 2)
    try:
        qm, path = run(job, log=lambda m: print(m, file=sys.stderr))
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        return _err(str(exc), 1)
    print(summary_table(role_rows(qm)))
    print("time: " + ", ".join(f"{k} {v:.1f}s" for k, v in qm.timings.items()))
    for w in qm.warnings:
        print(f"warning: {w}")
    print(f"wrote {path}")
    return 0


# --------------------------------------------------------------------------------------------
# fp4kit verify / push
# --------------------------------------------------------------------------------------------
def _add_verify(p: argparse.ArgumentParser) -> None:
    from .verify import AGAINST

    p.add_argument("checkpoint", type=Path)
    p.add_argument("--source", help="the BF16 model it was made from: re-derive and compare every byte")
    p.add_argument("--against", choices=AGAINST, help="re-quantize a sample of layers with nvidia-modelopt and compare")
    p.add_argument("--tp", type=int, help="check that the quantized layers shard cleanly for tensor parallelism N")
    p.add_argument("--ep", action="store_true", help="with --tp: experts are placed whole (expert parallelism)")
    p.add_argument("--device", default="cpu", help="where to load --source")
    p.add_argument("--json", type=Path, help="also write the report as JSON")


def _cmd_verify(args: argparse.Namespace) -> int:
    import json

    from .export.checkpoint import CONFIG_FILE
    from .verify import verify

    if not (args.checkpoint / CONFIG_FILE).is_file():
        return _err(f"{args.checkpoint} is not a checkpoint folder (no {CONFIG_FILE})", 2)
    try:
        report = verify(args.checkpoint, source=args.source, against=args.against, tp=args.tp, ep=args.ep, device=args.device)
    except (ValueError, FileNotFoundError) as exc:
        return _err(str(exc), 2)
    print(report.text())
    if args.json:
        args.json.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if report.ok else 1


def _add_push(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--repo", required=True, help="hub id, owner/name")
    p.add_argument("--private", action="store_true")
    p.add_argument("--revision", help="branch to upload to")


def _cmd_push(args: argparse.Namespace) -> int:
    from .export.push import push

    try:
        url = push(args.checkpoint, args.repo, private=args.private, revision=args.revision)
    except (ValueError, FileNotFoundError) as exc:
        return _err(str(exc), 2)
    except Exception as exc:  # the hub client's network, auth and offline errors
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return _err(f"push to {args.repo} failed ({type(exc).__name__}): {first}", 1)
    print(f"uploaded {args.checkpoint} to {url}")
    return 0


# --------------------------------------------------------------------------------------------
# fp4kit eval
# --------------------------------------------------------------------------------------------
def _add_eval(p: argparse.ArgumentParser) -> None:
    from .evaluate import DEFAULT_SEQ_LEN, DEFAULT_TOKENS
    from .kernels.backend import BACKENDS
    from .quantize import DEFAULT_CALIB, EMBEDDED_CALIB
    from .recipe import DEFAULT_RECIPE

    p.add_argument("--reference", help="the BF16 model folder")
    p.add_argument("--quantized", help="the quantized checkpoint folder (ModelOpt format)")
    p.add_argument("--compare-recipes", action="store_true",
                   help="quantize --model under plain NVFP4, 4/6 and 4/6 + importance and compare with BF16")
    p.add_argument("--model", help="with --compare-recipes: the BF16 model folder (default: the embedded tiny Nemotron-H)")
    p.add_argument("--recipe", help=f"with --compare-recipes: the base recipe whose NVFP4 rules are varied (default: {DEFAULT_RECIPE})")
    p.add_argument("--calib", help=f"with --compare-recipes: calibration set NxL, as for quantize (default: {EMBEDDED_CALIB}, "
                                   f"or {DEFAULT_CALIB} for --model with --dataset)")
    p.add_argument("--dataset", help="with --compare-recipes: calibration text source (default: bundled corpus)")
    p.add_argument("--data", help="evaluation text: file, folder or hub dataset id (default: the bundled eval split)")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help=f"evaluation tokens (default {DEFAULT_TOKENS})")
    p.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN, help=f"tokens per row (default {DEFAULT_SEQ_LEN})")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--backend", choices=BACKENDS, help="how quantized layers run (default: triton on CUDA, torch on CPU)")
    p.add_argument("--no-act-quant", action="store_true", help="run W4A4 NVFP4 layers weight-only, as the engines do on Hopper")
    p.add_argument("--out", help="folder for eval.json, eval.md and the plots")
    p.add_argument("--update-card", action="store_true", help="write the measured quality into the checkpoint's README.md")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _cmd_eval(args: argparse.Namespace) -> int:
    from .evaluate import compare_recipes, evaluate, layers_markdown, quality_markdown

    if args.compare_recipes:
        if args.reference or args.quantized:
            return _err("--compare-recipes quantizes --model itself; it takes no --reference/--quantized", 2)
        if args.backend or args.no_act_quant or args.update_card:
            return _err("--backend/--no-act-quant/--update-card apply to --quantized only", 2)
        try:
            summary = compare_recipes(
                args.model, base_recipe=args.recipe, calib=args.calib, dataset=args.dataset, data=args.data,
                tokens=args.tokens, seq_len=args.seq_len, device=args.device, batch_size=args.batch_size,
                out=args.out, progress=not args.no_progress, log=lambda m: print(m, file=sys.stderr),
            )
        except (ValueError, FileNotFoundError, ImportError) as exc:
            return _err(str(exc), 1)
        print(summary["markdown"])
        return 0
    if not (args.reference and args.quantized):
        return _err("give --reference and --quantized, or --compare-recipes", 2)
    if args.model or args.recipe or args.calib or args.dataset:
        return _err("--model/--recipe/--calib/--dataset apply to --compare-recipes only", 2)
    try:
        result = evaluate(
            args.reference, args.quantized, data=args.data, tokens=args.tokens, seq_len=args.seq_len, device=args.device,
            batch_size=args.batch_size, backend=args.backend, act_quant=not args.no_act_quant, out=args.out,
            progress=not args.no_progress,
        )
    except (ValueError, FileNotFoundError, ImportError) as exc:
        return _err(str(exc), 1)
    print(quality_markdown(result))
    print()
    print(layers_markdown(result["layers"]))
    if args.update_card:
        from .export.card import set_quality_section

        card = set_quality_section(args.quantized, quality_markdown(result))
        print(f"updated {card}")
    if args.out:
        print(f"wrote {', '.join(result['files'])} to {args.out}")
    return 0


# --------------------------------------------------------------------------------------------
# The parser
# --------------------------------------------------------------------------------------------
# name: (help, description, add arguments, run)
COMMANDS = {
    "error": ("NVFP4 error of the plain and 4/6 rules on one tensor", None, _add_error, _cmd_error),
    "quantize": ("quantize a BF16 Hugging Face model into an NVFP4 checkpoint (ModelOpt format)", None, _add_quantize, _cmd_quantize),
    "verify": ("check a checkpoint: engine conformance, re-derived bytes, ModelOpt, TP sharding", None, _add_verify, _cmd_verify),
    "push": ("upload a checkpoint folder to the Hugging Face hub (after a conformance check)", None, _add_push, _cmd_push),
    "eval": (
        "quality of a quantized checkpoint against its BF16 model (KL, top-1, perplexity, weight SQNR)",
        "Either --reference DIR --quantized DIR, or --compare-recipes [--model DIR].",
        _add_eval, _cmd_eval,
    ),
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """Every subcommand; its arguments for `command` only, or for all when it is None."""
    parser = argparse.ArgumentParser(prog="fp4kit", description="NVFP4 quantization toolkit")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, description, add_arguments, run) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=description)
        if command is None or command == name:
            add_arguments(p)
        p.set_defaults(func=run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # The subcommand is the first argument: the top-level parser has no options besides -h.
    parser = build_parser(argv[0] if argv and argv[0] in COMMANDS else "")
    args = parser.parse_args(argv)
    if getattr(args, "file", None) and not getattr(args, "tensor", None):
        parser.error("--file needs --tensor")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
