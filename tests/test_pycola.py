"""The real pyCOLA (pycola3 0.0.7, in its own environment) as simulation backend 'pycola'.

Cross-checks against our solver from the same initial conditions, judged by independent
references (linear growth, 100-step runs); the snapshot contract; bad input; the pipeline.
The environment comes from `python -m simulations.pycola_backend setup` (the README's test command);
the session fixture makes it if it is missing, so these tests never skip.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from conftest import FIXED_COSMOLOGY, IC_SETTINGS, SMALL, run_cli, run_snakemake, simulate, write_config
from simulations import cola, mesh, pycola_backend
from simulations.cosmology import Background, Cosmology
from simulations.initial_conditions import generate_initial_conditions, read_initial_conditions
from workflow.config import validate_config
from workflow.errors import ConfigError, PipelineError

COSMOLOGY = Cosmology(Omega_m=0.3, sigma_8=0.8, n_s=0.96, **FIXED_COSMOLOGY)
Z_INIT = 20.0


def make_ic(path: Path, n: int, box: float, seed: int = 3) -> Path:
    generate_initial_conditions(path, COSMOLOGY, n, box, Z_INIT, seed=seed, sim_id=seed,
                                **(IC_SETTINGS | {"fixed_amplitude": True}))
    return path


def snapshot(path: Path, index: int = 0) -> tuple[np.ndarray, np.ndarray]:
    with h5py.File(path, "r") as handle:
        return handle["positions"][index], handle["velocities"][index]


def density_power(positions: np.ndarray, box: float, n_mesh: int):
    counts = mesh.paint_cic(np.asarray(positions, np.float32), box, n_mesh)
    return mesh.power_spectrum(counts / counts.mean() - 1.0, box, deconvolve_cic=True)


def rms_separation(a: np.ndarray, b: np.ndarray, box: float) -> float:
    """rms |a - b| over particles, periodic, in Mpc/h."""
    difference = (a - b + box / 2) % box - box / 2
    return float(np.sqrt(np.mean(np.sum(difference.astype(np.float64) ** 2, axis=1))))


def evolve(ic_path: Path, out: Path, **settings) -> np.ndarray:
    """z = 0 positions of one run (10 steps, threads 2 unless given)."""
    settings = {"n_steps": 10, "threads": 2, **settings}
    simulate(ic_path, out, [0.0], **settings)
    return snapshot(out)[0]


# ------------------------------------------------------------------------------------------
# The environment and the snapshot contract


def test_environment_runs_pycola3_under_numpy_1(pycola_env):
    assert pycola_env["pycola3"] == pycola_backend.PYCOLA_VERSION
    assert pycola_env["numpy"].startswith("1.")


def test_pycola_snapshot_keeps_the_contract_at_several_redshifts(pycola_env, tmp_path):
    """Unsorted redshifts: same layout and attributes as ours; each output is a separate
    evolve() from z_init with the steps our schedule puts before it (bit for bit, 1 thread)."""
    n, box = 32, 64.0
    ic_path = make_ic(tmp_path / "ic.h5", n, box)
    redshifts = [0.0, 15.0, 2.0]
    settings = {"mesh_factor": 1, "threads": 1}
    out = simulate(ic_path, tmp_path / "snap.h5", redshifts, 6, backend="pycola",
                              **settings)
    with h5py.File(out, "r") as handle:
        assert handle["positions"].shape == handle["velocities"].shape == (3, n**3, 3)
        assert handle["positions"].dtype == handle["velocities"].dtype == np.float32
        np.testing.assert_array_equal(handle["redshifts"][...], redshifts)
        assert set(cola.SNAPSHOT_ATTRIBUTES) <= set(handle.attrs)
        assert handle.attrs["backend"] == "pycola"
        assert handle.attrs["backend_version"] == "pycola3 0.0.7"
        assert (handle.attrs["units_position"], handle.attrs["units_velocity"]) == ("Mpc/h", "km/s")
        assert handle.attrs["n_steps"] == 6 and handle.attrs["sim_id"] == 3
        positions, velocities = handle["positions"][...], handle["velocities"][...]
    assert positions.min() >= 0.0 and positions.max() < box
    axis = (np.arange(n) + 0.5) * box / n
    q = np.stack(np.meshgrid(axis, axis, axis, indexing="ij"), -1).reshape(-1, 3)
    rms = [rms_separation(x, q, box) for x in positions]
    assert rms[1] < rms[2] < rms[0]  # structure grows from z = 15 to 2 to 0

    # Units: one step after the start (z = 15, linear) pyCOLA's velocities are ours.
    native = simulate(ic_path, tmp_path / "native.h5", redshifts, 6, **settings)
    ours = snapshot(native, 1)[1].astype(np.float64)
    theirs = velocities[1].astype(np.float64)
    assert np.sqrt(np.mean(theirs**2) / np.mean(ours**2)) == pytest.approx(1.0, abs=0.02)
    assert np.corrcoef(theirs.ravel(), ours.ravel())[0, 1] > 0.995

    # z = 2 alone, with the steps the 6-step schedule puts before it
    steps = cola.time_steps(1 / (1 + Z_INIT), 1 / (1 + np.array(redshifts)), 6, "linear_a")
    before = pycola_backend.steps_to_outputs(steps, [1 / 3])[0]
    assert before == 3
    alone = simulate(ic_path, tmp_path / "alone.h5", [2.0], before,
                                backend="pycola", **settings)
    np.testing.assert_array_equal(snapshot(alone)[0], positions[2])


# ------------------------------------------------------------------------------------------
# Cross-validation against our solver, judged by independent references

# The bound tests/test_cola.py sets on 10 COLA steps against 100 PM steps up to half the
# particle Nyquist frequency.
COLA_TOLERANCE = 0.05
BOX64_RUNS = {  # name: settings of evolve()
    "ours": {},
    "pycola": {"backend": "pycola"},
    "pm100": {"n_steps": 100, "cola": False},
    "pycola100": {"n_steps": 100, "backend": "pycola"},
}


@pytest.fixture(scope="module")
def box64(pycola_env, tmp_path_factory):
    """Runs from one set of initial conditions, 32^3 particles in 64 Mpc/h: 2 Mpc/h apart,
    as in docs/stage-reference.md's 64^3 in 128 Mpc/h, in half that box. run(name, mesh_factor) gives the
    z = 0 positions and P(k) up to half the particle Nyquist frequency; each run is made once."""
    n, box = 32, 64.0
    directory = tmp_path_factory.mktemp("box64")
    ic_path = make_ic(directory / "ic.h5", n, box)

    @functools.cache
    def run(name: str, mesh_factor: int) -> tuple[np.ndarray, np.ndarray]:
        x = evolve(ic_path, directory / f"{name}_{mesh_factor}.h5", mesh_factor=mesh_factor,
                   **BOX64_RUNS[name])
        k, p, _ = density_power(x, box, 2 * n)
        return x, p[k <= 0.5 * np.pi * n / box]

    return run


def test_cross_check_mesh_factor_1_pycola_departs_on_small_scales_through_its_time_steps(box64):
    """32^3 particles, 64 Mpc/h, mesh factor 1, 10 steps, z = 20 -> 0, fixed amplitude.

    Against our 100-step PM run, up to half the particle Nyquist frequency: ours (10 COLA
    steps) is within the 5 % of tests/test_cola.py (0.4-2.8 %), and so is pyCOLA on the largest
    scale (+2.9 %), but on the smaller half of the k range pyCOLA has 15-23 % more power. Its
    own 100-step run departs at most half as much at any k (at most 5.4 %): the difference is
    pyCOLA's 10-step time integration, not its force."""
    reference = box64("pm100", 1)[1]
    ratio = {name: box64(name, 1)[1] / reference for name in ("ours", "pycola", "pycola100")}
    departure = {name: np.abs(value - 1) for name, value in ratio.items()}
    positions = {name: box64(name, 1)[0] for name in ("ours", "pycola", "pm100")}
    spacing = 2.0  # Mpc/h

    assert departure["ours"].max() < COLA_TOLERANCE
    assert departure["pycola"][0] < COLA_TOLERANCE  # the largest scale
    assert ratio["pycola"][len(reference) // 2:].min() > 1 + 2 * COLA_TOLERANCE
    assert np.all(departure["pycola100"] < departure["pycola"])
    assert departure["pycola100"].max() < 0.5 * departure["pycola"].max()
    assert rms_separation(positions["ours"], positions["pm100"], 64.0) < 0.15 * spacing
    assert rms_separation(positions["pycola"], positions["ours"], 64.0) < 0.6 * spacing


def test_cross_check_mesh_factor_2_pycola_departs_from_linear_growth(pycola_env, box64,
                                                                      tmp_path):
    """Mesh factor 2: pyCOLA's lattice q = i L / N sits on mesh nodes, where its force jumps.

    In 512 Mpc/h (32^3, 16 Mpc/h apart, initial displacements ~0.1 mesh cells) our large scales
    grow as linear theory within 3 % while pyCOLA's fail to grow at all. In 64 Mpc/h (32^3,
    2 Mpc/h apart) a mesh twice as fine resolves the force better, which raises the power: ours
    rises at every k up to half the particle Nyquist frequency (+2-17 %) and stays within 5 %
    of our 100-step PM run on that mesh (3.5 %); pyCOLA's falls at every k (by 15-26 %), to
    14-26 % below ours (docs/stage-reference.md, "The pyCOLA backend", the 128 Mpc/h
    table: below ours only up to k = 0.45 h/Mpc)."""
    n = 32
    background = Background(COSMOLOGY)
    linear = float(background.D1(1.0) / background.D1(1 / (1 + Z_INIT))) ** 2

    box = 512.0
    ic_path = make_ic(tmp_path / "ic512.h5", n, box)
    k, initial, _ = density_power(read_initial_conditions(ic_path).positions(), box, n)
    large = k < 4 * 2 * np.pi / box
    growth = {name: density_power(evolve(ic_path, tmp_path / f"{name}512.h5", backend=name),
                                  box, n)[1][large] / initial[large] / linear
              for name in ("native", "pycola")}
    np.testing.assert_allclose(growth["native"], 1.0, atol=0.03)
    assert growth["pycola"].max() < 0.5

    ours, theirs = box64("ours", 2)[1], box64("pycola", 2)[1]
    assert np.abs(ours / box64("pm100", 2)[1] - 1).max() < COLA_TOLERANCE
    assert np.all(ours > box64("ours", 1)[1])
    assert np.all(theirs < box64("pycola", 1)[1])
    assert np.all(theirs < ours)


# ------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("settings, words", [
    ({"simulation": {"cola": False}}, ["simulation.cola", "False", "pycola"]),
    ({"simulation": {"stepping": "log_a"}}, ["simulation.stepping", "log_a", "linear_a"]),
    ({"simulation": {"n_particles": 1024, "mesh_factor": 3}},
     ["simulation.mesh_factor", "3", "1024", "3072", "2048"]),
    ({"simulation": {"n_particles": 16, "threads": 8}}, ["simulation.threads", "8", "at most 4"]),
    ({"initial_conditions": {"z_init": 1000.0}}, ["initial_conditions.z_init", "1000", "999"]),
])
def test_config_rejects_what_pycola_cannot_take(settings, words):
    config = {"simulation": {"backend": "pycola", **settings.get("simulation", {})},
              **{key: value for key, value in settings.items() if key != "simulation"}}
    with pytest.raises(ConfigError) as raised:
        validate_config(config, source="pycola.yaml")
    for word in words:
        assert word in str(raised.value)
    validate_config({**config, "simulation": {**config["simulation"], "backend": "native"}})


def test_direct_call_rejects_what_pycola_cannot_take(pycola_env, tmp_path):
    ic_path = make_ic(tmp_path / "ic.h5", 16, 64.0)
    for settings, words in (({"threads": 8}, "threads = 8 with n_particles = 16"),
                            ({"cola": False}, "cola = False"),
                            ({"stepping": "log_a"}, "stepping = 'log_a'")):
        with pytest.raises(PipelineError, match=words):
            simulate(ic_path, tmp_path / "snap.h5", [0.0], 2, backend="pycola",
                                **settings)
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ic.h5"]


@pytest.mark.parametrize("interpreter, words", [
    (sys.executable, "cannot import pycola3"),  # a real interpreter without pycola3
    ("/no/such/pycola/bin/python", "does not exist"),
], ids=["without-pycola3", "absent"])
def test_missing_pycola_fails_before_the_simulation_starts(tmp_path, interpreter, words):
    missing_ic = tmp_path / "never_read.h5"  # the environment is checked first
    with pytest.raises(PipelineError) as raised:
        simulate(missing_ic, tmp_path / "snap.h5", [0.0], 2, backend="pycola",
                            pycola_python=interpreter)
    message = str(raised.value)
    assert "backend 'pycola'" in message and words in message
    assert pycola_backend.SETUP_COMMAND in message
    assert list(tmp_path.iterdir()) == []


def test_cli_batch_with_missing_pycola_writes_no_snapshot(tmp_path):
    config = {**SMALL, "results_dir": str(tmp_path / "results"),
              "simulation": {**SMALL["simulation"], "backend": "pycola",
                             "pycola_python": str(tmp_path / "absent" / "python")}}
    config_path = write_config(tmp_path, config)
    for stage in (("sample-parameters",), ("initial-conditions", "--batch", "0")):
        assert run_cli(*stage, "--config", config_path, cwd=tmp_path).returncode == 0
    result = run_cli("simulate", "--config", config_path, "--batch", "0", cwd=tmp_path)
    assert result.returncode == 1
    assert "backend 'pycola'" in result.stderr and pycola_backend.SETUP_COMMAND in result.stderr
    assert "Traceback" not in result.stderr
    run = tmp_path / "results" / "small"
    assert len(list(run.glob("sims/*/ic.h5"))) == 4
    assert not list(run.glob("sims/*/*snapshot*")) and not list(run.glob("sims/*/.snapshot*"))


def test_pycola_killed_mid_run_leaves_no_snapshot_and_names_the_simulation(pycola_env, tmp_path):
    """SIGKILL pyCOLA's process at its first kick (seen through our log of its output)."""
    ic_path = make_ic(tmp_path / "ic.h5", 32, 64.0)
    killed = []

    class KillAtFirstKick(logging.Handler):
        def emit(self, record):
            if "Kicked to" in record.getMessage() and not killed:
                for pid in _children():
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)

    logger = logging.getLogger("simulations.pycola_backend")
    handler, level = KillAtFirstKick(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        with pytest.raises(PipelineError) as raised:
            simulate(ic_path, tmp_path / "snap.h5", [0.0, 1.0], 10, backend="pycola",
                                threads=2)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert killed
    message = str(raised.value)
    assert "simulation 3" in message and "SIGKILL" in message and "no snapshot" in message
    assert sorted(path.name for path in tmp_path.iterdir()) == ["ic.h5"]  # nor temporary files


def _children() -> list[int]:
    """Process ids of this process's children (Linux /proc)."""
    pids = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        children = (task / "children").read_text().split()
        pids += [int(pid) for pid in children]
    return pids


# ------------------------------------------------------------------------------------------
# The pipeline


@pytest.mark.slow
def test_pipeline_with_pycola_backend_reruns_only_simulate_and_after(pycola_env, small_run, tmp_path):
    """The small ensemble through real Snakemake with the native solver (a copy of the session's
    small run, mtimes and Snakemake's records kept), then with pyCOLA: only simulate and the
    stages after it rerun, and verify-data accepts the new data set."""
    shutil.copytree(small_run[0], tmp_path, symlinks=True, dirs_exist_ok=True)
    run = tmp_path / "results" / "small"
    before = {path: path.stat().st_mtime_ns
              for path in [run / "params.csv", *run.glob("sims/*/ic.h5")]}

    pycola = {**SMALL, "simulation": {**SMALL["simulation"], "backend": "pycola"}}
    pycola_path = write_config(tmp_path, pycola, "pycola.yaml")
    result = run_snakemake(tmp_path, "--configfile", str(pycola_path), "--until", "manifest")
    assert result.returncode == 0, result.stderr[-3000:]
    ran = set(_rules_run(result.stdout + result.stderr))
    assert ran == {"simulate", "histogram", "write_tfrecords", "manifest"}
    assert {path: path.stat().st_mtime_ns for path in before} == before
    for path in run.glob("sims/*/snapshot.h5"):
        with h5py.File(path, "r") as handle:
            assert handle.attrs["backend"] == "pycola"
    verified = run_cli("verify-data", run)
    assert verified.returncode == 0, verified.stderr


def _rules_run(log: str) -> list[str]:
    """Rule names of the jobs a Snakemake run reports ('rule NAME:' lines)."""
    return [line.split()[-1].rstrip(":") for line in log.splitlines()
            if line.startswith(("rule ", "localrule ")) and line.rstrip().endswith(":")]
