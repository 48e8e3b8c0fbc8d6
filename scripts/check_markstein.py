"""The quantize kernel's per-element quotient, checked against IEEE division on the CPU.

fp4kit.kernels.quantize computes RN(a / s) without a division per element: y = RN(1 / s), then
q0 = RN(a * y), r = fma(-s, q0, a), q = fma(r, y, q0). This script runs that sequence in numpy
with an exact single-precision fma (the one Triton's interpreter uses) and compares q with
numpy's correctly rounded fp32 division:
  --exhaustive: every bf16 mantissa of a (a in [1, 2) and [2, 4)) against every fp32 mantissa
                of s in [1, 2) (scaling a or s by a power of two scales q exactly, so this covers
                every bf16 a and fp32 s in the normal range); about a minute on one core;
  --random N:   N random fp32 pairs (a in [1, 4), s in [1, 2)).
tests/test_kernels_interpret.py runs a sample of both.

    python scripts/check_markstein.py --exhaustive --random 268435456
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--exhaustive", action="store_true")
    ap.add_argument("--random", type=int, default=0, metavar="N")
    args = ap.parse_args()
    if args.exhaustive:
        bad, total = bf16_against_steps()
        print(f"every bf16 mantissa x every fp32 step mantissa: {bad} mismatches in {total:,}")
    if args.random:
        bad, total = random_pairs(args.random)
        print(f"random fp32 pairs: {bad} mismatches in {total:,}")


if __name__ == "__main__":
    main()
