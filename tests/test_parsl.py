"""Parsl execution (workflow/parsl/): the ensemble and the sweep with real Parsl executors.

Local HighThroughputExecutor and MPIExecutor runs on the small ensemble of conftest.SMALL, real
Snakemake beside them, and the Slurm configuration's submit script; the run through the local
Slurm is in tests/test_parsl_slurm.py.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import signal
import subprocess
import time

import h5py
import pytest

from conftest import SMALL, run_cli, run_snakemake, write_config
from workflow.config import validate_config
from workflow.errors import ConfigError, PipelineError

# the small ensemble with two local Parsl workers, its intermediates not kept (the default), and
# a sweep of 2 x 2 one-epoch trials
PARSL = {**SMALL, "parsl": {"workers_per_node": 2, "retries": 1, "progress_seconds": 2},
         "simulation": {**SMALL["simulation"], "keep_initial_conditions": False, "keep_snapshots": False},
         "training": {"model": "mlperf", "batch_size": 4, "epochs": 1, "threads": 1},
         "sweep": {"epochs": 1, "concurrent": 2, "threads": 1, "space": {
             "learning_rate": [0.0005, 0.001], "width": [0.25, 0.5], "batch_size": [4],
             "optimizer": ["adam"]}}}
RUN = "results/small"
MANIFEST = f"{RUN}/tfrecords/manifest.json"


def data_digests(run_dir):
    """sha256 of every TFRecord and HDF5 file of a run, by relative path."""
    return {str(path.relative_to(run_dir)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(run_dir.rglob("*")) if path.suffix in (".tfrecord", ".h5")}


def output_mtimes(run_dir):
    """mtimes of the stages' outputs (not logs, Parsl's records or the config record)."""
    skip = {"logs", "parsl", "benchmarks", "sweeps"}
    return {path: path.stat().st_mtime_ns for path in run_dir.rglob("*")
            if path.is_file() and not skip & set(path.relative_to(run_dir).parts)
            and path.name != "config.yaml"}


@pytest.fixture(scope="module")
def both_runs(tmp_path_factory):
    """The same configuration to the data set through Snakemake (and staged, for the sweep) and
    through `cosmoflow ensemble` on 2 local Parsl workers."""
    snakemake_dir, parsl_dir = tmp_path_factory.mktemp("snakemake"), tmp_path_factory.mktemp("parsl")
    validated = [f"{RUN}/batches/validate_simulations/{batch}.json" for batch in (0, 1)]
    snakemake = run_snakemake(snakemake_dir, f"{RUN}/staged/staged.json", *validated,
                              "--configfile", str(write_config(snakemake_dir, PARSL)))
    assert snakemake.returncode == 0, snakemake.stderr[-3000:]
    ensemble = run_cli("ensemble", "--config", write_config(parsl_dir, PARSL), cwd=parsl_dir)
    assert ensemble.returncode == 0, ensemble.stderr[-3000:]
    return snakemake_dir, parsl_dir, ensemble


def test_ensemble_on_two_workers_writes_the_bytes_snakemake_writes(both_runs):
    snakemake_dir, parsl_dir, ensemble = both_runs
    assert "13 job(s) ran, 0 up to date" in ensemble.stdout
    # live progress: a report per stage with done / running / pending, rate and time left
    assert "jobs/min, time left" in ensemble.stderr
    assert "simulate                 2 done    0 running     0 pending" in ensemble.stderr
    on_parsl, on_snakemake = (data_digests(d / RUN) for d in (parsl_dir, snakemake_dir))
    assert sum(name.endswith(".tfrecord") for name in on_parsl) == 8  # 32 + 16 + 16 samples, 8 per file
    assert on_parsl == on_snakemake
    # the logs are where the rules put theirs
    assert (parsl_dir / RUN / "logs" / "simulate" / "1.log").is_file()
    assert (parsl_dir / RUN / "logs" / "write_tfrecords" / "train_0000.log").is_file()
    assert run_cli("verify-data", parsl_dir / RUN).returncode == 0


def test_snakemake_takes_what_parsl_made_as_done(both_runs):
    """No metadata for Parsl's outputs, but newer than their inputs: nothing to redo."""
    _, parsl_dir, _ = both_runs
    config = str(parsl_dir / "config.yaml")
    result = run_snakemake(parsl_dir, "-n", MANIFEST, "--configfile", config)
    assert result.returncode == 0, result.stderr
    assert "Nothing to be done" in result.stdout + result.stderr
    assert "missing provenance/metadata" in result.stdout + result.stderr


def test_forcerun_redoes_a_stage_and_what_depends_on_it(both_runs):
    """`--forcerun histogram`: both histogram batch jobs, their validation, the three shards and
    the manifest run again, the stages upstream do not; the batch jobs skip their simulations (current), so
    only the batch summaries and the data set are rewritten, with the same bytes."""
    _, parsl_dir, _ = both_runs
    run = parsl_dir / RUN
    before, digests = output_mtimes(run), data_digests(run)
    result = run_cli("ensemble", "--config", parsl_dir / "config.yaml", "--forcerun", "histogram",
                     cwd=parsl_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "8 job(s) ran, 5 up to date" in result.stdout
    after = output_mtimes(run)
    assert set(after) == set(before)
    names = sorted(str(path.relative_to(run)) for path in before)
    rewritten = [name for name in names if after[run / name] != before[run / name]]
    data_set = [name for name in names if name.startswith("tfrecords/")]  # with the manifest
    summaries = [f"batches/{stage}/{batch}.json" for stage in ("histogram", "validate_simulations")
                 for batch in (0, 1)]
    assert rewritten == summaries + data_set, rewritten
    assert data_digests(run) == digests
    for name, runs in (("histogram/0", 2), ("write_tfrecords/train_0000", 2), ("simulate/0", 1),
                       ("sample_parameters/sample_parameters", 1)):
        log = (run / "logs" / f"{name}.log").read_text()
        assert log.count("=== cosmoflow (parsl):") == runs, (name, log)


def test_parsl_takes_what_snakemake_made_as_done(both_runs):
    snakemake_dir, _, _ = both_runs
    before = output_mtimes(snakemake_dir / RUN)
    assert not list((snakemake_dir / RUN / "sims").rglob("*.h5"))  # ic.h5, snapshot.h5 not kept
    result = run_cli("ensemble", "--config", snakemake_dir / "config.yaml", cwd=snakemake_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "0 job(s) ran, 13 up to date" in result.stdout
    assert output_mtimes(snakemake_dir / RUN) == before  # nothing rewritten
    # and Snakemake, after Parsl looked, still has nothing to do (nothing was touched)
    again = run_snakemake(snakemake_dir, "-n", f"{RUN}/staged/staged.json", "--configfile",
                          str(snakemake_dir / "config.yaml"))
    assert "Nothing to be done" in again.stdout + again.stderr


def test_failed_batch_is_retried_reported_and_alone_redone(tmp_path, monkeypatch):
    """A corrupt ic.h5 (its provenance intact, a dataset gone) fails simulate in batch 1: two
    attempts, reported by batch; batch 0 completes; the fixed input reruns batch 1 only."""
    from workflow.parsl.ensemble import run_ensemble

    monkeypatch.chdir(tmp_path)
    config = validate_config({**PARSL, "simulation": SMALL["simulation"]})  # ic.h5 kept
    run_ensemble(config, until="initial_conditions")
    victim = tmp_path / RUN / "sims" / "00005" / "ic.h5"  # batch 1 (4 simulations per batch)
    original = victim.read_bytes()
    with h5py.File(victim, "r+") as handle:
        del handle["psi2"]

    with pytest.raises(PipelineError) as raised:
        run_ensemble(config)
    message = str(raised.value)
    assert "simulate batch 1 (after 2 attempts)" in message and "psi2" in message, message
    # in plan order
    assert ("not run because of a failure: histogram batch 1, validate_simulations batch 1, "
            "write_tfrecords train shard 0, write_tfrecords val shard 0, write_tfrecords test shard 0, "
            "manifest.") in message
    assert "simulate batch 0" not in message
    log = (tmp_path / RUN / "logs" / "simulate" / "1.log").read_text()
    assert log.count("=== cosmoflow (parsl): simulate") == 2  # the attempt and its retry
    assert (tmp_path / RUN / "batches" / "histogram" / "0.json").is_file()  # the other batch completed
    assert not (tmp_path / RUN / "batches" / "simulate" / "1.json").exists()
    assert not (tmp_path / MANIFEST).exists()

    victim.write_bytes(original)  # the input fixed
    kept = output_mtimes(tmp_path / RUN)
    report = run_ensemble(config)
    assert sorted(report.ran) == sorted(
        ["simulate batch 1", "histogram batch 1", "validate_simulations batch 1", "manifest"]
        + [f"write_tfrecords {split} shard 0" for split in ("train", "val", "test")])
    assert "simulate batch 0" in report.current and "initial_conditions batch 1" in report.current
    now = output_mtimes(tmp_path / RUN)
    batch0 = [f"sims/0000{i}/snapshot.h5" for i in range(4)] + [f"histograms/0000{i}.h5" for i in range(4)]
    for name in batch0 + ["params.csv", "sims/00005/ic.h5", "batches/histogram/0.json"]:
        path = tmp_path / RUN / name
        assert now[path] == kept[path], name
    assert run_cli("verify-data", tmp_path / RUN).returncode == 0


def checkpointed_trials(sweep_dir):
    """Names of the trials in Parsl's checkpoint files of a sweep (memoizer: one pickle each)."""
    names = []
    for path in sweep_dir.glob("parsl/*/checkpoint/tasks.pkl"):
        with open(path, "rb") as handle:
            while True:
                try:
                    names.append(pickle.load(handle)["result"]["trial"])
                except (EOFError, pickle.UnpicklingError):  # the end, or a record being written
                    break
    return names


def test_sweep_of_four_trials_resumes_after_a_kill(both_runs):
    """2 x 2 trials, 2 at a time through the MPIExecutor; SIGTERM once one has finished, rerun:
    only the trials not checkpointed run again; sweep.csv has 4 rows and one best."""
    snakemake_dir, _, _ = both_runs
    config = snakemake_dir / "config.yaml"
    sweep_dir = snakemake_dir / RUN / "sweeps" / "sweep"
    first = subprocess.Popen(["cosmoflow", "sweep", "--config", str(config)], cwd=snakemake_dir,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 600
    while not checkpointed_trials(sweep_dir):
        assert first.poll() is None and time.monotonic() < deadline, first.communicate()[0][-3000:]
        time.sleep(0.2)
    first.send_signal(signal.SIGTERM)
    output = first.communicate(timeout=300)[0]
    assert first.returncode == 1 and "interrupted" in output, output[-3000:]
    done = checkpointed_trials(sweep_dir)
    assert 1 <= len(done) < 4, done
    trained = {name: (sweep_dir / name / "run.json").stat().st_mtime_ns for name in done}

    again = run_cli("sweep", "--config", config, cwd=snakemake_dir)
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"{len(done)} trial(s) taken from Parsl's checkpoints" in again.stderr
    assert {name: (sweep_dir / name / "run.json").stat().st_mtime_ns for name in done} == trained
    rows = (sweep_dir / "sweep.csv").read_text().splitlines()
    header, rows = rows[0].split(","), [dict(zip(rows[0].split(","), line.split(","))) for line in rows[1:]]
    assert len(rows) == 4 and {row["status"] for row in rows} == {"done"}
    assert {"learning_rate", "batch_size", "width", "optimizer", "val_loss", "val_mse_over_baseline",
            "seconds", "best"} <= set(header)
    best = [row for row in rows if row["best"] == "True"]
    assert len(best) == 1 and f"best trial of sweep sweep: {best[0]['trial']}" in again.stderr
    assert min(float(row["val_mse_over_baseline"]) for row in rows) == float(best[0]["val_mse_over_baseline"])
    for row in rows:  # every trial trained with its own values, for the sweep's epochs
        assert (sweep_dir / row["trial"] / "model.keras").is_file()


def test_a_trial_trains_on_two_mpi_ranks(both_runs):
    """sweep.ranks = 2: the MPIExecutor's $PARSL_MPI_PREFIX starts one world of 2 ranks."""
    snakemake_dir, _, _ = both_runs
    result = run_cli("sweep", "--config", snakemake_dir / "config.yaml", "--set", "sweep.name=ranks",
                     "--set", "sweep.ranks=2", "--set", "sweep.concurrent=1", "--set",
                     "sweep.space={learning_rate: [0.001], width: [0.25], batch_size: [2], optimizer: [sgd]}",
                     cwd=snakemake_dir)
    assert result.returncode == 0, result.stderr[-3000:]
    trial = snakemake_dir / RUN / "sweeps" / "ranks" / "lr0.001_bs2_w0.25_sgd"
    record = json.loads((trial / "run.json").read_text())
    assert record["ranks"] == 2 and record["global_batch"] == 4
    assert record["settings"]["optimizer"] == "sgd" and record["settings"]["width"] == 0.25
    assert "mpiexec -n 2 -ppn 2" in (trial / "trial.log").read_text()


def test_sweep_rule_runs_the_sweep_only_when_enabled(both_runs, tmp_path):
    _, parsl_dir, _ = both_runs  # to the manifest, no sweep yet
    config = str(parsl_dir / "config.yaml")
    plan = run_snakemake(parsl_dir, "-n", "--configfile", config)
    assert "rule sweep" not in plan.stdout and "rule train:" in plan.stdout
    enabled = write_config(tmp_path, {"sweep": {"enabled": True}}, "enabled.yaml")
    plan = run_snakemake(parsl_dir, "-n", "--configfile", config, str(enabled))
    assert "rule sweep:" in plan.stdout and "cosmoflow sweep --config" in plan.stdout
    assert f"output: {RUN}/sweeps/sweep/sweep.csv" in plan.stdout


def test_grid_and_random_search_choose_distinct_trials():
    from workflow.parsl.sweep import trials

    grid = trials(validate_config(PARSL))
    assert len(grid) == 4 and "lr0.001_bs4_w0.25_adam" in grid
    random = {**PARSL, "sweep": {**PARSL["sweep"], "search": "random", "trials": 3, "seed": 5}}
    drawn = trials(validate_config(random))
    assert len(drawn) == 3 and set(drawn) < set(grid)
    assert drawn == trials(validate_config(random))  # seeded


@pytest.mark.parametrize("config,words", [
    ({"parsl": {"mpi": {"launcher": "srun"}}}, ["parsl.mpi.launcher", "srun", "parsl.provider"]),
    ({"parsl": {"nodes_per_block": 4}}, ["parsl.nodes_per_block", "4", "slurm"]),
    ({"parsl": {"provider": "pbs"}}, ["parsl.provider", "pbs", "local, slurm"]),
    ({"parsl": {"interface": "eth0"}}, ["parsl.interface", "eth0", "slurm", "127.0.0.1"]),
    ({"parsl": {"slurm": {"walltime": "90 minutes"}}}, ["parsl.slurm.walltime", "90 minutes"]),
    ({"sweep": {"search": "random", "trials": 7}}, ["sweep.trials", "7", "6 distinct combinations"]),
    ({"sweep": {"space": {"optimizer": ["lamb"]}}}, ["sweep.space.optimizer[0]", "lamb", "adam, sgd"]),
    ({"sweep": {"enabled": True}, "training": {"validation_split": None}},
     ["training.validation_split", "sweep"]),
    ({"parsl": {"provider": "slurm", "nodes_per_block": 2}, "sweep": {"nodes": 3}},
     ["sweep.nodes", "3", "2"]),
])
def test_bad_parsl_or_sweep_keys_are_named(config, words):
    with pytest.raises(ConfigError) as raised:
        validate_config(config, source="test.yaml")
    assert all(word in str(raised.value) for word in words), str(raised.value)


SLURM = {"parsl": {"provider": "slurm", "nodes_per_block": 2, "slurm": {
    "partition": "cpu", "account": "cosmo", "walltime": "01:30:00", "worker_init": "module load mpich",
    "exclusive": False}}}


def test_slurm_configuration_gives_parsls_submit_script():
    """Built from the config: SlurmProvider, SrunLauncher for the ensemble's workers, a
    SimpleLauncher under the sweep's MPIExecutor; scripts rendered by Parsl's template."""
    from parsl.launchers import SimpleLauncher, SrunLauncher
    from parsl.providers import SlurmProvider

    from workflow.parsl.configs import ensemble_config, submit_script, sweep_executor
    from workflow.process import shell_exports

    config = validate_config(SLURM)
    (executor,) = ensemble_config(config, "runinfo").executors
    assert isinstance(executor.provider, SlurmProvider)
    assert isinstance(executor.provider.launcher, SrunLauncher)
    script = submit_script(executor.provider, "process_worker_pool.py")
    for line in ("#SBATCH --partition=cpu", "#SBATCH --account=cosmo", "#SBATCH --time=90",
                 "#SBATCH --nodes=2", "module load mpich", "srun --ntasks 2", shell_exports()):
        assert line in script, (line, script)  # the workers get the cosmoflow command's settings
    assert "--exclusive" not in script
    mpi = sweep_executor(config, "nodefile")
    assert isinstance(mpi.provider.launcher, SimpleLauncher) and mpi.mpi_launcher == "mpiexec"
    assert mpi.max_workers_per_block == 2  # two one-node trials per two-node block
    assert "srun" not in submit_script(mpi.provider, "process_worker_pool.py")


def test_slurm_workers_connect_to_the_address_of_parsl_interface():
    """The interchange listens on the named interface's address alone, and the workers are told
    that address; a name this machine lacks is an error naming the key and its interfaces."""
    from workflow.parsl.configs import ensemble_config, sweep_executor

    config = validate_config({"parsl": {**SLURM["parsl"], "interface": "lo"}})
    (executor,) = ensemble_config(config, "runinfo").executors
    assert executor.address == "127.0.0.1" and executor.all_addresses == {"127.0.0.1"}
    assert sweep_executor(config, "nodefile").all_addresses == {"127.0.0.1"}
    missing = validate_config({"parsl": {**SLURM["parsl"], "interface": "nosuch0"}})
    with pytest.raises(ConfigError) as raised:
        ensemble_config(missing, "runinfo")
    message = str(raised.value)
    assert all(word in message for word in ("parsl.interface", "nosuch0", "lo")), message


def test_submit_script_option_prints_it(tmp_path):
    path = write_config(tmp_path, SLURM)
    result = run_cli("ensemble", "--config", path, "--submit-script")
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --partition=cpu" in result.stdout and "process_worker_pool.py" in result.stdout
    local = run_cli("ensemble", "--config", write_config(tmp_path, {}, "local.yaml"), "--submit-script")
    assert local.returncode == 1 and "parsl.provider: slurm" in local.stderr
