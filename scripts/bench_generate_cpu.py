"""Decode speed of the embedded model's checkpoint on the CPU, as the README's `fp4kit generate`
example runs it: the README's main job (`fp4kit quantize`, the bundled tiny Nemotron-H under the
default recipe) into a temporary folder, the checkpoint loaded back with `fp4kit.load_quantized`
(exact emulation on the CPU) and decoded greedily by `fp4kit.generate`.

    python scripts/bench_generate_cpu.py [--tokens 64] [--repeats 5] [--out benchmarks/results/generate-cpu.json]

Times `generate` of --tokens new tokens from the prompt "ROMEO:" --repeats times (after one
untimed call) and records the median, the tokens/s and the threads torch used, with the date,
command and versions, and prints them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from benchlib.record import ROOT, run_record
from transformers import AutoTokenizer

from fp4kit import cli
from fp4kit.decode import generate
from fp4kit.export.load import load_quantized
from fp4kit.recipe import DEFAULT_RECIPE

PROMPT = "ROMEO:"


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per generate (default 64)")
    ap.add_argument("--repeats", type=int, default=5, help="timed generates (default 5)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "generate-cpu.json")
    args = ap.parse_args(argv)
    if args.tokens < 1 or args.repeats < 1:
        ap.error("--tokens and --repeats must be at least 1")
    with tempfile.TemporaryDirectory(prefix="fp4kit-bench-generate-") as tmp:
        folder = Path(tmp) / "tiny-nemotron-h-nvfp4"
        if cli.main(["quantize", "-o", str(folder), "--no-progress"]):
            raise SystemExit("fp4kit quantize failed")
        qmodel = load_quantized(folder, device="cpu")
        tokenizer = AutoTokenizer.from_pretrained(folder)
    generate(qmodel, tokenizer, [PROMPT], args.tokens, stop_at_eos=False)
    seconds = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        result = generate(qmodel, tokenizer, [PROMPT], args.tokens, stop_at_eos=False)
        seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds)
    record = {**run_record(None if argv is None else [str(ROOT / "scripts" / "bench_generate_cpu.py"), *argv]),
              "model": "the embedded tiny Nemotron-H", "recipe": DEFAULT_RECIPE, "prompt": PROMPT,
              "new_tokens": args.tokens, "repeats": args.repeats, "threads": torch.get_num_threads(),
              "seconds": seconds, "median_s": median, "tokens_per_s": args.tokens / median,
              "tokens": result.tokens[0]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"{args.tokens} tokens in {median:.3f} s (median of {args.repeats}): {record['tokens_per_s']:.1f} tokens/s "
          f"on {record['threads']} threads; wrote {args.out}")
    return record


if __name__ == "__main__":
    main()
