"""Calibration sets: how a spec such as "1000x32k" becomes token samples.

`parse_calib_spec("1000x32k")` checks the spec before any model is loaded; `iter_documents`
reads documents from the bundled corpus, local .txt/.jsonl/.json/.parquet files and folders, or
a hub dataset; `check_source_size` refuses a source too small for the spec from a sample of
it; `build_calibration_set` packs them, EOS after each document, into exactly N rows
of L tokens, deterministic under a seed and cached by content hash.
"""

from .build import CalibSourceTooSmall, build_calibration_set, check_source_size, default_cache_dir
from .sources import CalibSourceError, iter_documents
from .spec import CalibSpec, CalibSpecError, parse_calib_spec

__all__ = [
    "CalibSourceError",
    "CalibSourceTooSmall",
    "CalibSpec",
    "CalibSpecError",
    "build_calibration_set",
    "check_source_size",
    "default_cache_dir",
    "iter_documents",
    "parse_calib_spec",
]
