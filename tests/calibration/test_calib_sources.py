import json
import pathlib

import datasets
import huggingface_hub
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fp4kit.calibration import CalibSourceError, iter_documents
from fp4kit.calibration.sources import split_documents
from fp4kit.models import tiny


def write_jsonl(path, texts, field="text"):
    path.write_text("".join(json.dumps({field: t}) + "\n" for t in texts))
    return path


def docs(source, **kwargs):
    return list(iter_documents(source, **kwargs))


@pytest.fixture
def no_hub(monkeypatch):
    """Fail the test if anything reaches for the hub."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"hub lookup for {args!r}")

    monkeypatch.setattr(datasets, "load_dataset_builder", refuse)


# --- .txt files --------------------------------------------------------------------------------


def test_txt_file_without_form_feed_is_one_document(tmp_path):
    path = tmp_path / "one.txt"
    path.write_text("\nFirst line.\n\nSecond paragraph.\n\n")
    assert docs(path) == ["First line.\n\nSecond paragraph."]


def test_txt_file_splits_on_form_feeds(tmp_path):
    path = tmp_path / "many.txt"
    path.write_text("alpha one\n\f\nbeta\ntwo\fgamma\r\n\f\r\n\f \n\f\n\n")
    assert docs(str(path)) == ["alpha one", "beta\ntwo", "gamma"]


def test_split_documents_inverts_the_corpus_separator():
    plays = ["Title A\n\nline", "Title B\n\n\nline\n  indented"]
    assert split_documents(tiny.DOC_SEPARATOR.join(plays) + "\n") == plays


def test_txt_must_be_utf8(tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("caf\u00e9".encode("latin-1"))
    with pytest.raises(CalibSourceError, match="latin1.txt.*not UTF-8"):
        docs(path)


def test_text_field_is_refused_for_txt(tmp_path):
    path = tmp_path / "a.txt"
    path.write_text("x")
    with pytest.raises(CalibSourceError, match="text_field='body'.*a.txt"):
        iter_documents(path, text_field="body")


# --- the bundled corpus ------------------------------------------------------------------------


@pytest.mark.parametrize("split", tiny.SPLITS)
def test_bundled_corpus_documents_are_the_plays(split):
    if not tiny.corpus_path(split).is_file():
        pytest.skip(f"bundled corpus {tiny.corpus_path(split)} not built")
    plays = docs(None, split=split)
    assert plays == tiny.corpus_documents(split)
    assert len(plays) > 1 and all("\f" not in p and p == p.strip("\n") for p in plays)


def test_bundled_corpus_rejects_unknown_split_and_text_field():
    with pytest.raises(ValueError, match="'validation'"):
        iter_documents(None, split="validation")
    with pytest.raises(CalibSourceError, match="bundled corpus"):
        iter_documents(None, text_field="text")


# --- tables ------------------------------------------------------------------------------------


@pytest.mark.parametrize("field", ["text", "content", "body"])
def test_jsonl_text_column_is_detected(tmp_path, field):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"id": i, field: f"doc {i}"}) + "\n" for i in range(3)))
    assert docs(path) == ["doc 0", "doc 1", "doc 2"]


def test_text_beats_content_and_text_field_overrides(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"content": "c", "text": "t", "title": "h"}) + "\n")
    assert docs(path) == ["t"]
    assert docs(path, text_field="title") == ["h"]


def test_ambiguous_columns_are_an_error_listing_them(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"question": "q", "answer": "a", "n": 1}) + "\n")
    with pytest.raises(CalibSourceError, match="rows.jsonl") as info:
        iter_documents(path)
    message = str(info.value)
    assert "'question', 'answer', 'n' (not text)" in message and "text_field" in message


def test_bad_text_field_names_field_and_columns(tmp_path):
    path = write_jsonl(tmp_path / "rows.jsonl", ["a"])
    with pytest.raises(CalibSourceError, match=r"no column text_field='body'; its columns: 'text'"):
        iter_documents(path, text_field="body")


def test_text_field_must_hold_text(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"text": "a", "n": 3}) + "\n")
    with pytest.raises(CalibSourceError, match="text_field='n' does not hold text"):
        iter_documents(path, text_field="n")


def test_empty_null_and_blank_rows_are_skipped(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in ["a", "", None, " \n ", " b "]))
    assert docs(path) == ["a", " b "]


def test_column_mixing_text_and_numbers_is_not_text(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"text": "a"}) + "\n" + json.dumps({"text": 5}) + "\n")
    with pytest.raises(CalibSourceError, match="rows.jsonl.*no string column named 'text'.*'text' \\(not text\\)"):
        iter_documents(path)
    with pytest.raises(CalibSourceError, match="rows.jsonl': column text_field='text' does not hold text"):
        iter_documents(path, text_field="text")


def test_empty_jsonl_has_no_documents(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("")
    assert docs(path) == []


def test_json_array_file(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"content": "x y"}, {"content": "z"}]))
    assert docs(path) == ["x y", "z"]


def test_parquet_file(tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"id": [1, 2, 3], "body": ["p q", None, "r"]}), path)
    assert docs(path) == ["p q", "r"]
    with pytest.raises(CalibSourceError, match="no column text_field='text'; its columns: 'id' \\(not text\\), 'body'"):
        iter_documents(path, text_field="text")


def test_corrupt_table_names_the_file(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_text("not parquet")
    with pytest.raises(CalibSourceError, match="broken.parquet.*parquet"):
        iter_documents(path)


def test_file_names_are_literal_not_globs(tmp_path):
    write_jsonl(tmp_path / "shard[1].jsonl", ["right"])
    write_jsonl(tmp_path / "shard1.jsonl", ["wrong"])
    assert docs(tmp_path / "shard[1].jsonl") == ["right"]


# --- folders -----------------------------------------------------------------------------------


def test_folder_reads_supported_files_in_path_order(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / ".cache").mkdir()
    (tmp_path / "b.txt").write_text("from b\fsecond b")
    write_jsonl(tmp_path / "a.jsonl", ["from a"])
    pq.write_table(pa.table({"text": ["from sub/c"]}), tmp_path / "sub" / "c.parquet")
    write_jsonl(tmp_path / "c.JSONL", ["from c upper"])
    (tmp_path / ".hidden.txt").write_text("hidden")
    (tmp_path / ".cache" / "x.txt").write_text("cached")
    (tmp_path / "README.md").write_text("not a document")
    # Sorted by relative path: "a.jsonl" < "b.txt" < "c.JSONL" < "sub/c.parquet".
    assert docs(tmp_path) == ["from a", "from b", "second b", "from c upper", "from sub/c"]


def test_folder_checks_every_file_up_front(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", ["ok"])
    write_jsonl(tmp_path / "b.jsonl", ["ok"], field="body")
    with pytest.raises(CalibSourceError, match="b.jsonl.*no column text_field='text'"):
        iter_documents(tmp_path, text_field="text")


def test_folder_without_supported_files(tmp_path):
    (tmp_path / "notes.md").write_text("x")
    with pytest.raises(CalibSourceError, match="holds no .txt/.jsonl/.json/.parquet files"):
        iter_documents(tmp_path)


def test_unsupported_file_type(tmp_path):
    path = tmp_path / "rows.csv"
    path.write_text("text\nhello\n")
    with pytest.raises(CalibSourceError, match="rows.csv.*unsupported type"):
        iter_documents(path)


# --- missing paths and hub ids -----------------------------------------------------------------


@pytest.mark.parametrize(
    "source", ["./missing.txt", "../missing", "/no/such/folder", "~/fp4kit-no-such-dir", "missing.jsonl", "data/x.parquet"]
)
def test_missing_local_path_is_not_found_not_a_hub_lookup(tmp_path, monkeypatch, no_hub, source):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match=f"calibration source {source!r} not found"):
        iter_documents(source)


def test_missing_path_object_is_never_a_hub_id(tmp_path, monkeypatch, no_hub):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="'owner' not found"):
        iter_documents(pathlib.Path("owner"))


@pytest.mark.parametrize("source", ["two words", "a/b/c", "-dash", ""])
def test_text_that_is_no_path_and_no_hub_id(tmp_path, monkeypatch, no_hub, source):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CalibSourceError, match="calibration source"):
        iter_documents(source)


def test_hub_id_offline_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    # Both libraries read these variables at import; set the parsed values as well.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CalibSourceError) as info:
        iter_documents("fp4kit-tests/no-such-dataset", hub_split="train")
    message = str(info.value)
    assert "'fp4kit-tests/no-such-dataset'" in message
    assert "could not be loaded (offline mode is on" in message
    assert "local .txt/.jsonl/.parquet" in message
