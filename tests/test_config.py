"""Configuration: shipped presets validate; bad values fail before any work, naming the key."""

import importlib

import pytest

from conftest import KERNEL_CHOICES, REPO, run_cli, run_snakemake, write_config
from workflow.config import load_config, read_yaml, schema_enum, validate_config
from workflow.errors import ConfigError


@pytest.mark.parametrize("name", ["config.yaml", "paper.yaml", "science.yaml", "science_fisher.yaml"])
def test_shipped_configs_validate(name, monkeypatch):
    monkeypatch.chdir(REPO)  # science.yaml names its Fisher companion relative to the working directory
    config = load_config(REPO / "config" / name)
    assert config["preprocessing"]["grid"] % config["preprocessing"]["subvolume"] == 0


def test_empty_config_takes_every_default_from_the_schema():
    config = validate_config({})
    assert config["sampling"]["ranges"]["Omega_m"] == [0.25, 0.35]
    assert config["sampling"]["ranges"]["sigma_8"] == [0.78, 0.95]
    assert config["sampling"]["ranges"]["n_s"] == [0.9, 1.0]
    assert config["sampling"]["parameters"] == ["Omega_m", "sigma_8", "n_s"]
    assert validate_config(config) == config


@pytest.mark.parametrize("key, module, name", KERNEL_CHOICES)
def test_each_enumerated_key_allows_what_its_kernel_implements(key, module, name):
    """The schema lists what a configuration may choose, the kernel what it implements and
    checks its arguments against: the same set, so a configured value never fails in a job
    and no scheme of a kernel is out of the configuration's reach."""
    assert set(getattr(importlib.import_module(module), name)) == set(schema_enum(key))


def test_the_tiny_default_file_is_the_schemas_defaults():
    """config/config.yaml only writes out defaults: the README's main command, a configuration
    left empty, and any key another configuration leaves out (Snakemake layers every
    --configfile over config/config.yaml, `cosmoflow --config` does not) make the same run."""
    text = (REPO / "config" / "config.yaml").read_text()
    assert load_config(REPO / "config" / "config.yaml") == validate_config({})
    written = read_yaml(text)
    assert written["run_name"] == "tiny" and len(written["training"]) > 3  # it documents keys


@pytest.mark.parametrize("old, words", [
    ({"simulation": {"batch_size": 8}}, ["simulation.batch_size' was renamed 'simulation.sims_per_job'"]),
    ({"simulation": {"gradient": "finite_difference"}}, ["simulation.gradient' was removed",
                                                          "finite difference"]),
    ({"training": {"test_only_straggler_delay_s": 0}}, ["training.test_only_straggler_delay_s' was removed",
                                                         "COSMOFLOW_STRAGGLER_DELAY_S"]),
])
def test_a_configuration_of_an_earlier_version_is_told_what_became_of_its_keys(tmp_path, old, words):
    with pytest.raises(ConfigError) as raised:
        validate_config(old, source="old.yaml")
    assert all(word in str(raised.value) for word in ["old.yaml", *words]), raised.value
    result = run_cli("validate-config", write_config(tmp_path, old))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert all(word in result.stderr for word in words), result.stderr


def test_paper_preset_matches_the_paper():
    config = load_config(REPO / "config" / "paper.yaml")
    assert config["sampling"]["n_simulations"] == 12632
    assert config["simulation"]["box_size"] == 512
    assert config["simulation"]["n_particles"] == 512
    assert (config["preprocessing"]["grid"], config["preprocessing"]["subvolume"]) == (256, 128)
    assert config["preprocessing"]["samples_per_file"] == 64


BAD_CONFIGS = [
    # (config, words the message must contain)
    ({"sampling": {"ranges": {"Omega_m": [0.01, 0.3]}}}, ["sampling.ranges.Omega_m[0]", "0.01", "0.05"]),
    ({"sampling": {"ranges": {"sigma_8": [0.9, 0.8]}}}, ["sampling.ranges.sigma_8", "min < max"]),
    ({"preprocessing": {"grid": 64, "subvolume": 24}}, ["preprocessing.subvolume", "24", "divide"]),
    ({"sampling": {"n_simulation": 10}}, ["unknown key", "n_simulation", "n_simulations"]),
    ({"sampling": {"design": "halton"}}, ["sampling.design", "halton", "latin_hypercube"]),
    ({"sampling": {"splits": {"train": 0.5, "val": 0.1, "test": 0.1}}}, ["sampling.splits", "sum to 1"]),
    ({"sampling": {"design": "grid", "n_simulations": 30}}, ["sampling.n_simulations", "30", "27"]),
    ({"sampling": {"design": "fiducial_derivatives", "n_simulations": 8}},
     ["sampling.n_simulations", "multiple of 7"]),
    ({"sampling": {"parameters": ["Omega_m", "sigma_8", "h"]}}, ["sampling.parameters", "n_s"]),
    ({"cosmology": {"Omega_b": 0.3}}, ["cosmology.Omega_b", "0.3", "Omega_m"]),
    ({"simulation": {"box_size": -5}}, ["simulation.box_size", "-5", "greater than 0"]),
    ({"initial_conditions": {"z_init": 1.0}, "simulation": {"redshifts": [0.0, 1.5]}},
     ["initial_conditions.z_init", "1.0", "1.5"]),
    ({"initial_conditions": {"z_init": 0}}, ["initial_conditions.z_init", "greater than 0"]),
    ({"initial_conditions": {"backend": "music"}}, ["initial_conditions.music_executable"]),
    ({"simulation": {"mesh_factor": 0}}, ["simulation.mesh_factor", "at least 1"]),
    ({"simulation": {"mesh_factor": 1.5}}, ["simulation.mesh_factor", "integer"]),
    ({"cosmology": {"transfer": "table"}}, ["cosmology.transfer_table"]),
    ({"cosmology": {"transfer_table": "tk.txt"}}, ["cosmology.transfer_table", "tk.txt", "only used"]),
    ({"cosmology": {"transfer": "table", "transfer_table": "/no/such/tk.txt"}},
     ["/no/such/tk.txt", "no such file"]),
    ({"simulation": {"n_steps": 2, "redshifts": [2.0, 1.0, 0.0]}}, ["simulation.n_steps", "3 snapshot"]),
    ({"initial_conditions": {"backend": "music", "music_executable": "MUSIC", "fixed_amplitude": True}},
     ["initial_conditions.fixed_amplitude", "music"]),
    ({"initial_conditions": {"backend": "music", "music_executable": "MUSIC"},
      "cosmology": {"transfer": "eisenstein_hu_nowiggle"}}, ["cosmology.transfer", "MUSIC"]),
    ({"simulation": {"n_particles": 33}}, ["simulation.n_particles", "33", "even"]),
    ({"preprocessing": {"assignment": "cic"}}, ["preprocessing.dtype", "float32"]),
    ({"sampling": {"n_simulations": 5, "splits": {"train": 0.9, "val": 0.05, "test": 0.05}}},
     ["sampling.splits.val", "no simulation"]),
    ({"simulation": {"n_cola": 0}}, ["simulation.n_cola", "0", "not allowed", "non-zero"]),
    ({"training": {"validation_split": "train"}},
     ["training.validation_split", "'train'", "training.train_split"]),
    ({"training": {"train_fraction": 0.5}},
     ["training.train_fraction", "0.5", "48 of the 96 training simulations", "multiple of the 64"]),
    ({"training": {"validation_split": None}},
     ["analysis.baselines", "training.validation_split", "null"]),
    ({"analysis": {"baselines": ["mean"], "learning_curve": [0.5]},
      "preprocessing": {"sims_per_shard": 16}}, ["analysis.learning_curve", "mean and ridge"]),
    ({"training": {"train_split": "training"}}, ["training.train_split", "'training'", "train, val, test"]),
    ({"training": {"model": "resnet"}}, ["training.model", "'resnet'", "cosmoflow_paper, mlperf"]),
]

# refused once only inside the simulate, train or analyze job, after the earlier stages had run:
# n_cola 0, validation_split train, a train_fraction of part of a shard, baselines without a
# validation split, a learning curve without the ridge baseline
LATE_FAILURES = BAD_CONFIGS[-7:-2]


@pytest.mark.parametrize("config,words", BAD_CONFIGS)
def test_bad_config_names_key_and_value(config, words):
    with pytest.raises(ConfigError) as raised:
        validate_config(config, source="test.yaml")
    message = str(raised.value)
    assert "test.yaml" in message
    for word in words:
        assert word in message


@pytest.mark.parametrize("config,words", BAD_CONFIGS[:4])
def test_cli_rejects_bad_config_before_any_work(tmp_path, config, words):
    path = write_config(tmp_path, {"results_dir": str(tmp_path / "results"), **config})
    for args in (["validate-config", path], ["sample-parameters", "--config", path]):
        result = run_cli(*args)
        assert result.returncode == 1
        assert "Traceback" not in result.stderr
        assert all(word in result.stderr for word in words), result.stderr
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("config,words", LATE_FAILURES)
def test_cli_refuses_what_once_failed_inside_a_job(tmp_path, config, words):
    path = write_config(tmp_path, config)
    result = run_cli("validate-config", path)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert all(word in result.stderr for word in words), result.stderr


def test_set_overrides_a_key_and_is_validated_like_the_file(tmp_path):
    path = write_config(tmp_path, {"run_name": "base"})
    result = run_cli("validate-config", path, "--set", "run_name=other",
                     "--set", "simulation.redshifts=[1.0, 0.0]")
    assert result.returncode == 0 and "other" in result.stdout, result.stderr
    result = run_cli("validate-config", path, "--set", "simulation.n_cola=0")
    assert result.returncode == 1
    assert "--set simulation.n_cola=0" in result.stderr and "key 'simulation.n_cola' = 0" in result.stderr
    result = run_cli("validate-config", path, "--set", "simulation")
    assert result.returncode == 1 and "is not KEY=VALUE" in result.stderr


def test_scientific_notation_is_a_number():
    """PyYAML (YAML 1.1) reads 1e-3 as a string; config files and --set read it as a number."""
    assert load_config_text("training: {learning_rate: 1e-3}")["training"]["learning_rate"] == 0.001


def load_config_text(text: str) -> dict:
    return validate_config(read_yaml(text))


def test_snakemake_rejects_bad_config_before_any_work(tmp_path):
    path = write_config(tmp_path, {"preprocessing": {"grid": 64, "subvolume": 24}})
    result = run_snakemake(tmp_path, "--configfile", str(path))
    assert result.returncode != 0
    assert "preprocessing.subvolume" in result.stderr + result.stdout
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("text,words", [
    ("sampling: [unclosed", ["not valid YAML"]),
    ("- a list\n", ["mapping"]),
])
def test_unreadable_config_file_is_named(tmp_path, text, words):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    result = run_cli("validate-config", path)
    assert result.returncode == 1
    assert str(path) in result.stderr and all(w in result.stderr for w in words)


def test_missing_config_file_is_named(tmp_path):
    result = run_cli("sample-parameters", "--config", tmp_path / "nope.yaml")
    assert result.returncode == 1
    assert "nope.yaml" in result.stderr and "does not exist" in result.stderr


def test_the_fisher_companion_is_a_fiducial_derivatives_run_at_this_resolution(tmp_path):
    """Checked with the configuration, not when the analysis reads the companion's data set."""
    fiducial = {"run_name": "companion", "sampling": {
        "design": "fiducial_derivatives", "n_simulations": 7,
        "splits": {"train": 1.0, "val": 0.0, "test": 0.0}}}
    for name, companion, words in (
            ("latin.yaml", {}, ["is a latin_hypercube run", "fiducial_derivatives"]),
            ("coarse.yaml", fiducial | {"preprocessing": {"grid": 64, "subvolume": 32}},
             ["32^3 voxels of 4 Mpc/h", "this run's are 16^3, 8 Mpc/h", "same resolution"]),
            ("broken.yaml", fiducial | {"simulation": {"box_size": -1}}, ["is not valid", "box_size"])):
        path = write_config(tmp_path, companion, name)
        with pytest.raises(ConfigError) as raised:
            validate_config({"analysis": {"fisher_companion": str(path)}})
        assert all(word in str(raised.value) for word in [name, *words]), raised.value
    path = write_config(tmp_path, fiducial, "companion.yaml")
    assert validate_config({"analysis": {"fisher_companion": str(path)}})["analysis"]["fisher_companion"]
