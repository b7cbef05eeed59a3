"""Every benchmark runs as docs/benchmarks.md gives it: ``python bench/<name>.py --quick``, from the
repository root.

``--quick`` is a benchmark's smallest mode: the same code on small sizes with the fewest repeats.
Each test checks that the script exits 0 and prints the figures it promises as its last line
(one JSON object): the keys, finite numbers, ratios above 0. How fast anything ran is not
asserted: that is for full runs on a quiet machine (docs/getting-started.md, "Development").
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from conftest import REPO

HELPERS = {"machine.py", "quick_mode.py"}
"""bench/ modules that the benchmarks import, not benchmarks."""
NOT_HERE = {"faults.py"}
"""Benchmarks without a quick mode (fault injection: minutes of whole pipeline runs)."""
BENCHMARKS = {"plan", "cola", "pycola_crosscheck", "preprocess", "training_throughput", "staging",
              "async", "analysis_throughput", "parsl_overhead", "main_command"}


def run_quick(name: str) -> tuple[list[str], dict]:
    """Output lines and last-line figures of ``python bench/<name>.py --quick``."""
    result = subprocess.run([sys.executable, f"bench/{name}.py", "--quick"], cwd=REPO,
                            capture_output=True, text=True,
                            timeout=900)  # a hang guard: a quick run takes seconds to minutes
    assert result.returncode == 0, f"bench/{name}.py --quick:\n{result.stderr[-3000:]}"
    lines = result.stdout.strip().splitlines()
    return lines, json.loads(lines[-1])


def assert_positive(figures: dict, *keys: str) -> None:
    for key in keys:
        value = figures[key]
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (key, value)


def test_every_benchmark_is_run_here():
    scripts = {path.name for path in (REPO / "bench").glob("*.py")} - HELPERS - NOT_HERE
    assert scripts == {f"{name}.py" for name in BENCHMARKS}


def test_plan():
    _, figures = run_quick("plan")
    assert_positive(figures, "paper_dry_run_s", "paper_dry_run_cpu_s", "paper_over_tiny",
                    "paper_jobs", "paper_slurm_jobs")
    assert figures["paper_slurm_jobs"] < figures["paper_jobs"]  # job groups bundle jobs


def test_cola(pycola_env):
    lines, figures = run_quick("cola")
    assert_positive(figures, "step_over_fft", "naive_step_over_fft", "bytes_per_particle",
                    "tiny_sim_s", "step_over_pycola", "step_cpu_over_pycola",
                    "pycola_bytes_per_particle")
    assert any(line.startswith("32^3 particles on a 64^3 mesh") for line in lines)
    assert any(line.startswith("paper preset (512^3 particles") for line in lines)


def test_pycola_crosscheck(pycola_env):
    _, figures = run_quick("pycola_crosscheck")
    setups = ["16^3 32 Mpc/h mesh_factor 2", "16^3 32 Mpc/h mesh_factor 1",
              "16^3 16 Mpc/h mesh_factor 2"]
    departures = ["pycola/ours", "ours/PM100", "pycola/PM100", "pycola100/PM100"]
    for setup in setups:
        assert_positive(figures[setup], "positions_rms_over_spacing")
        for name in departures:
            assert math.isfinite(figures[setup][f"max_departure {name}"])
    growth = figures["large-scale growth / linear, 16^3 512 Mpc/h"]
    assert sorted(growth) == sorted(f"{backend} mesh_factor {factor}"
                                    for backend in ("native", "pycola") for factor in (1, 2, 3))
    for ratios in growth.values():
        assert len(ratios) == 3 and all(math.isfinite(r) and r > 0 for r in ratios)


def test_preprocess():
    _, figures = run_quick("preprocess")
    assert_positive(figures, "over_io_floor", "histogram_speedup_vs_bincount", "pipeline_s",
                    "io_floor_s")
    assert_positive(figures["bytes_per_sample"], "none", "gzip")
    assert_positive(figures["paper_dataset_tb"], "none", "gzip")
    assert figures["bytes_per_sample"]["gzip"] < figures["bytes_per_sample"]["none"]


@pytest.mark.slow  # 1-2 min on 2 cores: six TensorFlow processes (three mpiexec runs)
def test_training_throughput():
    lines, figures = run_quick("training_throughput")
    assert_positive(figures, "gflops_over_sgemm", "pipeline_over_training", "weak_scaling_2")
    assert math.isfinite(figures["overhead_vs_fit"]) and figures["overhead_vs_fit"] > -1
    details = json.loads(lines[-2])
    assert details["onednn"] is True  # configure_process ran before TensorFlow was imported
    assert_positive(details, "sgemm_gflops", "training_gflops", "convolutions_alone_gflops",
                    "two_independent_one_rank_runs_efficiency")
    step = figures["step_seconds"]  # where a step's time goes, from TensorFlow's profiler
    assert sorted(step) == sorted(["convolutions", "bias_activation", "pooling", "dense", "optimizer",
                                   "allreduce", "other"])
    assert_positive(step, "convolutions", "pooling", "dense", "optimizer")
    assert step["allreduce"] == 0.0  # one rank
    assert any(line.startswith("operation seconds per training step at 32^3") for line in lines)


def test_staging():
    _, figures = run_quick("staging")
    assert_positive(figures, "over_plain_copy", "over_hash_floor", "stage_mb_per_s",
                    "cp_mb_per_s", "hash_mb_per_s", "reuse_mb_per_s")
    assert (figures["files"], figures["bytes"]) == (2, 2 << 20)


@pytest.mark.slow  # 1.5-2 min on 2 cores: four mpiexec runs of 2 TensorFlow ranks
def test_async():
    lines, figures = run_quick("async")
    assert_positive(figures["straggler_speedup"], "2")
    assert_positive(figures["time_to_loss_ratio"], "2")
    assert_positive(figures, "rma_overhead")
    assert json.loads(lines[-2])["settings"]["model"] == "mlperf"


def test_analysis_throughput():
    lines, figures = run_quick("analysis_throughput")
    assert_positive(figures, "inference_over_training_rate", "posterior_over_point_rate", "pk_over_fft")
    details = json.loads(lines[-2])
    assert details["grid"] == 32
    assert_positive(details, "pk_seconds", "rfftn_seconds", "training_samples_per_second",
                    "inference_samples_per_second")


def test_parsl_overhead():
    lines, figures = run_quick("parsl_overhead")
    assert_positive(figures, "empty_task_ms", "parsl_seconds", "direct_seconds", "jobs")
    assert math.isfinite(figures["overhead_fraction"]) and figures["overhead_fraction"] > -1
    assert any(line.startswith("round 1: parsl") for line in lines)


@pytest.mark.slow  # about 1 min of 2 cores (~100 CPU s): the whole pipeline on 8 small simulations
def test_main_command():
    lines, figures = run_quick("main_command")
    assert_positive(figures, "main_s", "main_cpu_s", "simulations_s", "main_over_simulations")
    assert figures["main_s"] > figures["simulations_s"]  # the floor is part of the run
    assert any(line.startswith("CPU: ") for line in lines)
    stages = json.loads(lines[-2])["stage_seconds"]
    assert {"initial_conditions", "simulate", "train", "analyze"} <= set(stages)
