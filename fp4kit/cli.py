"""fp4kit command line: a thin layer over the library functions.

Defaults and choices are read from the modules that own them (recipe, quantize, formats.arith,
kernels.backend, evaluate). Those import torch, so a subcommand's arguments are built only when
that subcommand runs, and `fp4kit --help` starts without torch.
"""

from __future__ import annotations

import argparse
import os
import shlex
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


def _batch_size(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number or 'auto'") from None


def _err(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


# --------------------------------------------------------------------------------------------
# fp4kit error
# --------------------------------------------------------------------------------------------
def _add_error(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", type=_parse_shape, default=(1024, 1024), help="synthetic tensor shape, e.g. 1024x1024 (last dim a multiple of 16)")
    p.add_argument("--dist", choices=("randn", "student-t"), default="randn", help="distribution of the synthetic tensor (default randn)")
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic tensor (default 0)")
    p.add_argument("--file", help="a .safetensors file to read the tensor from (with --tensor)")
    p.add_argument("--tensor", help="tensor name inside --file")


def _read_tensor(file: str, name: str | None):
    """(tensor, None) from a safetensors file, or (None, the error line) naming the fix."""
    from safetensors import safe_open

    from .export.conformance import read_safetensors_header

    if not Path(file).is_file():
        return None, f"--file {file}: no such file"
    try:
        header, _ = read_safetensors_header(Path(file))
    except Exception as exc:  # an unreadable file as a whole: conformance's header error or OSError
        return None, f"--file {file}: not a readable safetensors file ({exc})"
    # Matrices first: those are what a recipe quantizes.
    names = sorted(header, key=lambda n: (len(header[n].shape) < 2, n))
    some = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    if name is None:
        return None, f"--file {file}: pass --tensor NAME; it holds {len(names)} tensors: {some}"
    if name not in header:
        return None, f"tensor {name!r} is not in {file}; it holds {len(names)} tensors: {some}"
    with safe_open(file, framework="pt") as f:
        return f.get_tensor(name), None


def _cmd_error(args: argparse.Namespace) -> int:
    import torch

    from .formats import FormatError, nvfp4
    from .formats.metrics import sqnr_db

    if args.file:
        w, problem = _read_tensor(args.file, args.tensor)
        if problem:
            return _err(problem, 2)
        source = f"{args.file}:{args.tensor}"
        given = f"--tensor {args.tensor}"
    elif args.tensor:
        return _err("--tensor names a tensor of --file; pass --file too", 2)
    else:
        g = torch.Generator().manual_seed(args.seed)
        w = torch.randn(*args.shape, generator=g)
        if args.dist == "student-t":
            torch.manual_seed(args.seed)  # StudentT draws from the global generator: seed it, as --seed says
            w = torch.distributions.StudentT(3.0).sample(args.shape)
        w = w.to(torch.bfloat16)
        source = f"{args.dist} {'x'.join(map(str, args.shape))} bf16 (seed {args.seed})"
        given = f"--shape {'x'.join(map(str, args.shape))}"
    x = w.float()
    rows = []
    try:
        for rule in nvfp4.SCALE_RULES:
            q, choice = nvfp4.quantize(w, scale_rule=rule, return_choice=True)
            w_hat = q.dequantize()
            rows.append((rule, (w_hat - x).pow(2).mean().item(), sqnr_db(x, w_hat), choice.float().mean().item()))
    except FormatError as exc:
        return _err(f"{given}: {exc}", 2)
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
    p.add_argument("--seed", type=int, default=job.seed, help=f"seed of the calibration set's document order (default {job.seed})")
    p.add_argument("--device", default=job.device, help="cpu, cuda, cuda:N, or auto (accelerate device_map)")
    p.add_argument("--max-memory", metavar="CAPS",
                   help="with --device auto: how much of each device the model may take, e.g. 0=40GiB,cpu=200GiB "
                        "(accelerate's max_memory; the rest goes to the next device, then the CPU)")
    p.add_argument("--backend", choices=BACKENDS, help="weight quantizer (default: triton on CUDA, torch on CPU)")
    p.add_argument("--batch-size", type=_batch_size, default=job.batch_size,
                   help="calibration samples per forward pass, or auto: the largest batch the GPU fits, "
                        f"measured on the first sample (default {job.batch_size})")
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
    p.add_argument("--gpus", type=int, metavar="N",
                   help="calibrate data-parallel on N GPUs of this machine (runs the same command under torchrun "
                        "with N ranks; the checkpoint is byte-identical to one GPU's)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _without_gpus(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--gpus":
            skip = True
        elif not a.startswith("--gpus="):
            out.append(a)
    return out


def _launch_ranks(args: argparse.Namespace, job) -> int:
    """`--gpus N`: the same command under torchrun, one rank per GPU."""
    import subprocess

    if os.environ.get("WORLD_SIZE"):
        return _err("--gpus starts torchrun itself; under torchrun, leave it out (the ranks come from torchrun)", 2)
    if args.gpus < 1:
        return _err(f"--gpus must be at least 1, got {args.gpus}", 2)
    if args.gpus == 1:
        return -1  # one GPU: run here
    if job.device != "cuda":
        return _err(f"--gpus {args.gpus} runs one rank per GPU with --device cuda, got --device {job.device}", 2)
    import torch

    have = torch.cuda.device_count()
    if have < args.gpus:
        return _err(f"--gpus {args.gpus}: this machine has {have} CUDA device(s)", 2)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.gpus}",
           "-m", "fp4kit.cli", *_without_gpus(args.argv)]
    return subprocess.call(cmd)


def _cmd_quantize(args: argparse.Namespace) -> int:
    from .export.card import role_rows, summary_table
    from .quantize import NetworkError, QuantizeJob, run, validate_job

    job = QuantizeJob(
        model=args.model, recipe=args.recipe, calib=args.calib, dataset=args.dataset, output=args.output,
        overwrite=args.overwrite, seed=args.seed, device=args.device, backend=args.backend,
        batch_size=args.batch_size, allow_repeat=args.allow_repeat, trust_remote_code=args.trust_remote_code, allow_pickle=args.allow_pickle,
        progress=not args.no_progress, resume=args.resume, checkpoint_every=args.checkpoint_every,
        arith=args.arith, max_memory=args.max_memory,
    )
    launch = args.gpus is not None and not os.environ.get("WORLD_SIZE")
    try:
        checked = validate_job(job, ranks=args.gpus if launch and args.gpus > 1 else None)
    except (ValueError, OSError, NetworkError) as exc:  # refused before loading: an unreachable hub too
        return _err(str(exc), 2)
    args.job, args.checked = job, checked  # what main's Ctrl-C message reports on
    if args.gpus is not None:
        code = _launch_ranks(args, job)
        if code >= 0:
            return code
    from . import parallel

    try:
        qm, path = run(job, log=lambda m: print(m, file=sys.stderr), checked=checked)
    except (ValueError, FileNotFoundError, FileExistsError) as exc:
        return _err(str(exc), 1)
    finally:
        parallel.finish()
    if qm is None:  # a rank other than 0: rank 0 reports
        return 0
    print(summary_table(role_rows(qm)))
    print("time: " + ", ".join(f"{k} {v:.1f}s" for k, v in qm.timings.items()))
    if qm.calibrate_s_per_sample:
        from .calibration import parse_calib_spec

        per = qm.calibrate_s_per_sample
        seq = parse_calib_spec(qm.calibration["spec"]).seq_len
        print(f"calibration: {per:.3f} s per sample after the first, {seq / per:,.0f} tokens/s")
    for w in qm.warnings:
        print(f"warning: {w}")
    print(f"wrote {path}")
    return 0


def _quantize_interrupted(args: argparse.Namespace | None) -> int:
    """Ctrl-C in `fp4kit quantize`: how far the calibration snapshot got, and the command that
    continues from it."""
    if getattr(args, "checked", None) is None:
        # Nothing more is imported here: the Ctrl-C may have cut torch's own import short.
        return _err("interrupted before calibration began; there is nothing to resume: run the same command again", 130)
    from .quantize import CalibState, calib_state_dir

    job, (_, spec, _, output) = args.job, args.checked
    if job.progress:
        print(file=sys.stderr)  # end the progress bar's line
    try:
        saved = CalibState.read_any(calib_state_dir(output))
    except ValueError:
        saved = None
    if saved is None:
        return _err(
            f"interrupted before the first calibration snapshot (one every {job.checkpoint_every} batches); "
            "there is nothing to resume: run the same command again", 130,
        )
    argv = list(args.argv) + ([] if "--resume" in args.argv else ["--resume"])
    return _err(
        f"interrupted; the calibration snapshot holds {saved['done']} of {spec.samples} samples; "
        f"continue with: {_prog()} {shlex.join(argv)}", 130,
    )


def _prog() -> str:
    """How this process was started: the console script, or `python -m fp4kit.cli`."""
    started = Path(sys.argv[0]) if sys.argv and sys.argv[0] else Path("fp4kit")
    if started.name in ("cli.py", "__main__.py"):
        return f"{Path(sys.executable).name} -m fp4kit.cli"
    return "fp4kit"


# --------------------------------------------------------------------------------------------
# fp4kit verify / push
# --------------------------------------------------------------------------------------------
def _add_verify(p: argparse.ArgumentParser) -> None:
    from .verify import AGAINST

    p.add_argument("checkpoint", type=Path, help="the checkpoint folder")
    p.add_argument("--source", help="the BF16 model it was made from: re-derive and compare every byte")
    p.add_argument("--against", choices=AGAINST,
                   help="with --source: re-quantize a sample of layers with nvidia-modelopt and compare (a checkpoint "
                        "made with --arith cuda, the default, needs a CUDA device for this)")
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
    problem = _verify_inputs(args)
    if problem:
        return _err(problem, 2)
    try:
        report = verify(args.checkpoint, source=args.source, against=args.against, tp=args.tp, ep=args.ep, device=args.device)
    except (ValueError, FileNotFoundError) as exc:
        return _err(str(exc), 2)
    print(report.text())
    if args.json:
        args.json.write_text(json.dumps(report.to_dict(), indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0 if report.ok else 1


def _verify_inputs(args: argparse.Namespace) -> str | None:
    """What verify would refuse only after loading the source model, checked first."""
    import torch

    from .export.checkpoint import read_metadata
    from .quantize import _looks_like_path, check_model_folder

    if args.against and not args.source:
        return f"--against {args.against} re-quantizes the BF16 source model: pass --source too"
    if args.source and _looks_like_path(args.source):
        try:
            check_model_folder(Path(args.source), flag="--source")
        except (ValueError, OSError) as exc:
            return str(exc)
    if args.against == "modelopt":
        try:
            arith = (read_metadata(args.checkpoint) or {}).get("arith", "cuda")
        except ValueError:
            arith = None  # an unreadable record: verify reports it
        if arith == "cuda" and not torch.cuda.is_available():
            return (
                f"--against modelopt: {args.checkpoint} was quantized with --arith cuda (the default), whose bytes "
                "nvidia-modelopt reproduces only on a CUDA device; run verify on a machine with CUDA, or quantize "
                "with --arith cpu to verify on this one"
            )
    return None


def _add_push(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoint", type=Path, help="the checkpoint folder (it must pass `fp4kit verify`'s conformance)")
    p.add_argument("--repo", required=True, help="hub id, owner/name")
    p.add_argument("--private", action="store_true", help="create the hub repository as private (if it does not exist yet)")
    p.add_argument("--revision", help="branch to upload to")


def _push_fix(exc: Exception) -> str:
    """What to do about a failed upload, from the kind of error the hub client raised."""
    text = f"{type(exc).__name__} {exc}".lower()
    if "offline" in text:
        return "nothing was uploaded: HF_HUB_OFFLINE is set; unset it to upload"
    if any(w in text for w in ("401", "403", "unauthorized", "forbidden", "token", "auth")):
        return "nothing was uploaded: log in with `hf auth login` or set HF_TOKEN to a token that can write to the repository"
    if any(w in text for w in ("connect", "timeout", "timed out", "name or service", "resolve", "network")):
        return "nothing was uploaded: the hub could not be reached; check the network (or HF_ENDPOINT) and run it again"
    return "nothing was uploaded (--debug shows the traceback)"


def _cmd_push(args: argparse.Namespace) -> int:
    from .export.push import push

    try:
        url = push(args.checkpoint, args.repo, private=args.private, revision=args.revision)
    except (ValueError, FileNotFoundError) as exc:
        return _err(str(exc), 2)
    except Exception as exc:  # the hub client's network, auth and offline errors: nothing was uploaded
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        return _err(f"push to {args.repo} failed ({type(exc).__name__}): {first}; {_push_fix(exc)}", 2)
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
    p.add_argument("--batch-size", type=int, default=1, help="evaluation rows per forward pass (default 1)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--backend", choices=BACKENDS, help="how quantized layers run (default: triton on CUDA, torch on CPU)")
    p.add_argument("--no-act-quant", action="store_true", help="run W4A4 NVFP4 layers weight-only, as the engines do on Hopper")
    p.add_argument("--out", help="folder for eval.json, eval.md and the plots (with --compare-recipes: compare.json and compare.md)")
    p.add_argument("--keep-checkpoints", metavar="DIR",
                   help="with --compare-recipes: keep each variant's checkpoint and report in DIR/<variant>/ "
                        "(default: a temporary folder, removed at the end)")
    p.add_argument("--update-card", action="store_true", help="write the measured quality into the checkpoint's README.md")
    p.add_argument("--ssm-state", metavar="FORMATS",
                   help="compare SSM-state cache formats against fp32: a comma-separated list of fp16 (round to nearest) "
                        "and fp16-sr (stochastic rounding), on --quantized, --model or the embedded tiny Nemotron-H")
    p.add_argument("--philox-rounds", default="5,10", help="with --ssm-state fp16-sr: Philox rounds, comma-separated (default 5,10)")
    p.add_argument("--generate", type=int, default=2048,
                   help="with --ssm-state: greedy tokens generated after a 32-token prompt (default 2048; 0 skips it)")
    p.add_argument("--state-error", action="store_true", help="with --ssm-state: also the state's relative error against fp32")
    p.add_argument("--seed", type=int, default=0, help="with --ssm-state: seed of the stochastic rounding's per-step seeds")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _quiet_kernel_fallbacks(cmd):
    """Runs a command that executes a model with transformers' "`x` is falling back to its reference
    PyTorch implementation" warnings kept out of its output: they name CUDA packages (mamba-ssm,
    causal-conv1d) that change nothing about the results. With --no-progress, transformers' own
    bars (loading weights) are off too."""

    def run(args: argparse.Namespace) -> int:
        from transformers.utils import logging as hf_logging

        from .quantize import _KernelFallbacks

        bars = hf_logging.is_progress_bar_enabled()
        if getattr(args, "no_progress", False):
            hf_logging.disable_progress_bar()
        try:
            with _KernelFallbacks():
                return cmd(args)
        finally:
            if bars:
                hf_logging.enable_progress_bar()

    run.__name__ = cmd.__name__
    run.__doc__ = cmd.__doc__
    return run


def _cmd_eval_ssm_state(args: argparse.Namespace) -> int:
    from . import ssm_eval
    from .evaluate import EMBEDDED_MODEL, check_inputs, provenance, token_rows

    if args.compare_recipes or args.reference or args.update_card or args.keep_checkpoints:
        return _err("--ssm-state runs one model (--quantized, --model, or the embedded one); it takes no "
                    "--compare-recipes/--reference/--update-card/--keep-checkpoints", 2)
    if args.quantized and args.model:
        return _err("give --quantized or --model, not both", 2)
    try:
        variants = ssm_eval.parse_variants(args.ssm_state, args.philox_rounds)
        if args.generate < 0 or args.tokens < 2:
            raise ValueError("--generate must be >= 0 and --tokens >= 2")
        if not 0 <= args.seed < 2**30:
            raise ValueError(f"--seed must be in [0, 2^30) with --ssm-state, got {args.seed}")
        check_inputs(quantized=args.quantized, model=args.model, data=args.data, tokens=args.tokens,
                     seq_len=args.tokens, out=args.out)
    except (ValueError, OSError) as exc:
        return _err(str(exc), 2)
    import sys as _sys

    import torch
    from transformers import AutoTokenizer

    from .kernels.backend import make_current

    device = args.device
    make_current(device)
    backend = args.backend or ("triton" if device.startswith("cuda") else "torch")
    if args.quantized:
        from .export.load import load_quantized

        model = load_quantized(args.quantized, device, backend=backend, act_quant=not args.no_act_quant)
        tokenizer = AutoTokenizer.from_pretrained(args.quantized)
        where = args.quantized
    else:
        from .quantize import load_model

        where = args.model or EMBEDDED_MODEL
        if args.model:
            model, tokenizer = load_model(args.model, device=device, progress=not args.no_progress)
        else:
            from .models.tiny import load_tiny_model

            model, tokenizer = load_tiny_model(device=device)
    try:
        rows, _ = token_rows(tokenizer, args.data, tokens=args.tokens, seq_len=args.tokens)
    except ValueError as exc:
        return _err(str(exc), 2)
    command = "fp4kit " + " ".join(_sys.argv[1:]) if _sys.argv and _sys.argv[0].endswith("fp4kit") else "fp4kit eval"
    result = ssm_eval.run(model, rows[0], variants, generate=args.generate, seed=args.seed,
                          backend="triton" if backend == "triton" and torch.cuda.is_available() else "torch",
                          state_error=args.state_error, out=args.out, provenance={**provenance(command, device), "model": where},
                          progress=not args.no_progress, log=lambda m: print(m, file=_sys.stderr))
    print(result["markdown"])
    if args.out:
        print(f"wrote {', '.join(result['files'])} to {args.out}")
    return 0


@_quiet_kernel_fallbacks
def _cmd_eval(args: argparse.Namespace) -> int:
    from .evaluate import check_inputs, compare_recipes, evaluate, layers_markdown, quality_markdown

    if args.ssm_state:
        return _cmd_eval_ssm_state(args)
    if args.compare_recipes:
        if args.reference or args.quantized:
            return _err("--compare-recipes quantizes --model itself; it takes no --reference/--quantized", 2)
        if args.backend or args.no_act_quant or args.update_card:
            return _err("--backend/--no-act-quant/--update-card apply to --quantized only", 2)
        try:
            check_inputs(model=args.model, data=args.data, dataset=args.dataset, recipe=args.recipe, calib=args.calib,
                         tokens=args.tokens, seq_len=args.seq_len, out=args.out, keep_checkpoints=args.keep_checkpoints)
        except (ValueError, OSError) as exc:
            return _err(str(exc), 2)
        try:
            summary = compare_recipes(
                args.model, base_recipe=args.recipe, calib=args.calib, dataset=args.dataset, data=args.data,
                tokens=args.tokens, seq_len=args.seq_len, device=args.device, batch_size=args.batch_size,
                out=args.out, keep_checkpoints=args.keep_checkpoints, progress=not args.no_progress,
                log=lambda m: print(m, file=sys.stderr),
            )
        except (ValueError, FileNotFoundError, ImportError) as exc:
            return _err(str(exc), 1)
        print(summary["markdown"])
        return 0
    if not (args.reference and args.quantized):
        return _err("give --reference and --quantized, or --compare-recipes", 2)
    if args.model or args.recipe or args.calib or args.dataset or args.keep_checkpoints:
        return _err("--model/--recipe/--calib/--dataset/--keep-checkpoints apply to --compare-recipes only", 2)
    try:
        check_inputs(reference=args.reference, quantized=args.quantized, data=args.data, tokens=args.tokens,
                     seq_len=args.seq_len, out=args.out)
    except (ValueError, OSError) as exc:
        return _err(str(exc), 2)
    from .kernels.backend import make_current

    make_current(args.device)
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
# fp4kit generate
# --------------------------------------------------------------------------------------------
def _add_generate(p: argparse.ArgumentParser) -> None:
    from .kernels.backend import BACKENDS

    p.add_argument("--model", required=True, help="a quantized checkpoint folder or a BF16 model folder")
    p.add_argument("--prompt", action="append", required=True, help="prompt text; repeat for a batch")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    p.add_argument("--device", default="cuda" if _cuda() else "cpu", help="cpu or cuda (default: cuda when there is one)")
    p.add_argument("--backend", choices=BACKENDS, help="how quantized layers run (default: triton on CUDA, torch on CPU)")
    p.add_argument("--no-graph", action="store_true", help="run each decode step eagerly instead of replaying a CUDA graph")
    p.add_argument("--compile", action="store_true",
                   help="compile the decode step with torch.compile first (fuses its small kernels: faster steps, "
                        "a compile of a minute or more at the start)")
    p.add_argument("--step-ops", choices=("fp4kit", "triton", "transformers"), default="triton",
                   help="what a decode step's attention, routers and Mamba mixers run (fp4kit.generate's step_ops): "
                        "fp4kit's; triton (default), those with each attention layer, single-group router and Mamba "
                        "step as one Triton launch on a GPU (elsewhere fp4kit's); transformers, the model's own")
    p.add_argument("--ssm-state", choices=("fp32", "fp16", "fp16-sr"), default="fp32",
                   help="hold the Mamba SSM state between steps in fp32 (the model's own), fp16, or fp16 with "
                        "stochastic rounding, as engines' --mamba-ssm-cache-dtype float16 do (default fp32)")
    p.add_argument("--philox-rounds", type=int, default=5, help="with --ssm-state fp16-sr: Philox rounds (default 5)")
    p.add_argument("--ssm-seed", type=int, default=0, help="with --ssm-state fp16-sr: seed of the rounding (default 0)")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


@_quiet_kernel_fallbacks
def _cmd_generate(args: argparse.Namespace) -> int:
    from .export.checkpoint import read_quant_configs
    from .quantize import check_model_folder

    folder = Path(args.model)
    if args.max_new_tokens < 1:
        return _err(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}", 2)
    if args.philox_rounds < 1 or not 0 <= args.ssm_seed < 2**30:
        return _err(f"--philox-rounds must be at least 1 and --ssm-seed in [0, 2^30), got {args.philox_rounds} and {args.ssm_seed}", 2)
    try:
        check_model_folder(folder)
        quantized = read_quant_configs(folder) != (None, None)
    except (ValueError, OSError) as exc:
        return _err(str(exc), 2)
    if args.backend and not quantized:
        return _err(f"--backend runs quantized layers; {folder} is not a quantized checkpoint", 2)
    if args.device.startswith("cuda") and not _cuda():
        return _err(f"--device {args.device}: no CUDA device here", 2)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .kernels.backend import make_current

    make_current(args.device)

    from .decode import generate
    from .export.load import MODEL_DTYPE, load_quantized
    from .modules import resolve_backend

    tokenizer = AutoTokenizer.from_pretrained(folder)
    if quantized:
        # The Triton kernels run W4A4 layers weight-only, as the engines do on Hopper.
        import torch

        backend = resolve_backend(args.backend, torch.device(args.device))
        model = load_quantized(folder, args.device, backend=backend, act_quant=backend != "triton")
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=MODEL_DTYPE, device_map=args.device, use_safetensors=True).eval()
    single = len(args.prompt) == 1
    if single:
        print(args.prompt[0], end="", flush=True)
    seen = [[] for _ in args.prompt]
    shown = [0] * len(args.prompt)

    def stream(tokens):
        if not single:
            return
        # Decode the whole continuation each step: a token may complete a character only with the next.
        if tokens[0] is not None:
            seen[0].append(tokens[0])
            text = tokenizer.decode(seen[0], skip_special_tokens=True)
            print(text[shown[0]:], end="", flush=True)
            shown[0] = len(text)

    try:
        result = generate(model, tokenizer, args.prompt, args.max_new_tokens, graph=False if args.no_graph else None,
                          stream=stream, ssm_state=args.ssm_state, philox_rounds=args.philox_rounds, ssm_seed=args.ssm_seed,
                          compile=args.compile, step_ops=args.step_ops)
    except ValueError as exc:
        return _err(str(exc), 2)
    if single:
        print()
    else:
        for prompt, text in zip(args.prompt, result.text):
            print(f"{prompt}{text}\n")
    how = ("CUDA graph" if result.graph else "eager") + (", compiled" if args.compile else "") + (
        "" if args.step_ops == "triton" else f", step ops {args.step_ops}")
    state = "" if args.ssm_state == "fp32" else f", SSM state {args.ssm_state}" + (
        f" R={args.philox_rounds}" if args.ssm_state == "fp16-sr" else "")
    print(f"{sum(map(len, result.tokens))} tokens in {result.seconds:.2f}s: {result.tokens_per_s:.1f} tokens/s with the "
          f"prefill, decode {result.decode_tokens_per_s:.1f} tokens/s ({how}, batch {result.batch}{state})", file=sys.stderr)
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
    "generate": ("generate text from a checkpoint or BF16 model, one decode step replayed as a CUDA graph", None,
                 _add_generate, _cmd_generate),
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
            p.add_argument("--debug", action="store_true", help="show the traceback of an unexpected error (also FP4KIT_DEBUG=1)")
        p.set_defaults(func=run)
    return parser


def _describe(exc: BaseException) -> str:
    """One line for an unexpected error: what it is and, where known, what to do."""
    import errno

    first = (str(exc).strip().splitlines() or [""])[0]
    if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
        return f"no space left on the device{f' writing {exc.filename}' if exc.filename else ''}; free space and run the command again"
    kind = type(exc).__name__
    # The hub client's HTTP libraries raise errors of their own, not ConnectionError.
    http_client = type(exc).__module__.split(".")[0] in ("httpx", "httpx2", "requests", "urllib3")
    if isinstance(exc, (ConnectionError, TimeoutError)) or http_client:
        return f"network error ({kind}: {first}); check the connection, or use local files"
    return f"{kind}: {first}" if first else kind


class _Interrupts:
    """A SIGINT handler that raises KeyboardInterrupt, as Python's own does, and counts: a library
    that turns the KeyboardInterrupt into an error of its own (transformers' lazy imports do) is
    still known to have been stopped by Ctrl-C."""

    def __init__(self) -> None:
        self.count = 0
        self.previous = None

    def __call__(self, signum, frame) -> None:
        self.count += 1
        raise KeyboardInterrupt

    def __enter__(self):
        import signal
        import threading

        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self.previous = signal.signal(signal.SIGINT, self)
        return self

    def __exit__(self, *exc) -> None:
        import signal

        if self.previous is not None:
            signal.signal(signal.SIGINT, self.previous)


def _interrupted(command: str, args: argparse.Namespace | None, debug: bool) -> int:
    import traceback

    if debug:
        traceback.print_exc()
    # CPython remembers a KeyboardInterrupt that escaped code run from a string (exec of a str,
    # as dataclasses and typing do) and then ends the process by SIGINT instead of with the exit
    # status; running a string clears that record (pythonrun.c, run_eval_code_obj).
    exec("None")
    if command == "quantize":
        return _quantize_interrupted(args)
    return _err("interrupted", 130)


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. Bad input ends in one `error:` line and exit 2; an unexpected error in
    one line and exit 1 (the traceback with --debug or FP4KIT_DEBUG=1); Ctrl-C in exit 130."""
    import traceback

    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv or os.environ.get("FP4KIT_DEBUG") == "1"
    command = argv[0] if argv and argv[0] in COMMANDS else ""
    args = None
    with _Interrupts() as interrupts:
        try:
            # The subcommand is the first argument: the top-level parser has no options besides -h.
            parser = build_parser(command)
            args = parser.parse_args(argv)
            args.argv = argv
            return args.func(args)
        except KeyboardInterrupt:
            return _interrupted(command, args, debug)
        except Exception as exc:
            if interrupts.count:
                return _interrupted(command, args, debug)
            if debug:
                traceback.print_exc()
            hint = "" if debug else " (--debug shows the traceback)"
            return _err(f"{command or 'fp4kit'} failed: {_describe(exc)}{hint}", 1)


if __name__ == "__main__":
    sys.exit(main())
