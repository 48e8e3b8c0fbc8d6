"""fp4kit command line: a thin layer over the library functions."""

from __future__ import annotations

import argparse
import sys


def _parse_shape(text: str) -> tuple[int, ...]:
    try:
        dims = tuple(int(d) for d in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r} is not of the form 1024x1024") from None
    if not dims or any(d <= 0 for d in dims):
        raise argparse.ArgumentTypeError(f"shape {text!r} must have positive dims")
    return dims


def _cmd_error(args: argparse.Namespace) -> int:
    import torch

    from .formats import nvfp4

    if args.file:
        from safetensors import safe_open

        with safe_open(args.file, framework="pt") as f:
            if args.tensor not in f.keys():
                print(f"error: tensor {args.tensor!r} is not in {args.file}", file=sys.stderr)
                return 2
            w = f.get_tensor(args.tensor)
        source = f"{args.file}:{args.tensor}"
    else:
        g = torch.Generator().manual_seed(args.seed)
        w = torch.randn(*args.shape, generator=g)
        if args.dist == "student-t":
            w = torch.distributions.StudentT(3.0).sample(args.shape)
        w = w.to(torch.bfloat16)
        source = f"{args.dist} {'x'.join(map(str, args.shape))} bf16 (seed {args.seed})"
    x = w.float()
    rows = []
    for rule in ("6", "4o6"):
        q, choice = nvfp4.quantize(w, scale_rule=rule, return_choice=True)
        err = q.dequantize() - x
        mse = err.pow(2).mean().item()
        sqnr = 10 * torch.log10(x.pow(2).mean() / err.pow(2).mean()).item()
        rows.append((rule, mse, sqnr, choice.float().mean().item()))
    print(f"NVFP4 weight error on {source}")
    print(f"{'rule':<6}{'MSE':>14}{'SQNR dB':>10}{'blocks->4':>11}")
    for rule, mse, sqnr, frac in rows:
        print(f"{rule:<6}{mse:>14.6e}{sqnr:>10.2f}{frac:>11.1%}")
    print(f"4/6 MSE / plain MSE = {rows[1][1] / rows[0][1]:.4f}")
    return 0


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
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        qm, path = run(job, log=lambda m: print(m, file=sys.stderr))
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(summary_table(role_rows(qm)))
    print("time: " + ", ".join(f"{k} {v:.1f}s" for k, v in qm.timings.items()))
    for w in qm.warnings:
        print(f"warning: {w}")
    print(f"wrote {path}")
    return 0


def _cmd_verify(args: argparse.Namespace) -> int:
    import json

    from .verify import verify

    if not (args.checkpoint / "config.json").is_file():
        print(f"error: {args.checkpoint} is not a checkpoint folder (no config.json)", file=sys.stderr)
        return 2
    try:
        report = verify(args.checkpoint, source=args.source, against=args.against, tp=args.tp, ep=args.ep, device=args.device)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(report.text())
    if args.json:
        args.json.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if report.ok else 1


def _cmd_push(args: argparse.Namespace) -> int:
    from .export.push import push

    try:
        url = push(args.checkpoint, args.repo, private=args.private, revision=args.revision)
    except (ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"uploaded {args.checkpoint} to {url}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fp4kit", description="NVFP4 quantization toolkit")
    sub = parser.add_subparsers(dest="command", required=True)

    err = sub.add_parser("error", help="NVFP4 error of the plain and 4/6 rules on one tensor")
    err.add_argument("--shape", type=_parse_shape, default=(1024, 1024), help="synthetic tensor shape, e.g. 1024x1024")
    err.add_argument("--dist", choices=("randn", "student-t"), default="randn")
    err.add_argument("--seed", type=int, default=0)
    err.add_argument("--file", help="a .safetensors file to read the tensor from")
    err.add_argument("--tensor", help="tensor name inside --file")
    err.set_defaults(func=_cmd_error)

    from .recipe import available_recipes

    q = sub.add_parser("quantize", help="quantize a BF16 Hugging Face model into an NVFP4 checkpoint (ModelOpt format)")
    q.add_argument("--model", help="model folder or hub id (default: the embedded tiny Nemotron-H)")
    q.add_argument("--recipe", default="nemotron-h-w4a16-4o6", help=f"recipe name ({', '.join(available_recipes())}) or a YAML file")
    q.add_argument("--calib", help="calibration set NxL, e.g. 1000x32k (default: 32x512 for the embedded model, else 512x2048)")
    q.add_argument("--dataset", help="calibration text: hub dataset id, .txt/.jsonl/.parquet file or folder (default: bundled corpus)")
    q.add_argument("-o", "--output", help="output folder (default: <model>-<recipe>)")
    q.add_argument("--overwrite", action="store_true", help="replace the output folder if it exists")
    q.add_argument("--seed", type=int, default=0)
    q.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N, or auto (accelerate device_map)")
    q.add_argument("--backend", choices=("torch", "triton"), help="weight quantizer (default: triton on CUDA, torch on CPU)")
    q.add_argument("--batch-size", type=int, default=1, help="calibration samples per forward pass")
    q.add_argument("--allow-repeat", action="store_true", help="reuse calibration text when the source is smaller than N x L")
    q.add_argument("--trust-remote-code", action="store_true", help="allow the model's own code to run (off by default)")
    q.add_argument("--allow-pickle", action="store_true", help="accept pickle (.bin) weights; they can run code when loaded")
    q.add_argument(
        "--arith", choices=("cuda", "cpu"), default="cuda",
        help="reproduce nvidia-modelopt's bytes as it computes them on CUDA (default) or on the CPU",
    )
    q.add_argument("--resume", action="store_true", help="continue a killed run's calibration from its last snapshot")
    q.add_argument("--checkpoint-every", type=int, default=8, metavar="N", help="snapshot calibration statistics every N batches (for --resume)")
    q.add_argument("--no-progress", action="store_true", help="no progress bars")
    q.set_defaults(func=_cmd_quantize)

    from pathlib import Path

    v = sub.add_parser("verify", help="check a checkpoint: engine conformance, re-derived bytes, ModelOpt, TP sharding")
    v.add_argument("checkpoint", type=Path)
    v.add_argument("--source", help="the BF16 model it was made from: re-derive and compare every byte")
    v.add_argument("--against", choices=("modelopt",), help="re-quantize a sample of layers with nvidia-modelopt and compare")
    v.add_argument("--tp", type=int, help="check that the quantized layers shard cleanly for tensor parallelism N")
    v.add_argument("--ep", action="store_true", help="with --tp: experts are placed whole (expert parallelism)")
    v.add_argument("--device", default="cpu", help="where to load --source")
    v.add_argument("--json", type=Path, help="also write the report as JSON")
    v.set_defaults(func=_cmd_verify)

    p = sub.add_parser("push", help="upload a checkpoint folder to the Hugging Face hub (after a conformance check)")
    p.add_argument("checkpoint", type=Path)
    p.add_argument("--repo", required=True, help="hub id, owner/name")
    p.add_argument("--private", action="store_true")
    p.add_argument("--revision", help="branch to upload to")
    p.set_defaults(func=_cmd_push)

    from .evaluate import add_eval_parser

    add_eval_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "file", None) and not getattr(args, "tensor", None):
        parser.error("--file needs --tensor")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
