"""`--batch-size auto`: the batch that fits, from one sample's measured peak."""

from __future__ import annotations

import pytest
import torch

from fp4kit.calibrate import AUTO_BATCH_HEADROOM, AUTO_BATCH_MOST, Statistics, fitting_batch
from fp4kit.cli import main
from fp4kit.quantize import QuantizeJob, _forward_samples, validate_job

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


def test_auto_is_accepted_and_other_words_are_refused(capsys, tmp_path):
    validate_job(QuantizeJob(batch_size="auto", output=str(tmp_path / "out")))  # no error
    for bad in (0, "many", 2.5):
        with pytest.raises(ValueError, match="--batch-size"):
            validate_job(QuantizeJob(batch_size=bad, output=str(tmp_path / "out")))
    with pytest.raises(SystemExit) as exit_:
        main(["quantize", "--batch-size", "many"])
    assert exit_.value.code == 2
    assert "'many' is not a whole number or 'auto'" in capsys.readouterr().err
