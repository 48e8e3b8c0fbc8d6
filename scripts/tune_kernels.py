"""Sweeps launch shapes on this GPU and writes the picks to fp4kit/kernels/tuning/<gpu>.json.

    python scripts/tune_kernels.py --list
    python scripts/tune_kernels.py w4a16.gemv moe.small [--gpu h200] [--dry-run]
    python scripts/tune_kernels.py fp8.gemv --rows benchmarks/results/kernels-sweeps-fp8-gemv-h200.json

Each sweep (scripts/sweeps/<kernel>.py, `SWEEPS`) times candidate launch shapes side by side and
returns its rows; its pick turns the rows into one table. The rows go to
benchmarks/results/kernels-sweeps-<sweep>-<gpu>.json (date, command, versions) and the pick into
the tuning file, with the command and date that chose it. With --rows, one sweep's pick is made
again from the rows of a results file it wrote (no GPU; the file is left as it is), as after a
change to the pick's rule. The library only reads the tuning file (fp4kit.kernels.launch);
nothing here changes a live table.
"""

from __future__ import annotations

import argparse
import importlib
import json
import pkgutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

def sweeps() -> dict:
    """{"kernel.sweep": Sweep} over every scripts/sweeps/<kernel>.py (a module with `SWEEPS`)."""
    out = {}
    for info in pkgutil.iter_modules([str(ROOT / "scripts" / "sweeps")]):
        module = importlib.import_module(f"sweeps.{info.name}")
        for name, sweep in getattr(module, "SWEEPS", {}).items():
            out[f"{info.name}.{name}"] = sweep
    return out


def write_pick(gpu: str, kernel: str, table: str, value, chosen_by: dict) -> Path:
    from fp4kit.kernels.launch import thaw, tuning_path

    path = Path(str(tuning_path(gpu)))
    doc = json.loads(path.read_text())
    entry = doc["kernels"][kernel]
    entry["tables"][table] = thaw(value)
    entry.setdefault("chosen_by", {})[table] = chosen_by
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="sweeps to run, as kernel.sweep (see --list)")
    ap.add_argument("--list", action="store_true", help="list the sweeps and the table each one picks")
    ap.add_argument("--gpu", default="h200", help="tuning file to write (fp4kit/kernels/tuning/<gpu>.json)")
    ap.add_argument("--dry-run", action="store_true", help="sweep and print the picks; write nothing")
    ap.add_argument("--rows", help="pick from this results file's rows (written by the one sweep named) instead of sweeping")
    args = ap.parse_args(argv)
    known = sweeps()
    if args.list or not args.names:
        for name, sweep in known.items():
            print(f"{name:24s} -> {sweep.kernel}.{sweep.table}: {sweep.doc}")
        return 0
    unknown = [n for n in args.names if n not in known]
    if unknown:
        print(f"error: unknown sweep(s) {', '.join(unknown)}; --list shows them", file=sys.stderr)
        return 2
    from benchlib.record import run_record

    record = run_record(None if argv is None else [str(ROOT / "scripts" / "tune_kernels.py"), *argv])
    command, date = record["command"], record["date"]
    if args.rows:
        if len(args.names) != 1:
            print("error: --rows picks for one sweep; name exactly one", file=sys.stderr)
            return 2
        source = Path(args.rows).resolve()
        swept = json.loads(source.read_text())
        written = swept.get("sweep")
        if written != args.names[0]:
            print(f"error: {args.rows} holds the rows of sweep {written!r}, not {args.names[0]!r}", file=sys.stderr)
            return 2
    for name in args.names:
        sweep = known[name]
        rows = swept["rows"] if args.rows else sweep.run()
        pick = sweep.pick(rows)
        print(f"{name}: {sweep.kernel}.{sweep.table} = {json.dumps(pick)}")
        if args.dry_run:
            continue
        if args.rows:
            result = source
        else:
            result = ROOT / "benchmarks" / "results" / f"kernels-sweeps-{name.replace('.', '-')}-{args.gpu}.json"
            result.write_text(json.dumps({**record, "sweep": name, "pick": pick, "rows": rows}, indent=1) + "\n")
        write_pick(args.gpu, sweep.kernel, sweep.table, pick,
                   {"command": command, "date": date,
                    "results": str(result.relative_to(ROOT)) if result.is_relative_to(ROOT) else str(result)})
        # The sweeps after this one time their candidates against the tables as picked so far.
        from fp4kit.kernels import launch

        launch.tables.cache_clear()
    return 0


if __name__ == "__main__":
    sys.exit(main())
