"""Build a calibration set: documents -> shuffled -> tokenized with EOS after each -> [N, L] tokens.

The token stream is the documents in shuffled order, each tokenized without special tokens and
followed by the tokenizer's EOS; the set is its first N*L tokens, row by row. Tokenizing stops
once N*L tokens are in hand, and the result depends only on the stream, so a small set is the
first rows of a larger one built with the same seed.

Shuffling keeps a window of SHUFFLE_WINDOW documents: a source with at most that many documents
is read whole and shuffled uniformly; a longer one (a streamed hub dataset) is shuffled within a
sliding window, so building a set never reads a whole large corpus.

A source whose stream is shorter than N*L raises CalibSourceTooSmall; with allow_repeat=True
the stream is cycled, starting again from its first token (same order, not reshuffled).
`check_source_size` says the same before any model is loaded, from at most SIZE_SAMPLE_BYTES
of tokenized text and the source's file size.

Finished sets are cached as safetensors under `cache_dir`, keyed by a sha256 of everything the
tokens depend on: the tokenizer (its backend JSON, else its vocabulary) and EOS id, the source
content (file bytes; hub id, split and resolved revision), the spec, seed and allow_repeat.
"""

from __future__ import annotations

import hashlib
import json
import operator
import os
import pathlib
import random
import tempfile
from collections.abc import Callable, Iterable, Iterator

import torch

from .sources import CalibSourceError, Source, open_source
from .spec import CalibSpec, parse_calib_spec

SHUFFLE_WINDOW = 10_000
# Documents per tokenizer call; a batch also ends once it has as many characters as tokens
# are still needed, so a small set does not tokenize far past what it uses.
BATCH_DOCS = 32
# Bump when the stream construction changes, so old cache entries stop matching.
CACHE_FORMAT = 1
CACHE_TENSOR = "input_ids"


class CalibSourceTooSmall(CalibSourceError):
    """The source's token stream is shorter than the spec needs, and repeating was not allowed."""


def default_cache_dir() -> pathlib.Path:
    """$FP4KIT_CACHE/calibration, else ~/.cache/fp4kit/calibration (read at call time)."""
    root = os.environ.get("FP4KIT_CACHE")
    base = pathlib.Path(root).expanduser() if root else pathlib.Path.home() / ".cache" / "fp4kit"
    return base / "calibration"


def build_calibration_set(
    tokenizer,
    spec: CalibSpec | str,
    source: str | os.PathLike | None = None,
    *,
    seed: int = 0,
    allow_repeat: bool = False,
    cache_dir: str | os.PathLike | None = None,
    split: str = "calibration",
    text_field: str | None = None,
    hub_split: str = "train",
    progress: bool = True,
) -> torch.Tensor:
    """[N, L] int64 token ids of `spec` ("NxL" or a CalibSpec) drawn from `source`.

    `source`, `split`, `text_field` and `hub_split` are as in `iter_documents` (None: the
    bundled corpus split `split`). The result is a pure function of the tokenizer, the source
    content, the spec, `seed` and `allow_repeat`, and is cached under `cache_dir`
    (default: `default_cache_dir()`); a cache hit tokenizes nothing.
    """
    if isinstance(spec, str):
        spec = parse_calib_spec(spec)
    elif not isinstance(spec, CalibSpec):
        raise TypeError(f"spec must be a CalibSpec or a string such as '1000x32k', got {spec!r}")
    try:
        seed_value = None if isinstance(seed, bool) else operator.index(seed)
    except TypeError:
        seed_value = None
    # random.Random folds negative seeds onto positive ones, so -1 would silently equal 1.
    if seed_value is None or seed_value < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    seed = seed_value
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
        raise ValueError(
            f"tokenizer {name!r} has no EOS token; calibration sets put EOS between documents "
            "(set tokenizer.eos_token)"
        )

    src = open_source(source, split=split, text_field=text_field, hub_split=hub_split)
    key = _cache_key(tokenizer, eos, src, spec, seed, allow_repeat)
    cache_dir = pathlib.Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    path = cache_dir / f"{key}.safetensors"
    cached = _load_cached(path, spec)
    if cached is not None:
        return cached
    # Fail on an unwritable cache before tokenizing, not after.
    cache_dir.mkdir(parents=True, exist_ok=True)

    need = spec.total_tokens
    stream = _token_stream(tokenizer, _shuffled(src.documents(), seed), need, eos, progress)
    if stream.numel() < need:
        if stream.numel() == 0:
            raise CalibSourceTooSmall(f"calibration source {src.description} holds no text")
        if not allow_repeat:
            raise CalibSourceTooSmall(_too_small_message(src, spec, stream.numel()))
        repeats = -(-need // stream.numel())
        stream = stream.repeat(repeats)[:need]
    ids = stream.view(spec.samples, spec.seq_len)

    metadata = {"spec": str(spec), "seed": str(seed), "allow_repeat": str(allow_repeat), "source": src.description}
    _save_atomic(path, ids, metadata)
    return ids


def _shuffled(documents: Iterable[str], seed: int) -> Iterator[str]:
    """`documents` in a seeded order: uniform within SHUFFLE_WINDOW, a sliding window beyond."""
    rng = random.Random(seed)
    window: list[str] = []
    for doc in documents:
        if len(window) < SHUFFLE_WINDOW:
            window.append(doc)
            continue
        i = rng.randrange(SHUFFLE_WINDOW)
        yield window[i]
        window[i] = doc
    rng.shuffle(window)
    yield from window


def _token_stream(tokenizer, documents: Iterator[str], need: int, eos: int, progress: bool) -> torch.Tensor:
    """The first `need` tokens of the stream (fewer if the documents run out), int64."""
    from tqdm.auto import tqdm

    chunks: list[torch.Tensor] = []
    filled = 0
    with tqdm(total=need, unit="tok", unit_scale=True, desc="tokenizing calibration set", disable=not progress) as bar:
        while filled < need:
            batch: list[str] = []
            chars = 0
            for doc in documents:
                batch.append(doc)
                chars += len(doc)
                if len(batch) == BATCH_DOCS or chars >= need - filled:
                    break
            if not batch:
                break
            encoded = tokenizer(batch, add_special_tokens=False, return_attention_mask=False, verbose=False)
            for ids in encoded["input_ids"]:
                ids.append(eos)
                take = min(len(ids), need - filled)
                chunks.append(torch.tensor(ids[:take], dtype=torch.long))
                filled += take
                bar.update(take)
                if filled == need:
                    break
    return torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.long)


def _too_small_message(src: Source, spec: CalibSpec, available: int) -> str:
    return (
        f"calibration source {src.description} gives {available} tokens with this tokenizer "
        f"(documents plus one EOS each) but {spec} needs {spec.total_tokens}{_fix_hint(spec, available)}"
    )


def _fix_hint(spec: CalibSpec, available: int) -> str:
    fits = available // spec.seq_len
    smaller = f", or a smaller --calib such as {CalibSpec(fits, spec.seq_len)}" if fits >= 1 else ", or a smaller --calib"
    return f"; pass --allow-repeat to cycle through the source again{smaller}"


# --- size, before the model loads -----------------------------------------------------------

# UTF-8 bytes of text tokenized to judge a source's size; a larger source is judged by
# extrapolating the sample's tokens per byte to its file size.
SIZE_SAMPLE_BYTES = 1 << 18
# An extrapolated count refuses a source only when the estimate times this still falls short:
# the sample's tokens per byte need not hold for the rest of the source.
ESTIMATE_SLACK = 1.5


def check_source_size(
    source: str | os.PathLike | None,
    spec: CalibSpec | str,
    count_tokens: Callable[[list[str]], list[int]] | None = None,
    *,
    allow_repeat: bool = False,
    split: str = "calibration",
    text_field: str | None = None,
) -> None:
    """Refuse a source whose token stream is shorter than `spec` needs, without tokenizing all of it.

    `count_tokens(documents)` gives each document's token count without special tokens (EOS is
    counted here, one per document); None bounds it by the UTF-8 byte count, which no byte-level
    or SentencePiece tokenizer exceeds by more than a token per document. At most
    SIZE_SAMPLE_BYTES of text are counted: a source that ends within them is judged exactly,
    a longer one by its file size. An empty source is refused even with `allow_repeat`; hub
    datasets and Parquet files, whose size says nothing of their text, are left to
    `build_calibration_set`. Raises CalibSourceTooSmall.
    """
    if isinstance(spec, str):
        spec = parse_calib_spec(spec)
    src = open_source(source, split=split, text_field=text_field)
    if src.nbytes is None:
        return
    count = count_tokens or (lambda docs: [len(d.encode("utf-8")) + 1 for d in docs])
    need = spec.total_tokens
    tokens = sampled = 0  # tokens counted (EOS included), and the UTF-8 bytes of text they cover
    whole = True  # every document counted in full
    for doc in src.documents():
        if tokens >= need or (allow_repeat and tokens) or sampled >= SIZE_SAMPLE_BYTES:
            whole = False
            break
        part = doc[: SIZE_SAMPLE_BYTES - sampled]
        tokens += count([part])[0] + (len(part) == len(doc))
        whole = whole and len(part) == len(doc)
        sampled += len(part.encode("utf-8"))
    if whole and tokens == 0:
        raise CalibSourceTooSmall(
            f"calibration source {src.description} holds no text; give one that does, or none for the bundled corpus"
        )
    if allow_repeat or tokens >= need:
        return
    if whole:
        if count_tokens is not None:
            raise CalibSourceTooSmall(_too_small_message(src, spec, tokens))
        raise CalibSourceTooSmall(
            f"calibration source {src.description} holds {sampled} bytes of text in its documents, "
            f"at most {tokens} tokens with EOS, but {spec} needs {need}{_fix_hint(spec, tokens)}"
        )
    estimate = tokens * src.nbytes // max(1, sampled)
    if estimate * ESTIMATE_SLACK >= need:
        return
    per = f"{sampled / tokens:.1f} bytes per token" if count_tokens is not None else "at most one token per byte"
    raise CalibSourceTooSmall(
        f"calibration source {src.description} gives about {estimate} tokens (its first {sampled} bytes of "
        f"text count {per}; it has {src.nbytes} bytes) but {spec} needs {need}{_fix_hint(spec, estimate)}"
    )


# --- cache ---------------------------------------------------------------------------------------


def _tokenizer_fingerprint(tokenizer) -> str:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        text = backend.to_str()
    else:
        text = json.dumps([type(tokenizer).__name__, sorted(tokenizer.get_vocab().items())])
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _cache_key(tokenizer, eos: int, src: Source, spec: CalibSpec, seed: int, allow_repeat: bool) -> str:
    fields = {
        "format": CACHE_FORMAT,
        "tokenizer": _tokenizer_fingerprint(tokenizer),
        "eos": eos,
        "source": src.fingerprint(),
        "spec": str(spec),
        "seed": seed,
        "allow_repeat": allow_repeat,
    }
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode("utf-8")).hexdigest()


def _load_cached(path: pathlib.Path, spec: CalibSpec) -> torch.Tensor | None:
    """The cached set at `path`, or None when absent or unreadable (it is then rebuilt)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not path.is_file():
        return None
    try:
        ids = load_file(path)[CACHE_TENSOR]
    except (OSError, SafetensorError, KeyError):
        return None
    if ids.dtype != torch.long or tuple(ids.shape) != (spec.samples, spec.seq_len):
        return None
    return ids


def _save_atomic(path: pathlib.Path, ids: torch.Tensor, metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    os.close(fd)
    try:
        save_file({CACHE_TENSOR: ids.contiguous()}, tmp, metadata=metadata)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
