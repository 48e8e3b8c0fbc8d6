import pytest
from hypothesis import given
from hypothesis import strategies as st

from fp4kit.calibration import CalibSpec, CalibSpecError, parse_calib_spec
from fp4kit.calibration.spec import MAX_SAMPLES, MAX_SEQ_LEN, MAX_TOTAL_TOKENS


@pytest.mark.parametrize(
    "text, samples, seq_len",
    [
        ("1000x32k", 1000, 32 * 1024),
        ("512x2048", 512, 2048),
        ("1x1", 1, 1),
        ("7X3K", 7, 3 * 1024),
        ("4x8k", 4, 8192),
        ("2x1m", 2, 1024 * 1024),
        ("2x1M", 2, 1024 * 1024),
        ("  16x512\n", 16, 512),
        ("0010x05", 10, 5),
        ("1000000x1", MAX_SAMPLES, 1),
        ("1x1024k", 1, MAX_SEQ_LEN),
        ("65536x1024k", 65536, 1024 * 1024),  # exactly 2**36 tokens
    ],
)
def test_good_specs(text, samples, seq_len):
    spec = parse_calib_spec(text)
    assert spec == CalibSpec(samples, seq_len)
    assert spec.total_tokens == samples * seq_len


@pytest.mark.parametrize(
    "text, problem",
    [
        ("0x32k", "sample count 0 is outside 1..1000000"),
        ("1000x", "sequence length after 'x' is missing"),
        ("x", "sample count before 'x' is missing"),
        ("x32k", "sample count before 'x' is missing"),
        ("1000x32q", "'32q' is not a positive integer"),
        ("-1x32k", "'-1' is not a positive integer"),
        ("1000x-32k", "'-32k' is not a positive integer"),
        ("1000x0", "sequence length 0 is outside"),
        ("1000x0k", "sequence length 0 is outside"),
        ("1000001x1", "sample count 1000001 is outside 1..1000000"),
        ("1x1025k", "sequence length 1049600 is outside 1..1048576"),
        ("1x2m", "sequence length 2097152 is outside"),
        ("65537x1024k", "more than the limit of 2**36"),
        ("1000000x1m", "more than the limit of 2**36"),
        ("99999999999999999999999x1", "sample count is outside"),
        ("1x99999999999999999999999k", "sequence length is outside"),
        ("1kx2048", "'1k' is not a positive integer (it takes no suffix)"),
        ("1.5x2048", "'1.5' is not a positive integer"),
        ("1e3x2048", "'1e3' is not a positive integer"),
        ("1000 x 32k", "'1000 ' is not a positive integer"),
        ("1000x32kk", "'32kk' is not a positive integer"),
        ("1000x32g", "'32g' is not a positive integer"),
        ("\u0663x5", "is not a positive integer"),  # a non-ASCII digit
        ("1x2x3", "expected NxL"),
        ("1000", "expected NxL"),
        ("", "expected NxL"),
        ("abc", "expected NxL"),
    ],
)
def test_bad_specs_name_the_spec_and_the_problem(text, problem):
    with pytest.raises(CalibSpecError) as info:
        parse_calib_spec(text)
    message = str(info.value)
    assert f"calibration spec {text!r}" in message
    assert problem in message


def test_absurdly_long_spec_is_quoted_short():
    text = "9" * 5000 + "x1"
    with pytest.raises(CalibSpecError, match=r"\(5002 characters\)") as info:
        parse_calib_spec(text)
    assert len(str(info.value)) < 200


def test_error_is_a_value_error_and_non_strings_are_rejected():
    assert issubclass(CalibSpecError, ValueError)
    with pytest.raises(CalibSpecError, match="got 1000"):
        parse_calib_spec(1000)


@pytest.mark.parametrize("samples, seq_len", [(0, 8), (8, 0), (-1, 8), (MAX_SAMPLES + 1, 1), (True, 8), (8, 2.0)])
def test_direct_construction_is_checked(samples, seq_len):
    with pytest.raises(CalibSpecError, match="calibration spec"):
        CalibSpec(samples, seq_len)


@pytest.mark.parametrize(
    "spec, text",
    [
        (CalibSpec(1000, 32768), "1000x32k"),
        (CalibSpec(512, 2048), "512x2k"),
        (CalibSpec(512, 2000), "512x2000"),
        (CalibSpec(3, 1024 * 1024), "3x1024k"),
        (CalibSpec(1, 1), "1x1"),
    ],
)
def test_canonical_form(spec, text):
    assert str(spec) == text


@given(
    st.integers(1, MAX_SAMPLES),
    st.one_of(st.integers(1, MAX_SEQ_LEN), st.integers(1, 1024).map(lambda k: k * 1024)),
)
def test_canonical_form_parses_back(samples, seq_len):
    if samples * seq_len > MAX_TOTAL_TOKENS:
        with pytest.raises(CalibSpecError, match="2\\*\\*36"):
            CalibSpec(samples, seq_len)
        return
    spec = CalibSpec(samples, seq_len)
    assert parse_calib_spec(str(spec)) == spec
