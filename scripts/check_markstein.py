"""The quantize kernel's per-element quotient, checked against IEEE division on the CPU.

fp4kit.kernels.quantize computes RN(a / s) without a division per element: y = RN(1 / s), then
q0 = RN(a * y), r = fma(-s, q0, a), q = fma(r, y, q0). This script runs that sequence in numpy
with an exact single-precision fma (the one Triton's interpreter uses) and compares q with
numpy's correctly rounded fp32 division:
  --exhaustive: every bf16 mantissa of a (a in [1, 2) and [2, 4)) against every fp32 mantissa
                of s in [1, 2) (scaling a or s by a power of two scales q exactly, so this covers
                every bf16 a and fp32 s in the normal range); about a minute on one core;
  --random N:   N random fp32 pairs (a in [1, 4), s in [1, 2)).
  --uncorrected N: why the two fused multiply-adds stay: for N random bf16 global amaxes per
                rule, whether q0 = RN(a * y) alone would give some bf16 weight a another E2M1
                value than RN(a / s) does, at a step s = float(e4m3 scale) * global scale of
                any of the 126 positive finite block scales (the bf16 values next to every
                E2M1 midpoint times s are tried). Both global scales divide by 3 (1536 = 3 * 512,
                2688 = 3 * 7 * 128), so midpoint * s often lands within an fp32 ulp of a bf16
                value: the members this happens in are counted.
tests/kernels/test_quantize.py runs a sample of each.

    python scripts/check_markstein.py --exhaustive --random 268435456 --uncorrected 1000
"""

from __future__ import annotations

import argparse

import numpy as np


def _fma():
    from triton._C.libtriton import interpreter

    return interpreter.fma_fp32


def mismatches(a: np.ndarray, s: np.ndarray) -> int:
    """How many of the pairs (a, s) the kernel's sequence gets wrong (float32 arrays)."""
    fma = _fma()
    y = (np.float32(1.0) / s).astype(np.float32)
    q0 = (a * y).astype(np.float32)
    q = fma(fma(-s, q0, a), y, q0)
    return int((q.view(np.uint32) != (a / s).astype(np.float32).view(np.uint32)).sum())


def bf16_against_steps(step_stride: int = 1) -> tuple[int, int]:
    """Every bf16 mantissa (two binades of a) against every step_stride-th fp32 step mantissa."""
    s = (np.arange(0, 2**23, step_stride, dtype=np.uint32) | np.uint32(0x3F800000)).view(np.float32)
    bad = total = 0
    for mantissa in range(128):
        for exponent in (0x3F800000, 0x40000000):
            a = np.full(s.shape, np.uint32(exponent | (mantissa << 16)), dtype=np.uint32).view(np.float32)
            bad += mismatches(a, s)
            total += s.size
    return bad, total


def random_pairs(n: int, seed: int = 1, chunk: int = 2**22) -> tuple[int, int]:
    rng = np.random.default_rng(seed)
    bad = total = 0
    while total < n:
        m = min(chunk, n - total)
        s = (rng.integers(0, 2**23, m, dtype=np.uint32) | np.uint32(0x3F800000)).view(np.float32)
        a = (rng.integers(0, 2**24, m, dtype=np.uint32) + np.uint32(0x3F800000)).view(np.float32)
        bad += mismatches(a, s)
        total += m
    return bad, total


def uncorrected_misrounds(g: float, rule: str, reach: int = 3) -> list[tuple[int, float]]:
    """(e4m3 scale code, bf16 weight a) pairs where the uncorrected quotient RN(a * RN(1 / s))
    gets another E2M1 value than RN(a / s), for the member with global amax g (a bf16 value)
    under `rule` (its global scale as arith "cuda" forms it: g / 1536 for "4o6", g / 2688 for
    "6"), over every positive finite block scale and the bf16 values within `reach` bf16 ulps of
    each E2M1 midpoint * s."""
    import torch

    from fp4kit.formats import e2m1, nvfp4
    from fp4kit.formats.constants import E2M1_MIDPOINTS

    gs = nvfp4.global_scale_of(torch.tensor(g, dtype=torch.float32), rule, "cuda").numpy()
    codes = np.arange(1, 127)
    scales = torch.tensor(codes, dtype=torch.uint8).view(torch.float8_e4m3fn).float().numpy()
    s = (scales * gs).astype(np.float32)  # [126]
    y = (np.float32(1.0) / s).astype(np.float32)
    mids = np.array(E2M1_MIDPOINTS, dtype=np.float32)
    near = torch.from_numpy((mids[:, None] * s[None, :]).astype(np.float32)).to(torch.bfloat16)
    bits = near.view(torch.int16).to(torch.int32)
    a = torch.stack([(bits + k).to(torch.int16).view(torch.bfloat16) for k in range(-reach, reach + 1)])
    a = a.float().numpy()  # [2 reach + 1, 7, 126], every value a bf16 weight can take there
    q = (a / s).astype(np.float32)  # correctly rounded
    q0 = (a * y).astype(np.float32)
    bad = (e2m1.encode(torch.from_numpy(q)) != e2m1.encode(torch.from_numpy(q0))).numpy() & (a > 0)
    return [(int(codes[c]), float(a[i, j, c])) for i, j, c in zip(*np.nonzero(bad))]


def uncorrected_members(n: int, rule: str, seed: int = 2) -> tuple[int, int]:
    """(members with some misrounding, n) over n random bf16 global amaxes in [2^-8, 2^4]."""
    import torch

    rng = np.random.default_rng(seed)
    amaxes = torch.from_numpy(np.exp2(rng.uniform(-8.0, 4.0, n)).astype(np.float32)).to(torch.bfloat16).float()
    return sum(bool(uncorrected_misrounds(float(g), rule)) for g in amaxes), n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exhaustive", action="store_true")
    ap.add_argument("--random", type=int, default=0, metavar="N")
    ap.add_argument("--uncorrected", type=int, default=0, metavar="N")
    args = ap.parse_args()
    if args.exhaustive:
        bad, total = bf16_against_steps()
        print(f"every bf16 mantissa x every fp32 step mantissa: {bad} mismatches in {total:,}")
    if args.random:
        bad, total = random_pairs(args.random)
        print(f"random fp32 pairs: {bad} mismatches in {total:,}")
    if args.uncorrected:
        for rule in ("4o6", "6"):
            bad, total = uncorrected_members(args.uncorrected, rule)
            print(f"rule {rule}: the uncorrected quotient misrounds some bf16 weight in {bad} of {total} "
                  f"members ({100 * bad / total:.0f}%)")


if __name__ == "__main__":
    main()
