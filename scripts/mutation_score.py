"""Mutation testing of the number formats and the ModelOpt exporter with mutmut 3, and the score.

    pip install -e '.[mutation]'
    python scripts/mutation_score.py                              # a full run from scratch
    python scripts/mutation_score.py fp4kit/formats/e4m3.py ...   # rerun the mutants of some files
    python scripts/mutation_score.py --report-only                # only read mutants/ and write the JSON

mutmut reads [tool.mutmut] in pyproject.toml (files, tests, time limits), copies the package into
mutants/ and runs, for every mutant, the tests that reached its function. A full run deletes
mutants/ first; a run over files keeps it and retests every mutant of those files. Then this writes
benchmarks/results/mutation.json: per file the mutants killed, timed out, survived and without a
test; the survivors no test can tell from the code (EQUIVALENT below, with the reason) and those
only a CUDA device can tell (CUDA_ONLY: a tensor made on the CPU where the input's device was
meant; tests/formats/test_mutation_scales.py's CUDA test kills them on a GPU); and the score

    score = (killed + timeout) / (total - equivalent - cuda_only)

A survivor neither names is listed as unexplained, and the command exits 1.
The EQUIVALENT and CUDA_ONLY tables below give the reason for each entry.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

from benchlib.record import run_record  # noqa: E402

# (function, the mutated line as mutmut writes it) -> why no test can tell the mutant from the code.
# A function is named as in mutmut's mutant names, without the `x_` prefix and the mutant number.
CPU_SCALAR = "a 0-d CPU tensor enters an op on any device as a scalar: the same value, the same bytes"
FP32_DEFAULT = "torch's default dtype makes the same fp32 tensor of a Python float"
EQUIVALENT = {
    # e4m3.encode
    ("fp4kit.formats.e4m3.encode", "normal = r > E4M3_MIN_NORMAL"):
        "at r = 2^-6 the subnormal formula r / 2^-9 gives 8 = 0x08, the code of 2^-6 itself",
    ("fp4kit.formats.e4m3.encode", "man = ((2.0 * mant - 1.0) * 9.0).to(torch.int32)"):
        "2 * mant - 1 is k/8 (k = 0..7): 9k/8 truncates to k, as 8k/8 does",
    ("fp4kit.formats.e4m3.encode", "code = code | (torch.signbit(x).to(None) << 7)"):
        "a bool tensor shifted by 7 is promoted to an integer tensor: the same sign bit",
    # e2m1.encode
    ("fp4kit.formats.e2m1.encode", "bounds = torch.tensor(E2M1_MIDPOINTS, dtype=None, device=x.device)"):
        "the midpoints are exact in fp32 and in every input dtype: the comparisons do not change",
    ("fp4kit.formats.e2m1.encode", "bounds = torch.tensor(E2M1_MIDPOINTS, device=x.device)"):
        "the midpoints are exact in fp32 and in every input dtype: the comparisons do not change",
    ("fp4kit.formats.e2m1.encode", "index = torch.bucketize(a, bounds, ).to(torch.uint8)"):
        "right=False is bucketize's default",
    ("fp4kit.formats.e2m1.encode", "index += (a == tie).to(None)"):
        "adding a bool tensor in place to a uint8 one adds 0 or 1",
    # fp8
    ("fp4kit.formats.fp8.search_amax", 'if not mults or not all(c > 0 and c == c and c != float("INF") for c in mults):'):
        'float() reads "INF" as infinity too',
    ("fp4kit.formats.fp8.fake_quant_modelopt", "return e4m3.decode(e4m3.encode((x.float() * scale).clamp(None, FP8_MAX))) * (1.0 / scale)"):
        "redundant clamp: e4m3.encode saturates at -448 itself",
    ("fp4kit.formats.fp8.fake_quant_modelopt", "return e4m3.decode(e4m3.encode((x.float() * scale).clamp(-FP8_MAX, None))) * (1.0 / scale)"):
        "redundant clamp: e4m3.encode saturates at +448 itself",
    ("fp4kit.formats.fp8.fake_quant_modelopt", "return e4m3.decode(e4m3.encode((x.float() * scale).clamp(-FP8_MAX, ))) * (1.0 / scale)"):
        "redundant clamp: e4m3.encode saturates at +448 itself",
    # arith.div_const
    ("fp4kit.formats.arith.div_const", "return x * torch.full((), fp32_reciprocal(c), dtype=None, device=x.device)"): FP32_DEFAULT,
    ("fp4kit.formats.arith.div_const", "return x * torch.full((), fp32_reciprocal(c), device=x.device)"): FP32_DEFAULT,
    ("fp4kit.formats.arith.div_const", "return x * torch.full((), fp32_reciprocal(c), dtype=torch.float32, device=None)"): CPU_SCALAR,
    ("fp4kit.formats.arith.div_const", "return x * torch.full((), fp32_reciprocal(c), dtype=torch.float32, )"): CPU_SCALAR,
    ("fp4kit.formats.arith.div_const", "return x / torch.full((), c, dtype=None, device=x.device)"): FP32_DEFAULT,
    ("fp4kit.formats.arith.div_const", "return x / torch.full((), c, device=x.device)"): FP32_DEFAULT,
    # nvfp4
    ("fp4kit.formats.nvfp4._cast_block_scale", "return e4m3.cast(s.clamp(min=BLOCK_SCALE_MIN, max=None))"):
        "redundant clamp: e4m3.cast saturates at 448 itself",
    ("fp4kit.formats.nvfp4._cast_block_scale", "return e4m3.cast(s.clamp(min=BLOCK_SCALE_MIN, ))"):
        "redundant clamp: e4m3.cast saturates at 448 itself",
    ("fp4kit.formats.nvfp4._assemble", "one = e4m3.cast(torch.ones((), device=None))"): CPU_SCALAR,
    ("fp4kit.formats.nvfp4._assemble", "one = e4m3.cast(torch.ones((), ))"): CPU_SCALAR,
    ("fp4kit.formats.nvfp4._importance_weights", "if w.dim() > 2:"):
        "redundant test: importance of a 2-D weight is [K], and its [K/16, 16] broadcasts alike with or without the N axis",
    ("fp4kit.formats.nvfp4._importance_weights", "if w.dim() >= 3:"):
        "redundant test: importance of a 2-D weight is [K], and its [K/16, 16] broadcasts alike with or without the N axis",
    ("fp4kit.formats.nvfp4._quantize", "global_scale = global_scale_of(g_safe, None, arith)"):
        "global_scale_of treats every rule but \"6\" as \"4o6\"",
    ("fp4kit.formats.nvfp4._quantize", 'global_scale = global_scale_of(g_safe, "XX4o6XX", arith)'):
        "global_scale_of treats every rule but \"6\" as \"4o6\"",
    ("fp4kit.formats.nvfp4._quantize", 'global_scale = global_scale_of(g_safe, "4O6", arith)'):
        "global_scale_of treats every rule but \"6\" as \"4o6\"",
}
# (function, mutated line) of the survivors that put a tensor on the CPU where the input's device
# was meant: on the CPU nothing changes, on CUDA the op mixes devices or divides by a CPU scalar.
CUDA_ONLY = {
    ("fp4kit.formats.e2m1.decode", "return _value_table(None)[codes.long()]"),
    ("fp4kit.formats.arith.div_const", "return x / torch.full((), c, dtype=torch.float32, device=None)"),
    ("fp4kit.formats.arith.div_const", "return x / torch.full((), c, dtype=torch.float32, )"),
    ("fp4kit.formats.nvfp4._resolve_global_amax", "g = torch.as_tensor(global_amax, dtype=torch.float32, device=None)"),
    ("fp4kit.formats.nvfp4._resolve_global_amax", "g = torch.as_tensor(global_amax, dtype=torch.float32, )"),
    ("fp4kit.formats.nvfp4._importance_weights", "imp = torch.as_tensor(importance, device=None).float()"),
    ("fp4kit.formats.nvfp4._importance_weights", "imp = torch.as_tensor(importance, ).float()"),
    ("fp4kit.formats.nvfp4.quantize_static", "g = torch.as_tensor(global_amax, dtype=torch.float32, device=None)"),
    ("fp4kit.formats.nvfp4.quantize_static", "g = torch.as_tensor(global_amax, dtype=torch.float32, )"),
}


def mutated_files() -> list[Path]:
    """The files [tool.mutmut] mutates, as mutmut itself walks them (run from the repository)."""
    from mutmut.utils.file_utils import walk_mutatable_files

    return sorted(walk_mutatable_files())


def run_mutmut(globs: list[str], max_children: int) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # a forked torch must not wait on a parent's thread pool
    cmd = [str(Path(sys.executable).with_name("mutmut")), "run", "--max-children", str(max_children), *globs]
    subprocess.run(cmd, cwd=REPO, env=env, check=True)


def mutated_line(diff: str) -> str:
    added = [line[1:].strip() for line in diff.splitlines() if line.startswith("+") and not line.startswith("+++")]
    return added[0] if len(added) == 1 else " / ".join(added)


def function_of(mutant: str) -> str:
    module, _, name = mutant.rpartition(".")
    name = name.rpartition("__mutmut_")[0]
    name = name[2:] if name.startswith("x_") else name.replace("xǁ", "").replace("ǁ", ".")
    return f"{module}.{name}"


def report() -> tuple[dict, list[dict]]:
    from mutmut.mutation.data import SourceFileMutationData
    from mutmut.mutation.diff_apply import get_diff_for_mutant
    from mutmut.stats import status_by_exit_code

    files, survivors = {}, []
    for path in mutated_files():
        data = SourceFileMutationData(path=path)
        data.load()
        counts = Counter(status_by_exit_code[code] for code in data.exit_code_by_key.values())
        equivalent = cuda_only = 0
        for mutant, code in sorted(data.exit_code_by_key.items()):
            status = status_by_exit_code[code]
            if status in ("killed", "timeout", "not checked"):
                continue
            line = mutated_line(get_diff_for_mutant(mutant, path=path))
            key = (function_of(mutant), line)
            entry = {"mutant": mutant, "status": status, "mutated_line": line}
            if status == "survived" and key in EQUIVALENT:
                equivalent += 1
                entry["equivalent"] = EQUIVALENT[key]
            elif status == "survived" and key in CUDA_ONLY:
                cuda_only += 1
                entry["cuda_only"] = True
            else:
                entry["unexplained"] = True
            survivors.append(entry)
        total = sum(counts.values())
        detected = counts["killed"] + counts["timeout"]
        undecidable = equivalent + cuda_only
        files[str(path)] = {
            "total": total, "killed": counts["killed"], "timeout": counts["timeout"],
            "survived": counts["survived"], "no_tests": counts["no tests"],
            "not_checked": counts["not checked"], "other": total - sum(counts[s] for s in (
                "killed", "timeout", "survived", "no tests", "not checked")),
            "equivalent": equivalent, "cuda_only": cuda_only,
            "score": round(detected / (total - undecidable), 4) if total > undecidable else None,
        }
    return files, survivors


def group_scores(files: dict) -> dict:
    groups = {"fp4kit/formats/": lambda p: p.startswith("fp4kit/formats/"),
              "fp4kit/export/modelopt.py": lambda p: p == "fp4kit/export/modelopt.py",
              "all": lambda p: True}
    out = {}
    for name, member in groups.items():
        rows = [r for p, r in files.items() if member(p)]
        total = sum(r["total"] for r in rows)
        detected = sum(r["killed"] + r["timeout"] for r in rows)
        equivalent = sum(r["equivalent"] for r in rows)
        cuda_only = sum(r["cuda_only"] for r in rows)
        left = total - equivalent - cuda_only
        out[name] = {"total": total, "detected": detected, "equivalent": equivalent, "cuda_only": cuda_only,
                     "score": round(detected / left, 4) if left else None,
                     "raw_score": round(detected / total, 4) if total else None}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="*", help="files whose mutants to retest (default: a full run from scratch)")
    p.add_argument("--report-only", action="store_true", help="run nothing; read mutants/")
    p.add_argument("--max-children", type=int, default=2)
    p.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results" / "mutation.json")
    args = p.parse_args()
    os.chdir(REPO)

    wall = None
    if not args.report_only:
        if args.paths:
            globs = [Path(x).with_suffix("").as_posix().replace("/", ".") + ".*" for x in args.paths]
        else:
            shutil.rmtree(REPO / "mutants", ignore_errors=True)
            globs = []
        t0 = time.perf_counter()
        run_mutmut(globs, args.max_children)
        wall = round(time.perf_counter() - t0, 1)

    files, survivors = report()
    record = run_record()
    record["versions"]["mutmut"] = importlib.metadata.version("mutmut")
    out = {
        **record,
        "mutmut_config": "pyproject.toml [tool.mutmut]",
        "machine": f"{os.cpu_count()} CPU cores, --max-children {args.max_children}",
        "wall_s": wall,
        "score": "(killed + timeout) / (total - equivalent - cuda_only); raw_score: (killed + timeout) / total",
        "groups": group_scores(files),
        "files": files,
        "survivors": survivors,
    }
    args.results.write_text(json.dumps(out, indent=2, ensure_ascii=False) + "\n")
    unexplained = [s["mutant"] for s in survivors if s.get("unexplained")]
    for name, g in out["groups"].items():
        print(f"{name}: {g['detected']} of {g['total']} detected, {g['equivalent']} equivalent, "
              f"{g['cuda_only']} CUDA-only: score {g['score']}, raw {g['raw_score']}")
    if unexplained:
        print(f"{len(unexplained)} surviving mutants are not named in EQUIVALENT:")
        print("\n".join(f"  {m}" for m in unexplained))
        sys.exit(1)


if __name__ == "__main__":
    main()
