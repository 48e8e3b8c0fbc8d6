"""Where calibration documents come from: the bundled corpus, local files and folders, hub datasets.

A source is one of
- None: the bundled Shakespeare corpus, `fp4kit/data/corpus/<split>.txt`;
- a local file: `.txt` (plain text), `.jsonl` / `.json` / `.parquet` (one document per row);
- a local folder: every such file under it, in order of relative path (hidden entries skipped);
- anything else: a Hugging Face hub dataset id, streamed.

Documents in a `.txt` file: the whole file is one document, unless it holds form feeds (`\\f`);
then each form feed ends a document. Line ends around a form feed belong to neither neighbour,
so a file of documents joined by "\\n\\f\\n" (the bundled corpus) splits into exactly those
documents. Documents and rows that are empty, null or only whitespace are skipped everywhere.

In tables the text column is `text_field` if given, else "text", else "content", else the only
string column.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import pathlib
import re
from collections.abc import Callable, Iterator

from fp4kit.models.tiny import corpus_path

DOCUMENT_SEPARATOR = "\f"
LINE_ENDS = "\r\n"
TEXT_SUFFIXES = (".txt",)
# Table files and the `datasets` packaged builder that reads each.
TABLE_SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet"}
SUFFIXES = TEXT_SUFFIXES + tuple(TABLE_SUFFIXES)
TEXT_COLUMNS = ("text", "content")
# Repository ids on the hub: "name" or "owner/name".
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
_PATH_PREFIXES = ("./", "../", ".\\", "..\\", "/", "\\", "~")


class CalibSourceError(ValueError):
    """A calibration source that cannot be read as documents."""


@dataclasses.dataclass(frozen=True)
class Source:
    """A resolved source: a description for messages, its documents, and a content fingerprint.

    `nbytes` is the size of the files that hold its text, where that bounds the text (plain text
    and JSON lines); None for compressed tables and hub datasets.
    """

    description: str
    documents: Callable[[], Iterator[str]]
    fingerprint: Callable[[], str]
    nbytes: int | None = None


def split_documents(text: str) -> list[str]:
    """The documents of one .txt file's text (see the module docstring for the rule)."""
    docs = (part.strip(LINE_ENDS) for part in text.split(DOCUMENT_SEPARATOR))
    return [doc for doc in docs if not doc.isspace() and doc]


def iter_documents(
    source: str | os.PathLike | None,
    *,
    split: str = "calibration",
    text_field: str | None = None,
    hub_split: str = "train",
) -> Iterator[str]:
    """The documents of `source`, in source order.

    `split` picks the bundled corpus file when `source` is None; `hub_split` is the split of a
    hub dataset. The source is checked when this is called, not when the iterator is first used.
    """
    return open_source(source, split=split, text_field=text_field, hub_split=hub_split).documents()


def open_source(
    source: str | os.PathLike | None,
    *,
    split: str = "calibration",
    text_field: str | None = None,
    hub_split: str = "train",
) -> Source:
    """Resolve `source` (see `iter_documents`), checking that it exists and has a text column."""
    if text_field is not None and (not isinstance(text_field, str) or not text_field):
        raise CalibSourceError(f"text_field must be a non-empty column name, got {text_field!r}")
    if source is None:
        return _bundled_source(split, text_field)
    is_path = isinstance(source, os.PathLike)
    if is_path:
        source = os.fspath(source)
    if not isinstance(source, str) or not source.strip():
        raise CalibSourceError(f"calibration source must be a path or a hub dataset id, got {source!r}")
    path = pathlib.Path(source).expanduser()
    if path.exists():
        return _local_source(path, text_field)
    if is_path or _looks_like_path(source):
        raise FileNotFoundError(f"calibration source {source!r} not found: no such file or folder")
    if _HUB_ID.fullmatch(source) is None:
        raise CalibSourceError(
            f"calibration source {source!r} is neither an existing local path nor a hub dataset id "
            "('name' or 'owner/name')"
        )
    return _hub_source(source, hub_split, text_field)


def _looks_like_path(source: str) -> bool:
    return (
        source in (".", "..")
        or source.startswith(_PATH_PREFIXES)
        or re.match(r"[A-Za-z]:[\\/]", source) is not None
        or pathlib.PurePath(source).suffix.lower() in SUFFIXES
    )


def _sha256_file(path: pathlib.Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _fingerprint(**fields) -> str:
    return json.dumps(fields, sort_keys=True)


# --- the bundled corpus and .txt files -------------------------------------------------------


def _read_text(path: pathlib.Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise CalibSourceError(f"calibration file {str(path)!r} is not UTF-8 text: {exc}") from None


def _bundled_source(split: str, text_field: str | None) -> Source:
    if text_field is not None:
        raise CalibSourceError(f"text_field={text_field!r} applies to table sources, not the bundled corpus")
    path = corpus_path(split)
    if not path.is_file():
        raise FileNotFoundError(f"bundled corpus split {split!r} not found at {path}")
    return Source(
        description=f"bundled corpus split {split!r}",
        documents=lambda: iter(split_documents(_read_text(path))),
        fingerprint=lambda: _fingerprint(kind="bundled", split=split, sha256=_sha256_file(path)),
        nbytes=path.stat().st_size,
    )


# --- local files and folders -------------------------------------------------------------------


def _local_source(path: pathlib.Path, text_field: str | None) -> Source:
    if path.is_dir():
        files = sorted(
            (p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in SUFFIXES
             and not any(part.startswith(".") for part in p.relative_to(path).parts)),
            key=lambda p: p.relative_to(path).as_posix(),
        )
        if not files:
            raise CalibSourceError(
                f"calibration folder {str(path)!r} holds no {'/'.join(SUFFIXES)} files"
            )
        description = f"folder {str(path)!r} ({len(files)} files)"
    elif path.suffix.lower() in SUFFIXES:
        if path.suffix.lower() in TEXT_SUFFIXES and text_field is not None:
            raise CalibSourceError(
                f"text_field={text_field!r} applies to .jsonl/.json/.parquet files, not {str(path)!r}"
            )
        files = [path]
        description = f"file {str(path)!r}"
    else:
        raise CalibSourceError(
            f"calibration file {str(path)!r} has an unsupported type; expected one of {', '.join(SUFFIXES)}"
        )

    readers = [_file_reader(f, text_field) for f in files]

    def documents() -> Iterator[str]:
        for read in readers:
            yield from read()

    def fingerprint() -> str:
        entries = [
            [f.relative_to(path).as_posix() if path.is_dir() else "", f.suffix.lower(), _sha256_file(f)]
            for f in files
        ]
        return _fingerprint(kind="local", files=entries, text_field=text_field)

    # Parquet compresses its text, so its file size says nothing about how much text it holds.
    nbytes = None if any(f.suffix.lower() == ".parquet" for f in files) else sum(f.stat().st_size for f in files)
    return Source(description=description, documents=documents, fingerprint=fingerprint, nbytes=nbytes)


def _file_reader(path: pathlib.Path, text_field: str | None) -> Callable[[], Iterator[str]]:
    """A function giving the documents of one file, after checking the file can give them."""
    suffix = path.suffix.lower()
    if suffix in TEXT_SUFFIXES:
        return lambda: iter(split_documents(_read_text(path)))
    where = f"calibration file {str(path)!r}"
    if path.stat().st_size == 0:
        return lambda: iter(())

    import datasets

    try:
        # data_files is a glob pattern; escape it so names with [ ] * ? are taken literally.
        dataset = datasets.load_dataset(
            TABLE_SUFFIXES[suffix], data_files=glob.escape(str(path)), split="train", streaming=True
        )
    except StopIteration:  # the json builder finds no rows to infer a schema from
        return lambda: iter(())
    except (OSError, ValueError) as exc:
        raise CalibSourceError(f"{where} cannot be read as {TABLE_SUFFIXES[suffix]}: {exc}") from exc
    column = _text_column(dataset, text_field, where)
    if column is None:
        return lambda: iter(())
    return lambda: _column_texts(dataset, column, where)


def _text_column(dataset, text_field: str | None, where: str) -> str | None:
    """The text column of a streamed dataset, or None when it has no rows to tell from."""
    if dataset.features is not None:
        columns = {
            name: getattr(feature, "dtype", None) in ("string", "large_string")
            for name, feature in dataset.features.items()
        }
    else:
        first = next(iter(dataset), None)
        if first is None:
            return None
        columns = {name: isinstance(value, str) for name, value in first.items()}
    listing = ", ".join(f"{name!r}" + ("" if is_text else " (not text)") for name, is_text in columns.items())
    if text_field is not None:
        if text_field not in columns:
            raise CalibSourceError(f"{where} has no column text_field={text_field!r}; its columns: {listing}")
        if not columns[text_field]:
            raise CalibSourceError(f"{where}: column text_field={text_field!r} does not hold text; its columns: {listing}")
        return text_field
    for name in TEXT_COLUMNS:
        if columns.get(name):
            return name
    text_columns = [name for name, is_text in columns.items() if is_text]
    if len(text_columns) == 1:
        return text_columns[0]
    raise CalibSourceError(
        f"{where}: cannot tell which column holds the documents (no string column named 'text' or "
        f"'content', and {len(text_columns)} other string columns); pass text_field; its columns: {listing}"
    )


def _column_texts(dataset, column: str, where: str) -> Iterator[str]:
    for index, row in enumerate(dataset):
        value = row.get(column)
        if value is None:
            continue
        if not isinstance(value, str):
            raise CalibSourceError(f"{where}: row {index} of column {column!r} holds {type(value).__name__}, not text")
        if value and not value.isspace():
            yield value


# --- hub datasets ------------------------------------------------------------------------------


def _hub_source(dataset_id: str, hub_split: str, text_field: str | None) -> Source:
    import datasets

    where = f"hub dataset {dataset_id!r} (split {hub_split!r})"
    try:
        builder = datasets.load_dataset_builder(dataset_id)
        dataset = builder.as_streaming_dataset(split=hub_split)
    except (OSError, ValueError, RuntimeError) as exc:
        offline = " (offline mode is on: HF_HUB_OFFLINE / HF_DATASETS_OFFLINE)" if datasets.config.HF_HUB_OFFLINE else ""
        raise CalibSourceError(
            f"calibration source {dataset_id!r} is not a local path and {where} could not be loaded{offline}: "
            f"{exc}; give a local .txt/.jsonl/.parquet file or folder, or no source for the bundled corpus"
        ) from exc
    column = _text_column(dataset, text_field, where)
    if column is None:
        raise CalibSourceError(f"{where} has no rows")
    # builder.hash is the commit the hub resolved, so a new revision of the dataset is a new source.
    revision = builder.hash
    return Source(
        description=where if revision is None else f"{where} at {revision}",
        documents=lambda: _column_texts(dataset, column, where),
        fingerprint=lambda: _fingerprint(
            kind="hub", id=dataset_id, config=builder.config.name, split=hub_split, revision=revision,
            text_field=text_field,
        ),
    )
