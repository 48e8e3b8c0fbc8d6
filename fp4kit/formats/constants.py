"""Every constant of the number formats, in one place.

Names follow ml_dtypes (`float4_e2m1fn`, `float8_e4m3fn`) so readers recognise them. The tables
are built from the bit layout, not typed in, and the tests check them against ml_dtypes.
"""

from __future__ import annotations

import math

# --- E2M1 (`float4_e2m1fn`): 1 sign, 2 exponent (bias 1), 1 mantissa bit; no NaN, no Inf. ---
E2M1_MAX = 6.0
# Magnitude of codes 0..7; code = sign << 3 | index.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Value of every code 0..15, with code 0x8 = -0.0 (as ml_dtypes decodes it).
E2M1_VALUES = E2M1_MAGNITUDES + tuple(-m for m in E2M1_MAGNITUDES)
# Rounding boundaries between neighbouring magnitudes (the midpoints). A midpoint goes to the
# neighbour with an even mantissa bit: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.
E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
# Midpoints whose upper neighbour has the even mantissa (ties round UP there).
E2M1_TIES_UP = (0.75, 1.75, 3.5)
# What ModelOpt's export writes for a NaN input: code 7 (+6).
E2M1_NAN_CODE = 0x7

# --- E4M3 (`float8_e4m3fn`): 1 sign, 4 exponent (bias 7), 3 mantissa bits; NaN = S.1111.111. ---
E4M3_MAX = 448.0
E4M3_EXP_BIAS = 7
E4M3_MANTISSA_BITS = 3
E4M3_MIN_NORMAL = 2.0**-6
E4M3_MIN_SUBNORMAL = 2.0**-9
E4M3_NAN_CODE = 0x7F  # 0xFF with the sign bit


def _e4m3_value(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    exp = (code >> 3) & 0xF
    man = code & 0x7
    if exp == 0xF and man == 0x7:
        return math.copysign(math.nan, sign)
    if exp == 0:
        return sign * man * 2.0 ** (1 - E4M3_EXP_BIAS - E4M3_MANTISSA_BITS)
    return sign * (1.0 + man / 8.0) * 2.0 ** (exp - E4M3_EXP_BIAS)


# Value of every byte 0..255 (0x80 = -0.0; 0x7F and 0xFF are NaN).
E4M3_VALUES = tuple(_e4m3_value(c) for c in range(256))

# --- NVFP4: E2M1 elements, one E4M3 scale per 16 elements along K, one fp32 global scale. ---
NVFP4_BLOCK_SIZE = 16
# FP8 normalisation of the block scales: the block holding the tensor max gets this scale.
FP8_NORM_PLAIN = 448.0  # plain NVFP4 (ModelOpt `nvfp4`, `nvfp4_static`)
FP8_NORM_4O6 = 256.0  # Four-Over-Six: 1.5 * 256 = 384 still fits E4M3
# Global-scale denominator of the plain (dynamic) rule: weight_scale_2 = amax / 2688.
NVFP4_GLOBAL_DENOM = E2M1_MAX * E4M3_MAX
# Four-Over-Six candidate amax multipliers: 1.0 maps the block max to 6, 1.5 maps it to 4.
FOUR_OVER_SIX_MULTIPLIERS = (1.0, 1.5)
# Block scales are clamped to [2^-9, 448] before the cast (ModelOpt >= 0.45).
BLOCK_SCALE_MIN = E4M3_MIN_SUBNORMAL
BLOCK_SCALE_MAX = E4M3_MAX

# --- FP8 per-tensor (ModelOpt `fp8`): scale = amax / 448. ---
FP8_MAX = E4M3_MAX
