"""The training stage as the workflow runs it: config section, launch checks, fixed shards."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import numpy as np
import pytest

from training.pipeline import shard_indices
from training.settings import LAUNCH_KEYS, TrainingSettings
from workflow.config import load_config, schema_keys, validate_config
from workflow import resources


def test_settings_fields_are_the_schema_keys_and_take_a_validated_section():
    fields = [f.name for f in dataclasses.fields(TrainingSettings)]
    assert fields + list(LAUNCH_KEYS) == list(schema_keys("training"))
    defaults = validate_config({})["training"]  # the schema's
    assert TrainingSettings.from_mapping(defaults).to_dict() == {
        key: value for key, value in defaults.items() if key not in LAUNCH_KEYS}


def test_config_training_section_becomes_settings():
    config = load_config("config/config.yaml")
    settings = TrainingSettings.from_mapping(config["training"])
    assert settings.epochs == config["training"]["epochs"]
    assert settings.threads == config["training"]["threads"]


@pytest.mark.parametrize("n_files,n_ranks", [(24, 2), (7, 3)])
def test_fixed_shards_cover_every_file_once_and_stay_with_their_rank(n_files, n_ranks):
    for epoch in range(4):
        shards = [shard_indices(n_files, 3, epoch, rank, n_ranks, fixed=True) for rank in range(n_ranks)]
        assert sorted(np.concatenate(shards).tolist()) == list(range(n_files))
        for rank, shard in enumerate(shards):
            assert set(shard) == set(shard_indices(n_files, 3, 0, rank, n_ranks, fixed=True))
    orders = [shard_indices(n_files, 3, epoch, 0, n_ranks, fixed=True).tolist() for epoch in range(4)]
    assert len({tuple(order) for order in orders}) > 1  # a new order within the shard each epoch


def test_separate_one_rank_worlds_are_refused():
    """srun --mpi=none starts N processes that each see MPI world size 1."""
    code = "from training.mpi import world_communicator; world_communicator()"
    for variable in ("SLURM_STEP_NUM_TASKS", "PMI_SIZE"):
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                env={"PATH": "/usr/bin:/bin", variable: "2", "TF_CPP_MIN_LOG_LEVEL": "2"})
        assert result.returncode != 0
        assert f"{variable}=2" in result.stderr and "--mpi=pmi2" in result.stderr
    ok = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        env={"PATH": "/usr/bin:/bin", "SLURM_STEP_NUM_TASKS": "1"})
    assert ok.returncode == 0, ok.stderr


def test_paper_preset_training_estimates_follow_the_flops():
    """130 epochs of 80,848 samples at 69.3 Gflop each, on 64 nodes x 64 cores."""
    config = load_config("config/paper.yaml")
    flops = 130 * 80848 * 69.33e9
    minutes = resources.SAFETY * flops / (resources.GFLOPS_PER_CORE * 1e9 * 64 * 64) / 60
    assert resources.training_runtime_min(config) == pytest.approx(minutes, rel=0.01)
    assert resources.training_cores(config) == 64 * 64
