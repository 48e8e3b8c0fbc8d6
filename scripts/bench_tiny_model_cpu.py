"""Time the bundled tiny model on CPU and record it under "cpu" in benchmarks/results/tiny-model.json.

    python scripts/bench_tiny_model_cpu.py [--results benchmarks/results/tiny-model.json]

Measures, in this fresh process: importing transformers, load_tiny_model() (model + tokenizer,
bf16), a forward over 512 tokens (the first call, then the median of --repeats), the held-out slice
loss on CPU (compare with "heldout_slice" recorded at training time) and a greedy sample. The
"cpu" section carries its own date, command and versions.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import time

from benchlib.record import run_record

REPO = pathlib.Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--results", type=pathlib.Path, default=REPO / "benchmarks" / "results" / "tiny-model.json")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--tokens", type=int, default=512)
    args = p.parse_args()

    t0 = time.perf_counter()
    import torch
    import transformers  # noqa: F401  (timed: the first import dominates a cold start)

    from fp4kit.models.tiny import heldout_slice, load_tiny_model

    t1 = time.perf_counter()
    model, tokenizer = load_tiny_model()
    t2 = time.perf_counter()

    ids = heldout_slice(tokenizer, rows=1, seq_len=args.tokens)
    times = []
    with torch.no_grad():
        for i in range(args.repeats + 1):
            start = time.perf_counter()
            model(input_ids=ids)
            times.append(time.perf_counter() - start)
        slice_ids = heldout_slice(tokenizer)
        slice_loss = model(input_ids=slice_ids, labels=slice_ids).loss.item()
        prompt = "ROMEO.\n"
        enc = tokenizer(prompt, return_tensors="pt")
        out = model.generate(**enc, max_new_tokens=48, do_sample=False)
    sample = tokenizer.decode(out[0], skip_special_tokens=True)

    cpu = {
        **run_record(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch threads {torch.get_num_threads()}",
        "dtype": "bfloat16",
        "experts_implementation": model.config._experts_implementation,
        "import_s": round(t1 - t0, 2),
        "load_s": round(t2 - t1, 2),
        "forward_tokens": args.tokens,
        "first_forward_s": round(times[0], 3),
        "forward_s_median": round(statistics.median(times[1:]), 3),
        "forward_s_max": round(max(times[1:]), 3),
        "forward_s_all": [round(t, 3) for t in times[1:]],
        "heldout_slice_loss": round(slice_loss, 4),
        "sample": {"prompt": prompt, "max_new_tokens": 48, "greedy": True, "text": sample},
    }
    results = json.loads(args.results.read_text())
    results["cpu"] = cpu
    args.results.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(cpu, indent=2))


if __name__ == "__main__":
    main()
