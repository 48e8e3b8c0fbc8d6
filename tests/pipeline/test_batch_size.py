"""`--batch-size auto`: the batch that fits, from one sample's measured peak."""

from __future__ import annotations

import pytest
import torch

from fp4kit.calibrate import AUTO_BATCH_HEADROOM, AUTO_BATCH_MOST, Statistics, fitting_batch
from fp4kit.cli import main
from fp4kit.quantize import BatchClock, QuantizeJob, _forward_samples, validate_job

GIB = 2**30


def test_the_batch_is_what_fits_in_the_headroom():
    # 10 GiB per sample, 100 GiB free: 85 GiB of headroom holds 8 samples
    assert fitting_batch(10 * GIB, 100 * GIB, 999) == int(AUTO_BATCH_HEADROOM * 100) // 10 == 8
    assert fitting_batch(10 * GIB, 100 * GIB, 999, headroom=1.0) == 10


def test_the_batch_is_at_least_one_and_at_most_the_cap_and_the_samples_left():
    assert fitting_batch(50 * GIB, 10 * GIB, 999) == 1  # not even one fits: still one at a time
    assert fitting_batch(1, 100 * GIB, 10**6) == AUTO_BATCH_MOST
    assert fitting_batch(1 * GIB, 100 * GIB, 3) == 3
    assert fitting_batch(0, 100 * GIB, 5) == 5  # nothing measured (no device peak): the samples left, capped
    assert fitting_batch(1 * GIB, 100 * GIB, 0) == 1


class _Counting(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.batches: list[int] = []

    def forward(self, input_ids, **kwargs):
        self.batches.append(input_ids.shape[0])


def test_auto_on_the_cpu_is_one_sample_at_a_time_and_sees_every_sample():
    model = _Counting()
    used = _forward_samples(model, torch.zeros(5, 4, dtype=torch.long), "auto", False, Statistics())
    assert used == 1 and model.batches == [1] * 5


def test_a_number_keeps_its_batches_and_the_last_is_short():
    model = _Counting()
    assert _forward_samples(model, torch.zeros(7, 4, dtype=torch.long), 3, False, Statistics()) == 3
    assert model.batches == [3, 3, 1]


def test_the_clock_times_each_batch_per_sample_and_takes_the_steady_rate_after_the_first(monkeypatch):
    import fp4kit.quantize as q

    ticks = iter([0.0, 5.0, 11.0, 17.0, 19.0])  # batches of 3, 3, 3 and 1 samples: 5, 6, 6 and 2 s
    monkeypatch.setattr(q.time, "perf_counter", lambda: next(ticks))
    clock = BatchClock(torch.device("cpu"))
    model = _Counting()
    _forward_samples(model, torch.zeros(10, 4, dtype=torch.long), 3, False, Statistics(), clock=clock)
    assert model.batches == [3, 3, 3, 1] and clock.rows == [3, 3, 3, 1]
    assert clock.per_sample() == pytest.approx([5 / 3, 2.0, 2.0, 2.0])
    assert clock.steady() == pytest.approx(2.0)  # the first batch (warm-up) left out
    one = BatchClock(torch.device("cpu"))
    assert one.steady() is None
    one.marks, one.rows = [0.0, 4.0], [2]
    assert one.steady() == 2.0  # a single batch is its own rate


def test_the_command_prints_the_steady_calibration_rate(capsys, tmp_path):
    assert main(["quantize", "--calib", "4x64", "-o", str(tmp_path / "out"), "--no-progress"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("calibration: "))
    import re

    found = re.fullmatch(r"calibration: (\d+\.\d{3}) s per sample after the first, ([\d,]+) tokens/s", line)
    per, rate = float(found[1]), float(found[2].replace(",", ""))
    # 64-token samples: the rate is 64 / the time, which the line rounds to 3 decimals
    assert per > 0 and 64 / (per + 0.0005) - 1 <= rate <= 64 / (per - 0.0005) + 1


def test_auto_is_accepted_and_other_words_are_refused(capsys, tmp_path):
    validate_job(QuantizeJob(batch_size="auto", output=str(tmp_path / "out")))  # no error
    for bad in (0, "many", 2.5):
        with pytest.raises(ValueError, match="--batch-size"):
            validate_job(QuantizeJob(batch_size=bad, output=str(tmp_path / "out")))
    with pytest.raises(SystemExit) as exit_:
        main(["quantize", "--batch-size", "many"])
    assert exit_.value.code == 2
    assert "'many' is not a whole number or 'auto'" in capsys.readouterr().err
