"""Real Snakemake runs of the Snakefile in temporary directories."""

import re

import pytest
import yaml

from conftest import REPO, run_snakemake, write_config
from simulations.sampling import assign_splits
from workflow.config import validate_config


def planned_jobs(output: str) -> dict:
    """Job counts from the 'Job stats' table of a dry run."""
    table = output.split("Job stats:")[1].split("Reasons:")[0]
    return {name: int(count) for name, count in re.findall(r"^(\w+)\s+(\d+)$", table, re.M)
            if name != "total"}


@pytest.mark.parametrize("preset", ["config.yaml", "paper.yaml"])
def test_dry_run_plans_the_presets(tmp_path, preset):
    result = run_snakemake(tmp_path, "-n", "--configfile", str(REPO / "config" / preset))
    assert result.returncode == 0, result.stderr
    jobs = planned_jobs(result.stdout)
    config = validate_config(yaml.safe_load((REPO / "config" / preset).read_text()))
    batches = -(-config["sampling"]["n_simulations"] // config["simulation"]["sims_per_job"])
    assert jobs["sample_parameters"] == 1 and jobs["all"] == 1 and jobs["manifest"] == 1
    for rule in ("initial_conditions", "simulate", "histogram"):
        assert jobs[rule] == batches, rule
    assert jobs["write_tfrecords"] >= 3


def test_sample_parameters_rule(tmp_path, tiny_config):
    config_path = write_config(tmp_path, tiny_config)
    result = run_snakemake(tmp_path, "--configfile", str(config_path), "--until", "sample_parameters")
    assert result.returncode == 0, result.stderr
    run = tmp_path / "results" / "test"
    lines = (run / "params.csv").read_text().splitlines()
    assert len(lines) == 1 + 16
    assert (run / "logs" / "sample_parameters" / "sample_parameters.log").exists()
    assert (run / "benchmarks" / "sample_parameters" / "sample_parameters.tsv").exists()
    # the run records the configuration it ran with, every default filled in
    assert yaml.safe_load((run / "config.yaml").read_text()) == validate_config(tiny_config)

    written = (run / "params.csv").stat().st_mtime_ns
    again = run_snakemake(tmp_path, "--configfile", str(config_path), "--until", "sample_parameters")
    assert again.returncode == 0
    assert "rule sample_parameters" not in again.stdout + again.stderr
    assert (run / "params.csv").stat().st_mtime_ns == written


def test_same_seed_same_bytes_other_seed_other_samples(tmp_path, tiny_config):
    tables, until = {}, ("--until", "sample_parameters")
    for name, seed in [("a", 7), ("b", 7), ("c", 8)]:
        config_path = write_config(tmp_path, {**tiny_config, "run_name": name, "seed": seed}, f"{name}.yaml")
        assert run_snakemake(tmp_path, "--configfile", str(config_path), *until).returncode == 0
        tables[name] = (tmp_path / "results" / name / "params.csv").read_bytes()
    assert tables["a"] == tables["b"]
    assert tables["a"] != tables["c"]


def test_changed_sampling_key_reruns_the_stage(tmp_path, tiny_config):
    config_path = write_config(tmp_path, tiny_config)
    until = ("--until", "sample_parameters")
    assert run_snakemake(tmp_path, "--configfile", str(config_path), *until).returncode == 0
    before = (tmp_path / "results" / "test" / "params.csv").read_text()
    result = run_snakemake(tmp_path, "--configfile", str(config_path), "--config",
                           "sampling={design: sobol}", *until)
    assert result.returncode == 0, result.stderr
    assert "sample_parameters" in result.stdout + result.stderr
    assert (tmp_path / "results" / "test" / "params.csv").read_text() != before


def test_each_tfrecord_shard_waits_only_for_the_batches_it_reads(tmp_path):
    """16 simulations in 8 batches of 2, shards of 2 simulations: a shard reads at most 2 of the
    8 histogram batches, and the shards of a split together read exactly its simulations' batches."""
    config = {"run_name": "s", "seed": 3,
              "sampling": {"n_simulations": 16, "splits": {"train": 0.5, "val": 0.25, "test": 0.25}},
              "simulation": {"sims_per_job": 2},
              "preprocessing": {"grid": 16, "subvolume": 8, "samples_per_file": 8, "sims_per_shard": 2}}
    result = run_snakemake(tmp_path, "-n", "--configfile", str(write_config(tmp_path, config)))
    assert result.returncode == 0, result.stderr
    blocks = re.findall(r"^rule write_tfrecords:\n    input: (.*)\n    output: \S*/(\w+)_shard_\d+\.json",
                        result.stdout, re.M)
    assert len(blocks) == 8  # 4 train, 2 val, 2 test shards
    labels = assign_splits(16, config["sampling"]["splits"], 3)
    read = {}
    for inputs, split in blocks:
        batches = sorted(int(b) for b in re.findall(r"batches/histogram/(\d+)\.json", inputs))
        assert 1 <= len(batches) <= 2 and "params.csv" in inputs
        read.setdefault(split, set()).update(batches)
    for split in ("train", "val", "test"):
        assert read[split] == {i // 2 for i, label in enumerate(labels) if label == split}
