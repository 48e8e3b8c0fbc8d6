"""Every committed results file says when, by which command and on what it was made, and every
figure the READMEs quote from one is that file's value.

FIGURES lists each quoted figure: the README text that quotes it, the results file and the path
of the value in it, and how the README rounds it. A figure drifts when either side changes alone:
the README's text is no longer found, or the file's value no longer rounds to what the text says.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
README = "README.md"
BENCH = "benchmarks/README.md"


# The four kernels of a compiled step's router (decode-profile-compiled-lightning-h200.json).
_ROUTER_KERNELS = ("void dot_kernel<float", "void reduce_1Block_kernel<float", "triton_poi_fused_sigmoid_topk_gather",
                   "_topk_gather_kernel")


# The seven Inductor kernels of a compiled step's Mamba mixer between in_proj and out_proj (the same file).
_MAMBA_KERNELS = tuple(f"triton_{kind}_fused_{name}" for kind, name in (
    ("per", "_to_copy_add_exp_expand_mul_neg_silu_softplus_split_with_sizes_sum_transpose_unsqueeze_view_"),
    ("poi", "_to_copy_add_copy_copy__mul_silu_split_with_sizes_transpose_unsqueeze_view_"),
    ("poi", "_to_copy_add_cat_expand_mul_select_slice_split_with_sizes_squeeze_transpose_view_"),
    ("poi", "_scaled_mm__to_copy_add_clamp_div_mean_mul_pow_rsqrt_silu_split_with_sizes_t_view_"),
    ("per", "_to_copy_mean_mul_pow_silu_split_with_sizes_view_"),
    ("poi", "cat_copy_copy__slice_split_with_sizes_transpose_view_"),
    ("poi", "cat_copy_slice_split_with_sizes_transpose_view_")))


def _load(name: str):
    return json.loads((RESULTS / name).read_text())


def _at(doc, path: tuple):
    """The value at `path`: keys for dicts; for lists an index or {field: value} naming the one item."""
    for step in path:
        if isinstance(step, dict):
            matches = [item for item in doc if all(item.get(k) == v for k, v in step.items())]
            assert len(matches) == 1, (step, len(matches))
            doc = matches[0]
        else:
            doc = doc[step]
    return doc


def _flat(text: str) -> str:
    return " ".join(text.split())


# --------------------------------------------------------------------------------------------
# Every file: date, command, versions
# --------------------------------------------------------------------------------------------
JSONS = sorted(p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*.json"))


# Sections that record a run of their own (bench_tiny_model_cpu.py's, beside the training's).
SECTION_RUNS = {"tiny-model.json": ("cpu",)}


def _runs(name: str, doc: dict) -> list[dict]:
    """The run records of a file: the file itself, or each section of a file of runs (one section
    per run, as dry_run.py and bench_vs_modelopt.py write them), and its SECTION_RUNS."""
    runs = [doc] if "command" in doc else [v for v in doc.values() if isinstance(v, dict)]
    return runs + [doc[key] for key in SECTION_RUNS.get(name, ())]


def _has_versions(run: dict) -> bool:
    if isinstance(run.get("versions"), dict) and run["versions"]:
        return True
    # check_engines.py: one environment per engine, each with its versions
    engines = run.get("engines")
    return isinstance(engines, dict) and bool(engines) and all(isinstance(e.get("versions"), dict) for e in engines.values())


@pytest.mark.parametrize("name", JSONS)
def test_results_file_records_date_command_versions(name):
    runs = _runs(name, _load(name))
    assert runs, f"{name}: no run record"
    for run in runs:
        assert isinstance(run.get("date"), str) and re.match(r"\d{4}-\d\d-\d\d", run["date"]), f"{name}: date"
        assert isinstance(run.get("command"), str) and run["command"], f"{name}: command"
        assert _has_versions(run), f"{name}: versions"


def _commands(command: str) -> list[list[str]]:
    """The words of each command in a command line (split at unquoted `;` and `&&`), without the
    note in parentheses that some records add after it."""
    command = re.split(r"\s\((?=[a-z])", command, maxsplit=1)[0]
    lexer = shlex.shlex(command, posix=True, punctuation_chars=";&")
    lexer.whitespace_split = True
    out = [[]]
    for word in lexer:
        if word in (";", "&&"):
            out.append([])
        else:
            out[-1].append(word)
    return [words for words in out if words]


_PROFILERS = ("ncu", "nsys", "compute-sanitizer")


def _programs(command: str) -> list[str]:
    """What each part of a command runs, as a repository path or an `fp4kit <subcommand>`."""
    out = []
    for words in _commands(command):
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):  # PYTHONPATH=., FP4KIT_TUNING=... and the like
            words.pop(0)
        if not words or words[0] == "cd":
            continue
        if words[0] in _PROFILERS:  # a profiler's options, then the program it runs
            words = words[next((i for i, w in enumerate(words) if w in ("python", "python3")), len(words)):] or words[:1]
        if words[0] == "fp4kit":
            out.append(f"fp4kit {words[1]}")
        elif words[0] in ("python", "python3") and words[1] == "-m":
            out.append(words[2].replace(".", "/") + ".py")
        elif words[0] in ("python", "python3") and words[1] == "-c":
            # fp4kit's modules, and the sweeps under scripts/ (on PYTHONPATH as `sweeps`)
            out += [("scripts/" if m.startswith("sweeps") else "") + m.replace(".", "/")
                    for m in re.findall(r"(?:from|import)\s+((?:fp4kit|sweeps)\b[\w.]*)", words[2])]
        elif words[0] in ("python", "python3"):
            out.append(words[1])
        else:
            out.append(words[0])
    return out


@pytest.mark.parametrize("name", JSONS)
def test_results_command_runs_a_committed_script(name):
    from fp4kit.cli import COMMANDS

    for run in _runs(name, _load(name)):
        programs = _programs(run["command"])
        assert programs, f"{name}: {run['command']!r} runs nothing"
        for program in programs:
            if program.startswith("fp4kit "):
                assert program.split()[1] in COMMANDS, f"{name}: {program}"
            else:
                path = ROOT / program
                assert path.is_file() or path.with_suffix(".py").is_file() or path.is_dir(), f"{name}: {program} is not in the repository"


def test_command_parsing_finds_each_program():
    assert _programs("PYTHONPATH=.:scripts python scripts/bench_kernels.py --out x.json") == ["scripts/bench_kernels.py"]
    assert _programs("python a.py X; python b.py merge Y") == ["a.py", "b.py"]
    assert _programs("fp4kit eval --compare-recipes --tokens 65536") == ["fp4kit eval"]
    assert _programs("python -c 'from fp4kit.kernels import quantize as q; q.f()'") == ["fp4kit/kernels"]
    assert _programs("cd <checkout> && python -m fp4kit.cli verify CKPT") == ["fp4kit/cli.py"]
    assert _programs("python scripts/x.py --sweep (the whole run; its pick's table)") == ["scripts/x.py"]
    assert _programs("ncu --section Occupancy --kernel-name regex:'_k|nvjet' python scripts/y.py > r.txt") == ["scripts/y.py"]
    assert _programs("ncu --version") == ["ncu"]


RESULT_FILES = sorted(p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file())
# The absolute path of a checkout's own files (e.g. /home/me/fp4kit/fp4kit/data/tiny-nemotron-h).
CHECKOUT_PATH = re.compile(r"(?<![\w.-])/(?:[\w.-]+/)+fp4kit/(?:data|configs|kernels)/")


@pytest.mark.parametrize("name", RESULT_FILES)
def test_results_hold_no_path_of_the_machine_that_wrote_them(name):
    text = (RESULTS / name).read_bytes().decode("utf-8", "replace")  # plots too: their metadata is text
    assert str(ROOT) not in text
    assert CHECKOUT_PATH.search(text) is None, CHECKOUT_PATH.search(text).group(0)


def test_recipe_comparison_markdown_is_its_json():
    from fp4kit.evaluate import recipes_markdown

    folder = RESULTS / "recipe-comparison"
    summary = json.loads((folder / "compare.json").read_text())
    assert (folder / "compare.md").read_text() == recipes_markdown(summary) + "\n"


# --------------------------------------------------------------------------------------------
# Figures quoted in the READMEs
# --------------------------------------------------------------------------------------------
def _f(digits: int, scale: float = 1.0):
    return lambda v: f"{v * scale:.{digits}f}"


def _pdl_gains(rows) -> tuple[float, float, float]:
    """(least, most, median) us a CUDA-core MoE launch gained as a programmatic dependent, over the
    sweep's (tokens, tile, K tiles ahead) pairs."""
    import statistics

    ms = {(r["tokens"], tuple(r["tile"]), r["ahead"], r["pdl"]): r["ms"] for r in rows if r["path"] == "gemv"}
    gains = [1e3 * (ms[k] - ms[(*k[:3], True)]) for k in ms if not k[3]]
    return min(gains), max(gains), statistics.median(gains)


KERNELS = "kernels-h200.json"
RECIPE_ROWS = (
    "| NVFP4 plain (rule 6) | 0.004574 | 0.0468 | 95.18% | 64.733 | 22.23 | - |",
    "| NVFP4 4/6 | 0.004347 | 0.04653 | 95.25% | 64.720 | 22.88 | 45.1% |",
    "| NVFP4 4/6 + importance | 0.004345 | 0.04575 | 95.29% | 64.776 | 22.69 | 44.5% |",
    "| BF16 | 0 | 0 | 100.00% | 64.628 | - | - |",
)
NANO = ({"N": 3712, "K": 2688}, {"N": 2688, "K": 3712})
def _decode_cells(*labels: str) -> tuple:
    """A decode table row's cells: each label's tokens/s, and for the checkpoints their ratio to BF16's graph."""
    out = []
    for label in labels:
        out.append(((f"tokens_per_s_{label}",), _f(1)))
        if not label.startswith("bf16"):
            out.append((("speedup_over_bf16_graph", label), lambda v: f"({v:.2f}x)"))
    return tuple(out)


_CKPTS = ("nemotron-h-w4a16-4o6_graph", "modelopt-lightning_graph")


def _overlap_row(n: int, k: int, m: int):
    """benchmarks/README.md's row of the overlapped GEMM's table: bf16, packed_matmul and the best
    overlapped launch, us."""
    def row(d):
        mine = [r for r in d["sweep_overlap"] if (r["N"], r["K"], r["M"]) == (n, k, m)]
        ms = {r["kernel"]: r["ms"] for r in mine if r["kernel"] != "overlap"}
        best = min(r["ms"] for r in mine if r["kernel"] == "overlap")
        return f"| {n} x {k}, {m} | {ms['bf16'] * 1e3:.1f} | {ms['packed'] * 1e3:.1f} | {best * 1e3:.1f} |"
    return row


def _ours_over_bf16(r: dict, state: str) -> float:
    """bf16's time over the faster of `w4a16_matmul` and `packed_matmul` (the table's shapes), one
    row of packed-gemm-cold-h100.json, warm or cold."""
    return r[f"ms_bf16_{state}"] / min(r[f"ms_w4a16_{state}"], r[f"ms_packed_{state}"])


def _cold_row(n: int, k: int, m: int):
    """benchmarks/README.md's row of the warm-and-cold table, us and ratios."""
    def row(rows):
        r = _at(rows, ({"N": n, "K": k, "M": m},))
        return (f"| {n} x {k}, {m} | {r['ms_bf16_warm'] * 1e3:.1f} | {r['ms_packed_warm'] * 1e3:.1f} | "
                f"{_ours_over_bf16(r, 'warm'):.2f}x | {r['ms_bf16_cold'] * 1e3:.1f} | {r['ms_packed_cold'] * 1e3:.1f} | "
                f"{_ours_over_bf16(r, 'cold'):.2f}x | {r['ms_packed_picked_cold'] * 1e3:.1f} |")
    return row


def _span(values, digits: int) -> str:
    return f"{min(values):.{digits}f}-{max(values):.{digits}f}"


def _slice_cost(rows) -> str:
    """How much slower the SLICE launches were than the plain ones, us, over rows, warm and cold."""
    return _span([(r[f"ms_packed_slice_{s}"] - r[f"ms_packed_{s}"]) * 1e3 for r in rows for s in ("warm", "cold")], 2)


def _prefetch_cell(op: str):
    """benchmarks/README.md's cold / prefetched (best launch shape and wait) / warm us of one op."""
    def cell(rows):
        r = _at(rows, ({"op": op},))
        return f"{r['cold_us']:.1f} / {min(r['prefetched_us'].values()):.1f} / {r['warm_us']:.1f}"
    return cell


def _prefetch_gains(d: dict) -> dict:
    """us each op of prefetch-h100.json gains prefetched over cold, and "moe": one token's up and down."""
    out = {r["op"]: r["cold_us"] - min(r["prefetched_us"].values()) for r in d["rows"]}
    m = d["moe"]
    out["moe"] = sum(m["cold"][k] - m["prefetched_up_and_down"][k] for k in ("up_us", "down_us"))
    return out


def _prefetch_step_bound(d: dict) -> float:
    """The half model's step (12 Mamba layers, 11 MoE, 3 attention) summed over its cold-to-prefetched gains."""
    g = _prefetch_gains(d)
    return (12 * (g["mamba.in_proj"] + g["mamba.out_proj"]) + 3 * (g["attention.qkv"] + g["attention.o_proj"])
            + 11 * g["moe"])


DECODE_ROWS = (
    ("1", "| 1 | 38.0 | 240.6 | 284.5 (1.18x) | 294.8 (1.23x) |", _decode_cells("bf16_eager", "bf16_graph", *_CKPTS)),
    ("16", "| 16 | - | 1540.4 | 2016.9 (1.31x) | 2032.6 (1.32x) |", _decode_cells("bf16_graph", *_CKPTS)),
    ("64", "| 64 | - | 3012.5 | 3477.5 (1.15x) | 3485.0 (1.16x) |", _decode_cells("bf16_graph", *_CKPTS)),
)
DECODE_ROWS_MAMBA = (
    ("1", "| 1 | 28.8 | 276.5 | 347.3 (1.26x) | 356.4 (1.29x) |", _decode_cells("bf16_eager", "bf16_graph", *_CKPTS)),
    ("16", "| 16 | - | 1970.4 | 2808.4 (1.43x) | 2893.8 (1.47x) |", _decode_cells("bf16_graph", *_CKPTS)),
    ("64", "| 64 | - | 4775.2 | 6092.5 (1.28x) | 6013.5 (1.26x) |", _decode_cells("bf16_graph", *_CKPTS)),
)
# (document, quoted text, results file, path of the value, how the text rounds it)
def _lightning_over_bf16(d: dict) -> str:
    """A batch-1 bench_decode run's `modelopt-lightning` over BF16 by tokens/s and by the decode steps alone."""
    return "{:.2f}x, the decode steps alone {:.2f}x".format(
        d["speedup_over_bf16_graph"]["modelopt-lightning_graph"],
        d["steps_tokens_per_s_modelopt-lightning_graph"] / d["steps_tokens_per_s_bf16_graph"])


def _epilogue_row(rows: list, n: int, case: str, split) -> dict:
    """bench_split_epilogue.py's row at 64 rows for weight rows n: "EPI e" split `split` ways, or "bf16"."""
    name = case if split is None else f"split {split}, {case}"
    (row,) = [r for r in rows if (r["N"], r["M"], r["case"]) == (n, 64, name)]
    return row


def _epilogue_part(rows: list, n: int, split: int, more: str, less: str) -> float:
    """What an epilogue part costs, warm us: the time with it (`more`) less the time without (`less`)."""
    return _epilogue_row(rows, n, more, split)["us_warm"] - _epilogue_row(rows, n, less, split)["us_warm"]


def _rows_ratio(n: int, kernel: str, state: str, lo: int = 1, hi: int = 64):
    """bench_packed.py --rows: the span of bf16's time over `kernel`'s at lo-hi rows on weight rows n."""
    def span(rows):
        ms = sorted({r["M"] for r in rows if r["N"] == n and lo <= r["M"] <= hi})
        return _span([_rows_cell(rows, n, m, "bf16")[f"ms_{state}"] / _rows_cell(rows, n, m, kernel)[f"ms_{state}"]
                      for m in ms], 2)
    return span


def _rows_ms(rows: list) -> list:
    """The row counts a bench_packed.py --rows file timed, in order."""
    return sorted({r["M"] for r in rows})


def _rows_cell(rows: list, n: int, m: int, kernel: str) -> dict:
    """bench_packed.py --rows's row of one kernel ("bf16", "w4a16", "packed", "dispatch") at m rows."""
    (row,) = [r for r in rows if (r["N"], r["M"], r["kernel"]) == (n, m, kernel)]
    return row


def _below_one(rows: list, n: int) -> str:
    """bench_packed.py --rows: the row counts at which `packed_linear` is slower than bf16 warm on
    weight rows n, as "a, b and c"."""
    ms = [str(m) for m in _rows_ms(rows)
          if _rows_cell(rows, n, m, "bf16")["ms_warm"] < _rows_cell(rows, n, m, "dispatch")["ms_warm"]]
    return ", ".join(ms[:-1]) + " and " + ms[-1]


def _stages_more(rows: list, cfg: dict) -> list:
    """packed-cluster-stages-h100.json: how much longer, us, packed_cluster's WG 4 CL 2 launch with
    cfg takes than with DB 1 and 3 buffers, warm and cold, at every shape and row count it was timed."""
    out = []
    for r in rows:
        if r["kernel"] == "cluster" and all(r["launch"][k] == v for k, v in cfg.items()):
            (base,) = [b for b in rows if (b["N"], b["M"], b["kernel"]) == (r["N"], r["M"], "cluster")
                       and (b["launch"]["DB"], b["launch"]["STAGES"]) == (1, 3)]
            out += [(r[f"ms_{st}"] - base[f"ms_{st}"]) * 1e3 for st in ("warm", "cold")]
    return out

def _cluster_cell(rows: list, n: int, m: int, kernel: str = "cluster", launch: dict | None = None,
                  variant: str | None = None) -> dict:
    """bench_packed.py --cluster's row of one kernel at m rows: "cluster" at the launch whose keys
    include `launch` (with no variant) or at `variant`; "bf16" or "dispatch"."""
    (row,) = [r for r in rows if (r["N"], r["M"], r["kernel"], r.get("variant")) == (n, m, kernel, variant)
              and (launch is None or all(r["launch"].get(k) == v for k, v in launch.items()))]
    return row


CLUSTER_DEFAULT = {"WG": 4, "CL": 2, "STAGES": 3}  # packed_cluster's default launch on Nano's shapes (132 SMs)


def _crow(rows: list, n: int, m: int, wg: int | None = None, pdl: int | None = None) -> dict:
    """bench_packed.py --cluster-rows: packed_cluster at m rows on weight rows n with CL 2, DB 1, STAGES
    3, the wgmma's N the rows rounded up to 8, `wg` shares of K and `pdl` (None: the defaults, WG 4 up
    to 32 rows, else 2, and PDL 1); the last such row (at 16 and 32 rows two launches coincide)."""
    wg = (4 if m <= 32 else 2) if wg is None else wg
    want = {"CL": 2, "DB": 1, "STAGES": 3, "BN": -(-m // 8) * 8, "WG": wg, "PDL": 1 if pdl is None else pdl}
    return [r for r in rows if (r["N"], r["M"], r["kernel"]) == (n, m, "cluster")
            and all(r["launch"][k] == v for k, v in want.items())][-1]


def _crows_ratio(rows: list, n: int, state: str, over: str = "bf16") -> str:
    """bench_packed.py --cluster-rows: the span, over its row counts, of `over`'s time ("bf16" or
    "dispatch") over packed_cluster's defaults' on weight rows n."""
    return _span([_rows_cell(rows, n, m, over)[f"ms_{state}"] / _crow(rows, n, m)[f"ms_{state}"]
                  for m in _rows_ms(rows)], 2)


def _crows_delta(rows: list, state: str, ms, a: dict, b: dict) -> list:
    """bench_packed.py --cluster-rows: us, launch a's time less launch b's (keys of `_crow`), over
    both Nano shapes at the row counts ms."""
    return [(_crow(rows, n, m, **a)[f"ms_{state}"] - _crow(rows, n, m, **b)[f"ms_{state}"]) * 1e3
            for n in (3712, 2688) for m in ms]


def _us(row: dict) -> str:
    return "{:.2f} / {:.2f}".format(row["ms_warm"] * 1e3, row["ms_cold"] * 1e3)


def _decode_speedup(label: str, batch: str):
    return lambda d: f"{d['batches'][batch]['speedup_over_bf16_graph'][label]:.2f}"


# packed_linear with packed_cluster's defaults of 2026-12-07, at 1-12 rows and at 16-64 (two processes of one call)
PDL_ROWS = ("packed-gemm-rows-pdl-few-h100.json", "packed-gemm-rows-pdl-h100.json")

WS_DEFAULT = {"BLOCK_M": 32, "P": 4}  # packed_ws's default launch at 64 rows, as bench_packed.py --ws names it


def _ws_row(rows: list, n: int, m: int, kernel: str, cfg: dict | None = None) -> dict:
    """bench_packed.py --ws's row for weight rows n, m activation rows, a kernel ("bf16", "packed",
    or "ws" with its launch keys `cfg`)."""
    (row,) = [r for r in rows if (r["N"], r["M"], r["kernel"]) == (n, m, kernel) and r.get("cfg") == cfg]
    return row


def _chain_fit(fits: list, m: int, split: int, state: str) -> dict:
    """bench_packed.py --chain's line fit for the launch table's shape at m rows."""
    (fit,) = [f for f in fits if (f["M"], f["variant"], f["SPLIT"], f["state"]) == (m, "table", split, state)]
    return fit


def _steps_over_bf16(d: dict, label: str) -> float:
    return d[f"steps_tokens_per_s_{label}_graph"] / d["steps_tokens_per_s_bf16_graph"]


# How the README quotes a batch-1 bench_decode run of both recipes: BF16's and the default recipe's
# tokens/s, `modelopt-lightning`'s, and the decode steps' alone.
_B1_CELLS = (
    lambda d: "BF16 {:.1f}, the default recipe {:.1f} ({:.2f}x)".format(
        d["tokens_per_s_bf16_graph"], d["tokens_per_s_nemotron-h-w4a16-4o6_graph"],
        d["speedup_over_bf16_graph"]["nemotron-h-w4a16-4o6_graph"]),
    lambda d: "{:.1f} tokens/s ({:.2f}x)".format(d["tokens_per_s_modelopt-lightning_graph"],
                                                d["speedup_over_bf16_graph"]["modelopt-lightning_graph"]),
    lambda d: "alone {:.1f}, {:.1f} ({:.2f}x) and {:.1f} ({:.2f}x)".format(
        d["steps_tokens_per_s_bf16_graph"], d["steps_tokens_per_s_nemotron-h-w4a16-4o6_graph"],
        _steps_over_bf16(d, "nemotron-h-w4a16-4o6"), d["steps_tokens_per_s_modelopt-lightning_graph"],
        _steps_over_bf16(d, "modelopt-lightning")),
)


_MAMBA_AB = ("decode-b1-mamba-plain-h200.json", "decode-b1-mamba-pdl-h200.json", "decode-b1-mamba-pdl-rerun-h200.json",
             "decode-b1-mamba-plain-rerun-h200.json")
FIGURES = [
    # README: calibration, ModelOpt parity, verify
    (README, "the calibration pass costs **1.014x** a plain forward", "calibration-overhead-h200.json",
     ("recipes", "nemotron-h-w4a16-4o6", "ratio"), _f(3)),
    (README, "and 1.021x for W4A4 on an H200", "calibration-overhead-h200.json", ("recipes", "nemotron-h-nvfp4-w4a4", "ratio"), _f(3)),
    (README, "| tensors (names, dtypes, shapes, bytes) | 809 / 875 |", "modelopt-mse-parity-h200.json", ("totals", "tensors_identical"), str),
    (README, "| tensors (names, dtypes, shapes, bytes) | 809 / 875 |", "modelopt-mse-parity-h200.json", ("totals", "tensors"), str),
    (README, "| NVFP4 4/6 blocks with the same choice | 622,405 / 622,592 (187 differ, 3.0e-4) |", "modelopt-mse-parity-h200.json",
     ("totals", "blocks_choice_differs"), str),
    (README, "| NVFP4 4/6 blocks with the same choice | 622,405 / 622,592 (187 differ, 3.0e-4) |", "modelopt-mse-parity-h200.json",
     ("totals", "fraction_blocks_differ"), lambda v: f"{v:.1e}".replace("e-04", "e-4")),
    (README, "In 164 blocks that kernel rounds", "modelopt-mse-parity-h200.json", ("classes", "fake_quant_scale_code_differs"), str),
    (README, "in 23 its step is off in the last bits", "modelopt-mse-parity-h200.json", ("classes", "fake_quant_step_last_bits"), str),
    (README, "the closer one in 174 of the 187 blocks and an exact tie in 13", "modelopt-mse-parity-h200.json",
     ("totals", "closer_in_fp64", "fp4kit_closer"), str),
    (README, "the closer one in 174 of the 187 blocks and an exact tie in 13", "modelopt-mse-parity-h200.json",
     ("totals", "closer_in_fp64", "exact_tie"), str),
    (README, "7370 / 8729 tensors identical", "modelopt-mse-parity-half-h200.json", ("totals", "tensors_identical"), str),
    (README, "7370 / 8729 tensors identical", "modelopt-mse-parity-half-h200.json", ("totals", "tensors"), str),
    (README, "ModelOpt's 913,790,976 / 913,790,976 block decisions", "modelopt-mse-parity-half-h200.json", ("totals", "modelopt_decision_reproduced"),
     lambda v: " / ".join(f"{int(x):,}" for x in v.split("/"))),
    (README, "214,495 choices differ (2.3e-4)", "modelopt-mse-parity-half-h200.json", ("totals", "blocks_choice_differs"), lambda v: f"{v:,}"),
    (README, "214,495 choices differ (2.3e-4)", "modelopt-mse-parity-half-h200.json", ("totals", "fraction_blocks_differ"), lambda v: f"{v:.1e}".replace("e-04", "e-4")),
    (README, "and no other NVFP4 byte differs", "modelopt-mse-parity-half-h200.json", ("totals", "blocks_bytes_differ_same_choice"), lambda v: "no other" if v == 0 else str(v)),
    (README, "in 672 of the 2816 routed-expert and 4 of the 22 shared-expert weights", "modelopt-mse-parity-half-h200.json",
     ("nvfp4_modules",), lambda v: " and ".join(
         f"{sum(1 for m in v if m['role'] == r and m['blocks_bytes_differ'])} of the {sum(1 for m in v if m['role'] == r)} {r.replace('_', '-')[:-1]}"
         for r in ("routed_experts", "shared_experts"))),
    (README, "203,445 scale-code", "modelopt-mse-parity-half-h200.json", ("classes", "fake_quant_scale_code_differs"), lambda v: f"{v:,}"),
    (README, "11,041 last-bits step", "modelopt-mse-parity-half-h200.json", ("classes", "fake_quant_step_last_bits"), lambda v: f"{v:,}"),
    (README, "and 9 where the fake quant's Triton division", "modelopt-mse-parity-half-h200.json", ("classes", "fake_quant_rounding_differs"), str),
    (README, "closer in 207,734, an exact tie in 6,356, and farther in 405", "modelopt-mse-parity-half-h200.json", ("totals", "closer_in_fp64", "fp4kit_closer"), lambda v: f"{v:,}"),
    (README, "closer in 207,734, an exact tie in 6,356, and farther in 405", "modelopt-mse-parity-half-h200.json", ("totals", "closer_in_fp64", "exact_tie"), lambda v: f"{v:,}"),
    (README, "closer in 207,734, an exact tie in 6,356, and farther in 405", "modelopt-mse-parity-half-h200.json", ("totals", "closer_in_fp64", "modelopt_closer"), str),
    (README, "The FP8 Mamba weights are 24 / 24 identical", "modelopt-mse-parity-half-h200.json", ("totals", "fp8_weights_identical"), str),
    (README, "they are 7 / 7 identical", "modelopt-mse-parity-half-h200.json", ("activation_scale_control",), lambda v: f"{v['identical']} / {v['tensors']}"),
    (README, "221 s on an H200", "modelopt-mse-parity-half-h200.json", ("total_s",), _f(0)),
    (README, "882/882 checks hold", "verify-tiny-nemotron-h-gpu.json", ("checks",), lambda v: f"{sum(c['ok'] for c in v)}/{len(v)}"),
    # README: mutation testing
    (README, "(5,858 mutants)", "mutation.json", ("groups", "all", "total"), lambda v: f"({v:,} mutants)"),
    (README, "except 128 that no input can tell", "mutation.json", ("groups", "all", "equivalent"), str),
    (README, "and 26 that only a CUDA device can", "mutation.json", ("groups", "all", "cuda_only"), str),
    # README: engines
    (README, "| Nemotron-H `nemotron-h-nvfp4-w4a4` | 1137, 0, 0 | 1137, 0, 0 | PASS |", "engines.json",
     ("results", "sglang", "ckpts-now/nh-nemotron-h-nvfp4-w4a4", "written"), str),
    (README, "vLLM keeps `k_scale` / `v_scale` as bf16 (0.0090681 becomes 0.0090942)", "engines.json",
     ("results", "vllm", "ckpts-now/nh-modelopt-lightning", "rounded", "backbone.layers.3.mixer.k_proj.k_scale", 0, "disk"), _f(7)),
    (README, "vLLM keeps `k_scale` / `v_scale` as bf16 (0.0090681 becomes 0.0090942)", "engines.json",
     ("results", "vllm", "ckpts-now/nh-modelopt-lightning", "rounded", "backbone.layers.3.mixer.k_proj.k_scale", 0, "stored"), _f(7)),
    # README: decode
    *[(README, row, "decode-graph-h200.json", ("batches", batch, *key), fmt)
      for batch, row, keys in DECODE_ROWS for key, fmt in keys],
    (README, "The weights take 10.06 GB of GPU memory under the default recipe against 31.07 GB in BF16",
     "decode-graph-h200.json", ("weight_memory_bytes", "nemotron-h-w4a16-4o6"), _f(2, 1e-9)),
    (README, "The weights take 10.06 GB of GPU memory under the default recipe against 31.07 GB in BF16",
     "decode-graph-h200.json", ("weight_memory_bytes", "bf16"), _f(2, 1e-9)),
    (README, "(0.32x; allocated bytes, measured)", "decode-graph-h200.json", ("weight_memory_over_bf16", "nemotron-h-w4a16-4o6"), _f(2)),
    (README, "decodes 7.5x faster than\neager BF16", "decode-graph-h200.json",
     ("batches", "1", "speedup_over_bf16_eager", "nemotron-h-w4a16-4o6_graph"), _f(1)),
    (README, "90.3 us of host time against 26.3 us for a torch matmul", "decode-graph-h200.json",
     ("eager_launch_host_us", "w4a16_host_us_per_call"), _f(1)),
    (README, "90.3 us of host time against 26.3 us for a torch matmul", "decode-graph-h200.json",
     ("eager_launch_host_us", "bf16_host_us_per_call"), _f(1)),
    (README, "part at step 122 of 256 at batch 1", "decode-graph-h200.json", ("batches", "1", "agree_bf16_eager", "row0_agree_prefix"), str),
    (README, "Triton launches at 48-145 us of host time against 16-31 us", "kernels-sweeps-mma-h200.json",
     ("host_overhead", "w4a16_host_us_per_call"), _f(0)),
    (README, "Triton launches at 48-145 us of host time against 16-31 us", "kernels-sweeps-matrix-unit-h200.json",
     ("host_overhead", "w4a16_host_us_per_call"), _f(0)),
    (README, "Triton launches at 48-145 us of host time against 16-31 us", "kernels-sweeps-mma-h200.json",
     ("host_overhead", "bf16_host_us_per_call"), _f(0)),
    (README, "Triton launches at 48-145 us of host time against 16-31 us", "kernels-sweeps-matrix-unit-h200.json",
     ("host_overhead", "bf16_host_us_per_call"), _f(0)),
    (README, "96.6 against 27.4 us in kernels-h200.json", KERNELS, ("host_overhead", "w4a16_host_us_per_call"), _f(1)),
    (README, "96.6 against 27.4 us in kernels-h200.json", KERNELS, ("host_overhead", "bf16_host_us_per_call"), _f(1)),
    (README, "the kernels are 1.6-2.5x faster than BF16 at one row", KERNELS, ("gemm", {**NANO[1], "M": 1}, "speedup_vs_bf16"), _f(1)),
    (README, "the kernels are 1.6-2.5x faster than BF16 at one row", KERNELS, ("gemm", {"N": 8192, "K": 8192, "M": 1}, "speedup_vs_bf16"), _f(1)),
    (README, "2.7-4.7x for the experts up to 8 tokens", KERNELS, ("moe", {"tokens": 8}, "speedup_vs_bf16"), _f(1)),
    (README, "2.7-4.7x for the experts up to 8 tokens", KERNELS, ("moe", {"tokens": 1}, "speedup_vs_bf16"), _f(1)),
    # README: recipe comparison (the table's cells as compare.md writes them)
    *[(README, row, "recipe-comparison/compare.json", ("rows", i, key), fmt)
      for i, row in enumerate(RECIPE_ROWS)
      for key, fmt in (("kl_mean", lambda v: f"| {v:.4g} |"), ("kl_p99", lambda v: f"| {v:.4g} |"),
                       ("top1_agreement", lambda v: f"| {v:.2%} |"), ("ppl", lambda v: f"| {v:.3f} |"),
                       ("weight_sqnr_db_mean", lambda v: "| - |" if v is None else f"| {v:.2f} |"),
                       ("frac4", lambda v: "| - |" if v is None else f"| {v:.1%} |"))],
    (README, "Four-Over-Six lowers the mean KL by 5.0 % against the plain rule", "recipe-comparison/compare.json", ("rows",),
     lambda rows: f"{1 - rows[1]['kl_mean'] / rows[0]['kl_mean']:.1%}".replace("%", " %")),
    # README: the kernel table
    (README, "one-launch stack kernel 2.30 TB/s plain, 1.51 TB/s 4/6", KERNELS, ("quantize", "expert_stack_tbps_kernels_plain"), _f(2)),
    (README, "one-launch stack kernel 2.30 TB/s plain, 1.51 TB/s 4/6", KERNELS, ("quantize", "expert_stack_tbps_kernels_4o6"), _f(2)),
    (README, "the whole eager call 1.74 plain, 1.12 4/6", KERNELS, ("quantize", "expert_stack_tbps_plain"), _f(2)),
    (README, "the whole eager call 1.74 plain, 1.12 4/6", KERNELS, ("quantize", "expert_stack_tbps"), _f(2)),
    (README, "1.53x on the kernels, 1.56x on the eager call", KERNELS, ("quantize", "ratio_4o6_to_plain_kernels"), _f(2)),
    (README, "1.53x on the kernels, 1.56x on the eager call", KERNELS, ("quantize", "ratio_4o6_to_plain"), _f(2)),
    (README, "| 302x on one Nano MoE layer |", KERNELS, ("quantize", "speedup_vs_modelopt"), _f(0)),
    (README, "2.51x bf16 on 8192x8192, 2.48x on 28672x8192", KERNELS, ("gemm", {"N": 8192, "K": 8192, "M": 1}, "speedup_vs_bf16_best"), _f(2)),
    (README, "2.51x bf16 on 8192x8192, 2.48x on 28672x8192", KERNELS, ("gemm", {"N": 28672, "K": 8192, "M": 1}, "speedup_vs_bf16_best"), _f(2)),
    (README, "0.69x (3712x2688), 0.84x (2688x3712)", KERNELS, ("gemm", {**NANO[0], "M": 64}, "speedup_vs_bf16_best"), _f(2)),
    (README, "0.69x (3712x2688), 0.84x (2688x3712)", KERNELS, ("gemm", {**NANO[1], "M": 64}, "speedup_vs_bf16_best"), _f(2)),
    (README, "4.67x at 1 token, 2.70x at 8, 2.85x at 64", KERNELS, ("moe", {"tokens": 1}, "speedup_vs_bf16"), _f(2)),
    (README, "4.67x at 1 token, 2.70x at 8, 2.85x at 64", KERNELS, ("moe", {"tokens": 8}, "speedup_vs_bf16"), _f(2)),
    (README, "4.67x at 1 token, 2.70x at 8, 2.85x at 64", KERNELS, ("moe", {"tokens": 64}, "speedup_vs_bf16"), _f(2)),
    (README, "measured (kernels-h200.json, 2026-12-03)", KERNELS, ("date",), lambda v: v[:10]),
    (README, "(host time per W4A16 call 96.6 against 82.7 us)", KERNELS, ("host_overhead", "w4a16_host_us_per_call"), _f(1)),
    # README: the embedded model
    (README, "held-out perplexity **64.9** on four unseen plays", "tiny-model.json", ("heldout", "perplexity"), _f(1)),
    (README, "against 580.5 for an add-one unigram model", "tiny-model.json", ("heldout", "unigram_perplexity"), _f(1)),
    (README, "Trained in 219 s", "tiny-model.json", ("training", "train_seconds"), _f(0)),
    (README, "relu^2, 13.2 M parameters", "tiny-model.json", ("model", "parameters"), _f(1, 1e-6)),
    (README, "Loads in 2.2 s on a 2-core CPU; a 512-token forward takes 0.08 s", "tiny-model.json", ("cpu", "load_s"), _f(1)),
    (README, "Loads in 2.2 s on a 2-core CPU; a 512-token forward takes 0.08 s", "tiny-model.json", ("cpu", "forward_s_median"), _f(2)),
    (README, "ROMEO.\nI am not in the world.\n\n[Exit.]\n\n[Enter SILVIA, and SILVIA, and SPEED.]\n", "tiny-model.json",
     ("cpu", "sample", "text"), lambda v: _flat("\n".join(v.splitlines()[:6]))),
    # README: the headline job
    (README, "| plain BF16 forward (the floor) | 1.354 s per 32K sample | 22.6 min |", "dry-run-h200.json",
     ("library", "plain_forward_per_sample_s"), _f(3)),
    (README, "| plain BF16 forward (the floor) | 1.354 s per 32K sample | 22.6 min |", "dry-run-h200.json",
     ("library", "projected_1000x32k", "plain_forward_s"), _f(1, 1 / 60)),
    (README, "| quantize (61.4 GB of BF16 weights) | 0.069 s (0.89 TB/s); its NVFP4 kernels alone 0.056 s |", "dry-run-h200.json",
     ("library", "quantize_s"), _f(3)),
    (README, "| quantize (61.4 GB of BF16 weights) | 0.069 s (0.89 TB/s); its NVFP4 kernels alone 0.056 s |", "dry-run-h200.json",
     ("library", "quantize_tb_per_s"), _f(2)),
    (README, "| quantize (61.4 GB of BF16 weights) | 0.069 s (0.89 TB/s); its NVFP4 kernels alone 0.056 s |", "dry-run-h200.json",
     ("library", "bare_quantize_with_terms_kernels_s"), _f(3)),
    (README, "| calibration forward with the observers | 1.380 s per sample, 23,700 tokens/s (1.019x plain) | 23.0 min |",
     "dry-run-h200.json", ("library", "calibrate_steady_per_sample_s"), _f(3)),
    (README, "| calibration forward with the observers | 1.380 s per sample, 23,700 tokens/s (1.019x plain) | 23.0 min |",
     "dry-run-h200.json", ("library", "calibrate_over_plain"), _f(3)),
    (README, "| calibration forward with the observers | 1.380 s per sample, 23,700 tokens/s (1.019x plain) | 23.0 min |",
     "dry-run-h200.json", ("library", "projected_1000x32k", "calibrate_s"), _f(1, 1 / 60)),
    (README, "| export (19.4 GB) | 7.0 s (2.8 GB/s) | 7.0 s |", "dry-run-h200.json", ("library", "export_s"), _f(1)),
    (README, "| export (19.4 GB) | 7.0 s (2.8 GB/s) | 7.0 s |", "dry-run-h200.json", ("library", "export_gb_per_s"), _f(1)),
    (README, "57.0 ms of\nkernel time, 51.9 of it the expert-stack kernel", "quantize-profile-h200.json",
     ("device_kernel_s",), _f(1, 1e3)),
    (README, "57.0 ms of\nkernel time, 51.9 of it the expert-stack kernel", "quantize-profile-h200.json",
     ("top_kernels", {"name": "_stack_kernel"}, "us"), _f(1, 1e-3)),
    (README, "takes 0.019 s of host time in that profile and launches 542 kernels", "quantize-profile-h200.json",
     ("queue_host_median_s",), _f(3)),
    (README, "takes 0.019 s of host time in that profile and launches 542 kernels", "quantize-profile-h200.json",
     ("device_kernel_launches",), str),
    (README, "1,570 small torch kernels beside the\nTriton ones, 0.045 s to queue, best stage 0.066 s",
     "quantize-profile-before-host-h200.json", ("top_cpu_ops", {"op": "cudaLaunchKernel"}, "count"), lambda v: f"{v:,}"),
    (README, "1,570 small torch kernels beside the\nTriton ones, 0.045 s to queue, best stage 0.066 s",
     "quantize-profile-before-host-h200.json", ("queue_host_median_s",), _f(3)),
    (README, "1,570 small torch kernels beside the\nTriton ones, 0.045 s to queue, best stage 0.066 s",
     "quantize-profile-before-host-h200.json", ("stage_best_s",), _f(3)),
    (README, "The stage's best wall is 0.059 s (1.04 TB/s)", "quantize-profile-h200.json", ("stage_best_s",), _f(3)),
    (README, "The stage's best wall is 0.059 s (1.04 TB/s)", "quantize-profile-h200.json", ("stage_tb_per_s",), _f(2)),
    (README, "the first stage in a process takes 0.072 s", "quantize-profile-h200.json", ("first_stage_s",), _f(3)),
    (README, "the whole 8-sample processes take 31.7 s against 165.4 s (5.22x)", "vs-modelopt-h200.json",
     ("half@8x32k+mamba-kernels+fresh-triton-cache+compiled-bytecode", "fp4kit", "wall_s"), _f(1)),
    (README, "the whole 8-sample processes take 31.7 s against 165.4 s (5.22x)", "vs-modelopt-h200.json",
     ("half@8x32k+mamba-kernels+fresh-triton-cache+compiled-bytecode", "modelopt", "wall_s"), _f(1)),
    (README, "the whole 8-sample processes take 31.7 s against 165.4 s (5.22x)", "vs-modelopt-h200.json",
     ("half@8x32k+mamba-kernels+fresh-triton-cache+compiled-bytecode", "speedup_whole_process"), _f(2)),
    (README, "projects 1000 samples to 6.4 min\nagainst 42.8 min, 6.6x", "vs-modelopt-h200.json",
     ("half@8x32k+mamba-kernels+fresh-triton-cache+compiled-bytecode", "projected_1000_samples", "fp4kit_s"), _f(1, 1 / 60)),
    (README, "projects 1000 samples to 6.4 min\nagainst 42.8 min, 6.6x", "vs-modelopt-h200.json",
     ("half@8x32k+mamba-kernels+fresh-triton-cache+compiled-bytecode", "projected_1000_samples", "modelopt_s"), _f(1, 1 / 60)),
    (README, "projects 1000 samples to 6.4 min\nagainst 42.8 min, 6.6x", "vs-modelopt-h200.json",
     ("half@8x32k+mamba-kernels+fresh-triton-cache+compiled-bytecode", "projected_1000_samples", "speedup"), _f(1)),
    (README, "gave BF16 412.9, the default recipe\n642.5 (1.56x) and `modelopt-lightning` 716.2 tokens/s (1.73x)",
     "decode-graph-compiled-b1-h200.json", ("batches", "1", "tokens_per_s_bf16_graph"), _f(1)),
    (README, "gave BF16 412.9, the default recipe\n642.5 (1.56x) and `modelopt-lightning` 716.2 tokens/s (1.73x)",
     "decode-graph-compiled-b1-h200.json", ("batches", "1", "tokens_per_s_nemotron-h-w4a16-4o6_graph"), _f(1)),
    (README, "gave BF16 412.9, the default recipe\n642.5 (1.56x) and `modelopt-lightning` 716.2 tokens/s (1.73x)",
     "decode-graph-compiled-b1-h200.json", ("batches", "1", "tokens_per_s_modelopt-lightning_graph"), _f(1)),
    (README, "the call costs 44.0 against 26.5 us in the decode benchmark's process",
     "decode-graph-compiled-b1-weight-operands-h200.json", ("eager_launch_host_us", "w4a16_host_us_per_call"), _f(1)),
    (README, "the call costs 44.0 against 26.5 us in the decode benchmark's process",
     "decode-graph-compiled-b1-weight-operands-h200.json", ("eager_launch_host_us", "bf16_host_us_per_call"), _f(1)),
    *[(README, "the call now costs 15.8 us against 17.5 for a torch matmul", "kernels-host-h200.json",
       ("host_overhead", key), _f(1)) for key in ("w4a16_host_us_per_call", "bf16_host_us_per_call")],
    *[(README, "the runs span\n14.2-21.3 us", "kernels-host-h200.json", ("host_overhead_runs", run, "w4a16_host_us_per_call"),
       _f(1)) for run in (2, 4)],
    *[(README, "gave 18.7 against\n16.5 us", "kernels-host-before-h200.json", ("host_overhead", key), _f(1))
      for key in ("w4a16_host_us_per_call", "bf16_host_us_per_call")],
    *[(README, "the kept launch alone costs 8.5 us with the tensors passed by\naddress and 9.9 with the tensors "
       "themselves, the output's allocation 2.5 us", "kernels-host-h200.json", ("host_overhead", key), _f(1))
      for key in ("launch_kept_addresses_host_us_per_call", "launch_kept_tensors_host_us_per_call",
                  "output_alloc_host_us_per_call")],
    *[(README, "420.2, 649.7 (1.55x) and 695.9 (1.66x)", "decode-graph-compiled-b1-weight-operands-h200.json",
       ("batches", "1", *key), fmt) for key, fmt in _decode_cells("bf16_graph", *_CKPTS)],
    (README, "(56.7 against 25.3 us on the machine of decode-graph-compiled-b1-h200.json)",
     "decode-graph-compiled-b1-h200.json", ("eager_launch_host_us", "w4a16_host_us_per_call"), _f(1)),
    (README, "(56.7 against 25.3 us on the machine of decode-graph-compiled-b1-h200.json)",
     "decode-graph-compiled-b1-h200.json", ("eager_launch_host_us", "bf16_host_us_per_call"), _f(1)),
    (README, "| end to end | | **23.4 min, 1.037x the plain forward** |", "dry-run-h200.json",
     ("library", "projected_1000x32k", "end_to_end_s"), _f(1, 1 / 60)),
    (README, "| end to end | | **23.4 min, 1.037x the plain forward** |", "dry-run-h200.json",
     ("library", "projected_1000x32k", "ratio_to_plain"), _f(3)),
    (README, "Peak GPU memory 75.7 GiB", "dry-run-h200.json", ("library", "peak_gpu_gib"), _f(1)),
    (README, "takes 38.0 s as a whole process", "dry-run-h200.json", ("cli", "wall_s"), _f(1)),
    (README, "takes 155.0 s against fp4kit's 33.8 s, 4.6x longer", "vs-modelopt-h200.json", ("half@8x32k", "modelopt", "wall_s"), _f(1)),
    (README, "takes 155.0 s against fp4kit's 33.8 s, 4.6x longer", "vs-modelopt-h200.json", ("half@8x32k", "fp4kit", "wall_s"), _f(1)),
    (README, "takes 155.0 s against fp4kit's 33.8 s, 4.6x longer", "vs-modelopt-h200.json", ("half@8x32k", "speedup_whole_process"), _f(1)),
    (README, "ModelOpt takes 47.0 min\nagainst fp4kit's 14.0 min, 3.4x", "vs-modelopt-h200.json",
     ("half@8x32k", "projected_1000_samples", "modelopt_s"), _f(1, 1 / 60)),
    (README, "ModelOpt takes 47.0 min\nagainst fp4kit's 14.0 min, 3.4x", "vs-modelopt-h200.json",
     ("half@8x32k", "projected_1000_samples", "fp4kit_s"), _f(1, 1 / 60)),
    (README, "ModelOpt takes 47.0 min\nagainst fp4kit's 14.0 min, 3.4x", "vs-modelopt-h200.json",
     ("half@8x32k", "projected_1000_samples", "speedup"), _f(1)),
    (README, "ModelOpt takes 104.3 s against fp4kit's 23.1 s (4.5x; 7.2x projected to 1000 samples)", "vs-modelopt-h200.json",
     ("slice7@32x4k", "modelopt", "wall_s"), _f(1)),
    (README, "ModelOpt takes 104.3 s against fp4kit's 23.1 s (4.5x; 7.2x projected to 1000 samples)", "vs-modelopt-h200.json",
     ("slice7@32x4k", "fp4kit", "wall_s"), _f(1)),
    (README, "ModelOpt takes 104.3 s against fp4kit's 23.1 s (4.5x; 7.2x projected to 1000 samples)", "vs-modelopt-h200.json",
     ("slice7@32x4k", "speedup_whole_process"), _f(1)),
    (README, "ModelOpt takes 104.3 s against fp4kit's 23.1 s (4.5x; 7.2x projected to 1000 samples)", "vs-modelopt-h200.json",
     ("slice7@32x4k", "projected_1000_samples", "speedup"), _f(1)),
    (README, "| plain BF16 forward per 32K sample | 1.354 s | 0.722 s |", "dry-run-h200.json", ("library", "plain_forward_per_sample_s"), _f(3)),
    (README, "| plain BF16 forward per 32K sample | 1.354 s | 0.722 s |", "dry-run-h200.json", ("library-mamba-kernels", "plain_forward_per_sample_s"), _f(3)),
    (README, "| calibration forward per sample | 1.380 s (1.019x) | 0.735 s (1.018x) |", "dry-run-h200.json",
     ("library-mamba-kernels", "calibrate_steady_per_sample_s"), _f(3)),
    (README, "| calibration forward per sample | 1.380 s (1.019x) | 0.735 s (1.018x) |", "dry-run-h200.json",
     ("library-mamba-kernels", "calibrate_over_plain"), _f(3)),
    (README, "| 1000 x 32K end to end | 23.4 min | **12.6 min (1.049x the plain forward)** |", "dry-run-h200.json",
     ("library-mamba-kernels", "projected_1000x32k", "end_to_end_s"), _f(1, 1 / 60)),
    (README, "| 1000 x 32K end to end | 23.4 min | **12.6 min (1.049x the plain forward)** |", "dry-run-h200.json",
     ("library-mamba-kernels", "projected_1000x32k", "ratio_to_plain"), _f(3)),
    (BENCH, "takes 0.722 s per 32K sample (1.88x faster than plain torch's 1.354 s), calibration 0.735 s", "dry-run-h200.json",
     ("library-mamba-kernels", "plain_forward_per_sample_s"), _f(3)),
    (BENCH, "5.1 s (3.8 GB/s), the same bytes", "dry-run-h200.json", ("library-mamba-kernels", "export_gb_per_s"), _f(1)),
    *[(README, row, "decode-graph-mamba-kernels-h200.json", ("batches", batch, *key), fmt)
      for batch, row, keys in DECODE_ROWS_MAMBA for key, fmt in keys],
    # benchmarks/README: quantize
    (BENCH, "| one launch, `_stack_kernel` (the default for these stacks) | 2.30 TB/s, 0.70-0.72 ms | 1.51 TB/s, 1.09 ms |",
     KERNELS, ("quantize", "rows", 0, "ms_kernels_6"), _f(2, 1)),
    (BENCH, "| one launch, `_stack_kernel` (the default for these stacks) | 2.30 TB/s, 0.70-0.72 ms | 1.51 TB/s, 1.09 ms |",
     KERNELS, ("quantize", "rows", 1, "ms_kernels_6"), _f(2, 1)),
    (BENCH, "| one launch, `_stack_kernel` (the default for these stacks) | 2.30 TB/s, 0.70-0.72 ms | 1.51 TB/s, 1.09 ms |",
     KERNELS, ("quantize", "rows", 0, "ms_kernels_4o6"), _f(2)),
    (BENCH, "| two launches: max pass, then `_quantize_kernel` | 1.79 TB/s, 0.91-0.92 ms | 1.18 TB/s, 1.38 ms |",
     KERNELS, ("quantize", "expert_stack_tbps_two_launches_plain"), _f(2)),
    (BENCH, "| two launches: max pass, then `_quantize_kernel` | 1.79 TB/s, 0.91-0.92 ms | 1.18 TB/s, 1.38 ms |",
     KERNELS, ("quantize", "expert_stack_tbps_two_launches_4o6"), _f(2)),
    (BENCH, "| two launches: max pass, then `_quantize_kernel` | 1.79 TB/s, 0.91-0.92 ms | 1.18 TB/s, 1.38 ms |",
     KERNELS, ("quantize", "rows", 0, "ms_two_launches_4o6"), _f(2)),
    (BENCH, "| one `_quantize_kernel` launch with a given global amax | 2.25 TB/s | 1.34 TB/s |",
     KERNELS, ("quantize", "expert_stack_tbps_given_amax_plain"), _f(2)),
    (BENCH, "| one `_quantize_kernel` launch with a given global amax | 2.25 TB/s | 1.34 TB/s |",
     KERNELS, ("quantize", "expert_stack_tbps_given_amax_4o6"), _f(2)),
    (BENCH, "the device-to-device copy ceiling is 4.27 TB/s", KERNELS, ("copy_ceiling_tbps",), _f(2)),
    (BENCH, "0.98 s for ModelOpt against 3.2 ms for fp4kit's 4/6 quantize, 302x", KERNELS,
     ("quantize", "modelopt", "modelopt", "calibration_s"), _f(2)),
    (BENCH, "0.98 s for ModelOpt against 3.2 ms for fp4kit's 4/6 quantize, 302x", KERNELS,
     ("quantize", "modelopt", "fp4kit_quantize_4o6_ms"), _f(1)),
    (BENCH, "alone: 138x in `results/modelopt-4o6-h200.json`", "modelopt-4o6-h200.json", ("speedup_vs_modelopt",), _f(0)),
    (BENCH, "the quantize kernel of then: 4.4 ms against 0.61 s", "modelopt-4o6-h200.json", ("fp4kit_quantize_4o6_ms",), _f(1)),
    (BENCH, "the quantize kernel of then: 4.4 ms against 0.61 s", "modelopt-4o6-h200.json", ("modelopt", "calibration_s"), _f(2)),
    # benchmarks/README: W4A16 GEMM
    (BENCH, "M = 1: 2.51x on 8192 x 8192 (GEMV, 13.5 us), 2.48x on 28672 x 8192 (GEMV, 43.7 us;", KERNELS,
     ("gemm", {"N": 8192, "K": 8192, "M": 1}, "ms_w4a16"), _f(1, 1e3)),
    (BENCH, "M = 1: 2.51x on 8192 x 8192 (GEMV, 13.5 us), 2.48x on 28672 x 8192 (GEMV, 43.7 us;", KERNELS,
     ("gemm", {"N": 28672, "K": 8192, "M": 1}, "ms_w4a16"), _f(1, 1e3)),
    (BENCH, "1.87x and 1.65x on the Nano shapes (GEMV), 2.21x on 131072 x 2688", KERNELS,
     ("gemm", {**NANO[0], "M": 1}, "speedup_vs_bf16"), _f(2)),
    (BENCH, "1.87x and 1.65x on the Nano shapes (GEMV), 2.21x on 131072 x 2688", KERNELS,
     ("gemm", {**NANO[1], "M": 1}, "speedup_vs_bf16"), _f(2)),
    (BENCH, "1.87x and 1.65x on the Nano shapes (GEMV), 2.21x on 131072 x 2688", KERNELS,
     ("gemm", {"N": 131072, "K": 2688, "M": 1}, "speedup_vs_bf16"), _f(2)),
    *[(BENCH, "M = 4 (mma kernel): 1.99x, 1.97x, 1.35x, 1.31x and 2.15x on the five bench shapes", KERNELS,
       ("gemm", {"N": n, "K": k, "M": 4}, "speedup_vs_bf16"), _f(2))
      for n, k in ((8192, 8192), (28672, 8192), (3712, 2688), (2688, 3712), (131072, 2688))],
    (BENCH, "0.88x and 0.94x on the Nano shapes (wgmma)", KERNELS, ("gemm", {**NANO[0], "M": 16}, "speedup_vs_bf16"), _f(2)),
    (BENCH, "0.88x and 0.94x on the Nano shapes (wgmma)", KERNELS, ("gemm", {**NANO[1], "M": 16}, "speedup_vs_bf16"), _f(2)),
    (BENCH, "takes 7.1 and 13.1 us on 8192 x 8192 against 13.1", KERNELS, ("gemv_limits", 0, "ms_loads_only"), _f(1, 1e3)),
    (BENCH, "takes 7.1 and 13.1 us on 8192 x 8192 against 13.1", KERNELS, ("gemv_limits", 0, "ms_arithmetic_only"), _f(1, 1e3)),
    (BENCH, "takes 7.1 and 13.1 us on 8192 x 8192 against 13.1", KERNELS, ("gemv_limits", 0, "ms_loop"), _f(1, 1e3)),
    (BENCH, "(36.9 and 39.3 against 43.8 on 28672 x 8192)", KERNELS, ("gemv_limits", 1, "ms_loads_only"), _f(1, 1e3)),
    (BENCH, "(36.9 and 39.3 against 43.8 on 28672 x 8192)", KERNELS, ("gemv_limits", 1, "ms_arithmetic_only"), _f(1, 1e3)),
    (BENCH, "(36.9 and 39.3 against 43.8 on 28672 x 8192)", KERNELS, ("gemv_limits", 1, "ms_loop"), _f(1, 1e3)),
    (BENCH, "while 2.5x bf16 (33.7 us in that table) needs 13.5 in all", KERNELS, ("gemv_limits", 0, "ms_bf16"), _f(1, 1e3)),
    (BENCH, "against 43.4 for 2.5x of that table's bf16 (108.4)", KERNELS, ("gemv_limits", 1, "ms_bf16"), _f(1, 1e3)),
    # benchmarks/README: pre-packed GEMM
    (BENCH, "16 rows: 1.96x on 8192 x 8192 (17.1 us; 1.54x)", "packed-gemm-h200.json",
     ("gemm", {"N": 8192, "K": 8192, "M": 16}, "speedup_vs_bf16_packed"), _f(2)),
    (BENCH, "16 rows: 1.96x on 8192 x 8192 (17.1 us; 1.54x)", "packed-gemm-h200.json",
     ("gemm", {"N": 8192, "K": 8192, "M": 16}, "speedup_vs_bf16"), _f(2)),
    (BENCH, "1.22x and 0.69x bf16 in `results/kernels-h200.json`", KERNELS, ("gemm", {**NANO[0], "M": 16}, "speedup_vs_bf16_packed"), _f(2)),
    (BENCH, "1.22x and 0.69x bf16 in `results/kernels-h200.json`", KERNELS, ("gemm", {**NANO[0], "M": 64}, "speedup_vs_bf16_packed"), _f(2)),
    # benchmarks/README: grouped MoE
    (BENCH, "4.67x at 1 token (23.6 us on the CUDA cores; the sorted path on the register-fed matrix units took 63.0)",
     KERNELS, ("moe", {"tokens": 1}, "ms_w4a16"), _f(1, 1e3)),
    (BENCH, "4.67x at 1 token (23.6 us on the CUDA cores; the sorted path on the register-fed matrix units took 63.0)",
     KERNELS, ("moe", {"tokens": 1}, "ms_w4a16_sorted_mma_graph"), _f(1, 1e3)),
    (BENCH, "2.70x at 8 (122.0 us, register-fed units; 187.9 on wgmma)", KERNELS, ("moe", {"tokens": 8}, "ms_w4a16"), _f(1, 1e3)),
    (BENCH, "2.70x at 8 (122.0 us, register-fed units; 187.9 on wgmma)", KERNELS, ("moe", {"tokens": 8}, "ms_w4a16_sorted_graph"), _f(1, 1e3)),
    (BENCH, "2.85x at 64 (330.0 us, register-fed units; 533.4 on wgmma)", KERNELS, ("moe", {"tokens": 64}, "ms_w4a16"), _f(1, 1e3)),
    (BENCH, "1.53x at 256 (wgmma), 0.53x at 2048", KERNELS, ("moe", {"tokens": 2048}, "speedup_vs_bf16"), _f(2)),
    # benchmarks/README: pipeline
    (BENCH, "Calibration: 1.380 s per sample after the first against 1.354 s for a plain forward", "dry-run-h200.json",
     ("library", "calibrate_steady_per_sample_s"), _f(3)),
    (BENCH, "Quantize: 0.069 s for 61.4 GB of BF16 weights (0.89 TB/s;", "dry-run-h200.json", ("library", "quantize_s"), _f(3)),
    (BENCH, "Quantize: 0.069 s for 61.4 GB of BF16 weights (0.89 TB/s;", "dry-run-h200.json", ("library", "quantize_tb_per_s"), _f(2)),
    (BENCH, "of a later version of the stage: best of 5 0.059 s, 1.04 TB/s", "quantize-profile-h200.json", ("stage_best_s",), _f(3)),
    (BENCH, "of a later version of the stage: best of 5 0.059 s, 1.04 TB/s", "quantize-profile-h200.json", ("stage_tb_per_s",), _f(2)),
    (BENCH, "quantize-profile-before-host-h200.json: best of 5 0.066 s, 0.94 TB/s", "quantize-profile-before-host-h200.json",
     ("stage_best_s",), _f(3)),
    (BENCH, "quantize-profile-before-host-h200.json: best of 5 0.066 s, 0.94 TB/s", "quantize-profile-before-host-h200.json",
     ("stage_tb_per_s",), _f(2)),
    (BENCH, "take 0.052 s, and 0.056 s while summing", "dry-run-h200.json", ("library", "bare_quantize_kernels_s"), _f(3)),
    (BENCH, "take 0.052 s, and 0.056 s while summing", "dry-run-h200.json", ("library", "bare_quantize_with_terms_kernels_s"), _f(3)),
    (BENCH, "The profile: 57.0 ms of kernel time, of which the stack kernel takes 51.9 ms", "quantize-profile-h200.json",
     ("device_kernel_s",), _f(1, 1e3)),
    (BENCH, "The profile: 57.0 ms of kernel time, of which the stack kernel takes 51.9 ms", "quantize-profile-h200.json",
     ("top_kernels", {"name": "_stack_kernel"}, "us"), _f(1, 1e-3)),
    (BENCH, "542 kernels in all, and queueing all 138 weights takes 0.019 s of host\n  time", "quantize-profile-h200.json",
     ("device_kernel_launches",), str),
    (BENCH, "542 kernels in all, and queueing all 138 weights takes 0.019 s of host\n  time", "quantize-profile-h200.json",
     ("queue_host_median_s",), _f(3)),
    (BENCH, "542 kernels in all, and queueing all 138 weights takes 0.019 s of host\n  time", "quantize-profile-h200.json",
     ("weights",), str),
    (BENCH, "the read-back's two\n  segmented sums 0.70", "quantize-profile-h200.json",
     ("top_kernels", {"name": "void at::native::(anonymous namespace)::segment_reduce_forward_kernel<double, long>(at::native::ReductionType, double*, double const*, long const*, long const*,"}, "us"),
     _f(2, 1e-3)),
    (BENCH, "of which torch's `segment_reduce` takes 0.70 ms", "quantize-profile-h200.json",
     ("top_kernels", {"name": "void at::native::(anonymous namespace)::segment_reduce_forward_kernel<double, long>(at::native::ReductionType, double*, double const*, long const*, long const*,"}, "us"),
     _f(2, 1e-3)),
    (BENCH, "before-readback-h200.json: best of 5 0.068 s, 0.90 TB/s", "quantize-profile-before-readback-h200.json",
     ("stage_best_s",), _f(3)),
    (BENCH, "before-readback-h200.json: best of 5 0.068 s, 0.90 TB/s", "quantize-profile-before-readback-h200.json",
     ("stage_tb_per_s",), _f(2)),
    (BENCH, "0.045 s of host time to queue against 58.7 ms of kernels", "quantize-profile-before-host-h200.json",
     ("queue_host_median_s",), _f(3)),
    (BENCH, "0.045 s of host time to queue against 58.7 ms of kernels", "quantize-profile-before-host-h200.json",
     ("device_kernel_s",), _f(1, 1e3)),
    (BENCH, "copied the partial\n  sums to pageable host memory (1.7 ms)", "quantize-profile-before-readback-h200.json",
     ("top_kernels", {"name": "Memcpy DtoH (Device -> Pageable)"}, "us"), _f(1, 1e-3)),
    (BENCH, "the FP8 passes 1.9", "quantize-profile-h200.json", ("top_kernels", {"name": "_fp8_kernel"}, "us"), _f(1, 1e-3)),
    (BENCH, "which imports transformers and nothing else, took 7.9 s there", "vs-modelopt-h200.json",
     ("half@8x32k+mamba-kernels", "fp4kit", "stages_s", "import"), _f(1)),
    (BENCH, "counted 1,570 small torch kernels beside the Triton ones", "quantize-profile-before-host-h200.json",
     ("top_cpu_ops", {"op": "cudaLaunchKernel"}, "count"), lambda v: f"{v:,}"),
    (BENCH, "best of 5 0.156 s, 0.39 TB/s;", "quantize-profile-before-fusion-h200.json", ("stage_best_s",), _f(3)),
    (BENCH, "best of 5 0.156 s, 0.39 TB/s;", "quantize-profile-before-fusion-h200.json", ("stage_tb_per_s",), _f(2)),
    (BENCH, "re-read every weight (37.7 ms)", "quantize-profile-before-fusion-h200.json",
     ("top_kernels", {"name": "_error_kernel"}, "us"), _f(1, 1e-3)),
    (BENCH, "58 ms of the 148 ms of kernels", "quantize-profile-before-fusion-h200.json", ("device_kernel_s",), _f(0, 1e3)),
    (BENCH, "Export: 7.0 s for 19.4 GB (2.8 GB/s).", "dry-run-h200.json", ("library", "export_gb_per_s"), _f(1)),
    (BENCH, "to 30.8 min against 6.7 min, 4.6x", "vs-modelopt-h200.json",
     ("half@8x32k+mamba-kernels", "projected_1000_samples", "modelopt_s"), _f(1, 1 / 60)),
    (BENCH, "to 30.8 min against 6.7 min, 4.6x", "vs-modelopt-h200.json",
     ("half@8x32k+mamba-kernels", "projected_1000_samples", "fp4kit_s"), _f(1, 1 / 60)),
    (BENCH, "to 30.8 min against 6.7 min, 4.6x", "vs-modelopt-h200.json",
     ("half@8x32k+mamba-kernels", "projected_1000_samples", "speedup"), _f(1)),
    (BENCH, "take 1.73 s each against fp4kit's 0.35 s", "vs-modelopt-h200.json",
     ("half@8x32k+mamba-kernels", "modelopt", "stages_s", "calibration_forward_steady_s"), _f(2)),
    (BENCH, "take 1.73 s each against fp4kit's 0.35 s", "vs-modelopt-h200.json",
     ("half@8x32k+mamba-kernels", "fp4kit", "calibrate_s_per_sample"), _f(2)),
    (BENCH, "The whole 8-sample processes took 129.0 s against 53.3 s (2.4x)", "vs-modelopt-h200.json",
     ("half@8x32k+mamba-kernels", "modelopt", "wall_s"), _f(1)),
    (BENCH, "The whole 8-sample processes took 129.0 s against 53.3 s (2.4x)", "vs-modelopt-h200.json",
     ("half@8x32k+mamba-kernels", "fp4kit", "wall_s"), _f(1)),
    (BENCH, "The whole 8-sample processes took 129.0 s against 53.3 s (2.4x)", "vs-modelopt-h200.json",
     ("half@8x32k+mamba-kernels", "speedup_whole_process"), _f(1)),
    (BENCH, "the whole processes 165.4 s\nagainst 31.7 s (5.22x)", "vs-modelopt-h200.json", ("half@8x32k+mamba-kernels+fresh-triton-cache+compiled-bytecode", "modelopt", "wall_s"), _f(1)),
    (BENCH, "the whole processes 165.4 s\nagainst 31.7 s (5.22x)", "vs-modelopt-h200.json", ("half@8x32k+mamba-kernels+fresh-triton-cache+compiled-bytecode", "fp4kit", "wall_s"), _f(1)),
    (BENCH, "the whole processes 165.4 s\nagainst 31.7 s (5.22x)", "vs-modelopt-h200.json", ("half@8x32k+mamba-kernels+fresh-triton-cache+compiled-bytecode", "speedup_whole_process"), _f(2)),
    (BENCH, "42.8 against 6.4 min projected to 1000 samples (6.6x)", "vs-modelopt-h200.json", ("half@8x32k+mamba-kernels+fresh-triton-cache+compiled-bytecode", "projected_1000_samples", "modelopt_s"), _f(1, 1 / 60)),
    (BENCH, "42.8 against 6.4 min projected to 1000 samples (6.6x)", "vs-modelopt-h200.json", ("half@8x32k+mamba-kernels+fresh-triton-cache+compiled-bytecode", "projected_1000_samples", "fp4kit_s"), _f(1, 1 / 60)),
    (BENCH, "42.8 against 6.4 min projected to 1000 samples (6.6x)", "vs-modelopt-h200.json", ("half@8x32k+mamba-kernels+fresh-triton-cache+compiled-bytecode", "projected_1000_samples", "speedup"), _f(1)),
    (BENCH, "The workers ran 16.1 s beside import and load; the job waited 4.7 s", "vs-modelopt-h200.json", ("half@8x32k+mamba-kernels+fresh-triton-cache+compiled-bytecode", "fp4kit", "stages_s", "mamba compile beside load"), _f(1)),
    (BENCH, "The workers ran 16.1 s beside import and load; the job waited 4.7 s", "vs-modelopt-h200.json", ("half@8x32k+mamba-kernels+fresh-triton-cache+compiled-bytecode", "fp4kit", "stages_s", "mamba compile wait"), _f(1)),
    (BENCH, "ModelOpt's\ncalibration forward took 59.4 s, fp4kit's calibrate stage 9.9 s", "vs-modelopt-h200.json", ("half@8x32k+mamba-kernels+fresh-triton-cache+compiled-bytecode", "modelopt", "stages_s", "calibration_forward_s"), _f(1)),
    (BENCH, "ModelOpt's\ncalibration forward took 59.4 s, fp4kit's calibrate stage 9.9 s", "vs-modelopt-h200.json", ("half@8x32k+mamba-kernels+fresh-triton-cache+compiled-bytecode", "fp4kit", "stages_s", "calibrate"), _f(1)),
    (BENCH, "ModelOpt's steady rate\nhere, 2.42 s per sample", "vs-modelopt-h200.json", ("half@8x32k+mamba-kernels+fresh-triton-cache+compiled-bytecode", "modelopt", "stages_s", "calibration_forward_steady_s"), _f(2)),
    (BENCH, "fp4kit 46.5 s against ModelOpt 137.4 s, 2.95x", "vs-modelopt-h200.json", ("half@8x32k+mamba-kernels+fresh-triton-cache+compiled-bytecode+before-mamba-precompile", "fp4kit", "wall_s"), _f(1)),
    (BENCH, "fp4kit 46.5 s against ModelOpt 137.4 s, 2.95x", "vs-modelopt-h200.json", ("half@8x32k+mamba-kernels+fresh-triton-cache+compiled-bytecode+before-mamba-precompile", "modelopt", "wall_s"), _f(1)),
    (BENCH, "fp4kit 46.5 s against ModelOpt 137.4 s, 2.95x", "vs-modelopt-h200.json", ("half@8x32k+mamba-kernels+fresh-triton-cache+compiled-bytecode+before-mamba-precompile", "speedup_whole_process"), _f(2)),
    (BENCH, "fp4kit's calibrate\nstage 32.1 s, ModelOpt's calibration forward 45.6 s", "vs-modelopt-h200.json", ("half@8x32k+mamba-kernels+fresh-triton-cache+compiled-bytecode+before-mamba-precompile", "fp4kit", "stages_s", "calibrate"), _f(1)),
    (BENCH, "fp4kit's calibrate\nstage 32.1 s, ModelOpt's calibration forward 45.6 s", "vs-modelopt-h200.json", ("half@8x32k+mamba-kernels+fresh-triton-cache+compiled-bytecode+before-mamba-precompile", "modelopt", "stages_s", "calibration_forward_s"), _f(1)),
    (README, "gave 46.5 s against 137.4 s (2.95x)", "vs-modelopt-h200.json", ("half@8x32k+mamba-kernels+fresh-triton-cache+compiled-bytecode+before-mamba-precompile", "fp4kit", "wall_s"), _f(1)),
    (README, "the workers ran 16.1 s, the job waited 4.7 s for them after loading, and the calibrate\nstage took 9.9 s", "vs-modelopt-h200.json", ("half@8x32k+mamba-kernels+fresh-triton-cache+compiled-bytecode", "fp4kit", "stages_s", "calibrate"), _f(1)),
    (README, "53.3 s against 129.0 s (2.4x)", "vs-modelopt-h200.json", ("half@8x32k+mamba-kernels", "fp4kit", "wall_s"), _f(1)),
    (README, "53.3 s against 129.0 s (2.4x)", "vs-modelopt-h200.json", ("half@8x32k+mamba-kernels", "modelopt", "wall_s"), _f(1)),
    (README, "53.3 s against 129.0 s (2.4x)", "vs-modelopt-h200.json", ("half@8x32k+mamba-kernels", "speedup_whole_process"), _f(1)),
    (README, "7529.5 (1.32x) | 7524.5 (1.32x) |", "decode-graph-compiled-b64-h200.json",
     ("batches", "64", "tokens_per_s_nemotron-h-w4a16-4o6_graph"), _f(1)),
    (README, "| 64 | - | 5697.1 | 7529.5 (1.32x) | 7524.5 (1.32x) |", "decode-graph-compiled-b64-h200.json",
     ("batches", "64", "tokens_per_s_bf16_graph"), _f(1)),
    (README, "| 64 | - | 5697.1 | 7529.5 (1.32x) | 7524.5 (1.32x) |", "decode-graph-compiled-b64-h200.json",
     ("batches", "64", "tokens_per_s_modelopt-lightning_graph"), _f(1)),
    (README, "| 64 | - | 5697.1 | 7529.5 (1.32x) | 7524.5 (1.32x) |", "decode-graph-compiled-b64-h200.json",
     ("batches", "64", "speedup_over_bf16_graph", "nemotron-h-w4a16-4o6_graph"), _f(2)),
    (README, "then costs 36.0 us of host time against 17.5 us for a\ntorch matmul", "decode-graph-compiled-before-pick-h200.json",
     ("eager_launch_host_us", "w4a16_host_us_per_call"), _f(1)),
    (README, "then costs 36.0 us of host time against 17.5 us for a\ntorch matmul", "decode-graph-compiled-before-pick-h200.json",
     ("eager_launch_host_us", "bf16_host_us_per_call"), _f(1)),
    (README, "| 1 | 40.9 | 430.1 | 677.1 (1.57x) | 716.9 (1.67x) |", "decode-graph-compiled-h200.json",
     ("batches", "1", "tokens_per_s_bf16_eager"), _f(1)),
    (README, "| 1 | 40.9 | 430.1 | 677.1 (1.57x) | 716.9 (1.67x) |", "decode-graph-compiled-h200.json",
     ("batches", "1", "tokens_per_s_bf16_graph"), _f(1)),
    (README, "| 1 | 40.9 | 430.1 | 677.1 (1.57x) | 716.9 (1.67x) |", "decode-graph-compiled-h200.json",
     ("batches", "1", "tokens_per_s_nemotron-h-w4a16-4o6_graph"), _f(1)),
    (README, "| 1 | 40.9 | 430.1 | 677.1 (1.57x) | 716.9 (1.67x) |", "decode-graph-compiled-h200.json",
     ("batches", "1", "tokens_per_s_modelopt-lightning_graph"), _f(1)),
    (README, "| 1 | 40.9 | 430.1 | 677.1 (1.57x) | 716.9 (1.67x) |", "decode-graph-compiled-h200.json",
     ("batches", "1", "speedup_over_bf16_graph", "nemotron-h-w4a16-4o6_graph"), _f(2)),
    (README, "| 1 | 40.9 | 430.1 | 677.1 (1.57x) | 716.9 (1.67x) |", "decode-graph-compiled-h200.json",
     ("batches", "1", "speedup_over_bf16_graph", "modelopt-lightning_graph"), _f(2)),
    (README, "| 16 | - | 2524.9 | 4184.6 (1.66x) | 4276.5 (1.69x) |", "decode-graph-compiled-h200.json",
     ("batches", "16", "tokens_per_s_bf16_graph"), _f(1)),
    (README, "| 16 | - | 2524.9 | 4184.6 (1.66x) | 4276.5 (1.69x) |", "decode-graph-compiled-h200.json",
     ("batches", "16", "tokens_per_s_nemotron-h-w4a16-4o6_graph"), _f(1)),
    (README, "| 16 | - | 2524.9 | 4184.6 (1.66x) | 4276.5 (1.69x) |", "decode-graph-compiled-h200.json",
     ("batches", "16", "tokens_per_s_modelopt-lightning_graph"), _f(1)),
    (README, "| 16 | - | 2524.9 | 4184.6 (1.66x) | 4276.5 (1.69x) |", "decode-graph-compiled-h200.json",
     ("batches", "16", "speedup_over_bf16_graph", "nemotron-h-w4a16-4o6_graph"), _f(2)),
    (README, "The compiled step runs 2.16 ms (BF16)\nand 1.35 ms (default recipe) of kernels", "decode-profile-compiled-h200.json",
     ("per_step_total_us", "bf16"), _f(2, 1e-3)),
    (README, "The compiled step runs 2.16 ms (BF16)\nand 1.35 ms (default recipe) of kernels", "decode-profile-compiled-h200.json",
     ("per_step_total_us", "nemotron-h-w4a16-4o6"), _f(2, 1e-3)),
    *[(README, "Top-k and sort now take 0.03 ms", "decode-profile-compiled-h200.json",
       ("per_step", model, "top-k and sort", "us"), _f(2, 1e-3)) for model in ("bf16", "nemotron-h-w4a16-4o6")],
    (README, "batch 1 the compiled checkpoint decodes 16.6x faster than eager BF16", "decode-graph-compiled-h200.json",
     ("batches", "1", "speedup_over_bf16_eager", "nemotron-h-w4a16-4o6_graph"), _f(1)),
    *[(README, "gave 43.5, 419.1, 639.1 (1.52x) and 686.7 (1.64x) at batch 1",
       "decode-graph-compiled-before-pick-h200.json", ("batches", "1", *key), fmt)
      for key, fmt in [(("tokens_per_s_bf16_eager",), _f(1)), *_decode_cells("bf16_graph", *_CKPTS)]],
    *[(README, "2498.4, 4065.3 (1.63x) and\n4104.3 (1.64x) at batch 16",
       "decode-graph-compiled-before-pick-h200.json", ("batches", "16", *key), fmt)
      for key, fmt in _decode_cells("bf16_graph", *_CKPTS)],
    (BENCH, "| default recipe over BF16, batch 1 | 1.70x (decode-b1-moe-tile-h200.json)", "decode-b1-moe-tile-h200.json",
     ("batches", "1", "speedup_over_bf16_graph", "nemotron-h-w4a16-4o6_graph"), _f(2)),
    (BENCH, "| `modelopt-lightning` over BF16, batch 1 | 1.84x (same file)", "decode-b1-moe-tile-h200.json",
     ("batches", "1", "speedup_over_bf16_graph", "modelopt-lightning_graph"), _f(2)),
    *[(README, "batch 1 gives BF16 445.0, the default recipe 756.7 (1.70x) and\n`modelopt-lightning` 817.8 tokens/s (1.84x)",
       "decode-b1-moe-tile-h200.json", ("batches", "1", *key), fmt) for key, fmt in _decode_cells("bf16_graph", *_CKPTS)],
    (README, "`generate` 38.4 on that machine, 29.8 on the one\nbefore", "decode-b1-moe-tile-h200.json",
     ("batches", "1", "tokens_per_s_bf16_eager"), _f(1)),
    (README, "`generate` 38.4 on that machine, 29.8 on the one\nbefore", "decode-b1-fp8-fix-h200.json",
     ("batches", "1", "tokens_per_s_bf16_eager"), _f(1)),
    *[(BENCH, "| batch 16 / batch 64 | 1.80x / 1.45x (decode-b16-b64-fp8-fix-h200.json)", "decode-b16-b64-fp8-fix-h200.json",
       ("batches", b, "speedup_over_bf16_graph", "nemotron-h-w4a16-4o6_graph"), _f(2)) for b in ("16", "64")],
    *[(README, "Batches 16 and 64 give BF16 2716.8 and 6703.4, the default\nrecipe 4892.1 (1.80x) and 9696.6 (1.45x), "
       "`modelopt-lightning` 5054.7 (1.86x) and 9712.9 (1.45x)", "decode-b16-b64-fp8-fix-h200.json", ("batches", b, *key), fmt)
      for b in ("16", "64") for key, fmt in _decode_cells("bf16_graph", *_CKPTS)],
    *[(README, "same code gives `modelopt-lightning` 789.3 to 829.9 tokens/s at batch 1", name,
       ("batches", "1", "tokens_per_s_modelopt-lightning_graph"), _f(1))
      for name in ("decode-b1-ahead-h200.json", "decode-b1-fp8-fix-h200.json")],
    *[(README, "the default recipe\n754.9-756.7", name, ("batches", "1", "tokens_per_s_nemotron-h-w4a16-4o6_graph"), _f(1))
      for name in ("decode-b1-fp8-fix-h200.json", "decode-b1-moe-tile-h200.json")],
    *[(README, text, "decode-b1-one-launch-h200.json", ("batches", "1", *key), fmt)
      for text, labels in (("batch 1 with \"triton\" gives BF16 486.7, the default recipe 876.5 (1.80x) and `modelopt-lightning`\n"
                            "916.5 tokens/s (1.88x)", tuple(c + "_triton-ops" for c in ("bf16_graph", *_CKPTS))),
                           ("against 453.5, 763.4 (1.68x) and 826.7 (1.82x)", ("bf16_graph", *_CKPTS)))
      for key, fmt in _decode_cells(*labels)],
    *[(README, "\"triton\" gives BF16 2650.4 and 6472.0, the default recipe 4676.2\n(1.76x) and 9463.8 tokens/s (1.46x), "
       "against 2493.9 and 5803.5, 4158.4 (1.67x) and 8077.8 (1.39x)", name, ("batches", b), fmt)
      for name, b, fmt in (
          *[("decode-b16-one-launch-h100.json", "16", lambda d, k=k: f"{d[k]:.1f}")
            for k in ("tokens_per_s_bf16_graph_triton-ops", "tokens_per_s_nemotron-h-w4a16-4o6_graph_triton-ops",
                      "tokens_per_s_bf16_graph", "tokens_per_s_nemotron-h-w4a16-4o6_graph")],
          *[("decode-b16-one-launch-h100.json", "16", lambda d, k=k: f"({d['speedup_over_bf16_graph'][k]:.2f}x)")
            for k in ("nemotron-h-w4a16-4o6_graph_triton-ops", "nemotron-h-w4a16-4o6_graph")],
          # batch 64: the decode steps' own times (the file's provenance says why)
          *[("decode-b64-one-launch-h100.json", "64", lambda d, k=k: f"{d['steps_tokens_per_s_' + k]:.1f}")
            for k in ("bf16_graph_triton-ops", "nemotron-h-w4a16-4o6_graph_triton-ops", "bf16_graph",
                      "nemotron-h-w4a16-4o6_graph")],
          *[("decode-b64-one-launch-h100.json", "64",
             lambda d, q=q, b=b: f"({d['steps_tokens_per_s_' + q] / d['steps_tokens_per_s_' + b]:.2f}x)")
            for q, b in (("nemotron-h-w4a16-4o6_graph_triton-ops", "bf16_graph_triton-ops"),
                         ("nemotron-h-w4a16-4o6_graph", "bf16_graph"))])],
    *[(BENCH, "with `step_ops=\"triton\"` for both, on an H100, 1.76x / 1.46x", name, ("batches", b), fmt)
      for name, b, fmt in (("decode-b16-one-launch-h100.json", "16",
                            lambda d: f"{d['speedup_over_bf16_graph']['nemotron-h-w4a16-4o6_graph_triton-ops']:.2f}x"),
                           ("decode-b64-one-launch-h100.json", "64",
                            lambda d: f"{d['steps_tokens_per_s_nemotron-h-w4a16-4o6_graph_triton-ops'] / d['steps_tokens_per_s_bf16_graph_triton-ops']:.2f}x"))],
    # the down launch as a programmatic dependent of the up launch (MOE_GEMV "pdl")
    *[(README, "on the table's 8 x 512 tile take 21.93 us against 24.01", "kernels-sweeps-moe-gemv-pdl-h100.json",
       ("rows", {"tokens": 1, "path": "gemv", "tile": [1, 8, 512, 1], "ahead": 1, "pdl": p}, "ms"), _f(2, 1e3))
      for p in (True, False)],
    (README, "by 0.65 to 4.74 us (median 2.18)", "kernels-sweeps-moe-gemv-pdl-h100.json", ("rows",),
     lambda rows: "by {:.2f} to {:.2f} us (median {:.2f})".format(*_pdl_gains(rows))),
    *[(README, "went from 849.6 to 860.2 tokens/s, 1.98x to 2.00x BF16's 429.3 and 429.0", name, ("batches", "1"), fmt)
      for name in ("decode-b1-lightning-before-pdl-h100.json", "decode-b1-lightning-pdl-h100.json")
      for fmt in (lambda d: f"{d['steps_tokens_per_s_modelopt-lightning_graph']:.1f}",
                  lambda d: f"{d['steps_tokens_per_s_bf16_graph']:.1f}",
                  lambda d: f"{d['steps_tokens_per_s_modelopt-lightning_graph'] / d['steps_tokens_per_s_bf16_graph']:.2f}x")],
    (BENCH, "with the down launch as a dependent launch, 2.00x (decode-b1-lightning-pdl-h100.json)",
     "decode-b1-lightning-pdl-h100.json", ("batches", "1"),
     lambda d: f"{d['steps_tokens_per_s_modelopt-lightning_graph'] / d['steps_tokens_per_s_bf16_graph']:.2f}x"),
    *[(README, text, "decode-profile-compiled-lightning-one-launch-h100.json", path, fmt) for text, path, fmt in (
        ("1161.3 us per step against BF16's 2321.6", ("per_step_wall_us", "modelopt-lightning"), _f(1)),
        ("1161.3 us per step against BF16's 2321.6", ("per_step_wall_us", "bf16"), _f(1)),
        *[(f"{us} us ({n})", ("top_kernels_per_step", "modelopt-lightning", {"kernel": k}),
           lambda r: f"{r['us']:.1f} us ({r['count']:.0f})")
          for us, n, k in (("319.0", 22, "_moe_small_kernel"), ("77.1", 11, "_route_kernel"), ("74.3", 12, "_mamba_step_kernel"),
                           ("48.7", 3, "_decode_attention_kernel"))],
        ("in_proj and out_proj in cuBLAS 233.3 us (24)", ("top_kernels_per_step", "modelopt-lightning"),
         lambda rows: "{:.1f} us ({:.0f})".format(*[sum(r[f] for r in rows if "qqtst" in r["kernel"]) for f in ("us", "count")])),
        ("GEMVs 133.3 us", ("top_kernels_per_step", "modelopt-lightning", {"kernel": "_gemv_kernel"}), lambda r: f"{r['us']:.1f} us"),
        ("lm_head 92.8 us", ("top_kernels_per_step", "modelopt-lightning", {"kernel": "_mma_kernel"}), lambda r: f"{r['us']:.1f} us"))],
    *[(README, "take 13.07 us for in_proj and 7.78 us for out_proj at one row\nagainst cuBLAS's 12.88 and 6.91",
       "kernels-sweeps-fp8-mma-h100.json", ("rows", {"N": n, "K": k, "M": 1, "kernel": kernel, **tile}),
       lambda r: f"{r['ms'] * 1e3:.2f}")
      for n, k in ((10304, 2688), (2688, 4096))
      for kernel, tile in (("_scaled_mm", {}), ("mma", {"tile": [64, 128, 4, 5, 2]}))],
    *[(README, "4 warps instead of 8 warps take 11.45 us at 16 tokens and 28.56 us at 64 against 15.25 and 40.89,\n"
       "and 7.23 against 7.10 us at one token", "kernels-sweeps-router-route-h100.json",
       ("rows", {"T": t, "experts": 4, "num_warps": w}), lambda r: f"{r['ms'] * 1e3:.2f}")
      for t in (1, 16, 64) for w in (4, 8)],
    (BENCH, "1.88x with `step_ops=\"triton\"` for both (decode-b1-one-launch-h200.json)", "decode-b1-one-launch-h200.json",
     ("batches", "1", "speedup_over_bf16_graph", "modelopt-lightning_graph_triton-ops"), _f(2)),
    *[(BENCH, text, "packed-gemm-overlap-h200.json", (), _overlap_row(*p)) for text, p in (
        ("| 3712 x 2688, 16 | 6.9 | 6.1 | 7.1 |", (3712, 2688, 16)), ("| 3712 x 2688, 64 | 6.5 | 9.3 | 10.2 |", (3712, 2688, 64)),
        ("| 2688 x 3712, 16 | 7.5 | 5.8 | 6.6 |", (2688, 3712, 16)), ("| 2688 x 3712, 64 | 8.0 | 9.4 | 10.4 |", (2688, 3712, 64)),
        ("| 8192 x 8192, 64 | 36.7 | 30.5 | 31.9 |", (8192, 8192, 64)))],
    *[(BENCH, "takes 22.9 us unsplit, 15.5 split 2 ways and 13.2 split 4 ways (the table's), against 12.0 for the\n"
       "bf16 matmul; the 4-way split fills 0.70 waves and reads DRAM at 14.9 % of its peak, against 50.5 %\n"
       "for bf16, with a warp waiting 10.2 cycles per instruction issued", "packed-gemm-ncu-m64-h100.json",
       ("launches", index), lambda r, key=key, fmt=fmt: fmt.format(r[key]))
      for index, key, fmt in ((0, "duration_us", "{:.1f} us"), (3, "duration_us", "{:.1f} split 2"),
                              (6, "duration_us", "{:.1f} split 4"), (10, "duration_us", "against {:.1f}"),
                              (6, "waves_per_sm", "fills {:.2f} waves"), (6, "dram_pct", "at {:.1f} %"),
                              (10, "dram_pct", "against {:.1f} %"), (6, "cycles_per_issue", "waiting {:.1f} cycles"))],
    (BENCH, "split in all 120 timed launches", "packed-gemm-overlap-h200.json", ("sweep_overlap",),
     lambda rows: f"split in all {sum(r['equal'] for r in rows if r['kernel'] == 'overlap')} timed launches"),
    (BENCH, "10.2 / 10.4 against bf16's 6.5 / 8.0 us (packed-gemm-overlap-h200.json", "packed-gemm-overlap-h200.json", (),
     lambda d: "{} / {} against bf16's {} / {} us (packed-gemm-overlap-h200.json".format(
         *[_overlap_row(n, k, 64)(d).split(" | ")[3].rstrip(" |") for n, k in ((3712, 2688), (2688, 3712))],
         *[_overlap_row(n, k, 64)(d).split(" | ")[1] for n, k in ((3712, 2688), (2688, 3712))])),
    (README, "| over BF16's eager `generate`, batch 1 | 19.7x (decode-b1-moe-tile-h200.json)", "decode-b1-moe-tile-h200.json",
     ("batches", "1", "speedup_over_bf16_eager", "nemotron-h-w4a16-4o6_graph"), _f(1)),
    (README, "at BF16's 445.0 tokens/s that is 979\ntokens/s, a step of 1.02 ms against 1.22 ms now", "decode-b1-moe-tile-h200.json",
     ("batches", "1"), lambda b: f"{b['tokens_per_s_bf16_graph']:.1f} tokens/s that is {2.2 * b['tokens_per_s_bf16_graph']:.0f} "
     f"tokens/s, a step of {1e3 / (2.2 * b['tokens_per_s_bf16_graph']):.2f} ms against "
     f"{1e3 / b['tokens_per_s_modelopt-lightning_graph']:.2f} ms"),
    *[(README, row, "decode-b1-h200.json" if b == "1" else "decode-b16-b64-h200.json", ("batches", b, *key), fmt)
      for b, row in (("1", "| 1 | 454.0 | 729.2 (1.61x) | 777.0 (1.71x) | 697.8 (1.54x) | 735.0 (1.62x) |"),
                     ("16", "| 16 | 2785.9 | 4792.4 (1.72x) | 4920.3 (1.77x) | 4600.6 (1.65x) | 4697.1 (1.69x) |"),
                     ("64", "| 64 | 6793.7 | 9631.7 (1.42x) | 9655.0 (1.42x) | 9335.3 (1.37x) | 9329.6 (1.37x) |"))
      for key, fmt in _decode_cells("bf16_graph", *_CKPTS, *(c + "_sequential-shared" for c in _CKPTS))],
    *[(README, "(BF16 442.7\nagainst 438.5 tokens/s;", "decode-b1-step-ops-h200.json", ("batches", "1", f"tokens_per_s_{label}"), _f(1))
      for label in ("bf16_graph", "bf16_graph_transformers-ops")],
    (README, "the step runs 1284.9 us of kernels on two streams,\n514.8 us of them fp4kit's and 337.1 us BF16/FP8 matrix products",
     "decode-profile-compiled-lightning-h200.json", ("per_step_total_us", "modelopt-lightning"), _f(1)),
    *[(README, "the step runs 1284.9 us of kernels on two streams,\n514.8 us of them fp4kit's and 337.1 us BF16/FP8 matrix products",
       "decode-profile-compiled-lightning-h200.json", ("per_step", "modelopt-lightning", kind, "us"), _f(1))
      for kind in ("fp4kit kernels", "bf16 matmul")],
    *[(README, text, "decode-profile-compiled-lightning-h200.json", ("top_kernels_per_step", "modelopt-lightning", {"kernel": k}),
       lambda r: f"{r['us']:.1f} us" + (" (11 MoE layers)" if r["count"] == 22 and r["kernel"] == "_moe_small_kernel" else ""))
      for text, k in (("routed\nexperts' two projections take 270.2 us (11 MoE layers)", "_moe_small_kernel"),
                      ("the shared experts' GEMVs 144.0 us", "_gemv_kernel"), ("the W4A16 lm_head 77.2 us", "_mma_kernel"))],
    *[(README, "it took the profiled step from 331 to 287 kernels and from 1284.9 to 1107.1 us of kernel time, the\n"
       "routed launches growing from 270.2 to 289.2 us", name, (), fmt)
      for name, fmt in (("decode-profile-compiled-lightning-h200.json",
                         lambda d: f"from {d['per_step_kernels']['modelopt-lightning']:.0f} to"),
                        ("decode-profile-compiled-lightning-shared-parts-h200.json",
                         lambda d: f"to {d['per_step_kernels']['modelopt-lightning']:.0f} kernels"),
                        ("decode-profile-compiled-lightning-h200.json",
                         lambda d: f"from {d['per_step_total_us']['modelopt-lightning']:.1f} to"),
                        ("decode-profile-compiled-lightning-shared-parts-h200.json",
                         lambda d: f"to {d['per_step_total_us']['modelopt-lightning']:.1f} us"),
                        ("decode-profile-compiled-lightning-h200.json", lambda d: "from {:.1f} to".format(
                            _at(d, ("top_kernels_per_step", "modelopt-lightning", {"kernel": "_moe_small_kernel"}, "us")))),
                        ("decode-profile-compiled-lightning-shared-parts-h200.json", lambda d: "to {:.1f} us".format(
                            _at(d, ("top_kernels_per_step", "modelopt-lightning", {"kernel": "_moe_small_kernel"}, "us")))))],
    *[(README, text, name, ("batches", "1", f"tokens_per_s_{label}"), _f(1))
      for text, name in (("decoded 806.1 tokens/s (1.80x BF16's 447.6", "decode-b1-shared-parts-h200.json"),
                         ("against 825.2 (1.84x of 447.9)", "decode-b1-side-stream-h200.json"))
      for label in ("bf16_graph", "modelopt-lightning_graph")],
    *[(README, text, name, ("batches", "1"),
       lambda b: f"{b['tokens_per_s_modelopt-lightning_graph'] / b['tokens_per_s_bf16_graph']:.2f}x")
      for text, name in (("decoded 806.1 tokens/s (1.80x BF16's 447.6", "decode-b1-shared-parts-h200.json"),
                         ("against 825.2 (1.84x of 447.9)", "decode-b1-side-stream-h200.json"))],
    (README, "the pick): 82.5 us per step over 11 layers", "decode-profile-compiled-lightning-h200.json",
     ("top_kernels_per_step", "modelopt-lightning"), lambda rows: "{:.1f} us per step over {:.0f} layers".format(
         sum(r["us"] for r in rows if r["kernel"].startswith(_ROUTER_KERNELS)),
         next(r["count"] for r in rows if r["kernel"] == "_topk_gather_kernel"))),
    (README, "(about 12.4 us a layer, 149 us per step over 12\nlayers,", "decode-profile-compiled-lightning-h200.json",
     ("top_kernels_per_step", "modelopt-lightning"), lambda rows: "(about {:.1f} us a layer, {:.0f} us per step over {:.0f}".format(
         *(lambda mine: (sum(r["us"] for r in mine) / mine[0]["count"], sum(r["us"] for r in mine), mine[0]["count"]))(
             [r for r in rows if r["kernel"].startswith(_MAMBA_KERNELS)]))),
    (README, "takes 71.5 us over 3\nlayers", "decode-profile-compiled-lightning-h200.json",
     ("top_kernels_per_step", "modelopt-lightning"),
     lambda rows: "{:.1f} us over {:.0f} layers".format(*next((r["us"], r["count"]) for r in rows
                                                            if r["kernel"].startswith("cudnn_generated_fort_native_sdpa")))),
    (README, "`_moe_combine_kernel` (23.3 us per step over 11 layers", "decode-profile-compiled-lightning-h200.json",
     ("top_kernels_per_step", "modelopt-lightning"), lambda rows: "{:.1f} us per step over {:.0f} layers".format(
         *next((r["us"], r["count"]) for r in rows if r["kernel"] == "_moe_combine_kernel"))),
    (README, "The routed experts' 270.2 us per step", "decode-profile-compiled-lightning-h200.json",
     ("top_kernels_per_step", "modelopt-lightning", {"kernel": "_moe_small_kernel"}, "us"), _f(1)),
    *[(README, "stream one\ntoken's 33.7 MB at 1.5 TB/s", "kernels-sweeps-moe-gemv-h200.json",
       ("rows", {"tokens": 1, "path": "gemv", "tile": [1, 8, 512, 1], "ahead": 1}, "ms"), fmt)
      for fmt in (lambda ms: f"{6 * 2 * 1856 * 2688 * 9 / 16 / 1e6:.1f} MB",
                  lambda ms: f"{6 * 2 * 1856 * 2688 * 9 / 16 / (ms * 1e-3) / 1e12:.1f} TB/s")],
    (BENCH, "the same tile won: 26.0 us for one\ntoken's six experts", "kernels-sweeps-moe-gemv-before-kb-h200.json",
     ("rows", {"tokens": 1, "path": "gemv", "tile": [1, 4, 512, 1]}, "ms"), lambda ms: f"{ms * 1e3:.1f}"),
    *[(BENCH, "the same tile at SMALL's split, 24.1 / 41.5 / 67.5\n/ 127.1 us at 1 / 2 / 4 / 8 tokens",
       "kernels-sweeps-moe-gemv-before-ahead-h200.json",
       ("rows", {"tokens": t, "path": "gemv", "tile": [1, 4, 512, 1], "maxnreg": None, "programs_per_sm": 2}, "ms"),
       lambda ms: f"{ms * 1e3:.1f}") for t in (1, 2, 4, 8)],
    (BENCH, "ahead of the matrix units (137.1 us) up to 8 tokens", "kernels-sweeps-moe-gemv-before-ahead-h200.json",
     ("rows", {"tokens": 8, "path": "matrix-unit"}, "ms"), lambda ms: f"{ms * 1e3:.1f}"),
    (BENCH, "(max_assignments 48)", "kernels-sweeps-moe-gemv-before-ahead-h200.json", ("pick", "max_assignments"), str),
    (BENCH, "faster at one token (22.5 us)", "kernels-sweeps-moe-gemv-before-ahead-h200.json",
     ("rows", {"tokens": 1, "path": "gemv", "tile": [1, 8, 512, 1], "maxnreg": None, "programs_per_sm": 2}, "ms"),
     lambda ms: f"{ms * 1e3:.1f}"),
    (README, "makes them slower (65.9 us)", "kernels-sweeps-moe-gemv-before-ahead-h200.json",
     ("rows", {"tokens": 1, "path": "gemv", "tile": [1, 4, 512, 1], "maxnreg": None, "programs_per_sm": 64}, "ms"),
     lambda ms: f"{ms * 1e3:.1f}"),
    *[(README, text, "kernels-sweeps-moe-gemv-h200.json", ("rows", {"tokens": 1, "path": "gemv", "tile": tile, "ahead": a}, "ms"),
       lambda ms: f"{ms * 1e3:.1f}")
      for text, tile, a in (("One token's experts take 22.5 us for both projections", [1, 8, 512, 1], 1),
                            ("24.2 on the 4 x 512 one\nbefore", [1, 4, 512, 1], 1),
                            ("(26.3 and 27.4 us on 4 x 512;", [1, 4, 512, 1], 2),
                            ("(26.3 and 27.4 us on 4 x 512;", [1, 4, 512, 1], 3))],
    (README, "the loop is bound by issuing its\ninstructions (4.73 per weight)", "moe-gemv-sass.json",
     ("rows", {"tile": [4, 512, 1], "maxnreg": None}, "per_weight"), _f(2)),
    (README, "| weight memory | 0.32x of BF16", "decode-graph-compiled-h200.json",
     ("weight_memory_over_bf16", "nemotron-h-w4a16-4o6"), _f(2)),
    (README, "| eager W4A16 call, host time | 15.8 us", "kernels-host-h200.json",
     ("host_overhead", "w4a16_host_us_per_call"), _f(1)),
    (BENCH, "Before: the linear 0.69x / 0.84x", KERNELS,
     ("gemm", {**NANO[0], "M": 64}, "speedup_vs_bf16_best"), _f(2)),
    (BENCH, "Before: the linear 0.69x / 0.84x", KERNELS,
     ("gemm", {**NANO[1], "M": 64}, "speedup_vs_bf16_best"), _f(2)),
    (BENCH, "the MoE 2.85x bf16 at 64 tokens", KERNELS, ("moe", {"tokens": 64}, "speedup_vs_bf16"), _f(2)),
    *[(README, "And 0.42 ms of the default\nrecipe's step (0.49 ms of BF16's; decode-profile-compiled-h200.json) goes to copies",
       "decode-profile-compiled-h200.json", ("per_step", model),
       lambda kinds: f"{sum(kinds[k]['us'] for k in ('copy', 'elementwise', 'top-k and sort', 'other', 'reduction')) / 1e3:.2f}")
      for model in ("nemotron-h-w4a16-4o6", "bf16")],
    (BENCH, "exported the same 19.4 GB in 3.6 s", "dry-run-h200.json", ("library_earlier", "export_s"), _f(1)),
    (BENCH, "each a separate process: fp4kit 33.8 s, ModelOpt 155.0 s", "vs-modelopt-h200.json", ("half@8x32k", "fp4kit", "wall_s"), _f(1)),
    (README, "On the CPU that checkpoint decodes at 66.1\ntokens/s on 2 threads", "generate-cpu.json", ("tokens_per_s",), _f(1)),
    (README, "On the CPU that checkpoint decodes at 66.1\ntokens/s on 2 threads", "generate-cpu.json", ("threads",), str),
    (README, "the same tokens at 31.2 before the emulation", "generate-cpu-before.json", ("tokens_per_s",), _f(1)),
    *[(BENCH, text, "kernels-sweeps-fp8-gemv-h200.json", ("rows", sel, "ms"), lambda ms: f"{ms * 1e3:.1f}")
      for text, sel in (("(10.3 us at one row against 10.3-14.1 for the tiles)", {"N": 10304, "M": 1, "kernel": "_scaled_mm"}),
                        ("(5.4 against 6.2 us)", {"N": 2688, "M": 1, "kernel": "gemv", "tile": [1, 1024, 2]}),
                        ("(5.4 against 6.2 us)", {"N": 2688, "M": 1, "kernel": "_scaled_mm"}))],
    (BENCH, "(10.3 us at one row against 10.3-14.1 for the tiles)", "kernels-sweeps-fp8-gemv-h200.json", ("rows",),
     lambda rows: "-".join(f"{f(r['ms'] for r in rows if r['N'] == 10304 and r['M'] == 1 and r['kernel'] == 'gemv') * 1e3:.1f}"
                           for f in (min, max))),
    (BENCH, "so `max_m` stayed 0", "kernels-sweeps-fp8-gemv-h200.json", ("pick", "max_m"), str),
    # benchmarks/README.md: the FP8 GEMV's K loop, compiled ahead of time (scripts/sass_loop.py)
    (BENCH, "program it takes 3.20 instructions per weight", "fp8-gemv-sass.json",
     ("rows", {"rows": 1, "tile": [4, 512, 1]}, "per_weight"), _f(2)),
    (BENCH, "then fp32, one fma each) at 95 registers", "fp8-gemv-sass.json", ("rows", {"rows": 1, "tile": [4, 512, 1]}, "registers"),
     str),
    (BENCH, "(8 weight rows x 512 columns, four warps: 3.84 at 63 registers)", "fp8-gemv-sass.json",
     ("rows", {"rows": 1, "tile": [8, 512, 4]}, "per_weight"), _f(2)),
    (BENCH, "(8 weight rows x 512 columns, four warps: 3.84 at 63 registers)", "fp8-gemv-sass.json",
     ("rows", {"rows": 1, "tile": [8, 512, 4]}, "registers"), str),
    *[(BENCH, "one-warp tile of 4 x 512 picked until the last sweep) takes 4.73 instructions per weight at 64 registers", "moe-gemv-sass.json",
       ("rows", {"tile": [4, 512, 1], "maxnreg": None}, key), fmt) for key, fmt in (("per_weight", _f(2)), ("registers", str))],
    *[(BENCH, "its loop took\n5.06 instructions per weight at 86 registers", "moe-gemv-before-kb-sass.json",
       ("rows", {"tile": [4, 512, 1], "maxnreg": None}, key), fmt) for key, fmt in (("per_weight", _f(2)), ("registers", str))],
    (BENCH, "(20 integer multiply-adds, adds, shifts and\naddress computations more per step)", "moe-gemv-before-kb-sass.json",
     ("rows", {"tile": [4, 512, 1], "maxnreg": None}, "ops"),
     lambda ops: str(sum(ops[k] for k in ("IMAD", "IADD3", "LEA", "SHF")) - sum(
         _at(_load("moe-gemv-sass.json"), ("rows", {"tile": [4, 512, 1], "maxnreg": None}, "ops"))[k]
         for k in ("IMAD", "IADD3", "LEA", "SHF")))),
    *[(BENCH, "The one-warp 8 x 512 tile takes 4.31 per weight at 130 registers, or 96\ncapped (`maxnreg`) with nothing spilled",
       "moe-gemv-sass.json", ("rows", {"tile": [8, 512, 1], "maxnreg": mr}, key), fmt)
      for mr, key, fmt in ((None, "per_weight", _f(2)), (None, "registers", str), (96, "registers", str),
                           (96, "stack", lambda b: {0: "nothing spilled"}[b]))],
    *[(BENCH, "more tiles in flight are slower for every tile and\ntoken count (4 x 512: 24.2 / 26.3 / 27.4 us at one token; "
       "8 x 512: 22.5 / 25.1 / 26.5)", "kernels-sweeps-moe-gemv-h200.json",
       ("rows", {"tokens": 1, "path": "gemv", "tile": tile, "ahead": a}, "ms"), lambda ms: f"{ms * 1e3:.1f}")
      for tile in ([1, 4, 512, 1], [1, 8, 512, 1]) for a in (1, 2, 3)],
    (BENCH, "matrix units now win at 8 tokens (117.9 against 135.6 us)", "kernels-sweeps-moe-gemv-h200.json",
     ("rows",), lambda rows: f"{next(r['ms'] for r in rows if r['tokens'] == 8 and r['path'] == 'matrix-unit') * 1e3:.1f} "
     f"against {min(r['ms'] for r in rows if r['tokens'] == 8 and r['path'] == 'gemv') * 1e3:.1f}"),
    (BENCH, "so the tiles serve up to 4\n(max_assignments 24)", "../../fp4kit/kernels/tuning/h200.json",
     ("kernels", "moe", "tables", "MOE_GEMV", "max_assignments"), str),
    *[(BENCH, "which takes the 8 x 512 tile (22.5 / 37.0 / 71.6 us at 1 / 2 / 4 tokens)", "kernels-sweeps-moe-gemv-h200.json",
       ("rows", {"tokens": t, "path": "gemv", "tile": [1, 8, 512, 1], "ahead": 1}, "ms"), lambda ms: f"{ms * 1e3:.1f}")
      for t in (1, 2, 4)],
    (BENCH, "which takes the 8 x 512 tile", "../../fp4kit/kernels/tuning/h200.json",
     ("kernels", "moe", "tables", "MOE_GEMV"), lambda g: f"{g['BLOCK_N']} x {g['BLOCK_K']} tile"),
    *[(BENCH, text, "moe-gemv-ahead-sass.json", ("rows", {"tile": [4, 512, 1], "ahead": a}, key), fmt)
      for text, a in (("its loop takes 5.05 instructions per weight at 72 registers", 2), ("(3 tiles: 5.22 at 102;", 3))
      for key, fmt in (("per_weight", _f(2)), ("registers", str))],
    *[(BENCH, "slower than the\nCUDA-core tiles at 1 and 2 tokens (26.0 against 22.7 us and 41.6 against 37.0 us at its best\nlaunch)",
       "kernels-sweeps-moe-small_mma-h200.json", ("rows",),
       lambda rows, t=t: f"{min(r['ms'] for r in rows if r['tokens'] == t and r['path'] == 'small-mma') * 1e3:.1f} against "
       f"{next(r['ms'] for r in rows if r['tokens'] == t and r['path'] == 'gemv') * 1e3:.1f}") for t in (1, 2)],
    (BENCH, "wrong on the GPU at 4 and 8 tokens", "kernels-sweeps-moe-small_mma-h200.json", ("rows",),
     lambda rows: "4 and 8" if sorted({r["tokens"] for r in rows if r["path"] == "small-mma" and r["ms"] is None
                                         and r.get("error", "").startswith("ArithmeticError")}) == [4, 8] else "?"),
    *[(README, "they took 82.1 and 48.8 us of each `modelopt-lightning` step",
       "decode-profile-compiled-lightning-one-graph-h100.json", ("top_kernels_per_step", "modelopt-lightning", {"kernel": k}),
       lambda r: f"{r['us']:.1f}") for k in ("_route_kernel", "_decode_attention_kernel")],
    # benchmarks/README.md: the decode step's router tail and attention combine, compiled ahead of time
    *[(BENCH, text, name, ("rows", {"experts": 4, "warps": 4}, "ops"), lambda ops: str(ops["BAR"]))
      for text, name in (("output back out of the vectors with another reduction: 55 barriers", "route-tail-before-sass.json"),
                         ("place: 25 barriers", "route-tail-sass.json"))],
    *[(BENCH, text, name, ("rows", {"combine": c}, key), str)
      for text, name, c, key in (("loaded one split's 10 values", "attention-combine-before-sass.json", 1, "loads_before_exp"),
                                 ("issues 4 splits' loads", "attention-combine-sass.json", 4, "combine"),
                                 ("48, before its first exponential", "attention-combine-sass.json", 4, "loads_before_exp"),
                                 ("at 126 registers", "attention-combine-sass.json", 4, "registers"),
                                 ("against 122", "attention-combine-before-sass.json", 1, "registers"))],
    # benchmarks/README.md: the FP8 GEMV as a programmatic dependent launch, compiled ahead of time
    *[(BENCH, text, "fp8-gemv-pdl-sass.json", ("rows", {"tile": [4, 1024, 2], "even_k": False}, key), str)
      for text, key in (("issues its 4 weight loads of the first tile", "loads_before_wait"),
                        ("its 4 weight loads of the first tile", "tile_loads"),
                        ("at 97 registers", "registers"), ("against 96", "plain_registers"))],
    (BENCH, "and no store\nbefore its trigger", "fp8-gemv-pdl-sass.json",
     ("rows", {"tile": [4, 1024, 2], "even_k": False}),
     lambda r: "no store" if r["stores_before_trigger"] == 0 and r["wait_before_trigger"] and r["loop_same"] else "?"),
    *[(BENCH, text, "mamba-step-pdl-sass.json", ("rows", {"pdl": True}, key), str)
      for text, key in (("it issues 7 loads before its wait", "loads_before_wait"),
                        ("its state\nrows' 4 per thread", "state_loads"))],
    (BENCH, "the head's three parameters, no store", "mamba-step-pdl-sass.json", ("rows", {"pdl": True}),
     lambda r: "no store" if r["stores_before_wait"] == 0 and r["loads_before_wait"] == r["state_loads"] + 3
     and r["wait_before_trigger"] else "?"),
    (BENCH, "its 3.86 instructions per weight", "moe-small-mma-sass.json",
     ("rows", {"rows": 1, "warps": 1, "kwarps": 4}, "per_weight"), _f(2)),
    (BENCH, "the packed kernel's (`packed`) 4.0 per weight at 64 rows", "packed-sass.json",
     ("rows", {"BLOCK_M": 64, "UNROLL": 1}, "per_weight"), _f(1)),
    (BENCH, "of which eight are\nwgmma per K tile", "packed-sass.json", ("rows", {"BLOCK_M": 64, "UNROLL": 1}, "ops", "HGMMA"),
     lambda v: {8: "eight"}[v]),
    # the pre-packed GEMM warm and cold (bench_packed.py --cold), and its SLICE run
    *[(BENCH, _cold_row(n, k, m)(_load("packed-gemm-cold-h100.json")["gemm_cold"]), "packed-gemm-cold-h100.json",
       ("gemm_cold",), _cold_row(n, k, m)) for n, k in ((3712, 2688), (2688, 3712)) for m in (16, 32, 64)],
    (BENCH, "bf16 loses more than the packed kernel does (its 20 MB now come from memory, 9.9-13.0 us\nagainst 6.5-8.6)",
     "packed-gemm-cold-h100.json", ("gemm_cold",),
     lambda rows: "{} us against {}".format(*[_span([r[f"ms_bf16_{s}"] * 1e3 for r in rows if r["M"] >= 16], 1)
                                              for s in ("cold", "warm")])),
    (BENCH, "at 16-32 rows the best of ours is 1.12-1.55x bf16 where warm it was\n0.96-1.36x", "packed-gemm-cold-h100.json",
     ("gemm_cold",), lambda rows: "the best of ours is {}x bf16 where warm it was {}x".format(
         *[_span([_ours_over_bf16(r, s) for r in rows if r["M"] in (16, 32)], 2) for s in ("cold", "warm")])),
    (BENCH, "faster in sum over the six problems (54.2 against 56.1 us)", "packed-gemm-cold-h100.json", ("gemm_cold",),
     lambda rows: "({:.1f} against {:.1f} us)".format(
         *[sum(r[f"ms_{kind}_cold"] for r in rows if r["M"] >= 16) * 1e3 for kind in ("packed_picked", "packed")])),
    *[(BENCH, "the cold pick gives 1.03x on 3712 x 2688 but not on 2688 x 3712 (11.2 us; the\nsweep's fastest shape there "
       "takes 11.0)", "packed-gemm-cold-h100.json", path, fmt) for path, fmt in (
        (("gemm_cold", {"N": 3712, "K": 2688, "M": 64}), lambda r: f"{r['ms_bf16_cold'] / r['ms_packed_picked_cold']:.2f}x"),
        (("gemm_cold", {"N": 2688, "K": 3712, "M": 64}, "ms_packed_picked_cold"), _f(1, 1e3)),
        (("sweep_cold",), lambda rows: f"takes {min(r['ms'] for r in rows if (r['N'], r['M']) == (2688, 64)) * 1e3:.1f}"))],
    (BENCH, "was 0.12-0.88 us slower than without", "packed-gemm-cold-slice-h100.json", ("gemm_cold",), _slice_cost),
    (BENCH, "its output equal byte for byte\n(`results/packed-gemm-cold-slice-h100.json`", "packed-gemm-cold-slice-h100.json",
     ("gemm_cold",), lambda rows: "equal" if all(r["slice_equal"] for r in rows) else "differs"),
    *[(doc, text, "packed-gemm-cold-h100.json", ("gemm_cold",), fmt) for doc, text, fmt in (
        (BENCH, "on an H100: 0.97x / 0.97x at 64 rows, 1.12x-1.55x at 16-32 (packed-gemm-cold-h100.json)",
         lambda rows: "{:.2f}x / {:.2f}x at 64 rows, {:.2f}x-{:.2f}x at 16-32".format(
             *[_ours_over_bf16(r, "cold") for r in rows if r["M"] == 64],
             *sorted(_ours_over_bf16(r, "cold") for r in rows if r["M"] in (16, 32))[::3])),
        (README, "with cold weights, 0.97x and 0.97x on an H100 (packed-gemm-cold-h100.json)",
         lambda rows: "{:.2f}x and {:.2f}x".format(*[_ours_over_bf16(r, "cold") for r in rows if r["M"] == 64])))],
    # the same on an H200, and its decode at batch 1 with the dependent launch
    (BENCH, "on an H200: 0.76x / 0.86x at 64 rows, 1.26x-1.33x at 16-32 (packed-gemm-cold-h200.json)",
     "packed-gemm-cold-h200.json", ("gemm_cold",), lambda rows: "{:.2f}x / {:.2f}x at 64 rows, {:.2f}x-{:.2f}x at 16-32".format(
         *[_ours_over_bf16(r, "cold") for r in rows if r["M"] == 64],
         *sorted(_ours_over_bf16(r, "cold") for r in rows if r["M"] in (16, 32))[::3])),
    (README, "0.76x and 0.86x on an H200 (packed-gemm-cold-h200.json)", "packed-gemm-cold-h200.json", ("gemm_cold",),
     lambda rows: "{:.2f}x and {:.2f}x".format(*[_ours_over_bf16(r, "cold") for r in rows if r["M"] == 64])),
    (BENCH, "at 64 rows cuBLAS reads bf16's weight cold in 8.4 and 9.2 us, faster than at 16-32 rows\n(10.6-11.2), "
     "against 11.0 and 10.7 for the packed kernel, 0.76x and 0.86x; at 16-32 rows the\nbest of ours is 1.26-1.33x bf16",
     "packed-gemm-cold-h200.json", ("gemm_cold",), lambda rows: (
         "cold in {:.1f} and {:.1f} us, faster than at 16-32 rows ({}), against {:.1f} and {:.1f} for the packed kernel, "
         "{:.2f}x and {:.2f}x; at 16-32 rows the best of ours is {}x bf16").format(
         *[r["ms_bf16_cold"] * 1e3 for r in rows if r["M"] == 64],
         _span([r["ms_bf16_cold"] * 1e3 for r in rows if r["M"] in (16, 32)], 1),
         *[r["ms_packed_cold"] * 1e3 for r in rows if r["M"] == 64],
         *[_ours_over_bf16(r, "cold") for r in rows if r["M"] == 64],
         _span([_ours_over_bf16(r, "cold") for r in rows if r["M"] in (16, 32)], 2))),
    *[(BENCH, text, "decode-b1-pdl-h200.json", ("batches", "1"), fmt) for text, fmt in (
        ("with the dependent launch and today's tables 1.95x, the decode steps alone 1.81x (decode-b1-pdl-h200.json)",
         lambda d: "{:.2f}x, the decode steps alone {:.2f}x".format(
             d["speedup_over_bf16_graph"]["nemotron-h-w4a16-4o6_graph"],
             d["steps_tokens_per_s_nemotron-h-w4a16-4o6_graph"] / d["steps_tokens_per_s_bf16_graph"])),
        ("with it on an H200, 2.08x, the decode steps alone 1.97x (decode-b1-pdl-h200.json)",
         _lightning_over_bf16))],
    *[(README, "gives BF16 481.4, the default recipe 940.0 (1.95x) and\n`modelopt-lightning` 1000.8 tokens/s (2.08x); "
       "the decode steps alone 480.7, 868.6 (1.81x) and\n945.3 (1.97x)", "decode-b1-pdl-h200.json", ("batches", "1"), fmt)
      for fmt in _B1_CELLS],
    # the step as one compiled graph (H100)
    (BENCH, "with the step one compiled graph, on an H100, 1.82x (decode-b1-one-graph-h100.json)",
     "decode-b1-one-graph-h100.json", ("batches", "1", "speedup_over_bf16_graph", "nemotron-h-w4a16-4o6_graph"),
     lambda v: f"{v:.2f}x"),
    (BENCH, "with the step one compiled graph, on an H100, 2.09x, the decode steps alone 2.07x",
     "decode-b1-one-graph-h100.json", ("batches", "1"),
     _lightning_over_bf16),
    # before (the one-launch profile) and after (one graph): kernels and wall time per step
    *[(README, text, f"decode-profile-compiled-lightning-{which}-h100.json", (key, model),
       (lambda v, key=key, which=which: f"{'from' if which == 'one-launch' else 'to'} {v:.{0 if key == 'per_step_kernels' else 1}f}"))
      for model, text in (("modelopt-lightning", "went from 224 to 185 kernels and from 1161.3 to 1101.4 us"),
                          ("bf16", "BF16's from 312 to 285 kernels and from 2321.6 to 2290.0 us"))
      for key in ("per_step_kernels", "per_step_wall_us") for which in ("one-launch", "one-graph")],
    *[(README, "gives BF16\n428.3, the default recipe 778.1 (1.82x) and `modelopt-lightning` 893.8 tokens/s (2.09x); the\n"
       "decode steps alone 434.3, 796.7 (1.83x) and 900.7 (2.07x)", "decode-b1-one-graph-h100.json", ("batches", "1"), fmt)
      for fmt in _B1_CELLS],
    # the FP8 GEMV and Inductor's kernels as programmatic dependents (decode issue, H100)
    (BENCH, "2.18x and 2.16x on a rerun, the decode steps alone 2.16x and 2.15x", "decode-graph-compiled-pdl-h100.json",
     ("batches", "1"), lambda d: "{:.2f}x and".format(d["speedup_over_bf16_graph"]["modelopt-lightning_graph"])
     + " {:.2f}x on a rerun".format(_load("decode-b1-pdl-rerun-h100.json")["batches"]["1"]["speedup_over_bf16_graph"]
                                    ["modelopt-lightning_graph"])
     + ", the decode steps alone {:.2f}x and {:.2f}x".format(
         _steps_over_bf16(d, "modelopt-lightning"),
         _steps_over_bf16(_load("decode-b1-pdl-rerun-h100.json")["batches"]["1"], "modelopt-lightning"))),
    (BENCH, "with Inductor's kernels as dependent launches, on an H100, 1.91x (decode-graph-compiled-pdl-h100.json)", "decode-graph-compiled-pdl-h100.json",
     ("batches", "1", "speedup_over_bf16_graph", "nemotron-h-w4a16-4o6_graph"), lambda v: f"{v:.2f}x"),
    (BENCH, "with the code of that day, on an H100, 1.84x / 1.49x", "decode-graph-compiled-pdl-h100.json", ("batches",),
     lambda b: "{:.2f}x / {:.2f}x".format(*(b[n]["speedup_over_bf16_graph"]["nemotron-h-w4a16-4o6_graph"] for n in ("16", "64")))),
    (README, "at batches 16 and 64, 1.84x / 1.92x and 1.49x / 1.50x", "decode-graph-compiled-pdl-h100.json", ("batches",),
     lambda b: "{:.2f}x / {:.2f}x and {:.2f}x / {:.2f}x".format(*(b[n]["speedup_over_bf16_graph"][f"{r}_graph"]
                                                               for n in ("16", "64") for r in ("nemotron-h-w4a16-4o6", "modelopt-lightning")))),
    (README, "and 2.14x on another H100 (decode-b1-lightning-rerun-h100.json)", "decode-b1-lightning-rerun-h100.json",
     ("batches", "1", "speedup_over_bf16_graph", "modelopt-lightning_graph"), lambda v: f"and {v:.2f}x"),
    # the Mamba step as a programmatic dependent: plain, dependent, dependent, plain on one H200
    (README, "the decode steps alone 2.13x, 2.17x, 2.17x and 2.12x", "decode-b1-mamba-plain-h200.json", ("batches", "1"),
     lambda d: "the decode steps alone " + ", ".join(
         f"{_steps_over_bf16(_load(n)['batches']['1'], 'modelopt-lightning'):.2f}x" for n in _MAMBA_AB[:3])
     + f" and {_steps_over_bf16(_load(_MAMBA_AB[3])['batches']['1'], 'modelopt-lightning'):.2f}x"),
    (README, "a one-token generate, 1.96x, 2.08x, 2.24x and 2.14x", "decode-b1-mamba-plain-h200.json", ("batches", "1"),
     lambda d: "a one-token generate, " + ", ".join(
         f"{_load(n)['batches']['1']['speedup_over_bf16_graph']['modelopt-lightning_graph']:.2f}x" for n in _MAMBA_AB[:3])
     + f" and {_load(_MAMBA_AB[3])['batches']['1']['speedup_over_bf16_graph']['modelopt-lightning_graph']:.2f}x"),
    (BENCH, "on an H200, 2.08x and 2.24x on a rerun, the decode steps alone 2.17x and 2.17x", "decode-b1-mamba-pdl-h200.json",
     ("batches", "1"), lambda d: "on an H200, {:.2f}x and {:.2f}x on a rerun, the decode steps alone {:.2f}x and {:.2f}x".format(
         d["speedup_over_bf16_graph"]["modelopt-lightning_graph"],
         _load(_MAMBA_AB[2])["batches"]["1"]["speedup_over_bf16_graph"]["modelopt-lightning_graph"],
         _steps_over_bf16(d, "modelopt-lightning"), _steps_over_bf16(_load(_MAMBA_AB[2])["batches"]["1"], "modelopt-lightning"))),
    # MoE CUDA-core tiles whose K lanes divide Nano's K, against the table's 8 x 512 tile
    (README, "one token's experts take 27.70 us at best against 21.86 on the table's\ntile, two tokens' 42.59 against 41.27",
     "kernels-sweeps-moe-gemv-unpadded-h100.json", ("rows",),
     lambda rows: "one token's experts take {:.2f} us at best against {:.2f} on the table's tile, two tokens' {:.2f} "
                  "against {:.2f}".format(*(1e3 * min(r["ms"] for r in rows if r["tokens"] == t and r["path"] == "gemv"
                                                      and (r["tile"] == [1, 8, 512, 1]) == table)
                                            for t in (1, 2) for table in (False, True)))),
    (README, "BF16 450.9, the default recipe 860.2 (1.91x)\nand `modelopt-lightning` 984.1 tokens/s (2.18x) at batch 1, 2.16x on a rerun",
     "decode-graph-compiled-pdl-h100.json", ("batches", "1"),
     lambda d: "BF16 {:.1f}, the default recipe {:.1f} ({:.2f}x) and `modelopt-lightning` {:.1f} tokens/s ({:.2f}x)".format(
         d["tokens_per_s_bf16_graph"], d["tokens_per_s_nemotron-h-w4a16-4o6_graph"],
         d["speedup_over_bf16_graph"]["nemotron-h-w4a16-4o6_graph"], d["tokens_per_s_modelopt-lightning_graph"],
         d["speedup_over_bf16_graph"]["modelopt-lightning_graph"])),
    *[(README, text, name, ("batches", "1"),
       lambda d: "{:.1f} against {:.1f}".format(d["tokens_per_s_bf16_graph"], d["tokens_per_s_modelopt-lightning_graph"]))
      for name, text in (("decode-b1-before-tails-h100.json", "443.3 against 915.3 tokens/s (2.06x"),
                         ("decode-b1-tails-h100.json", "448.4 against 928.6 (2.07x"),
                         ("decode-b1-fp8-pdl-h100.json", "449.8 against 968.5 (2.15x"))],
    *[(README, text, name, ("batches", "1", "speedup_over_bf16_graph", "modelopt-lightning_graph"), lambda v: f"({v:.2f}x")
      for name, text in (("decode-b1-before-tails-h100.json", "443.3 against 915.3 tokens/s (2.06x"),
                         ("decode-b1-tails-h100.json", "448.4 against 928.6 (2.07x"),
                         ("decode-b1-fp8-pdl-h100.json", "449.8 against 968.5 (2.15x"))],
    *[(README, text, name, ("batches", "1", "speedup_over_bf16_graph", "modelopt-lightning_graph"), lambda v: f"{v:.2f}x")
      for name, text in (("decode-b1-fp8-gemv-no-pdl-h100.json", "plainly gave 2.11x (decode-b1-fp8-gemv-no-pdl-h100.json)"),
                         ("decode-b1-fp8-pdl-other-h100.json", "against 2.15x as a dependent"),
                         ("decode-b1-fp8-pdl-no-inductor-pdl-h100.json", "without Inductor's\n2.13x"),
                         ("decode-b1-fp8-pdl-one-row-tile-h100.json", "both projections 2.01x"))],
    *[(BENCH, text, name, ("batches", "1", "speedup_over_bf16_graph", "modelopt-lightning_graph"), lambda v: f"{v:.2f}x")
      for name, text in (("decode-b1-fp8-gemv-no-pdl-h100.json", "went from 2.11x BF16's tokens/s"),
                         ("decode-b1-fp8-pdl-other-h100.json", "launched plainly to 2.15x"))],
    *[(README, text, "decode-profile-compiled-lightning-pdl-h100.json",
       ("top_kernels_per_step", "modelopt-lightning", {"kernel": k}), lambda r: f"{r['us']:.1f}")
      for k, text in (("_moe_small_kernel", "two launches 390.2 us\nper step (22)"), ("_fp8_gemv_kernel", "the FP8 GEMV 223.6 (24)"),
                      ("_gemv_kernel", "GEMVs 139.5 on the second stream"), ("_mma_kernel", "W4A16 lm_head 91.1"),
                      ("_mamba_step_kernel", "the Mamba steps 73.1"))],
    *[(README, text, "decode-profile-compiled-lightning-pdl-h100.json",
       ("top_kernels_per_step", "modelopt-lightning", {"kernel": k}), lambda r: f"({r['count']:.0f})")
      for k, text in (("_moe_small_kernel", "390.2 us\nper step (22)"), ("_fp8_gemv_kernel", "223.6 (24)"))],
    *[(BENCH, text, name, ("top_kernels_per_step", "modelopt-lightning", {"kernel": k}), lambda r: f"{r['us']:.1f}")
      for name, text in (("decode-profile-compiled-lightning-one-graph-h100.json", "took 82.1 and 48.8 us before"),
                         ("decode-profile-compiled-lightning-pdl-h100.json", "and 69.5 and 38.3 us after"))
      for k in ("_route_kernel", "_decode_attention_kernel")],
    *[(BENCH, "from 2.06x to 2.07x BF16's", name, ("batches", "1", "speedup_over_bf16_graph", "modelopt-lightning_graph"),
       lambda v: f"{v:.2f}x") for name in ("decode-b1-before-tails-h100.json", "decode-b1-tails-h100.json")],
    *[(README, "now 69.5 and 38.3 us", "decode-profile-compiled-lightning-pdl-h100.json",
       ("top_kernels_per_step", "modelopt-lightning", {"kernel": k}), lambda r: f"{r['us']:.1f}")
      for k in ("_route_kernel", "_decode_attention_kernel")],
    # the FP8 GEMV sweep on an H100, at one row
    *[(doc, text, "kernels-sweeps-fp8-gemv-h100.json", ("rows", sel, "ms"), lambda ms: f"{ms * 1e3:.1f}")
      for doc, text in ((README, "takes 11.5 us on in_proj and 5.8 on out_proj against\n`torch._scaled_mm`'s 12.6 and 6.8"),
                        (BENCH, "takes 11.5 us on in_proj and 5.8 on out_proj at one row, against 12.3 and 6.4 launched\n"
                                "plainly and 12.6 and 6.8 for `torch._scaled_mm`"))
      for sel in ({"N": 10304, "M": 1, "kernel": "gemv", "tile": [4, 1024, 2], "pdl": True},
                  {"N": 2688, "M": 1, "kernel": "gemv", "tile": [4, 1024, 2], "pdl": True},
                  {"N": 10304, "M": 1, "kernel": "_scaled_mm"}, {"N": 2688, "M": 1, "kernel": "_scaled_mm"})],
    *[(BENCH, "against 12.3 and 6.4 launched\nplainly", "kernels-sweeps-fp8-gemv-h100.json",
       ("rows", {"N": n, "M": 1, "kernel": "gemv", "tile": [4, 1024, 2], "pdl": False}, "ms"), lambda ms: f"{ms * 1e3:.1f}")
      for n in (10304, 2688)],
    *[(BENCH, "(1 x 1024:\n16.3 and 7.0)", "kernels-sweeps-fp8-gemv-h100.json",
       ("rows", {"N": n, "M": 1, "kernel": "gemv", "tile": [1, 1024, 2], "pdl": True}, "ms"), lambda ms: f"{ms * 1e3:.1f}")
      for n in (10304, 2688)],
    (BENCH, "(`max_m` 1)", "kernels-sweeps-fp8-gemv-h100.json", ("pick", "max_m"), str),
    (README, "on another H100 gave\n1.82x and 2.06x (decode-b1-one-graph-rerun-h100.json)", "decode-b1-one-graph-rerun-h100.json",
     ("batches", "1", "speedup_over_bf16_graph"),
     lambda v: "{:.2f}x and {:.2f}x".format(v["nemotron-h-w4a16-4o6_graph"], v["modelopt-lightning_graph"])),
    (README, "gave `modelopt-lightning` 842.4 tokens/s, 1.97x (decode-b1-lightning-pdl-h100.json)",
     "decode-b1-lightning-pdl-h100.json", ("batches", "1"),
     lambda d: "{:.1f} tokens/s, {:.2f}x".format(d["tokens_per_s_modelopt-lightning_graph"],
                                                 d["speedup_over_bf16_graph"]["modelopt-lightning_graph"])),
    # the in-step prefetch tried and removed
    *[(doc, text, "decode-b1-prefetch-h100.json", ("batches", "1"), fmt) for doc, text, fmt in (
        (README, "`modelopt-lightning` 885.7 tokens/s against 919.7 without it, the default\nrecipe 783.7 against 818.9",
         lambda d: "{:.1f} tokens/s against {:.1f} without it, the default recipe {:.1f} against {:.1f}".format(
             d["tokens_per_s_modelopt-lightning_graph"], d["tokens_per_s_modelopt-lightning_graph_no-prefetch"],
             d["tokens_per_s_nemotron-h-w4a16-4o6_graph"], d["tokens_per_s_nemotron-h-w4a16-4o6_graph_no-prefetch"])),
        (BENCH, "`modelopt-lightning` 885.7 against 919.7", lambda d: "{:.1f} against {:.1f}".format(
            d["tokens_per_s_modelopt-lightning_graph"], d["tokens_per_s_modelopt-lightning_graph_no-prefetch"])))],
    # a weight already in L2 (bench_prefetch.py)
    *[(BENCH, text, "prefetch-h100.json", ("rows",), _prefetch_cell(op)) for op, text in (
        ("mamba.in_proj", "`torch._scaled_mm`) 12.2 / 9.4 / 7.9"), ("mamba.out_proj", "out_proj (11.0 MB) 6.6 / 5.3 / 5.1"),
        ("shared_expert.up", "GEMV (5.6 MB) 5.0 / 4.3 / 4.1"), ("attention.qkv", "qkv (24.8 MB) 10.7 / 8.6 / 7.5"),
        ("attention.o_proj", "o_proj (22.0 MB) 10.3 / 8.1 / 6.6"))],
    (BENCH, "up and down launches together, 23.6 / 21.5 / 20.7", "prefetch-h100.json", ("moe",),
     lambda m: " / ".join(f"{m[s]['up_us'] + m[s]['down_us']:.1f}" for s in ("cold", "prefetched_up_and_down", "warm"))),
    (BENCH, "the prefetch launch itself takes 4.1-6.5 us on the 27.7 MB", "prefetch-h100.json", ("prefetch_launch_us",),
     lambda d: f"takes {_span(d.values(), 1)} us"),
    *[(doc, text, "prefetch-h100.json", (), lambda d: f"about {round(_prefetch_step_bound(d), -1):.0f} us")
      for doc, text in ((BENCH, "add up to about 80 us of the H100's 1161"), (README, "about 80 us in all"))],
    # the router inside the MoE call, as a dependent launch, the up launch as its dependent (one H100)
    (BENCH, "with the router inside the MoE block's call, on an H100, 2.23x, the decode steps alone 2.24x",
     "decode-b1-router-inside-h100.json", ("batches", "1"), lambda d: "on an H100, {:.2f}x, the decode steps alone {:.2f}x".format(
         d["speedup_over_bf16_graph"]["modelopt-lightning_graph"], _steps_over_bf16(d, "modelopt-lightning"))),
    (BENCH, "(today's tables) 2.26x, the decode steps alone 2.27x", "decode-b1-router-inside-route-pdl-h100.json",
     ("batches", "1"), lambda d: "{:.2f}x, the decode steps alone {:.2f}x".format(
         d["speedup_over_bf16_graph"]["modelopt-lightning_graph"], _steps_over_bf16(d, "modelopt-lightning"))),
    *[(README, f"| {row} | {n} |", name, ("batches", "1"),
       lambda d: "| {:.1f} | {:.2f}x |".format(d["steps_tokens_per_s_modelopt-lightning_graph"],
                                               _steps_over_bf16(d, "modelopt-lightning")))
      for row, n, name in (
          ("nothing else (the tables before)", "996.6 | 2.24x", "decode-b1-router-inside-h100.json"),
          ("the router a dependent launch (ROUTE pdl; today's tables)", "1014.0 | 2.27x",
           "decode-b1-router-inside-route-pdl-h100.json"),
          ("the up launch a dependent of the router (pdl_up, trigger)", "997.4 | 2.22x",
           "decode-b1-router-inside-up-pdl-h100.json"),
          ("both", "1019.1 | 2.26x", "decode-b1-router-inside-up-route-pdl-h100.json"))],
    (README, "gains 1.7 %; the up launch as the router's dependent 0.1 % alone\nand 0.5 % beside it",
     "decode-b1-router-inside-h100.json", ("batches", "1"),
     lambda d: "gains {:.1f} %; the up launch as the router's dependent {:.1f} % alone and {:.1f} % beside it".format(
         *(100 * (_load(a)["batches"]["1"]["steps_tokens_per_s_modelopt-lightning_graph"]
                  / _load(b)["batches"]["1"]["steps_tokens_per_s_modelopt-lightning_graph"] - 1)
           for a, b in (("decode-b1-router-inside-route-pdl-h100.json", "decode-b1-router-inside-h100.json"),
                        ("decode-b1-router-inside-up-pdl-h100.json", "decode-b1-router-inside-h100.json"),
                        ("decode-b1-router-inside-up-route-pdl-h100.json", "decode-b1-router-inside-route-pdl-h100.json"))))),
    # the issue's whole bench with the router inside the MoE call (one H100, two runs back to back)
    (BENCH, "as a dependent launch, on an H100, 1.98x, the decode steps alone 1.98x (decode-graph-compiled-h100.json)",
     "decode-graph-compiled-h100.json", ("batches", "1"), lambda d: "on an H100, {:.2f}x, the decode steps alone {:.2f}x".format(
         d["speedup_over_bf16_graph"]["nemotron-h-w4a16-4o6_graph"], _steps_over_bf16(d, "nemotron-h-w4a16-4o6"))),
    (BENCH, "with today's code, on an H100, 2.26x, the decode steps alone 2.26x (decode-graph-compiled-h100.json)",
     "decode-graph-compiled-h100.json", ("batches", "1"), lambda d: "on an H100, {:.2f}x, the decode steps alone {:.2f}x".format(
         d["speedup_over_bf16_graph"]["modelopt-lightning_graph"], _steps_over_bf16(d, "modelopt-lightning"))),
    (BENCH, "2.26x and 2.27x in two runs", "decode-graph-compiled-h100.json", ("batches", "1"),
     lambda d: "{:.2f}x and {:.2f}x in two runs".format(
         _steps_over_bf16(d, "modelopt-lightning"),
         _steps_over_bf16(_load("decode-b1-router-inside-route-pdl-h100.json")["batches"]["1"], "modelopt-lightning"))),
    (BENCH, "(today's code), on an H100, 1.86x / 1.50x", "decode-graph-compiled-h100.json", (),
     lambda d: "on an H100, {:.2f}x / {:.2f}x".format(
         d["batches"]["16"]["speedup_over_bf16_graph"]["nemotron-h-w4a16-4o6_graph"],
         _load("decode-graph-compiled-b64-h100.json")["batches"]["64"]["speedup_over_bf16_graph"]["nemotron-h-w4a16-4o6_graph"])),
    # the issue's whole bench, today's code, on an H200 (batches 1 and 16)
    (BENCH, "the same code on an H200, 2.22x, the decode steps alone 2.04x", "decode-graph-compiled-router-inside-h200.json",
     ("batches", "1"), lambda d: "on an H200, {:.2f}x, the decode steps alone {:.2f}x".format(
         d["speedup_over_bf16_graph"]["nemotron-h-w4a16-4o6_graph"], _steps_over_bf16(d, "nemotron-h-w4a16-4o6"))),
    *[(BENCH, quoted, "decode-graph-compiled-router-inside-h200.json", ("batches", "1"),
       lambda d, fmt=fmt: fmt.format(d["speedup_over_bf16_graph"]["modelopt-lightning_graph"],
                                     _steps_over_bf16(d, "modelopt-lightning")))
      for quoted, fmt in (("on an H200, 2.30x, the decode steps alone 2.25x", "on an H200, {:.2f}x, the decode steps alone {:.2f}x"),
                          ("on an H200 (2.30x; the decode steps, whose rate spreads least from run to run, 2.25x)",
                           "on an H200 ({:.2f}x; the decode steps, whose rate spreads least from run to run, {:.2f}x)"))],
    (BENCH, "batch 16 with today's code on an H200, 1.94x, `modelopt-lightning` 2.03x", "decode-graph-compiled-router-inside-h200.json",
     ("batches", "16", "speedup_over_bf16_graph"), lambda sp: "on an H200, {:.2f}x, `modelopt-lightning` {:.2f}x".format(
         sp["nemotron-h-w4a16-4o6_graph"], sp["modelopt-lightning_graph"])),
    # the packed GEMM's time against its K tiles per program (bench_packed.py --chain, H100)
    *[(BENCH, text, "packed-gemm-chain-h100.json", ("fits",),
       lambda fits, split=split, key=key, form=form: form.format(
           *(_chain_fit(fits, m, split, "warm")[key] for m in (1, 16, 64))))
      for text, split, key, form in (
          ("each K tile adds 0.42 us at 1 row, 0.45 at 16 and 0.51 at 64", 1, "us_per_tile",
           "{:.2f} us at 1 row, {:.2f} at 16 and {:.2f} at 64"),
          ("launch costs 1.49, 1.50 and 1.66 us whatever its K", 1, "intercept_us", "{:.2f}, {:.2f} and {:.2f} us"),
          ("(0.46, 0.42 and 0.67 us)", 4, "us_per_tile", "({:.2f}, {:.2f} and {:.2f} us)"),
          ("grows with the rows: 2.89, 3.57 and 5.59 us", 4, "intercept_us", "{:.2f}, {:.2f} and {:.2f} us"))],
    (BENCH, "about\n3.9 us are the split itself", "packed-gemm-chain-h100.json", ("fits",),
     lambda fits: "about {:.1f} us are the split itself".format(
         _chain_fit(fits, 64, 4, "warm")["intercept_us"] - _chain_fit(fits, 64, 1, "warm")["intercept_us"])),
    (BENCH, "about 3.9 us is its split of K", "packed-gemm-chain-h100.json", ("fits",),
     lambda fits: "about {:.1f} us is its split".format(
         _chain_fit(fits, 64, 4, "warm")["intercept_us"] - _chain_fit(fits, 64, 1, "warm")["intercept_us"])),
    # the split-K epilogue in parts (bench_split_epilogue.py, H100)
    *[(BENCH, f"| {label} | {cells} |", "split-epilogue-h100.json", ("rows",),
       lambda rows, case=case: "| " + " | ".join(
           "{:.2f} / {:.2f}".format(*(_epilogue_row(rows, n, case, None if case == "bf16" else split)[f"us_{s}"]
                                     for s in ("warm", "cold")))
           for n, split in ((3712, 4), (2688, 6))) + " |")
      for label, case, cells in (
          ("the library's (partials, counter, the last program's sums)", "EPI 0", "9.87 / 11.14 | 9.80 / 11.20"),
          ("partials and counter, no sums", "EPI 1", "8.14 / 9.41 | 8.07 / 8.95"),
          ("the counter alone", "EPI 2", "7.43 / 8.90 | 7.12 / 8.22"),
          ("none (each program stores its own partial)", "EPI 3", "6.82 / 8.15 | 6.50 / 7.55"),
          ("partials, summed by a second launch", "EPI 5", "9.24 / 10.58 | 9.18 / 10.25"),
          ("bf16 torch.matmul", "bf16", "7.94 / 10.07 | 8.47 / 10.53"))],
    (BENCH, "the epilogue costs\n3.1 and 3.3 us warm", "split-epilogue-h100.json", ("rows",),
     lambda rows: "costs {:.1f} and {:.1f} us warm".format(*(
         _epilogue_row(rows, n, "EPI 0", sp)["us_warm"] - _epilogue_row(rows, n, "EPI 3", sp)["us_warm"]
         for n, sp in ((3712, 4), (2688, 6))))),
    (BENCH, "summing of the partials is 1.7 us on\nboth shapes, the partial stores 0.7 and 0.9 and the counter 0.6",
     "split-epilogue-h100.json", ("rows",),
     lambda rows: "is {:.1f} us on both shapes, the partial stores {:.1f} and {:.1f} and the counter {:.1f}".format(
         *{round(_epilogue_part(rows, n, sp, "EPI 0", "EPI 1"), 1) for n, sp in ((3712, 4), (2688, 6))},
         *(_epilogue_part(rows, n, sp, "EPI 1", "EPI 2") for n, sp in ((3712, 4), (2688, 6))),
         *{round(_epilogue_part(rows, n, sp, "EPI 2", "EPI 3"), 1) for n, sp in ((3712, 4), (2688, 6))})),
    (BENCH, "saves 0.6 us warm, not enough (0.86x and 0.92x bf16 warm)", "split-epilogue-h100.json", ("rows",),
     lambda rows: "saves {:.1f} us warm, not enough ({:.2f}x and {:.2f}x bf16 warm)".format(
         *{round(_epilogue_part(rows, n, sp, "EPI 0", "EPI 5"), 1) for n, sp in ((3712, 4), (2688, 6))},
         *(_epilogue_row(rows, n, "bf16", None)["us_warm"] / _epilogue_row(rows, n, "EPI 5", sp)["us_warm"]
           for n, sp in ((3712, 4), (2688, 6))))),
    (BENCH, "6.82 / 8.15 against 7.94 / 10.07 us warm / cold", "split-epilogue-h100.json", ("rows",),
     lambda rows: "{:.2f} / {:.2f} against {:.2f} / {:.2f} us".format(
         _epilogue_row(rows, 3712, "EPI 3", 4)["us_warm"], _epilogue_row(rows, 3712, "EPI 3", 4)["us_cold"],
         _epilogue_row(rows, 3712, "bf16", None)["us_warm"], _epilogue_row(rows, 3712, "bf16", None)["us_cold"])),
    # the split of K inside each program (bench_packed.py --ws, H100)
    *[(BENCH, f"| {n} x {k} | {cells} |", "packed-gemm-ws-h100.json", ("ws",),
       lambda rows, n=n: "| " + " | ".join("{:.2f} / {:.2f}".format(r["ms_warm"] * 1e3, r["ms_cold"] * 1e3)
                                          for r in (_ws_row(rows, n, 64, "ws", {"BLOCK_M": 32, "P": 4, "SPLIT": 1}),
                                                    _ws_row(rows, n, 64, "packed"), _ws_row(rows, n, 64, "bf16"))) + " |")
      for n, k, cells in ((3712, 2688, "8.35 / 10.06 | 9.29 / 10.73 | 7.57 / 10.01"),
                          (2688, 3712, "9.44 / 11.43 | 9.98 / 11.00 | 8.15 / 10.51"))],
    (BENCH, "(6.55 against 6.18 us, split 2\nways) and faster cold (7.90 against 8.68)", "packed-gemm-ws-h100.json", ("ws",),
     lambda rows: "({:.2f} against {:.2f} us, split 2 ways) and faster cold ({:.2f} against {:.2f})".format(
         _ws_row(rows, 3712, 16, "ws", {"BLOCK_M": 16, "P": 4, "SPLIT": 2})["ms_warm"] * 1e3,
         _ws_row(rows, 3712, 16, "packed")["ms_warm"] * 1e3,
         _ws_row(rows, 3712, 16, "ws", {"BLOCK_M": 16, "P": 4, "SPLIT": 2})["ms_cold"] * 1e3,
         _ws_row(rows, 3712, 16, "packed")["ms_cold"] * 1e3)),
    (BENCH, "It gained 0.9 us warm on 3712 x 2688", "packed-gemm-ws-h100.json", ("ws",),
     lambda rows: "gained {:.1f} us warm".format(1e3 * (_ws_row(rows, 3712, 64, "packed")["ms_warm"] - _ws_row(
         rows, 3712, 64, "ws", {"BLOCK_M": 32, "P": 4, "SPLIT": 1})["ms_warm"]))),
    (BENCH, "1.5 us above the split launch with no epilogue at all (6.82 us\nwarm, above)", "packed-gemm-ws-h100.json", ("ws",),
     lambda rows: "{:.1f} us above the split launch with no epilogue at all ({:.2f} us".format(
         _ws_row(rows, 3712, 64, "ws", {"BLOCK_M": 32, "P": 4, "SPLIT": 1})["ms_warm"] * 1e3
         - _epilogue_row(_load("split-epilogue-h100.json")["rows"], 3712, "EPI 3", 4)["us_warm"],
         _epilogue_row(_load("split-epilogue-h100.json")["rows"], 3712, "EPI 3", 4)["us_warm"])),
    (BENCH, "took 8.35 / 10.06 against bf16's 7.57 / 10.01", "packed-gemm-ws-h100.json", ("ws",),
     lambda rows: "took {:.2f} / {:.2f} against bf16's {:.2f} / {:.2f}".format(
         *(1e3 * r[f"ms_{s}"] for r in (_ws_row(rows, 3712, 64, "ws", {"BLOCK_M": 32, "P": 4, "SPLIT": 1}),
                                        _ws_row(rows, 3712, 64, "bf16")) for s in ("warm", "cold")))),
    # the chunked warp-specialized kernel (bench_packed.py --ws, H100), the prototype with codes further
    # ahead and the decoding with rotations on the same machine
    *[(BENCH, f"| {n} x {k} | {cells} |", "packed-gemm-ws-chunks-h100.json", ("ws",),
       lambda rows, n=n: "| " + " | ".join("{:.2f} / {:.2f}".format(r["ms_warm"] * 1e3, r["ms_cold"] * 1e3)
                                          for r in (_ws_row(rows, n, 64, "ws", WS_DEFAULT), _ws_row(rows, n, 64, "packed"),
                                                    _ws_row(rows, n, 64, "bf16"))) + " |")
      for n, k, cells in ((3712, 2688, "8.07 / 8.62 | 8.95 / 10.76 | 7.57 / 9.98"),
                          (2688, 3712, "9.55 / 10.05 | 10.00 / 10.94 | 8.25 / 10.52"))],
    *[(doc, quoted, "packed-gemm-ws-chunks-h100.json", ("ws",),
       lambda rows, fmt=fmt: fmt.format(*(_ws_row(rows, n, 64, "bf16")[f"ms_{s}"] / _ws_row(rows, n, 64, "ws", WS_DEFAULT)[f"ms_{s}"]
                                          for s in ("cold", "warm") for n in (3712, 2688))))
      for doc, quoted, fmt in ((BENCH, "(1.16x and 1.05x); warm it is not (0.94x and 0.86x)",
                                "({:.2f}x and {:.2f}x); warm it is not ({:.2f}x and {:.2f}x)"),
                               (BENCH, "1.16x and 1.05x, but 0.94x and 0.86x warm",
                                "{:.2f}x and {:.2f}x, but {:.2f}x and {:.2f}x warm"))],
    (BENCH, "8.07 / 8.62 against 7.57 / 9.98 on 3712 x 2688 and 9.55 / 10.05 against 8.25 / 10.52 on 2688 x 3712",
     "packed-gemm-ws-chunks-h100.json", ("ws",),
     lambda rows: " and ".join("{:.2f} / {:.2f} against {:.2f} / {:.2f} on {} x {}".format(
         *(1e3 * r[f"ms_{s}"] for r in (_ws_row(rows, n, 64, "ws", WS_DEFAULT), _ws_row(rows, n, 64, "bf16"))
           for s in ("warm", "cold")), n, k) for n, k in ((3712, 2688), (2688, 3712)))),
    (BENCH, "gain 0.23 and 0.20 us warm at 64 rows", "packed-gemm-ws-chunks-h100.json", ("ws",),
     lambda rows: "gain {:.2f} and {:.2f} us warm".format(*(1e3 * (
         _ws_row(_load("packed-gemm-ws-chunks-rotate-h100.json")["ws"], n, 64, "ws", WS_DEFAULT)["ms_warm"]
         - _ws_row(rows, n, 64, "ws", WS_DEFAULT)["ms_warm"]) for n in (3712, 2688)))),
    (BENCH, "takes 9.27 against 8.07 us warm on\n3712 x 2688", "packed-gemm-ws-chunks-h100.json", ("ws",),
     lambda rows: "takes {:.2f} against {:.2f} us warm".format(
         *(1e3 * _ws_row(rows, 3712, 64, "ws", cfg)["ms_warm"] for cfg in ({"BLOCK_M": 32, "P": 4, "XS": 6}, WS_DEFAULT)))),
    (BENCH, "(7.12 / 7.71 and 8.38 / 8.91 us against bf16's\n6.38 / 9.91 and 9.04 / 13.13)",
     "packed-gemm-ws-chunks-h100.json", ("ws",),
     lambda rows: "({:.2f} / {:.2f} and {:.2f} / {:.2f} us against bf16's {:.2f} / {:.2f} and {:.2f} / {:.2f})".format(
         *(1e3 * _ws_row(rows, n, 32, "ws", {"BLOCK_M": 16, "P": 4})[f"ms_{s}"] for n in (3712, 2688) for s in ("warm", "cold")),
         *(1e3 * _ws_row(rows, n, 32, "bf16")[f"ms_{s}"] for n in (3712, 2688) for s in ("warm", "cold")))),
    (BENCH, "9.92-10.61\nagainst 8.27 us warm on 3712 x 2688", "packed-gemm-ws-ahead-h100.json", ("ws",),
     lambda rows: "{:.2f}-{:.2f} against {:.2f} us warm".format(
         *(f(1e3 * _ws_row(rows, 3712, 64, "ws", cfg)["ms_warm"] for cfg in (
             {"BLOCK_M": 32, "P": 4, "XS": 3, "AHEAD": 2}, {"BLOCK_M": 32, "P": 4, "XS": 3, "AHEAD": 3},
             {"BLOCK_M": 32, "P": 4, "XS": 4, "AHEAD": 3})) for f in (min, max)),
         1e3 * _ws_row(rows, 3712, 64, "ws", {"BLOCK_M": 32, "P": 4})["ms_warm"])),
    (BENCH, "10.98 against 9.77\nwith 64 rows", "packed-gemm-ws-ahead-h100.json", ("ws",),
     lambda rows: "{:.2f} against {:.2f} with 64 rows".format(
         *(1e3 * _ws_row(rows, 3712, 64, "ws", cfg)["ms_warm"] for cfg in ({"BLOCK_M": 64, "P": 4, "AHEAD": 2},
                                                                             {"BLOCK_M": 64, "P": 4})))),
    # the unrolled loop (constant buffer indices): against the loop before in one process, the
    # canonical bench run after it, its Nsight Compute metrics, its sm_90 listing, and the dropped
    # mma.sync variant
    *[(BENCH, f"| {n} x {k} | {cells} |", "packed-gemm-ws-unrolled-ab-h100.json", ("ws",),
       lambda rows, n=n: "| " + " | ".join("{:.2f} / {:.2f}".format(r["ms_warm"] * 1e3, r["ms_cold"] * 1e3)
                                          for r in (_ws_row(rows, n, 64, "ws-old", WS_DEFAULT), _ws_row(rows, n, 64, "ws", WS_DEFAULT),
                                                    _ws_row(rows, n, 64, "bf16"))) + " |")
      for n, k, cells in ((3712, 2688, "8.22 / 8.74 | 7.85 / 9.04 | 8.14 / 10.15"),
                          (2688, 3712, "9.51 / 10.06 | 9.09 / 10.38 | 8.62 / 10.53"))],
    (BENCH, "0.36 and 0.42 us faster warm, 0.30 and 0.32 slower cold", "packed-gemm-ws-unrolled-ab-h100.json", ("ws",),
     lambda rows: "{:.2f} and {:.2f} us faster warm, {:.2f} and {:.2f} slower cold".format(*(
         1e3 * sign * (_ws_row(rows, n, 64, "ws-old", WS_DEFAULT)[f"ms_{s}"] - _ws_row(rows, n, 64, "ws", WS_DEFAULT)[f"ms_{s}"])
         for s, sign in (("warm", 1), ("cold", -1)) for n in (3712, 2688)))),
    *[(doc, quoted, "packed-gemm-ws-unrolled-h100.json", ("ws",),
       lambda rows, fmt=fmt: fmt.format(*(1e3 * r[f"ms_{s}"] for n in (3712, 2688) for r in (
           _ws_row(rows, n, 64, "ws", WS_DEFAULT), _ws_row(rows, n, 64, "bf16")) for s in ("warm", "cold"))))
      for doc, quoted, fmt in (
          (BENCH, "gives 7.87 / 9.08 against bf16's\n8.17 / 10.18 on 3712 x 2688",
           "gives {:.2f} / {:.2f} against bf16's {:.2f} / {:.2f} on 3712 x 2688"),
          (BENCH, "7.87 / 9.08 against bf16's 8.17 / 10.18 on 3712 x 2688 and 9.09 / 10.39 against 8.54 / 10.49 on "
                   "2688 x 3712", "{:.2f} / {:.2f} against bf16's {:.2f} / {:.2f} on 3712 x 2688 and {:.2f} / {:.2f} "
                                  "against {:.2f} / {:.2f} on 2688 x 3712"))],
    (BENCH, "9.09 / 10.39 against\n8.54 / 10.49 on 2688 x 3712", "packed-gemm-ws-unrolled-h100.json", ("ws",),
     lambda rows: "{:.2f} / {:.2f} against {:.2f} / {:.2f} on 2688 x 3712".format(*(
         1e3 * r[f"ms_{s}"] for r in (_ws_row(rows, 2688, 64, "ws", WS_DEFAULT), _ws_row(rows, 2688, 64, "bf16"))
         for s in ("warm", "cold")))),
    (BENCH, "faster warm (1.04x) and cold (1.12x)", "packed-gemm-ws-unrolled-h100.json", ("ws",),
     lambda rows: "faster warm ({:.2f}x) and cold ({:.2f}x)".format(*(
         _ws_row(rows, 3712, 64, "bf16")[f"ms_{s}"] / _ws_row(rows, 3712, 64, "ws", WS_DEFAULT)[f"ms_{s}"]
         for s in ("warm", "cold")))),
    (BENCH, "faster cold (1.01x) but not warm (0.94x)", "packed-gemm-ws-unrolled-h100.json", ("ws",),
     lambda rows: "faster cold ({:.2f}x) but not warm ({:.2f}x)".format(*(
         _ws_row(rows, 2688, 64, "bf16")[f"ms_{s}"] / _ws_row(rows, 2688, 64, "ws", WS_DEFAULT)[f"ms_{s}"]
         for s in ("cold", "warm")))),
    (BENCH, "with three, 9.68 /\n9.93 us on 3712 x 2688", "packed-gemm-ws-unrolled-h100.json", ("ws",),
     lambda rows: "with three, {:.2f} / {:.2f} us".format(*(
         1e3 * _ws_row(rows, 3712, 64, "ws", {"BLOCK_M": 32, "P": 4, "XS": 3})[f"ms_{s}"] for s in ("warm", "cold")))),
    (BENCH, "issues\non 38-42 % of a scheduler's cycles", "packed-gemm-ws-unrolled-ab-h100.json", ("ncu",),
     lambda runs: "on {} % of".format(_span([r["metrics"]["smsp__issue_active.avg.pct_of_peak_sustained_active"]
                                              for r in runs], 0))),
    (BENCH, "2.0-2.5 cycles at\nbarriers", "packed-gemm-ws-unrolled-ab-h100.json", ("ncu",),
     lambda runs: "{} cycles at".format(_span([r["metrics"][
         "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio"] for r in runs], 1))),
    (BENCH, "1.4-1.6 on loads", "packed-gemm-ws-unrolled-ab-h100.json", ("ncu",),
     lambda runs: "{} on loads".format(_span([r["metrics"][
         "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio"] for r in runs], 1))),
    (BENCH, "1.2-1.5 for instructions to be fetched", "packed-gemm-ws-unrolled-ab-h100.json", ("ncu",),
     lambda runs: "{} for instructions".format(_span([r["metrics"][
         "smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio"] for r in runs], 1))),
    (BENCH, "the default launch's four loops come to 1720\ninstructions, 27.5 KB at 16 bytes each; two warpgroups with two buffers each (64 rows) to 845",
     "packed-ws-sass.json", ("rows",), lambda rows: "come to {} instructions, {:.1f} KB at 16 bytes each; two warpgroups with two buffers each (64 rows) to {}".format(
         rows[0]["loop_instructions_all_partitions"], rows[0]["loop_instructions_all_partitions"] * 16 / 1000,
         next(r["loop_instructions_all_partitions"] for r in rows if (r["BLOCK_M"], r["P"], r["XS"]) == (64, 2, 2)))),
    (BENCH, "take 212.0-216.5\ninstructions per K tile and warp, with no descriptor arithmetic and 20-20.5 byte permutes",
     "packed-ws-sass.json", ("rows", 0, "loop_per_tile"),
     lambda tiles: "take {}-{} instructions per K tile and warp, with no descriptor arithmetic and {}-{} byte "
                   "permutes".format(min(t["instructions"] for t in tiles), max(t["instructions"] for t in tiles),
                                     *(f"{f(t['PRMT'] for t in tiles):g}" for f in (min, max)))
     if all(t["descriptor_ops"] == 0 for t in tiles) else "descriptor arithmetic in the loop"),
    (BENCH, "8.99 against 7.99 us warm at the default launch on 3712 x\n2688", "packed-gemm-ws-mma-sync-h100.json", ("ws",),
     lambda rows: "{:.2f} against {:.2f} us warm".format(*(
         1e3 * _ws_row(rows, 3712, 64, "ws", cfg)["ms_warm"] for cfg in ({"BLOCK_M": 32, "P": 4, "MMA": 2}, WS_DEFAULT)))),
    (BENCH, "8.51 / 9.24 against 6.94 / 10.04 us on 3712 x 2688, 9.28 /\n10.33 against 9.35 / 13.04 on 2688 x 3712",
     "packed-gemm-ws-split-h100.json", ("ws",),
     lambda rows: ", ".join("{:.2f} / {:.2f} against {:.2f} / {:.2f}{} on {} x {}".format(
         *(1e3 * r[f"ms_{s}"] for r in (_ws_row(rows, n, 48, "ws", WS_DEFAULT), _ws_row(rows, n, 48, "bf16"))
           for s in ("warm", "cold")), " us" if n == 3712 else "", n, k) for n, k in ((3712, 2688), (2688, 3712)))),
    (BENCH, "at 48 rows 8.51 against bf16's 6.94 warm on 3712 x 2688", "packed-gemm-ws-split-h100.json", ("ws",),
     lambda rows: "at 48 rows {:.2f} against bf16's {:.2f} warm".format(
         *(1e3 * r["ms_warm"] for r in (_ws_row(rows, 3712, 48, "ws", WS_DEFAULT), _ws_row(rows, 3712, 48, "bf16"))))),
    (BENCH, "takes 9.35 / 11.13 against 9.11 / 10.36 unsplit", "packed-gemm-ws-split-h100.json", ("ws",),
     lambda rows: "takes {:.2f} / {:.2f} against {:.2f} / {:.2f} unsplit".format(
         *(1e3 * r[f"ms_{s}"] for r in (_ws_row(rows, 2688, 64, "ws", {"BLOCK_M": 64, "P": 2, "SPLIT": 3}),
                                        _ws_row(rows, 2688, 64, "ws", WS_DEFAULT)) for s in ("warm", "cold")))),
    (BENCH, "against 4.0 us for the six K tiles", "packed-gemm-chain-h100.json", ("fits",),
     lambda fits: "against {:.1f} us".format(6 * _chain_fit(fits, 64, 4, "warm")["us_per_tile"])),
    (BENCH, "(a fixed\n6.11 against 2.05 us)", "packed-gemm-chain-h100.json", ("fits",),
     lambda fits: "(a fixed {:.2f} against {:.2f} us)".format(
         _chain_fit(fits, 64, 4, "cold")["intercept_us"], _chain_fit(fits, 64, 1, "cold")["intercept_us"])),
    (README, "0.7-2.7 us per projection\nand 2.1 us per token's routed experts", "prefetch-h100.json", (),
     lambda d: "{} us per projection and {:.1f} us per token's".format(
         _span([v for k, v in _prefetch_gains(d).items() if k != "moe"], 1), _prefetch_gains(d)["moe"])),
    # every row count, 1-64 (packed-gemm-rows-fill-h100.json; packed-gemm-rows-h100.json before the
    # 16-row entry's cold pick and WS min_fill)
    *[(doc, text, "packed-gemm-rows-fill-h100.json", ("rows",), _rows_ratio(n, "dispatch", state, lo, hi))
      for doc, text, n, state, lo, hi in (
        (BENCH, "| 3712 x 2688 | 1.14-1.52x at every row count", 3712, "cold", 1, 64),
        (BENCH, "| 2688 x 3712 | 1.05-1.93x at every row count", 2688, "cold", 1, 64),
        (BENCH, "at every row count | 1.03-1.33x up to 16 rows", 3712, "warm", 1, 16),
        (BENCH, "up to 16 rows, 0.83-1.02x at 20-56", 3712, "warm", 20, 56),
        (BENCH, "0.83-1.02x at 20-56, 1.00-1.03x at 60-64", 3712, "warm", 60, 64),
        (BENCH, "| 0.92-1.55x; below 1.0 at 44, 52, 56, 60 and 64 rows |", 2688, "warm", 1, 64),
        (BENCH, "1.14-1.52x bf16 on 3712 x 2688 and 1.05-1.93x", 3712, "cold", 1, 64),
        (BENCH, "1.14-1.52x bf16 on 3712 x 2688 and 1.05-1.93x", 2688, "cold", 1, 64),
        (BENCH, "warm 0.83-1.02x at 20-56 rows on 3712 x 2688", 3712, "warm", 20, 56))],
    # packed_cluster at 16-48 rows of 3712 x 2688 (packed-gemm-rows-cluster-h100.json)
    *[(doc, text, "packed-gemm-rows-cluster-h100.json", ("rows",), _rows_ratio(n, "dispatch", state, lo, hi))
      for doc, text, n, state, lo, hi in (
        (BENCH, "1.12-1.51x bf16 on 3712 x 2688 and 1.02-1.89x", 3712, "cold", 1, 64),
        (BENCH, "1.12-1.51x bf16 on 3712 x 2688 and 1.02-1.89x", 2688, "cold", 1, 64),
        (BENCH, "that L2 keeps, 0.88-1.05x at 20-56 rows", 3712, "warm", 20, 56),
        (BENCH, "and 0.95-1.01x at 52-64 rows on 2688 x 3712", 2688, "warm", 52, 64),
        (BENCH, "| 3712 x 2688 | 1.12-1.51x at every row count", 3712, "cold", 1, 64),
        (BENCH, "| 2688 x 3712 | 1.02-1.89x at every row count", 2688, "cold", 1, 64),
        (BENCH, "at every row count | 1.09-1.31x up to 16 rows", 3712, "warm", 1, 16),
        (BENCH, "up to 16 rows, 0.88-1.05x at 20-56", 3712, "warm", 20, 56),
        (BENCH, "0.88-1.05x at 20-56, 1.02-1.03x at 60-64", 3712, "warm", 60, 64),
        (BENCH, "| 0.95-1.53x; below 1.0 at 52, 60 and 64 rows |", 2688, "warm", 1, 64))],
    (BENCH, "below 1.0 at 52, 60 and 64 rows", "packed-gemm-rows-cluster-h100.json", ("rows",),
     lambda rows: "below 1.0 at {} and {} rows".format(*(lambda ms: (", ".join(ms[:-1]), ms[-1]))(
         [str(m) for m in _rows_ms(rows) if _rows_cell(rows, 2688, m, "bf16")["ms_warm"] < _rows_cell(rows, 2688, m, "dispatch")["ms_warm"]]))),
    (BENCH, "(below 1.0 at 20-28 and 36-56)", "packed-gemm-rows-cluster-h100.json", ("rows",),
     lambda rows: "(below 1.0 at {} and {})".format(*(lambda ms: ("{}-{}".format(ms[0], ms[2]), "{}-{}".format(ms[3], ms[-1])))(
         [m for m in _rows_ms(rows) if _rows_cell(rows, 3712, m, "bf16")["ms_warm"] < _rows_cell(rows, 3712, m, "dispatch")["ms_warm"]]))
     if [m for m in _rows_ms(rows) if _rows_cell(rows, 3712, m, "bf16")["ms_warm"] < _rows_cell(rows, 3712, m, "dispatch")["ms_warm"]]
     == [20, 24, 28, 36, 40, 44, 48, 52, 56] else "other rows"),
    (BENCH, "takes 0.15-0.61 us warm and 0.16-0.56 cold off `packed_linear` at 16-48 rows on 3712 x 2688",
     ("packed-gemm-rows-fill-h100.json", "packed-gemm-rows-cluster-h100.json"), ("rows",),
     lambda old, new: "takes {} us warm and {} cold off".format(*(_span(
         [(_rows_cell(old, 3712, m, "dispatch")[f"ms_{st}"] - _rows_cell(new, 3712, m, "dispatch")[f"ms_{st}"]) * 1e3
          for m in _rows_ms(new) if 16 <= m <= 48], 2) for st in ("warm", "cold")))),
    (BENCH, "takes 5.79-7.37 / 7.00-8.51 us warm / cold at 16-48\n  rows where it took 6.40-7.81 / 7.56-8.86",
     ("packed-gemm-rows-cluster-h100.json", "packed-gemm-rows-fill-h100.json"), ("rows",),
     lambda new, old: "takes {} / {} us warm / cold at 16-48 rows where it took {} / {}".format(*(
         _span([_rows_cell(d, 3712, m, "dispatch")[f"ms_{st}"] * 1e3 for m in _rows_ms(d) if 16 <= m <= 48], 2)
         for d in (new, old) for st in ("warm", "cold")))),
    # packed_cluster's stages and launch shapes (packed-cluster-h100.json)
    *[(BENCH, text, "packed-cluster-h100.json", ("cluster",),
       lambda rows, m=m: "| 3712 x 2688, {} | {} |".format(m, " | ".join(
           _us(_cluster_cell(rows, 3712, m, *args)) for args in (
               ("cluster", CLUSTER_DEFAULT), ("cluster", None, "plain"), ("cluster", None, "no-x"),
               ("cluster", None, "no-mma"), ("cluster", None, "no-x-no-mma"), ("dispatch",), ("bf16",)))))
      for text, m in (("| 3712 x 2688, 16 | 5.79 / 7.03 | 8.24 / 9.07 | 5.17 / 6.47 | 5.33 / 6.69 | 4.60 / 6.15 | 5.74 / 7.01 | 6.35 / 9.91 |", 16),
                      ("| 3712 x 2688, 48 | 7.29 / 8.45 | 15.19 / 15.99 | 6.10 / 7.39 | 6.31 / 7.69 | 5.22 / 6.87 | 7.30 / 8.42 | 7.15 / 10.11 |", 48),
                      ("| 3712 x 2688, 64 | 8.18 / 9.30 | 20.29 / 21.09 | 6.81 / 8.09 | 6.94 / 8.36 | 5.62 / 7.32 | 7.73 / 8.88 | 7.80 / 10.09 |", 64))],
    (BENCH, "a launch took up to\n12.11 us longer", "packed-cluster-h100.json", ("cluster",),
     lambda rows: "up to {:.2f} us longer".format(max(
         (_cluster_cell(rows, n, m, "cluster", None, "plain")["ms_warm"] - _cluster_cell(rows, n, m, "cluster", CLUSTER_DEFAULT)["ms_warm"]) * 1e3
         for n in (3712, 2688) for m in _rows_ms(rows)))),
    (BENCH, "At 48-64 rows the copies take 1.19-1.37 us warm and the wgmma 0.98-1.24", "packed-cluster-h100.json", ("cluster",),
     lambda rows: "the copies take {} us warm and the wgmma {}".format(*(_span([
         (_cluster_cell(rows, 3712, m, "cluster", CLUSTER_DEFAULT)["ms_warm"] - _cluster_cell(rows, 3712, m, "cluster", None, v)["ms_warm"]) * 1e3
         for m in (48, 64)], 2) for v in ("no-x", "no-mma")))),
    (BENCH, "the launch, 4.60-5.62 us at 16-64\nrows", "packed-cluster-h100.json", ("cluster",),
     lambda rows: "the launch, {} us at 16-64".format(_span([_cluster_cell(rows, 3712, m, "cluster", None, "no-x-no-mma")["ms_warm"] * 1e3
                                                              for m in (16, 48, 64)], 2))),
    (BENCH, "7.63, clusters of 2 (3 tiles) 5.79, of 4 (two waves of 2 tiles) 9.01", "packed-cluster-h100.json", ("cluster",),
     lambda rows: "{:.2f}, clusters of 2 (3 tiles) {:.2f}, of 4 (two waves of 2 tiles) {:.2f}".format(*(
         _cluster_cell(rows, 3712, 16, "cluster", {"WG": 4, "CL": q, "STAGES": 3})["ms_warm"] * 1e3 for q in (1, 2, 4)))),
    (BENCH, "a K\ntile costs a warpgroup 0.61 us and a block 2.6 besides", "packed-cluster-h100.json", ("cluster",),
     lambda rows: (lambda t: "tile costs a warpgroup {:.2f} us and a block {:.1f} besides".format(
         (t[1] - t[2]) / 3, (t[4] - 4 * (t[1] - t[2]) / 3) - (t[2] - (t[1] - t[2]))))(
         {q: _cluster_cell(rows, 3712, 16, "cluster", {"WG": 4, "CL": q, "STAGES": 3})["ms_warm"] * 1e3 for q in (1, 2, 4)})),
    (BENCH, "Clusters of 3 take 9.20-15.53 us against 5.79-9.31 for 2", "packed-cluster-h100.json", ("cluster",),
     lambda rows: "Clusters of 3 take {} us against {} for 2".format(*(_span([
         _cluster_cell(rows, n, m, "cluster", {"WG": 4, "CL": q, "STAGES": 3})["ms_warm"] * 1e3
         for n in (3712, 2688) for m in _rows_ms(rows)], 2) for q in (3, 2)))),
    (BENCH, "within -0.63 to +0.18 us of four warm and 0.60-1.71 us slower cold", "packed-cluster-h100.json", ("cluster",),
     lambda rows: "within {:+.2f} to {:+.2f} us of four warm and {} us slower cold".format(*(lambda d: (min(d["warm"]), max(d["warm"]), _span(d["cold"], 2)))(
         {st: [(_cluster_cell(rows, n, m, "cluster", {"WG": 2, "CL": 2, "STAGES": 3})[f"ms_{st}"]
                - _cluster_cell(rows, n, m, "cluster", CLUSTER_DEFAULT)[f"ms_{st}"]) * 1e3
               for n in (3712, 2688) for m in _rows_ms(rows)] for st in ("warm", "cold")}))),
    (BENCH, "below 1.0 at 44, 52, 56, 60 and 64 rows", "packed-gemm-rows-fill-h100.json", ("rows",),
     lambda rows: "below 1.0 at {} and {} rows".format(*(lambda ms: (", ".join(ms[:-1]), ms[-1]))(
         [str(m) for m in _rows_ms(rows) if _rows_cell(rows, 2688, m, "bf16")["ms_warm"] < _rows_cell(rows, 2688, m, "dispatch")["ms_warm"]]))),
    (BENCH, "0.92-0.98x at 44 and 52-64 rows on 2688 x 3712", "packed-gemm-rows-fill-h100.json", ("rows",),
     lambda rows: "{}x".format(_span([_rows_cell(rows, 2688, m, "bf16")["ms_warm"] / _rows_cell(rows, 2688, m, "dispatch")["ms_warm"]
                                      for m in (44, 52, 56, 60, 64)], 2))),
    *[(BENCH, text, "packed-gemm-rows-fill-h100.json", ("rows",), _rows_ratio(n, "w4a16", state, 16, 64)) for text, n, state in (
        ("`w4a16_matmul` at 16-64 rows: 0.55-0.76x warm", 3712, "warm"),
        ("0.55-0.76x warm and 0.78-1.07x cold", 3712, "cold"),
        ("3712 x 2688, 0.73-1.07x and 0.81-1.44x", 2688, "warm"),
        ("0.73-1.07x and 0.81-1.44x on 2688 x 3712", 2688, "cold"))],
    (BENCH, "(its GEMV: 5.16 against 6.53 us cold", "packed-gemm-rows-fill-h100.json", ("rows",),
     lambda rows: "{:.2f} against {:.2f}".format(*(_rows_cell(rows, 3712, 1, kind)["ms_cold"] * 1e3
                                                  for kind in ("w4a16", "dispatch")))),
    # the 16-row entry's cold pick: one row, 1-12 rows, before and after
    (BENCH, "takes 6.53 and\n  6.56 us on 3712 x 2688 and 2688 x 3712 where it took 8.04 and 7.45",
     ("packed-gemm-rows-fill-h100.json", "packed-gemm-rows-h100.json"), (),
     lambda new, old: "takes {:.2f} and {:.2f} us on 3712 x 2688 and 2688 x 3712 where it took {:.2f} and {:.2f}".format(
         *(_rows_cell(d["rows"], n, 1, "dispatch")["ms_cold"] * 1e3 for d in (new, old) for n in (3712, 2688)))),
    (BENCH, "at 1-12 rows 6.33-7.16\n  where it took 7.42-8.30", ("packed-gemm-rows-fill-h100.json", "packed-gemm-rows-h100.json"), (),
     lambda new, old: "at 1-12 rows {} where it took {}".format(
         *(_span([_rows_cell(d["rows"], n, m, "dispatch")["ms_cold"] * 1e3 for n in (3712, 2688) for m in _rows_ms(d["rows"]) if m <= 12], 2)
           for d in (new, old)))),
    (BENCH, "warm, 5.01-5.96 against 5.48-5.81 on 3712 x 2688 and\n  5.21-6.07 against 5.15-5.56 on 2688 x 3712",
     ("packed-gemm-rows-fill-h100.json", "packed-gemm-rows-h100.json"), (),
     lambda new, old: "warm, {} against {} on 3712 x 2688 and {} against {} on 2688 x 3712".format(
         *(_span([_rows_cell(d["rows"], n, m, "dispatch")["ms_warm"] * 1e3 for m in _rows_ms(d["rows"]) if m <= 12], 2)
           for n in (3712, 2688) for d in (new, old)))),
    # WS min_fill: 2688 x 3712 at 16-32 rows with packed_ws and without
    (BENCH, "`packed_linear` took 7.36-8.00 / 8.20-9.26 us warm / cold with it, 6.72-7.62 / 7.75-8.68 without",
     ("packed-gemm-rows-h100.json", "packed-gemm-rows-fill-h100.json"), (),
     lambda old, new: "`packed_linear` took {} / {} us warm / cold with it, {} / {} without".format(
         *(_span([_rows_cell(d["rows"], 2688, m, "dispatch")[f"ms_{st}"] * 1e3 for m in (16, 20, 24, 28, 32)], 2)
           for d in (old, new) for st in ("warm", "cold")))),
    (BENCH, "took 9.41 / 9.57 us warm / cold, and 7.77 / 8.92", "packed-gemm-ws-pad-h100.json", ("runs",),
     lambda runs: "{:.2f} / {:.2f} us warm / cold, and {:.2f} / {:.2f}".format(*[v * 1e3 for r in runs if (r["N"], r["M"], r["cfg"]) == (3712, 40, {"BLOCK_M": 32, "P": 4}) for v in r["plain"] + r["padded"]])),
    (BENCH, "10.28 / 10.36 us before", "packed-gemm-rows-before-shift-h100.json", ("rows",),
     lambda rows: "{:.2f} / {:.2f}".format(*[r[f"ms_{s}"] * 1e3 for r in rows if (r["N"], r["M"], r["kernel"]) == (3712, 36, "ws") and (r["launch"]["BLOCK_M"], r["launch"]["P"], r["launch"]["SPLIT"]) == (32, 4, 1) for s in ("warm", "cold")])),
    (BENCH, "7.62 / 8.78 after", "packed-gemm-rows-h100.json", ("rows",),
     lambda rows: "{:.2f} / {:.2f}".format(*[r[f"ms_{s}"] * 1e3 for r in rows if (r["N"], r["M"], r["kernel"]) == (3712, 36, "ws") and (r["launch"]["BLOCK_M"], r["launch"]["P"], r["launch"]["SPLIT"]) == (32, 4, 1) for s in ("warm", "cold")])),
    *[(BENCH, text, "decode-graph-compiled-layouts-h100.json", (), fmt) for text, fmt in (
        ("the default recipe 1.96x / 1.89x over BF16 at batch 1", lambda d: "{}x / {}x".format(
            _decode_speedup("nemotron-h-w4a16-4o6_graph", "1")(d), _decode_speedup("nemotron-h-w4a16-4o6_packed-layout_graph", "1")(d))),
        ("1.86x / 1.86x at 16, 1.50x / 1.50x at 64", lambda d: "{}x / {}x at 16, {}x / {}x at 64".format(
            *(_decode_speedup(lab, b)(d) for b in ("16", "64") for lab in ("nemotron-h-w4a16-4o6_graph",
                                                                          "nemotron-h-w4a16-4o6_packed-layout_graph")))))],
    (BENCH, "`modelopt-lightning` 2.15x / 2.07x, 1.96x / 1.97x, 1.52x / 1.53x", "decode-graph-compiled-layouts-lightning-h100.json", (),
     lambda d: "{}x / {}x, {}x / {}x, {}x / {}x".format(*(_decode_speedup(lab, b)(d) for b in ("1", "16", "64") for lab in (
         "modelopt-lightning_graph", "modelopt-lightning_packed-layout_graph")))),
    (BENCH, "1.92x against 1.98x at batch 1", "decode-graph-compiled-layouts-b1-h100.json", (),
     lambda d: "{}x against {}x".format(_decode_speedup("nemotron-h-w4a16-4o6_packed-layout_graph", "1")(d),
                                       _decode_speedup("nemotron-h-w4a16-4o6_graph", "1")(d))),
    (BENCH, "batch 1 1.98x /\n  1.92x", "decode-graph-compiled-layouts-b1-h100.json", (),
     lambda d: "{}x / {}x".format(_decode_speedup("nemotron-h-w4a16-4o6_graph", "1")(d),
                                 _decode_speedup("nemotron-h-w4a16-4o6_packed-layout_graph", "1")(d))),
    (BENCH, "1.89x against 1.96x at batch 1", "decode-graph-compiled-layouts-h100.json", (),
     lambda d: "{}x against {}x".format(_decode_speedup("nemotron-h-w4a16-4o6_packed-layout_graph", "1")(d),
                                       _decode_speedup("nemotron-h-w4a16-4o6_graph", "1")(d))),
    # packed_cluster's overlapped K tiles (DB 1) and shared activation tiles (WN), 40 rows (packed-cluster-wn-h100.json)
    (BENCH, "6.95 / 7.94 against 7.32 / 8.50 us on 3712 x 2688 and 8.05 / 8.94 against 8.57 / 9.50 on\n2688 x 3712",
     "packed-cluster-wn-h100.json", ("cluster",),
     lambda rows: "{} against {} us on 3712 x 2688 and {} against {} on 2688 x 3712".format(*(
         _us(_cluster_cell(rows, n, 40, "cluster", {"WG": 4, "WN": 1, "CL": 2, "DB": db})) for n in (3712, 2688) for db in (1, 0)))),
    (BENCH, "bf16 there\n6.53 / 10.02 and 8.92 / 13.17", "packed-cluster-wn-h100.json", ("cluster",),
     lambda rows: "bf16 there {} and {}".format(*(_us(_cluster_cell(rows, n, 40, "bf16")) for n in (3712, 2688)))),
    (BENCH, "8.17 / 9.58 and 8.55 / 9.85 on 3712 x 2688 and\n8.81 / 10.09 and 9.58 / 10.89 on 2688 x 3712 (and at "
            "clusters of 6, 14.43 / 15.34 and 14.88 / 16.54)", "packed-cluster-wn-h100.json", ("cluster",),
     lambda rows: "{} and {} on 3712 x 2688 and {} and {} on 2688 x 3712 (and at clusters of 6, {} and {})".format(*(
         [_us(_cluster_cell(rows, n, 40, "cluster", {"WG": wg, "WN": wn, "CL": cl, "DB": 0}))
          for n in (3712, 2688) for wg, wn, cl in ((2, 2, 4), (1, 4, 8))]
         + [_us(_cluster_cell(rows, n, 40, "cluster", {"WG": 2, "WN": 2, "CL": 6, "DB": 0})) for n in (3712, 2688)]))),
    (BENCH, "the CUDA C++ launch of `kernels.packed_cluster` (32 rows, 3712 x 2688) 24.0 us on an H100",
     "packed-cluster-wn-h100.json", ("eager_host_us", "us"), lambda us: f"{us:.1f} us on an H100"),
    (BENCH, "6.95 / 7.94 us warm / cold against 7.32 / 8.50 before on 3712 x 2688 (bf16 6.53 / 10.02) and 8.05 / 8.94 "
             "against 8.57 / 9.50 on 2688 x 3712 (bf16 8.92 / 13.17)", "packed-cluster-wn-h100.json", ("cluster",),
     lambda rows: "{} us warm / cold against {} before on 3712 x 2688 (bf16 {}) and {} against {} on 2688 x 3712 (bf16 {})".format(*(
         _us(_cluster_cell(rows, n, 40, *args)) for n in (3712, 2688) for args in (
             ("cluster", {"WG": 4, "WN": 1, "CL": 2, "DB": 1}), ("cluster", {"WG": 4, "WN": 1, "CL": 2, "DB": 0}), ("bf16",))))),
    # packed_linear with the CLUSTER entry's min_fill 0.6, every row count (packed-gemm-rows-cluster-fill-h100.json),
    # and the run before it that chose it (packed-gemm-rows-db-h100.json)
    (README, "grouped MoE: 2.85x bf16 at 64 tokens (kernels-h200.json)", KERNELS, ("moe", {"tokens": 64}, "speedup_vs_bf16"), _f(2)),
    (README, "the faster one at one row but takes 0.56-1.40x bf16's speed at 16-64 rows, warm or cold",
     PDL_ROWS, (), lambda few, many: "{} at one row but takes {}x bf16's speed at 16-64 rows".format(
         "the faster one" if all(_rows_cell(few["rows"], n, 1, "w4a16")[f"ms_{st}"] < _rows_cell(few["rows"], n, 1, "dispatch")[f"ms_{st}"]
                                 for n in (3712, 2688) for st in ("warm", "cold")) else "not the faster one",
         _span([_rows_cell(many["rows"], n, m, "bf16")[f"ms_{st}"] / _rows_cell(many["rows"], n, m, "w4a16")[f"ms_{st}"]
                for n in (3712, 2688) for m in _rows_ms(many["rows"]) for st in ("warm", "cold")], 2))),
    *[(doc, text, "packed-gemm-rows-cluster-fill-h100.json", ("rows",), fmt) for doc, text, fmt in (
        (BENCH, "1.13-1.52x bf16\non 3712 x 2688 and 1.04-1.90x on 2688 x 3712",
         lambda rows: "{}x bf16 on 3712 x 2688 and {}x on 2688 x 3712".format(
             *(_rows_ratio(n, "dispatch", "cold")(rows) for n in (3712, 2688)))),
        (BENCH, "0.88-1.30x and 0.94-1.54x,\nbelow 1.0 at 20, 24, 36, 40, 52 and 56 rows on 3712 x 2688 and at 52, 60 and 64 on 2688 x 3712",
         lambda rows: "{}x and {}x, below 1.0 at {} rows on 3712 x 2688 and at {} on 2688 x 3712".format(
             *(_rows_ratio(n, "dispatch", "warm")(rows) for n in (3712, 2688)), *(_below_one(rows, n) for n in (3712, 2688)))),
        *[(BENCH, f"| {n} x {k} | {cold}x at every row count | {warm}x; below 1.0 at {below} rows |",
           lambda rows, n=n, k=k: "| {} x {} | {}x at every row count | {}x; below 1.0 at {} rows |".format(
               n, k, _rows_ratio(n, "dispatch", "cold")(rows), _rows_ratio(n, "dispatch", "warm")(rows), _below_one(rows, n)))
          for n, k, cold, warm, below in ((3712, 2688, "1.13-1.52", "0.88-1.30", "20, 24, 36, 40, 52 and 56"),
                                          (2688, 3712, "1.04-1.90", "0.94-1.54", "52, 60 and 64"))],
        (BENCH, "`packed_linear` so, against torch.matmul", lambda rows: "`packed_linear` so, against torch.matmul" if all(
            _rows_cell(rows, n, m, "dispatch")["launch"]["uses_ws"] == (n == 3712 or m > 32) for n in (3712, 2688)
            for m in _rows_ms(rows) if 16 <= m <= 48) else "another choice"))],
    (BENCH, "by up to 1.23 us between these two runs at the same row count\n  (2688 x 3712 at 56 rows: 8.28 and 9.16 us)",
     ("packed-gemm-rows-db-h100.json", "packed-gemm-rows-cluster-fill-h100.json"), (),
     lambda a, b: "by up to {:.2f} us between these two runs at the same row count (2688 x 3712 at 56 rows: {:.2f} and {:.2f} us)".format(
         max(abs(_rows_cell(a["rows"], n, m, "bf16")["ms_warm"] - _rows_cell(b["rows"], n, m, "bf16")["ms_warm"]) * 1e3
             for n in (3712, 2688) for m in _rows_ms(a["rows"])),
         *(_rows_cell(d["rows"], 2688, 56, "bf16")["ms_warm"] * 1e3 for d in (a, b)))),
    *[(BENCH, text, "packed-gemm-rows-db-h100.json", ("rows",), fmt) for text, fmt in (
        ("16-48 rows with the weights cold (7.14-8.88 against\n  7.95-9.25 us)",
         lambda rows: "16-48 rows with the weights cold ({} against {} us)".format(
             *(_span([_rows_cell(rows, 2688, m, k)["ms_cold"] * 1e3 for m in _rows_ms(rows) if 16 <= m <= 48], 2) for k in ("cluster", "dispatch")))),
        ("(6.27 against 6.71 us at 16); warm at 20-28 rows it\n  is 0.02-0.26 us slower",
         lambda rows: "({:.2f} against {:.2f} us at 16); warm at 20-28 rows it is {} us slower".format(
             _rows_cell(rows, 2688, 16, "cluster")["ms_warm"] * 1e3, _rows_cell(rows, 2688, 16, "dispatch")["ms_warm"] * 1e3,
             _span([(_rows_cell(rows, 2688, m, "cluster")["ms_warm"] - _rows_cell(rows, 2688, m, "dispatch")["ms_warm"]) * 1e3
                    for m in (20, 24, 28)], 2))),
        ("beats what `packed_linear` ran there at 16-48 rows",
         lambda rows: "beats what `packed_linear` ran there at 16-48 rows" if all(
             _rows_cell(rows, 2688, m, "cluster")["ms_cold"] < _rows_cell(rows, 2688, m, "dispatch")["ms_cold"]
             for m in _rows_ms(rows) if 16 <= m <= 48) and [m for m in _rows_ms(rows) if 16 <= m <= 48 and
             _rows_cell(rows, 2688, m, "cluster")["ms_warm"] > _rows_cell(rows, 2688, m, "dispatch")["ms_warm"]] == [20, 24, 28]
         else "other rows"))],
    # packed_cluster's activation buffers with DB 1 (packed-cluster-stages-h100.json)
    (BENCH, "4 buffers take 0.12-0.89 us longer warm or cold than 3, and 5 (up to 32 rows, where they fit)\n0.09-0.71 us longer; "
            "`DB` 0 with 4 buffers is 0.23-0.70 us slower", "packed-cluster-stages-h100.json", ("cluster",),
     lambda rows: "4 buffers take {} us longer warm or cold than 3, and 5 (up to 32 rows, where they fit) {} us longer; "
     "`DB` 0 with 4 buffers is {} us slower".format(*(_span(_stages_more(rows, cfg), 2) for cfg in (
         {"DB": 1, "STAGES": 4}, {"DB": 1, "STAGES": 5}, {"DB": 0, "STAGES": 4})))),
    # the README's decode targets, each at its latest run
    *[(README, f"on an H200 {{}}x, the decode steps alone {{}}x (decode-graph-compiled-router-inside-h200.json); on an H100 {{}}x "
       "(decode-graph-compiled-h100.json)".format(*quoted), "decode-graph-compiled-router-inside-h200.json", ("batches", "1"),
       lambda d, ck=ck: "on an H200 {:.2f}x, the decode steps alone {:.2f}x (decode-graph-compiled-router-inside-h200.json); "
       "on an H100 {:.2f}x (decode-graph-compiled-h100.json)".format(
           d["speedup_over_bf16_graph"][f"{ck}_graph"], _steps_over_bf16(d, ck),
           _load("decode-graph-compiled-h100.json")["batches"]["1"]["speedup_over_bf16_graph"][f"{ck}_graph"]))
      for ck, quoted in (("nemotron-h-w4a16-4o6", ("2.22", "2.04", "1.98")), ("modelopt-lightning", ("2.30", "2.25", "2.26")))],
    (README, "on an H200 1.94x at batch 16", "decode-graph-compiled-router-inside-h200.json",
     ("batches", "16", "speedup_over_bf16_graph", "nemotron-h-w4a16-4o6_graph"), lambda v: f"on an H200 {v:.2f}x at batch 16"),
    (README, "1.32x at batch 64 with the code of 2026-12-04 (decode-graph-compiled-b64-h200.json)", "decode-graph-compiled-b64-h200.json",
     (), lambda d: "{:.2f}x at batch 64 with the code of {} (decode-graph-compiled-b64-h200.json)".format(
         d["batches"]["64"]["speedup_over_bf16_graph"]["nemotron-h-w4a16-4o6_graph"], d["date"][:10])),
    (README, "on an H100 with the code of 2026-12-07 1.85x / 1.50x (decode-graph-compiled-b16-b64-pdl-h100.json)",
     "decode-graph-compiled-b16-b64-pdl-h100.json", (), lambda d: "on an H100 with the code of {} {:.2f}x / {:.2f}x".format(
         d["date"][:10], *(d["batches"][b]["speedup_over_bf16_graph"]["nemotron-h-w4a16-4o6_graph"] for b in ("16", "64")))),
    (BENCH, "on an H100, 1.85x / 1.50x (decode-graph-compiled-b16-b64-pdl-h100.json)", "decode-graph-compiled-b16-b64-pdl-h100.json",
     ("batches",), lambda b: "on an H100, {:.2f}x / {:.2f}x".format(
         *(b[n]["speedup_over_bf16_graph"]["nemotron-h-w4a16-4o6_graph"] for n in ("16", "64")))),
    # packed_linear's cluster launch, eager, host time per call (32 rows), before and after its default launch was kept per shape
    (README, "14.7 us against 14.2 for a torch matmul on an H100", "kernels-host-cluster-h100.json", ("cluster_host_overhead",),
     lambda d: "{:.1f} us against {:.1f} for a torch matmul".format(d["packed_linear_host_us_per_call"], d["bf16_host_us_per_call"])
     if d["packed_linear_uses_cluster"] else "not the cluster launch"),
    (README, "40.1 against 21.6 before the launcher kept its default launch per shape", "kernels-host-cluster-before-h100.json",
     ("cluster_host_overhead",), lambda d: "{:.1f} against {:.1f} before".format(d["packed_linear_host_us_per_call"], d["bf16_host_us_per_call"])),
    (BENCH, "40.1 us against 21.6 for a torch matmul in the same runs (kernels-host-cluster-before-h100.json), and with the "
            "default launch kept per shape 14.7 against 14.2", ("kernels-host-cluster-before-h100.json", "kernels-host-cluster-h100.json"),
     ("cluster_host_overhead",), lambda a, b: "{:.1f} us against {:.1f} for a torch matmul in the same runs "
     "(kernels-host-cluster-before-h100.json), and with the default launch kept per shape {:.1f} against {:.1f}".format(
         a["packed_linear_host_us_per_call"], a["bf16_host_us_per_call"], b["packed_linear_host_us_per_call"], b["bf16_host_us_per_call"])),
    (BENCH, "in two processes one after the other, 10.4 against 10.3 and 10.6 against 10.7",
     ("kernels-host-cluster-rerun1-h100.json", "kernels-host-cluster-rerun2-h100.json"), ("cluster_host_overhead",),
     lambda a, b: "in two processes one after the other, {}".format(" and ".join(
         "{:.1f} against {:.1f}".format(d["packed_linear_host_us_per_call"], d["bf16_host_us_per_call"]) for d in (a, b)))),
    # packed_cluster's defaults of 2026-12-07 at 16-64 rows (packed-cluster-rows-h100.json)
    # packed_linear with those defaults at every row count (packed-gemm-rows-pdl-few-h100.json, packed-gemm-rows-pdl-h100.json)
    *[(doc, text, PDL_ROWS, (), lambda few, many, doc=doc: "{}x bf16 on 3712 x 2688 and {}x on 2688 x 3712, {} {}x and {}x".format(
        *(_rows_ratio(n, "dispatch", "cold")(few["rows"] + many["rows"]) for n in (3712, 2688)),
        "and replaying one weight that L2 keeps" if doc == README else "with one weight kept in L2",
        *(_rows_ratio(n, "dispatch", "warm")(few["rows"] + many["rows"]) for n in (3712, 2688))))
      for doc, text in ((README, "as in a decode step, 1.27-1.67x bf16 on 3712 x 2688 and 1.16-1.90x on 2688 x 3712, and "
                                 "replaying one weight that L2 keeps 1.08-1.32x and 1.06-1.53x"),
                        (BENCH, "weights read from memory 1.27-1.67x bf16 on 3712 x 2688 and 1.16-1.90x on 2688 x 3712, with one "
                                "weight kept in L2 1.08-1.32x and 1.06-1.53x"))],
    (BENCH, "at no row count below 1.0", PDL_ROWS, (), lambda few, many: "at no row count below 1.0" if all(
        _rows_cell(r, n, m, "bf16")["ms_warm"] >= _rows_cell(r, n, m, "dispatch")["ms_warm"]
        for r in (few["rows"], many["rows"]) for n in (3712, 2688) for m in _rows_ms(r)) else "below 1.0 somewhere"),
    (README, "at every row count from 1 to 64 (1-12, then 16-64 in steps of 4", PDL_ROWS, (),
     lambda few, many: "at every row count from {} to {} ({}-{}, then {}-{} in steps of 4".format(
         _rows_ms(few["rows"])[0], _rows_ms(many["rows"])[-1], _rows_ms(few["rows"])[0], _rows_ms(few["rows"])[-1],
         _rows_ms(many["rows"])[0], _rows_ms(many["rows"])[-1])
     if _rows_ms(many["rows"]) == list(range(16, 65, 4)) and _rows_ms(few["rows"]) == [1, 2, 3, 4, 6, 8, 12] else "other rows"),
    (README, "never slower than bf16: met on an H100 at every row count from 1 to 64, warm and cold", PDL_ROWS, (),
     lambda few, many: "never slower than bf16: met" if all(
         _rows_cell(r, n, m, "bf16")[f"ms_{st}"] >= _rows_cell(r, n, m, "dispatch")[f"ms_{st}"]
         for r in (few["rows"], many["rows"]) for n in (3712, 2688) for m in _rows_ms(r) for st in ("warm", "cold"))
     else "slower somewhere"),
    *[(BENCH, text, "packed-cluster-rows-h100.json", ("cluster",),
       lambda rows, n=n, m=m: "| {} x {}, {} | {} |".format(n, 6400 - n, m, " | ".join(_us(c) for c in (
           _rows_cell(rows, n, m, "bf16"), _rows_cell(rows, n, m, "dispatch"),
           *(_crow(rows, n, m, wg, pdl) for pdl in (0, 1) for wg in (4, 2))))))
      for text, n, m in (
          ("| 3712 x 2688, 16 | 6.16 / 10.06 | 5.44 / 6.62 | 5.48 / 6.59 | 5.34 / 7.31 | 4.99 / 5.92 | 4.89 / 6.68 |", 3712, 16),
          ("| 3712 x 2688, 40 | 6.28 / 10.04 | 6.92 / 7.92 | 6.72 / 7.71 | 6.34 / 8.03 | 6.32 / 7.14 | 5.89 / 7.47 |", 3712, 40),
          ("| 3712 x 2688, 56 | 6.76 / 10.09 | 7.72 / 8.88 | 7.81 / 9.21 | 6.59 / 8.33 | 7.40 / 8.61 | 6.16 / 7.73 |", 3712, 56),
          ("| 3712 x 2688, 64 | 7.98 / 10.30 | 7.88 / 9.09 | 8.38 / 9.82 | 6.98 / 8.55 | 8.00 / 9.18 | 6.57 / 8.06 |", 3712, 64),
          ("| 2688 x 3712, 16 | 8.09 / 12.75 | 6.28 / 7.19 | 6.29 / 7.19 | 6.17 / 8.05 | 5.99 / 6.66 | 5.95 / 7.39 |", 2688, 16),
          ("| 2688 x 3712, 40 | 8.93 / 13.18 | 7.99 / 8.90 | 7.82 / 8.75 | 7.45 / 9.10 | 7.59 / 8.33 | 7.27 / 8.49 |", 2688, 40),
          ("| 2688 x 3712, 56 | 8.30 / 10.70 | 9.04 / 10.28 | 9.11 / 10.78 | 7.84 / 9.43 | 8.86 / 10.03 | 7.62 / 8.81 |", 2688, 56),
          ("| 2688 x 3712, 64 | 8.43 / 10.70 | 9.02 / 10.27 | 9.64 / 11.16 | 8.21 / 9.76 | 9.45 / 10.64 | 7.96 / 9.18 |", 2688, 64))],
    *[(BENCH, f"| {n} x {6400 - n} | {cold}x | {warm}x |", "packed-cluster-rows-h100.json", ("cluster",),
       lambda rows, n=n: "| {} x {} | {}x | {}x |".format(n, 6400 - n, _crows_ratio(rows, n, "cold"), _crows_ratio(rows, n, "warm")))
      for n, cold, warm in ((3712, "1.28-1.70", "1.07-1.29"), (2688, "1.16-1.91", "1.02-1.41"))],
    (BENCH, "row count timed (16, 20, 24, 32, 36, 40, 44, 48, 52, 56, 60, 64)", "packed-cluster-rows-h100.json", ("cluster",),
     lambda rows: "row count timed ({})".format(", ".join(map(str, _rows_ms(rows))))),
    (BENCH, "and 1.09-1.29x / 1.05-1.16x (3712 x 2688) and 1.02-1.20x / 1.04-1.17x (2688 x 3712) faster",
     "packed-cluster-rows-h100.json", ("cluster",),
     lambda rows: "and {}x / {}x (3712 x 2688) and {}x / {}x (2688 x 3712) faster".format(
         *(_crows_ratio(rows, n, st, "dispatch") for n in (3712, 2688) for st in ("warm", "cold")))),
    (BENCH, "it would be 0.99x bf16 warm at 40 rows on 3712 x 2688", "packed-cluster-rows-h100.json", ("cluster",),
     lambda rows: "it would be {:.2f}x bf16 warm at 40 rows".format(
         _rows_cell(rows, 3712, 40, "bf16")["ms_warm"] / _crow(rows, 3712, 40, 2, 0)["ms_warm"])),
    (BENCH, "two shares of K instead of four are 0.04-1.61 us faster warm at\n  every row count and 0.89-1.54 faster cold at 52-64 rows",
     "packed-cluster-rows-h100.json", ("cluster",),
     lambda rows: "are {} us faster warm at every row count and {} faster cold at 52-64 rows".format(
         _span([-v for v in _crows_delta(rows, "warm", _rows_ms(rows), {"wg": 2, "pdl": 0}, {"wg": 4, "pdl": 0})], 2),
         _span([-v for v in _crows_delta(rows, "cold", (52, 56, 60, 64), {"wg": 2, "pdl": 0}, {"wg": 4, "pdl": 0})], 2))),
    (BENCH, "but 0.16-0.87 slower cold at 16-48", "packed-cluster-rows-h100.json", ("cluster",),
     lambda rows: "but {} slower cold at 16-48".format(_span(_crows_delta(
         rows, "cold", [m for m in _rows_ms(rows) if m <= 48], {"wg": 2, "pdl": 0}, {"wg": 4, "pdl": 0}), 2))),
    (BENCH, "takes 0.22-0.75 us off cold at every row count and `WG`", "packed-cluster-rows-h100.json", ("cluster",),
     lambda rows: "takes {} us off cold at every row count".format(_span(
         [v for wg in (2, 4) for v in _crows_delta(rows, "cold", _rows_ms(rows), {"wg": wg, "pdl": 0}, {"wg": wg, "pdl": 1})], 2))),
    (BENCH, "0.18-0.53 off warm but for two of\n  the 48 (2688 x 3712 with `WG` 2: 0.44 us slower at 44 rows, 0.03 at 60)",
     "packed-cluster-rows-h100.json", ("cluster",),
     lambda rows: (lambda d: "{} off warm but for {} of the {} (2688 x 3712 with `WG` 2: {:.2f} us slower at 44 rows, {:.2f} at 60)".format(
         _span([v for v in d.values() if v > 0], 2), {1: "one", 2: "two", 3: "three"}.get(sum(v <= 0 for v in d.values()), "more"),
         len(d), -d[2688, 44, 2], -d[2688, 60, 2]))(
         {(n, m, wg): (_crow(rows, n, m, wg, 0)["ms_warm"] - _crow(rows, n, m, wg, 1)["ms_warm"]) * 1e3
          for n in (3712, 2688) for m in _rows_ms(rows) for wg in (2, 4)})),
]


@pytest.mark.parametrize("doc,quoted,name,path,fmt", FIGURES,
                         ids=[f"{d}:{'+'.join((n,) if isinstance(n, str) else n)}:{'/'.join(map(str, p))}"
                              for d, _, n, p, _ in FIGURES])
def test_quoted_figure_is_its_results_value(doc, quoted, name, path, fmt):
    # name: one results file, or a tuple of them (a before-and-after figure: fmt takes each in turn)
    assert _flat(quoted) in _flat((ROOT / doc).read_text()), f"{doc} no longer says {quoted!r}"
    names = (name,) if isinstance(name, str) else name
    shown = fmt(*(_at(_load(n), path) for n in names))
    assert shown in _flat(quoted), f"{name} {path} is {shown}; {doc} says {quoted!r}"


@pytest.mark.parametrize("folder,program", [("ssm-state-tiny", None), ("ssm-state-h200", "python scripts/ssm_state_slice.py")])
def test_ssm_state_markdown_is_its_json_and_the_readme_quotes_it(folder, program):
    from fp4kit.ssm_eval import markdown

    folder = RESULTS / folder
    doc = json.loads((folder / "ssm-state.json").read_text())
    md = (folder / "ssm-state.md").read_text()
    assert md == markdown(doc) + "\n"
    readme = (ROOT / README).read_text()
    assert md.strip() in readme
    # the command as the README gives it (the H200 run wrote to the device's own output folder)
    assert _flat(program or doc["command"]) in _flat(readme)
    assert doc["command"].startswith(program or doc["command"])
