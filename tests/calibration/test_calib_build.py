import json

import pytest
import torch

from fp4kit.calibration import CalibSourceTooSmall, CalibSpec, build_calibration_set
from fp4kit.calibration import build as build_module
from fp4kit.calibration.build import BATCH_DOCS
from fp4kit.models import tiny

EOS_ID = 1


def word_id(i: int) -> int:
    return i + 2  # the test tokenizer's id of f"w{i}"


def write_docs(path, lengths):
    """A .jsonl source whose document i is f"w{i}" repeated lengths[i] times."""
    rows = [{"text": " ".join([f"w{i}"] * n)} for i, n in enumerate(lengths)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def segments(ids: torch.Tensor) -> list[list[int]]:
    """The flattened rows cut after each EOS (the EOS dropped); the last piece may be partial."""
    out, current = [], []
    for token in ids.flatten().tolist():
        if token == EOS_ID:
            out.append(current)
            current = []
        else:
            current.append(token)
    return out + ([current] if current else [])


@pytest.fixture
def source(tmp_path):
    # 20 documents; with one EOS each they hold 20 + sum(lengths) = 140 tokens.
    lengths = [3, 9, 1, 5, 7, 2, 8, 4, 6, 10, 3, 9, 1, 5, 7, 2, 8, 4, 6, 20]
    return write_docs(tmp_path / "docs.jsonl", lengths), lengths


def build(tokenizer, spec, source, cache_dir, **kwargs):
    return build_calibration_set(tokenizer, spec, source, cache_dir=cache_dir, progress=False, **kwargs)


@pytest.mark.parametrize("spec, shape", [("1x1", (1, 1)), ("3x7", (3, 7)), ("7x20", (7, 20)), ("1x140", (1, 140))])
def test_exact_shape(tokenizer, source, tmp_path, spec, shape):
    ids = build(tokenizer, spec, source[0], tmp_path / "cache")
    assert ids.shape == shape and ids.dtype == torch.int64


def test_every_document_whole_and_followed_by_eos(tokenizer, source, tmp_path):
    path, lengths = source
    ids = build(tokenizer, "7x20", path, tmp_path / "cache")  # exactly the 140 tokens of the source
    pieces = segments(ids)
    assert ids.flatten()[-1] == EOS_ID and len(pieces) == len(lengths)
    order = []
    for piece in pieces:
        i = piece[0] - 2
        assert piece == [word_id(i)] * lengths[i]
        order.append(i)
    assert sorted(order) == list(range(len(lengths)))
    assert order != list(range(len(lengths)))  # the document order is shuffled


def test_seed_determines_the_set(tokenizer, source, tmp_path):
    path = source[0]
    first = build(tokenizer, "4x16", path, tmp_path / "c1", seed=5)
    again = build(tokenizer, "4x16", path, tmp_path / "c2", seed=5)
    other = build(tokenizer, "4x16", path, tmp_path / "c3", seed=6)
    assert torch.equal(first, again)
    assert not torch.equal(first, other)


def test_small_set_is_the_start_of_a_large_one(tokenizer, source, tmp_path):
    path = source[0]
    large = build(tokenizer, "7x20", path, tmp_path / "c1", seed=3)
    small = build(tokenizer, "2x9", path, tmp_path / "c2", seed=3)
    assert torch.equal(small.flatten(), large.flatten()[:18])


def test_tokenizing_stops_once_enough_tokens(tokenizer, tmp_path, count_tokenized):
    path = write_docs(tmp_path / "big.jsonl", [50] * 300)
    ids = build(tokenizer, "2x8", path, tmp_path / "cache")
    assert ids.shape == (2, 8)
    assert 1 <= len(count_tokenized) <= BATCH_DOCS < 300


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_shuffle_window_bounds_how_far_ahead_it_reads(monkeypatch, seed):
    window = 4
    monkeypatch.setattr(build_module, "SHUFFLE_WINDOW", window)
    read = []

    def documents():
        for i in range(30):
            read.append(i)
            yield f"d{i}"

    shuffled = build_module._shuffled(documents(), seed)
    first = next(shuffled)
    assert len(read) == window + 1  # one document out needs only the window plus one read
    order = [int(d[1:]) for d in [first, *shuffled]]
    assert sorted(order) == list(range(30)) and order != list(range(30))
    # Document j enters the window when read, so it cannot come out before position j - window.
    assert all(position >= j - window for position, j in enumerate(order))
    assert order == [int(d[1:]) for d in build_module._shuffled((f"d{i}" for i in range(30)), seed)]


def test_progress_bar_only_when_asked(tokenizer, source, tmp_path, capfd):
    build_calibration_set(tokenizer, "2x8", source[0], cache_dir=tmp_path / "c1", progress=False)
    assert "tokenizing calibration set" not in capfd.readouterr().err
    build_calibration_set(tokenizer, "2x8", source[0], cache_dir=tmp_path / "c2", progress=True)
    assert "tokenizing calibration set" in capfd.readouterr().err


def test_too_small_source_says_how_small(tokenizer, source, tmp_path):
    with pytest.raises(CalibSourceTooSmall) as info:
        build(tokenizer, "3x50", source[0], tmp_path / "cache")
    message = str(info.value)
    assert "gives 140 tokens" in message and "3x50 needs 150" in message
    assert "--allow-repeat" in message and "such as 2x50" in message
    assert isinstance(info.value, ValueError)
    assert not list((tmp_path / "cache").glob("*.safetensors"))


def test_allow_repeat_cycles_the_stream(tokenizer, source, tmp_path):
    path = source[0]
    once = build(tokenizer, "1x140", path, tmp_path / "c1", seed=2).flatten()
    cycled = build(tokenizer, "5x64", path, tmp_path / "c2", seed=2, allow_repeat=True).flatten()
    expected = torch.cat([once, once, once])[:320]
    assert torch.equal(cycled, expected)


def test_allow_repeat_cannot_repeat_nothing(tokenizer, tmp_path):
    path = tmp_path / "blank.txt"
    path.write_text("\n\f\n\f\n")
    with pytest.raises(CalibSourceTooSmall, match="blank.txt.*holds no text"):
        build(tokenizer, "1x4", path, tmp_path / "cache", allow_repeat=True)


def test_cache_hit_tokenizes_nothing(tokenizer, source, tmp_path, count_tokenized):
    path, cache = source[0], tmp_path / "cache"
    first = build(tokenizer, "3x16", path, cache, seed=1)
    assert count_tokenized
    count_tokenized.clear()
    second = build(tokenizer, "3x16", path, cache, seed=1)
    assert count_tokenized == []
    assert torch.equal(first, second)
    assert len(list(cache.glob("*.safetensors"))) == 1
    assert not list(cache.glob("*.tmp"))


def test_cache_follows_content_not_path(tokenizer, source, tmp_path, count_tokenized):
    path, cache = source[0], tmp_path / "cache"
    first = build(tokenizer, "3x16", path, cache)
    count_tokenized.clear()
    copy = tmp_path / "elsewhere" / "copy.jsonl"
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes())
    assert torch.equal(build(tokenizer, "3x16", copy, cache), first)
    assert count_tokenized == []

    write_docs(path, [4] * 20)  # new content under the old name
    changed = build(tokenizer, "3x16", path, cache)
    assert count_tokenized
    assert not torch.equal(changed, first)
    assert len(list(cache.glob("*.safetensors"))) == 2


@pytest.mark.parametrize("change", [{"seed": 1}, {"spec": "4x12"}, {"allow_repeat": True}])
def test_cache_key_covers_the_arguments(tokenizer, source, tmp_path, count_tokenized, change):
    args = {"spec": "3x16", "seed": 0, "allow_repeat": False} | change
    build(tokenizer, "3x16", source[0], tmp_path / "cache")
    count_tokenized.clear()
    build(tokenizer, args.pop("spec"), source[0], tmp_path / "cache", **args)
    assert count_tokenized


def test_cache_key_covers_the_tokenizer(tokenizer, make_tokenizer, source, tmp_path):
    other = make_tokenizer()
    other.backend_tokenizer.add_tokens(["w1 w1"])  # a different backend, same vocabulary words
    build(tokenizer, "3x16", source[0], tmp_path / "cache")
    build(other, "3x16", source[0], tmp_path / "cache")
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == 2


def test_corrupt_cache_entry_is_rebuilt(tokenizer, source, tmp_path):
    cache = tmp_path / "cache"
    first = build(tokenizer, "3x16", source[0], cache)
    (entry,) = cache.glob("*.safetensors")
    entry.write_bytes(b"garbage")
    assert torch.equal(build(tokenizer, "3x16", source[0], cache), first)


def test_default_cache_dir_is_under_fp4kit_cache(tokenizer, source, tmp_path, monkeypatch):
    monkeypatch.setenv("FP4KIT_CACHE", str(tmp_path / "fp4kit-cache"))
    build_calibration_set(tokenizer, "2x8", source[0], progress=False)
    assert len(list((tmp_path / "fp4kit-cache" / "calibration").glob("*.safetensors"))) == 1


def test_spec_object_or_text(tokenizer, source, tmp_path):
    a = build(tokenizer, CalibSpec(2, 10), source[0], tmp_path / "c1")
    b = build(tokenizer, "2x10", source[0], tmp_path / "c2")
    assert torch.equal(a, b)


def test_bad_arguments(tokenizer, make_tokenizer, source, tmp_path):
    with pytest.raises(ValueError, match="has no EOS token"):
        build(make_tokenizer(eos=False), "2x8", source[0], tmp_path)
    for seed in (-1, True, 1.0, "0"):
        with pytest.raises(ValueError, match=f"seed must be a non-negative int, got {seed!r}"):
            build(tokenizer, "2x8", source[0], tmp_path, seed=seed)
    with pytest.raises(ValueError, match="calibration spec '2x'"):
        build(tokenizer, "2x", source[0], tmp_path)
    with pytest.raises(TypeError, match="got \\(2, 8\\)"):
        build(tokenizer, (2, 8), source[0], tmp_path)


def test_bundled_corpus_with_the_shipped_tokenizer(tmp_path):
    from transformers import AutoTokenizer

    tokenizer_dir = tiny.tiny_model_path()
    corpus = tiny.corpus_path("calibration")
    if not (tokenizer_dir / "tokenizer.json").is_file() or not corpus.is_file():
        pytest.skip(f"needs the shipped tokenizer in {tokenizer_dir} and the bundled corpus {corpus}")
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    plays = tiny.corpus_documents("calibration")
    streams = [tiny.token_stream(tokenizer, [play]) for play in plays]
    total = sum(s.numel() for s in streams)
    seq_len = 2048
    ids = build_calibration_set(tokenizer, CalibSpec(total // seq_len, seq_len), cache_dir=tmp_path, progress=False)
    flat = ids.flatten()
    # The set is the plays in some order, each tokenized alone and followed by EOS, cut to length.
    pos, used = 0, set()
    while pos < flat.numel():
        match = [i for i, s in enumerate(streams) if i not in used and torch.equal(flat[pos : pos + s.numel()], s[: flat.numel() - pos])]
        assert len(match) == 1, f"no single play continues the set at token {pos}"
        used.add(match[0])
        pos += streams[match[0]].numel()
    assert len(used) == len(plays) and flat.numel() > total - seq_len
    with pytest.raises(CalibSourceTooSmall, match=f"gives {total} tokens"):
        build_calibration_set(tokenizer, CalibSpec(total // seq_len + 1, seq_len), cache_dir=tmp_path, progress=False)
