"""Metrics against values computed by hand on a small synthetic prediction table."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from analysis import metrics
from workflow.errors import PipelineError

NAMES = ("Omega_m", "sigma_8")
RANGES = {"Omega_m": (0.25, 0.35), "sigma_8": (0.78, 0.95)}


@pytest.fixture
def table() -> metrics.Predictions:
    """Two simulations of two sub-volumes each.

    Omega_m: truths 0.3, 0.3, 0.25, 0.25; predictions 0.31, 0.29, 0.26, 0.27
    (errors +0.01, -0.01, +0.01, +0.02). sigma_8 is predicted exactly.
    """
    true = np.array([[0.30, 0.80], [0.30, 0.80], [0.25, 0.90], [0.25, 0.90]])
    pred = np.array([[0.31, 0.80], [0.29, 0.80], [0.26, 0.90], [0.27, 0.90]])
    return metrics.Predictions(NAMES, np.array([7, 7, 3, 3]), true, pred)


def test_per_sample_metrics_by_hand(table):
    result = metrics.evaluate(table, RANGES)
    om = result["per_sample"]["parameters"]["Omega_m"]
    assert om["mae"] == pytest.approx(0.05 / 4)  # (0.01 + 0.01 + 0.01 + 0.02) / 4
    assert om["bias"] == pytest.approx(0.03 / 4)
    assert om["rmse"] == pytest.approx(math.sqrt(7e-4 / 4))  # (1 + 1 + 1 + 4) 1e-4 / 4
    # mean |e| / true = (0.01/0.3 + 0.01/0.3 + 0.01/0.25 + 0.02/0.25) / 4
    assert om["relative_error"] == pytest.approx((1 / 30 + 1 / 30 + 0.04 + 0.08) / 4)
    # SS_tot = 4 x 0.025^2 = 0.0025, SS_res = 7e-4
    assert om["r2"] == pytest.approx(1 - 7e-4 / 0.0025)
    # deviations: pred (0.0275, 0.0075, -0.0225, -0.0125), true (0.025, 0.025, -0.025, -0.025)
    assert om["pearson_r"] == pytest.approx(0.00175 / math.sqrt(0.001475 * 0.0025))
    assert om["mlperf_mae"] == pytest.approx(0.0125 * 2 / 0.1)  # MAE x 2 / (high - low)
    s8 = result["per_sample"]["parameters"]["sigma_8"]
    assert s8["mae"] == 0 and s8["r2"] == 1 and s8["pearson_r"] == pytest.approx(1)
    assert result["per_sample"]["mlperf_mae"] == pytest.approx((0.25 + 0.0) / 2)
    assert result["per_sample"]["n"] == 4
    assert result["mlperf_target_mae"] == 0.124


def test_per_simulation_means_and_error_bars_by_hand(table):
    sims = table.per_simulation()
    np.testing.assert_array_equal(sims.sim_ids, [3, 7])
    np.testing.assert_array_equal(sims.n_subvolumes, [2, 2])
    np.testing.assert_allclose(sims.true[:, 0], [0.25, 0.30])
    np.testing.assert_allclose(sims.pred[:, 0], [0.265, 0.30])
    # sample standard deviation of (0.26, 0.27) and of (0.31, 0.29)
    np.testing.assert_allclose(sims.pred_std[:, 0], [0.005 * math.sqrt(2), 0.01 * math.sqrt(2)])
    result = metrics.evaluate(table, RANGES)["per_simulation"]
    om = result["parameters"]["Omega_m"]
    assert result["n"] == 2
    assert om["mae"] == pytest.approx(0.015 / 2)
    assert om["bias"] == pytest.approx(0.015 / 2)
    assert om["relative_error"] == pytest.approx(0.015 / 0.25 / 2)
    assert om["subvolume_std"] == pytest.approx(0.015 * math.sqrt(2) / 2)


def test_single_subvolume_has_zero_error_bar():
    single = metrics.Predictions(("n_s",), [4], [[0.95]], [[0.96]])
    sims = single.per_simulation()
    assert sims.pred_std.tolist() == [[0.0]]
    result = metrics.evaluate(single)
    assert math.isnan(result["per_sample"]["parameters"]["n_s"]["r2"])  # one truth: undefined
    assert math.isnan(result["per_sample"]["mlperf_mae"])  # no ranges given


def test_scale_targets_maps_the_range_to_plus_minus_one():
    scaled = metrics.scale_targets([[0.25, 0.95], [0.30, 0.865]], NAMES, RANGES)
    np.testing.assert_allclose(scaled, [[-1, 1], [0, 0]], atol=1e-12)


def test_files_round_trip(tmp_path, table):
    other = metrics.Predictions(NAMES, table.sim_ids, table.true, table.true.mean(0) + 0 * table.true)
    path = metrics.write_predictions_csv(tmp_path / "predictions.csv", {"network": table, "mean": other})
    back = metrics.read_predictions_csv(path)
    assert list(back) == ["network", "mean"]
    np.testing.assert_array_equal(back["network"].pred, table.pred)
    np.testing.assert_array_equal(back["network"].sim_ids, table.sim_ids)
    lines = path.read_text().splitlines()
    assert lines[0].startswith("model,level,sim_id,sample,n_subvolumes,true_Omega_m,pred_Omega_m,std_Omega_m")
    assert sum(line.startswith("network,simulation") for line in lines) == 2
    result = {"network": metrics.evaluate(table)}
    metrics.write_metrics_json(tmp_path / "metrics.json", result)
    loaded = json.loads((tmp_path / "metrics.json").read_text())
    assert loaded["network"]["per_sample"]["mlperf_mae"] is None  # NaN written as null


def test_bad_tables_are_refused():
    with pytest.raises(PipelineError, match="empty"):
        metrics.Predictions(NAMES, [], np.zeros((0, 2)), np.zeros((0, 2)))
    with pytest.raises(PipelineError, match="shape"):
        metrics.Predictions(NAMES, [1, 2], np.zeros((2, 3)), np.zeros((2, 2)))
    with pytest.raises(PipelineError, match="not finite"):
        metrics.Predictions(NAMES, [1], [[0.3, np.nan]], [[0.3, 0.8]])
    mixed = metrics.Predictions(NAMES, [1, 1], [[0.3, 0.8], [0.31, 0.8]], [[0.3, 0.8]] * 2)
    with pytest.raises(PipelineError, match="different true Omega_m"):
        mixed.per_simulation()
    with pytest.raises(PipelineError, match="lack parameter"):
        metrics.scale_targets([[0.3, 0.8]], NAMES, {"Omega_m": (0.25, 0.35)})


def _predictions(sim_ids, true, pred):
    return metrics.Predictions(("a",), np.array(sim_ids), np.array(true, float)[:, None],
                               np.array(pred, float)[:, None])


def test_bootstrap_by_hand():
    """Two simulations of two sub-volumes; a model with errors (1, 1 | 3, 3), one twice as
    wrong, the mean. Every resample draws each simulation 0, 1 or 2 times: its MSE is 1, 5 or 9."""
    sims, true = [0, 0, 1, 1], [0.0, 0.0, 0.0, 0.0]
    models = {"mean": _predictions(sims, true, [4, 4, 4, 4]),
              "network": _predictions(sims, true, [1, -1, 3, 3]),
              "other": _predictions(sims, true, [2, -2, 6, 6])}
    record = metrics.bootstrap_mse(models, n_resamples=400, seed=1)
    network = record["models"]["network"]["a"]
    assert network["mse"] == pytest.approx(5.0) and network["ratio"] == pytest.approx(5 / 16)
    assert record["n_simulations"] == 2 and record["n_resamples"] == 400
    # resampled MSEs are 1 (sim 0 twice), 5 (one each) or 9 (sim 1 twice), with chances 1/4, 1/2, 1/4
    assert network["mse_std"] == pytest.approx(math.sqrt(8), rel=0.15)
    assert network["ratio_low"] == pytest.approx(1 / 16) and network["ratio_high"] == pytest.approx(9 / 16)
    paired = record["versus"]["other"]["a"]  # the network is 1/4 of the other in every resample
    assert paired["ratio"] == paired["ratio_low"] == paired["ratio_high"] == pytest.approx(0.25)
    assert paired["p_better"] == 1.0
    assert "mean" not in record["versus"]


def test_bootstrap_refuses_predictions_of_other_samples():
    a = _predictions([0, 1], [0.0, 0.0], [1.0, 1.0])
    b = _predictions([0, 2], [0.0, 0.0], [1.0, 1.0])
    with pytest.raises(PipelineError, match="not of the same samples"):
        metrics.bootstrap_mse({"network": a, "mean": b})


def test_learning_curve_trend_recovers_power_laws_and_their_crossing():
    sizes = [160, 320, 640]
    network = [0.1 * n**-0.8 for n in sizes]   # falls faster, behind at 640
    ridge = [0.002 * n**-0.3 for n in sizes]
    trend = metrics.learning_curve_trend(sizes, network, ridge)
    assert trend["network_slope"] == pytest.approx(-0.8) and trend["baseline_slope"] == pytest.approx(-0.3)
    assert not trend["network_ahead"]
    assert trend["crossover_simulations"] == pytest.approx(2500)  # 0.1 N^-0.8 = 0.002 N^-0.3
    assert metrics.learning_curve_trend(sizes[::-1], network[::-1], ridge[::-1]) == pytest.approx(trend)
    # Behind and not gaining: no crossing; ahead: none needed.
    assert metrics.learning_curve_trend(sizes, ridge[::-1], ridge)["crossover_simulations"] is None
    assert metrics.learning_curve_trend(sizes, [m / 2 for m in ridge], ridge)["network_ahead"]
    with pytest.raises(PipelineError, match="two or more"):
        metrics.learning_curve_trend([640], [0.1], [0.2])


def test_saturating_fit_recovers_a_known_learning_curve_and_its_bound_crossing():
    from analysis.metrics import bound_crossing, saturating_fit

    sizes = np.array([50, 100, 200, 400, 800])
    fit = saturating_fit(sizes, 0.01 + 0.5 * sizes**-0.39)
    assert fit == pytest.approx({"L_min": 0.01, "c": 0.5, "alpha": 0.39}, rel=1e-3)
    # N where 0.01 + 0.5 N^-0.39 = 0.05, and none below the floor L_min
    assert bound_crossing(fit, 0.05) == pytest.approx((0.5 / 0.04) ** (1 / 0.39), rel=1e-3)
    assert bound_crossing(fit, 0.005) is None and bound_crossing(None, 0.05) is None
    assert saturating_fit(sizes[:2], [0.2, 0.1]) is None  # three parameters need three sizes
    assert saturating_fit(sizes[:3], 0.01 + 0.5 * sizes[:3] ** -0.39) is not None
