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
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "file", None) and not getattr(args, "tensor", None):
        parser.error("--file needs --tensor")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
