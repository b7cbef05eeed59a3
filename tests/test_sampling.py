"""Parameter sampling: designs, seeds, splits and the params.csv table."""

import numpy as np
import pytest

from simulations.sampling import assign_splits, sample_ensemble, simulation_seeds, write_params_csv
from workflow.config import split_counts, validate_config
from workflow.params_table import read_params_csv


def ensemble_for(sims_per_job=None, **sampling):
    simulation = {"sims_per_job": sims_per_job} if sims_per_job else {}
    config = validate_config({"sampling": sampling, "simulation": simulation})
    s = config["sampling"]
    return sample_ensemble(
        s["n_simulations"], s["design"], s["parameters"], s["ranges"], s["splits"],
        sims_per_job=config["simulation"]["sims_per_job"], master_seed=config["seed"],
        fiducial=s["fiducial"], derivative_steps=s["derivative_steps"],
    ), s


@pytest.mark.parametrize("n", [10, 64, 101])
def test_latin_hypercube_puts_one_sample_in_each_bin(n):
    ensemble, s = ensemble_for(n_simulations=n, design="latin_hypercube")
    for column, name in enumerate(ensemble.parameter_names):
        low, high = s["ranges"][name]
        bins = np.floor((ensemble.values[:, column] - low) / (high - low) * n).astype(int)
        assert sorted(bins) == list(range(n)), name


@pytest.mark.parametrize("design", ["sobol", "uniform", "latin_hypercube"])
def test_samples_stay_inside_the_ranges(design):
    ensemble, s = ensemble_for(n_simulations=64, design=design, parameters=["Omega_m", "sigma_8", "n_s", "h"])
    assert ensemble.values.shape == (64, 4)
    for column, name in enumerate(ensemble.parameter_names):
        low, high = s["ranges"][name]
        values = ensemble.values[:, column]
        assert values.min() >= low and values.max() <= high, name
        # space-filling: the samples reach into both outer quarters of each range
        assert values.min() < low + 0.25 * (high - low) and values.max() > high - 0.25 * (high - low)


def test_sobol_power_of_two_is_balanced():
    ensemble, s = ensemble_for(n_simulations=64, design="sobol")
    low, high = s["ranges"]["Omega_m"]
    halves = ensemble.values[:, 0] < (low + high) / 2
    assert halves.sum() == 32


def test_grid_design_has_every_combination():
    ensemble, s = ensemble_for(n_simulations=27, design="grid")
    for column, name in enumerate(ensemble.parameter_names):
        assert np.allclose(np.unique(ensemble.values[:, column]), np.linspace(*s["ranges"][name], 3))
    assert len({tuple(row) for row in ensemble.values}) == 27


def test_fiducial_derivatives_design():
    ensemble, s = ensemble_for(n_simulations=14, design="fiducial_derivatives")
    fiducial = np.array([s["fiducial"][n] for n in ensemble.parameter_names])
    steps = np.array([s["derivative_steps"][n] for n in ensemble.parameter_names])
    first = ensemble.values[:7]
    assert np.allclose(first[0], fiducial)
    for i in range(3):
        minus, plus = first[1 + 2 * i], first[2 + 2 * i]
        expected = np.zeros(3)
        expected[i] = steps[i]
        assert np.allclose(minus, fiducial - expected) and np.allclose(plus, fiducial + expected)
    assert np.array_equal(ensemble.values[7:], first)
    # the points of one repetition share a seed (paired differences), repetitions differ
    assert len(set(ensemble.seeds[:7])) == 1 and len(set(ensemble.seeds[7:])) == 1
    assert ensemble.seeds[0] != ensemble.seeds[7]


def test_simulation_seeds_are_unique_and_depend_only_on_master_seed_and_id():
    seeds = simulation_seeds(1808, np.arange(20000))
    assert len(np.unique(seeds)) == 20000
    assert seeds.min() >= 1 and seeds.max() < 2**31 - 1
    assert np.array_equal(simulation_seeds(1808, np.array([17, 12631])), seeds[[17, 12631]])
    assert not np.array_equal(simulation_seeds(1809, np.arange(100)), seeds[:100])


def test_splits_partition_the_simulations():
    fractions = {"train": 0.8, "val": 0.1, "test": 0.1}
    labels = assign_splits(12632, fractions, master_seed=3)
    counts = split_counts(12632, fractions)
    assert {split: labels.count(split) for split in counts} == counts
    assert counts == {"train": 10106, "val": 1263, "test": 1263}
    assert labels == assign_splits(12632, fractions, master_seed=3)
    assert labels != assign_splits(12632, fractions, master_seed=4)


def test_params_csv_round_trip(tmp_path):
    ensemble, _ = ensemble_for(8, n_simulations=20, parameters=["Omega_m", "sigma_8", "n_s", "h"])
    path = write_params_csv(tmp_path / "params.csv", ensemble)
    header = path.read_text().splitlines()[0]
    assert header == "sim_id,batch,Omega_m,sigma_8,n_s,h,seed,split"
    records = read_params_csv(path)
    assert [r.sim_id for r in records] == list(range(20))
    assert [r.batch for r in records] == [i // 8 for i in range(20)]
    for record, row, seed in zip(records, ensemble.values, ensemble.seeds):
        assert list(record.parameters.values()) == list(row)  # exact: floats written with repr
        assert record.seed == seed
