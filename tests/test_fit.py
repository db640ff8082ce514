"""The throughput and memory models recover known parameters and predict unseen points."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import TRUE_MEMORY, TRUE_THROUGHPUT, micro_seconds, peak_bytes, synthetic_calibration, synthetic_rows

from benchtrain.calibration.fit import fit_measurements, throughput_features, throughput_terms
from benchtrain.calibration.memory_fit import linear_terms, memory_features
from benchtrain.calibration.model import Calibration
from benchtrain.calibration.step_config import StepConfig


@pytest.mark.parametrize("workers", [0, 3])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_fits_features_price_a_step_as_the_written_truth_does(workers: int, checkpointing: bool) -> None:
    """The truth (tests/helpers.py micro_seconds, peak_bytes) is written out apart from the fit's
    features; at the true parameters both price every step alike."""
    for b, s, a in [(1, 128, 1), (3, 200, 4), (8, 1024, 2)]:
        config = StepConfig(micro_batch_size=b, num_workers=workers, grad_accum=a, seq_len=s).switched(
            gradient_checkpointing=checkpointing
        )
        priced = float(np.dot(throughput_features(config), [TRUE_THROUGHPUT[t] for t in throughput_terms()]))
        assert priced == pytest.approx(micro_seconds(config), rel=1e-12)
        held = float(
            np.dot(memory_features(config), [{**TRUE_MEMORY, "accumulated_gradients": 3e8}[t] for t in linear_terms()])
        )
        assert held == pytest.approx(peak_bytes(config, {**TRUE_MEMORY, "accumulated_gradients": 3e8}), rel=1e-12)


def test_noise_free_fit_recovers_parameters() -> None:
    fit = fit_measurements(synthetic_rows(noise=0.0, workers=(0, 1, 4), checkpointing=(0, 1)))
    assert fit["kind"] == "physical"
    for term, value in TRUE_THROUGHPUT.items():
        assert fit["parameters"][term] == pytest.approx(value, rel=1e-3, abs=1e-12), term
    for term, value in TRUE_MEMORY.items():
        assert fit["memory"]["parameters"][term] == pytest.approx(value, rel=1e-3), term
    assert fit["held_out_error"]["median_abs_pct"] < 0.01


def test_noisy_fit_predicts_unmeasured_configurations_within_the_noise() -> None:
    calibration = Calibration(synthetic_calibration(synthetic_rows(noise=0.03, seed=1)))
    # Between and beyond the measured values: batch 3, 6, 16; length 192, 384, 1024; accum 3, 8; workers 1, 4.
    errors = []
    for b, s, a, w in [(3, 192, 1, 0), (6, 384, 3, 1), (16, 512, 2, 2), (2, 1024, 8, 4), (5, 300, 4, 0)]:
        config = StepConfig(micro_batch_size=b, num_workers=w, grad_accum=a, seq_len=s)
        predicted = calibration.predict(StepConfig(b, w, a, s))
        truth = b * s * a / (micro_seconds(config) * a)
        errors.append(abs(predicted.tokens_per_second - truth) / truth)
        assert predicted.tokens_per_second_low < predicted.tokens_per_second < predicted.tokens_per_second_high
        assert predicted.step_seconds_low < predicted.step_seconds < predicted.step_seconds_high
    assert np.median(errors) < 0.05, errors
    # The stored held-out error reflects the injected 3% noise (not 0, not wild).
    median = calibration.fit["held_out_error"]["median_abs_pct"]
    assert 0.5 < median < 6.0


def test_memory_boundary_separates_fitting_from_oom_configurations() -> None:
    limit = 6e9
    rows = synthetic_rows(noise=0.01, memory_limit=limit, batch_sizes=(1, 2, 4, 8, 16), seq_lens=(256, 512, 1024))
    assert any(row["status"] == "oom" for row in rows)
    calibration = Calibration(synthetic_calibration(rows, memory_bytes=limit))
    for row in rows:
        fits = calibration.predict(StepConfig(row["micro_batch_size"], 0, 1, row["seq_len"])).fits_in_memory
        if row["status"] == "oom":
            assert not fits, row
    # A configuration well under the limit fits; one far above does not.
    assert calibration.predict(StepConfig(1, 0, 1, 256)).fits_in_memory
    assert not calibration.predict(StepConfig(64, 0, 1, 2048)).fits_in_memory
    truth_small = peak_bytes(StepConfig(micro_batch_size=1, num_workers=0, grad_accum=1, seq_len=256))
    assert calibration.predict(StepConfig(1, 0, 1, 256)).peak_memory_bytes == pytest.approx(truth_small, rel=0.05)


def test_another_form_is_chosen_when_the_physical_model_misses_a_shape() -> None:
    rows = synthetic_rows(noise=0.0)
    # A device that is 40% slower at batch 8 only: the physical terms cannot express it.
    for row in rows:
        if row["micro_batch_size"] == 8:
            row["step_seconds"] *= 1.4
            row["tokens_per_second"] /= 1.4
    fit = fit_measurements(rows)
    assert fit["kind"] in ("physical+residual", "overlap")
    assert fit["alternatives"][fit["kind"]]["median_abs_pct"] < fit["alternatives"]["physical"]["median_abs_pct"]
    assert fit["held_out_error"]["median_abs_pct"] == fit["alternatives"][fit["kind"]]["median_abs_pct"]
    assert "cut the held-out median error" in fit["reason"]


def test_history_factor_corrects_later_predictions() -> None:
    data = synthetic_calibration()
    before = Calibration(data).predict(StepConfig(4, 0, 1, 256)).tokens_per_second
    data["history"] = [{"predicted_tokens_per_second": 1000.0, "actual_tokens_per_second": 900.0}]
    after_one = Calibration(data).predict(StepConfig(4, 0, 1, 256)).tokens_per_second
    assert after_one == pytest.approx(before * 0.9**0.5)  # one run: half-way (shrunk towards 1)
    data["history"] *= 4
    after_four = Calibration(data).predict(StepConfig(4, 0, 1, 256)).tokens_per_second
    assert after_four == pytest.approx(before * 0.9**0.8)
    data["history"].append({"predicted_tokens_per_second": 1000.0, "actual_tokens_per_second": 300.0})
    assert Calibration(data).predict(StepConfig(4, 0, 1, 256)).tokens_per_second == pytest.approx(
        before * 0.9 ** (5 / 6)
    )


def test_explain_names_every_term_in_words() -> None:
    text = "\n".join(Calibration(synthetic_calibration()).explain())
    for phrase in ("fixed per micro-step", "per token", "optimizer step", "workers", "Held-out", "Memory"):
        assert phrase in text


def test_too_few_rows_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least 3"):
        fit_measurements(synthetic_rows(batch_sizes=(1,), workers=(0,), accums=(1,), seq_lens=(128, 256)))


def test_measured_data_wait_separates_data_terms_even_with_two_worker_counts() -> None:
    # Without the wait, per-token compute and per-token data cost are collinear when only
    # workers 0 and 2 are measured; the measured wait share tells them apart.
    fit = fit_measurements(synthetic_rows(noise=0.0, workers=(0, 2), checkpointing=(0, 1)))
    for term, value in TRUE_THROUGHPUT.items():
        assert fit["parameters"][term] == pytest.approx(value, rel=1e-3, abs=1e-12), term
    rows = synthetic_rows(noise=0.0, workers=(0, 2))
    for row in rows:
        row.pop("data_wait_share")
    blind = fit_measurements(rows)
    assert blind["held_out_error"]["median_abs_pct"] < 0.01  # still predicts the measured points


def test_run_to_run_spread_widens_the_bounds() -> None:
    data = synthetic_calibration()
    narrow = Calibration(data).relative_bound
    data["history"] = [
        {"predicted_tokens_per_second": 1000.0, "actual_tokens_per_second": 1000.0},
        {"predicted_tokens_per_second": 1000.0, "actual_tokens_per_second": 700.0},
    ]
    wide = Calibration(data)
    assert wide.relative_bound > max(narrow, 0.15)
    prediction = wide.predict(StepConfig(4, 0, 1, 256))
    assert prediction.step_seconds_high == pytest.approx(prediction.step_seconds * (1 + wide.relative_bound))


def test_with_few_probes_the_flops_tied_form_is_the_honest_fit() -> None:
    """Issue 21: four probes cannot pin down nine terms; tied to the model's FLOPs (one cost per
    FLOP), the compute terms come from one number, and the held-out error says so."""
    flops = {"per_token": 6e6, "attention": 1.2e3, "recompute_per_token": 2e6, "recompute_attention": 400.0}
    per_flop = 3e-13

    def truth(config: StepConfig) -> float:
        device = (
            per_flop
            * config.micro_batch_size
            * config.seq_len
            * (flops["per_token"] + flops["attention"] * config.seq_len)
        )
        return 0.002 + device + 0.004 / config.grad_accum

    rows = []
    for b, s, a in [(1, 128, 1), (4, 128, 1), (1, 512, 2), (8, 256, 1)]:
        step = truth(StepConfig(micro_batch_size=b, num_workers=0, grad_accum=a, seq_len=s)) * a
        rows.append(
            {
                "micro_batch_size": b,
                "seq_len": s,
                "grad_accum": a,
                "num_workers": 0,
                "status": "ok",
                "step_seconds": step,
                "peak_memory_bytes": 1e9 + b * s * 1e5,
            }
        )
    tied = fit_measurements(rows, flops)
    untied = fit_measurements(rows)
    assert tied["kind"] == "flops" and "FLOPs" in tied["reason"]
    assert tied["extrapolated_error"]["count"] >= 2  # held out, the corners were extrapolations
    assert tied["held_out_error"]["median_abs_pct"] < untied["held_out_error"]["median_abs_pct"]
    assert tied["parameters"]["attention"] / tied["parameters"]["per_token"] == pytest.approx(
        flops["attention"] / flops["per_token"]
    )
    # Far outside the probes, the tied fit still predicts the truth.
    far = StepConfig(micro_batch_size=16, num_workers=0, grad_accum=1, seq_len=1024)
    predicted = Calibration(synthetic_calibration(rows, fit=tied)).throughput.micro_step_seconds(far)
    assert predicted == pytest.approx(truth(far), rel=0.02)


def test_the_bound_widens_where_a_plan_extrapolates() -> None:
    calibration = Calibration(synthetic_calibration(synthetic_rows(batch_sizes=(1, 2, 4), noise=0.03, seed=2)))
    inside = StepConfig(micro_batch_size=2, num_workers=0, grad_accum=2, seq_len=256)
    double = StepConfig(micro_batch_size=8, num_workers=0, grad_accum=2, seq_len=256)
    far = StepConfig(micro_batch_size=64, num_workers=0, grad_accum=2, seq_len=256)
    assert calibration.relative_bound_for(inside) == calibration.relative_bound
    assert calibration.extrapolation_ratio(far) == 16
    assert (
        calibration.relative_bound_for(inside)
        <= calibration.relative_bound_for(double)
        < calibration.relative_bound_for(far)
    )
    prediction = calibration.predict(StepConfig(64, 0, 2, 256))
    assert prediction.step_seconds_high == pytest.approx(
        prediction.step_seconds * (1 + calibration.relative_bound_for(far))
    )


def test_a_fit_whose_probes_never_extrapolated_does_not_bet_a_plan_beyond_them() -> None:
    """All probes at one micro-batch and length (a budget that paid for one compilation): held out,
    none lay beyond the others, so nothing measured how the fit extrapolates in size."""
    rows = synthetic_rows(batch_sizes=(2,), seq_lens=(256,), workers=(0, 2), accums=(1, 2, 4), noise=0.01)
    calibration = Calibration(synthetic_calibration(rows))
    assert calibration.fit["extrapolated_error"]["count"] == 0
    assert (
        calibration.relative_bound_for(StepConfig(micro_batch_size=2, num_workers=0, grad_accum=2, seq_len=256)) < 0.1
    )
    assert (
        calibration.relative_bound_for(StepConfig(micro_batch_size=8, num_workers=0, grad_accum=2, seq_len=256)) >= 0.5
    )
