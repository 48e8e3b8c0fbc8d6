"""The calibration spec "NxL": N samples of exactly L tokens each, e.g. "1000x32k" or "512x2048"."""

from __future__ import annotations

import dataclasses
import re

# Sequence-length suffixes; k and m are binary, as in context lengths ("32k" = 32768 tokens).
SUFFIXES = {"": 1, "k": 1024, "m": 1024 * 1024}
MAX_SAMPLES = 1_000_000
MAX_SEQ_LEN = 1024 * 1024
MAX_TOTAL_TOKENS = 2**36

_SPEC = re.compile(r"(?P<samples>[^xX]*)[xX](?P<seq_len>[^xX]*)")
_SEQ_LEN = re.compile(r"(?P<digits>[0-9]+)(?P<suffix>[kKmM]?)")
_FORM = "expected NxL such as 1000x32k or 512x2048 (k = 1024, m = 1024k)"


class CalibSpecError(ValueError):
    """A calibration spec that is malformed or outside the limits."""


def _shown(text: str) -> str:
    """The spec as quoted in messages, cut short if it is absurdly long."""
    return repr(text) if len(text) <= 40 else repr(text[:40]) + f"... ({len(text)} characters)"


def _limit_problem(samples: int, seq_len: int) -> str | None:
    if not 1 <= samples <= MAX_SAMPLES:
        return f"the sample count {samples} is outside 1..{MAX_SAMPLES}"
    if not 1 <= seq_len <= MAX_SEQ_LEN:
        return f"the sequence length {seq_len} is outside 1..{MAX_SEQ_LEN} (1024k)"
    if samples * seq_len > MAX_TOTAL_TOKENS:
        return (
            f"{samples} x {seq_len} = {samples * seq_len} tokens is more than the limit of "
            f"2**36 = {MAX_TOTAL_TOKENS} tokens"
        )
    return None


@dataclasses.dataclass(frozen=True)
class CalibSpec:
    """N samples of exactly `seq_len` tokens each."""

    samples: int
    seq_len: int

    def __post_init__(self) -> None:
        for name in ("samples", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise CalibSpecError(f"calibration spec {name} must be an int, got {value!r}")
        problem = _limit_problem(self.samples, self.seq_len)
        if problem is not None:
            raise CalibSpecError(f"calibration spec {self.samples}x{self.seq_len}: {problem}")

    @property
    def total_tokens(self) -> int:
        return self.samples * self.seq_len

    def __str__(self) -> str:
        if self.seq_len % 1024 == 0:
            return f"{self.samples}x{self.seq_len // 1024}k"
        return f"{self.samples}x{self.seq_len}"


def parse_calib_spec(text: str) -> CalibSpec:
    """Parse "NxL" (N plain, L with an optional k/m suffix) into a CalibSpec, checking the limits."""
    if not isinstance(text, str):
        raise CalibSpecError(f"calibration spec must be a string such as '1000x32k', got {text!r}")
    shown = _shown(text)
    match = _SPEC.fullmatch(text.strip())
    if match is None:
        raise CalibSpecError(f"calibration spec {shown}: {_FORM}")
    samples_text, seq_len_text = match["samples"], match["seq_len"]
    if not samples_text:
        raise CalibSpecError(f"calibration spec {shown}: the sample count before 'x' is missing; {_FORM}")
    if not seq_len_text:
        raise CalibSpecError(f"calibration spec {shown}: the sequence length after 'x' is missing; {_FORM}")
    if not re.fullmatch(r"[0-9]+", samples_text):
        raise CalibSpecError(
            f"calibration spec {shown}: the sample count {_shown(samples_text)} is not a positive integer "
            "(it takes no suffix)"
        )
    seq_match = _SEQ_LEN.fullmatch(seq_len_text)
    if seq_match is None:
        raise CalibSpecError(
            f"calibration spec {shown}: the sequence length {_shown(seq_len_text)} is not a positive integer "
            "with an optional suffix k (x1024) or m (x1048576)"
        )
    # Digit strings this long are far over every limit (and int() refuses past 4300 digits).
    if len(samples_text.lstrip("0")) > 18:
        raise CalibSpecError(f"calibration spec {shown}: the sample count is outside 1..{MAX_SAMPLES}")
    if len(seq_match["digits"].lstrip("0")) > 18:
        raise CalibSpecError(f"calibration spec {shown}: the sequence length is outside 1..{MAX_SEQ_LEN} (1024k)")
    samples = int(samples_text)
    seq_len = int(seq_match["digits"]) * SUFFIXES[seq_match["suffix"].lower()]
    problem = _limit_problem(samples, seq_len)
    if problem is not None:
        raise CalibSpecError(f"calibration spec {shown}: {problem}")
    return CalibSpec(samples, seq_len)
