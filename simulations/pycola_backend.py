"""The real pyCOLA (PyPI ``pycola3`` 0.0.7) as the simulation backend ``pycola``.

pyCOLA (Tassev, Zaldarriaga & Eisenstein 2013, JCAP 06, 036; Tassev et al. 2015) evolved the
CosmoFlow ensemble. With ``simulation.backend: pycola`` each simulation of the ``simulate``
stage is evolved by pyCOLA's ``evolve()`` from our ``ic.h5`` (ours or MUSIC's fields) with
the same steps, nCola, a_initial, mesh factor and snapshot redshifts, and written to the same
``snapshot.h5`` by :func:`simulations.cola.run_simulation`. MUSIC's initial conditions
(``initial_conditions.backend: music``) reach pyCOLA through ``ic.h5`` as well: pyCOLA's own
``import_music_snapshot`` reads a Zel'dovich-only MUSIC run at z = 0 (``zstart = 0``,
``use_2LPT = no``, as its docstring requires), not the 2LPT run at z_init that the music backend
makes, converts and then deletes.

Why pyCOLA runs in its own interpreter, through files: pycola3 0.0.7 fails under NumPy 2
("Buffer dtype mismatch, expected 'float32_t' but got 'double'": NumPy 2's promotion rules
turn its float32 velocity arrays into float64), while this pipeline needs NumPy 2
(TensorFlow). So pycola3 lives in a separate virtual environment with numpy<2, made by
:func:`setup_environment` (``python -m simulations.pycola_backend setup``), and our entry
point ``simulations/pycola_worker.py`` runs there as a subprocess, the way
:mod:`simulations.music` drives the MUSIC executable. It reads ``ic.h5`` itself and writes
the particles to an HDF5 file in a temporary directory beside the snapshot. pycola3's sdist
does not declare its build requirements (Cython, NumPy), so it is installed with
``--no-build-isolation`` after them; it needs a C compiler with OpenMP.

What pyCOLA cannot take (checked before any simulation starts, by
:func:`check_arguments` and the configuration's cross-key rules):

* plain PM (``cola: false``), ``stepping: log_a``: evolve() has neither;
* a PM mesh of more than :data:`MAX_MESH` cells per side: its kernels clip a particle's mesh
  coordinate to ``ngrid - 0.0001`` in float32, which rounds to ``ngrid`` itself above 2048
  cells, and then index one plane past the mesh (bounds checks are compiled out);
* ``z_init`` above 999: its growth factor is tabulated for a in [0.001, 1.1];
* fewer than :data:`MIN_PLANES_PER_THREAD` lattice planes per thread: its OpenMP loops take
  ``n_particles // threads`` planes per chunk; with 0 they never finish, and with 1 or 2 the
  threads' mass assignments (unprotected ``+=`` into shared mesh cells) collide.

Known differences from our solver, measured in tests/test_pycola.py and listed in
docs/stage-reference.md ("The pyCOLA backend"): with a mesh factor above 1 pyCOLA's lattice
q = i L / N sits on mesh nodes, where its force (the derivative of a 4-point interpolation of
the potential, which jumps at nodes) pushes particles off the nodes; where the initial
displacements are small against the mesh spacing its large scales then depart from linear
growth. With threads > 1 its mass assignment is not bit-for-bit reproducible (order of float
additions); with ``simulation.threads: 1`` it is.

Outputs: none of its own; :func:`simulations.cola.run_simulation` writes the snapshot. The
worker's output (pyCOLA's progress messages) goes to this module's logger.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Sequence

from workflow.config import PYCOLA_MAX_MESH, PYCOLA_MAX_Z_INIT, PYCOLA_MIN_PLANES_PER_THREAD
from workflow.errors import PipelineError

logger = logging.getLogger(__name__)

PYCOLA_VERSION = "0.0.7"
ENVIRONMENT_REQUIREMENTS = (
    "numpy>=1.26,<2", "scipy>=1.13", "h5py>=3.11", "pyfftw>=0.14", "cython>=3.0",
    "setuptools>=70", "wheel>=0.43",
)
"""What pycola3 needs before it is built (numpy<2: see the module docstring)."""
MAX_MESH = PYCOLA_MAX_MESH
MIN_PLANES_PER_THREAD = PYCOLA_MIN_PLANES_PER_THREAD
MIN_A_INITIAL = 1.0 / (1.0 + PYCOLA_MAX_Z_INIT)
WORKER = Path(__file__).with_name("pycola_worker.py")
SETUP_COMMAND = "python -m simulations.pycola_backend setup"
_STATS_PREFIX = "pycola_worker stats: "


# --------------------------------------------------------------------------------------------
# The environment


def default_environment() -> Path:
    """Where :func:`setup_environment` puts pyCOLA's environment unless told otherwise.

    ``$COSMOFLOW_PYCOLA_ENV`` if set, else ``$XDG_DATA_HOME/cosmoflow/pycola3-0.0.7``
    (``~/.local/share/cosmoflow/pycola3-0.0.7``).
    """
    if os.environ.get("COSMOFLOW_PYCOLA_ENV"):
        return Path(os.environ["COSMOFLOW_PYCOLA_ENV"]).expanduser()
    data = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    return data / "cosmoflow" / f"pycola3-{PYCOLA_VERSION}"


def environment_python(configured: str | os.PathLike | None = None) -> Path:
    """The interpreter that runs pyCOLA: ``configured`` (simulation.pycola_python) or the
    default environment's ``bin/python``."""
    if configured:
        return Path(configured).expanduser()
    return default_environment() / "bin" / "python"


def _clean_environment(threads: int | None = None) -> dict:
    """The process environment for pyCOLA's interpreter, without our Python search paths."""
    env = {key: value for key, value in os.environ.items()
           if key not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


@functools.lru_cache(maxsize=None)
def _probe(python: str) -> tuple[tuple[str, str], ...]:
    completed = subprocess.run([python, str(WORKER), "probe"], capture_output=True, text=True,
                               env=_clean_environment(), timeout=300, check=False)
    if completed.returncode != 0:
        lines = (completed.stderr or completed.stdout).strip().splitlines()
        raise RuntimeError(lines[-1] if lines else f"exit status {completed.returncode}")
    return tuple(json.loads(completed.stdout.strip().splitlines()[-1]).items())


def check_environment(configured: str | os.PathLike | None = None) -> dict:
    """Versions in pyCOLA's environment ({'pycola3', 'numpy', 'python'}), checked once per
    interpreter and process; PipelineError naming the backend and the set-up command if the
    interpreter is missing or cannot import pycola3 under numpy<2."""
    python = environment_python(configured)
    where = ("simulation.pycola_python" if configured
             else f"the default environment {python.parent.parent}")
    advice = (f"create it with `{SETUP_COMMAND}` (or set simulation.pycola_python to the "
              f"interpreter of an environment with numpy<2 and pycola3=={PYCOLA_VERSION})")
    if not python.is_file():
        raise PipelineError(f"Simulation backend 'pycola' needs pyCOLA's own Python environment, "
                            f"but {python} ({where}) does not exist; {advice}.")
    try:
        versions = dict(_probe(str(python)))
    except (RuntimeError, OSError, subprocess.TimeoutExpired, ValueError) as error:
        raise PipelineError(f"Simulation backend 'pycola' cannot import pycola3 with {python} "
                            f"({where}): {error}; {advice}.") from None
    if versions["numpy"].split(".")[0] != "1":
        raise PipelineError(f"Simulation backend 'pycola': {python} has numpy {versions['numpy']}, "
                            f"but pycola3 fails under NumPy 2; {advice}.")
    return versions


def setup_environment(prefix: str | os.PathLike | None = None,
                      base_python: str | os.PathLike | None = None) -> Path:
    """Create (or complete) pyCOLA's virtual environment and return its interpreter.

    prefix: the environment's directory (default :func:`default_environment`); base_python:
    the interpreter to make it from (default this one; numpy<2 has wheels for Python <= 3.12).
    Idempotent: an environment that already imports pycola3 is left alone. Needs network
    access to PyPI and a C compiler with OpenMP (pycola3 is built from its sdist, ~30 s).
    """
    prefix = Path(prefix).expanduser() if prefix else default_environment()
    python = prefix / "bin" / "python"
    try:
        versions = check_environment(python)
        logger.info("pyCOLA environment %s is ready (%s)", prefix, versions)
        return python
    except PipelineError:
        pass
    base = str(base_python or sys.executable)
    run = functools.partial(subprocess.run, check=True, env=_clean_environment())
    logger.info("creating pyCOLA's environment in %s from %s", prefix, base)
    run([base, "-m", "venv", str(prefix)])
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
    run(pip + ["--upgrade", "pip"])
    run(pip + list(ENVIRONMENT_REQUIREMENTS))
    run(pip + ["--no-build-isolation", f"pycola3=={PYCOLA_VERSION}"])
    _probe.cache_clear()
    logger.info("pyCOLA environment %s is ready (%s)", prefix, check_environment(python))
    return python


# --------------------------------------------------------------------------------------------
# Running pyCOLA


def check_arguments(cola: bool, stepping: str, n_particles: int, mesh_factor: int,
                    threads: int, a_init: float) -> None:
    """PipelineError naming the first setting pyCOLA cannot take (module docstring)."""
    n_mesh = mesh_factor * n_particles
    checks = [
        (cola, f"cola = {cola!r}", "true (pyCOLA has no plain PM mode)"),
        (stepping == "linear_a", f"stepping = {stepping!r}",
         "'linear_a' (pyCOLA's steps are uniform in a)"),
        (n_mesh <= MAX_MESH, f"mesh_factor = {mesh_factor} with n_particles = {n_particles}",
         f"at most {MAX_MESH} mesh cells per side (pyCOLA indexes past a larger mesh)"),
        (n_particles >= MIN_PLANES_PER_THREAD * threads,
         f"threads = {threads} with n_particles = {n_particles}",
         f"at most n_particles / {MIN_PLANES_PER_THREAD} threads (pyCOLA's OpenMP chunks)"),
        (a_init >= MIN_A_INITIAL, f"z_init = {1 / a_init - 1:g}",
         f"at most {1 / MIN_A_INITIAL - 1:g} (pyCOLA tabulates growth from a = {MIN_A_INITIAL})"),
    ]
    for ok, setting, expected in checks:
        if not ok:
            raise PipelineError(f"Simulation backend 'pycola' cannot take {setting}; it needs "
                                f"{expected}.")
    if mesh_factor > 1:
        _warn_lattice_on_nodes(mesh_factor)


@functools.lru_cache(maxsize=None)
def _warn_lattice_on_nodes(mesh_factor: int) -> None:
    logger.warning(
        "pyCOLA with mesh_factor %d starts its particles on mesh nodes, where its force pushes "
        "them off: where initial displacements are small against the mesh spacing its large "
        "scales fall below linear growth (with 2 Mpc/h between particles 18%% less power than "
        "ours on the largest scale in 128 Mpc/h, 14-26%% less at every k in 64 Mpc/h; no "
        "growth with 16 Mpc/h; docs/stage-reference.md, 'The pyCOLA backend'); mesh_factor 1 avoids it",
        mesh_factor)


def steps_to_outputs(steps: Sequence[float], a_outputs: Sequence[float]) -> list[int]:
    """Number of our step boundaries from a_init to each output (``steps`` from
    :func:`simulations.cola.time_steps`): each pyCOLA run to an output takes that many."""
    positions = {float(a): index for index, a in enumerate(steps)}
    return [positions[float(a)] for a in a_outputs]


def run_pycola(ic_path: str | os.PathLike, result_path: str | os.PathLike, sim_id: int,
               a_outputs: Sequence[float], n_steps: Sequence[int], n_cola: float,
               mesh_factor: int, threads: int, python: str | os.PathLike | None = None) -> dict:
    """Evolve ``ic_path`` with pyCOLA's evolve() to each scale factor in ``a_outputs``, taking
    ``n_steps[i]`` steps from a_init to ``a_outputs[i]``, and write the particles to
    ``result_path`` (HDF5: positions, velocities (n_outputs, N^3, 3) float32, Mpc/h and km/s).

    One evolve() per output, each from a_init: evolve() starts only from LPT displacement
    fields (with zero COLA residual velocity), so it cannot continue from an earlier output.
    Returns the worker's statistics (evolve seconds per output, peak and baseline resident
    memory in bytes). Raises PipelineError naming the simulation if pyCOLA fails or dies.
    """
    python = environment_python(python)
    result_path = Path(result_path)
    request = result_path.with_suffix(".json")
    request.write_text(json.dumps({
        "ic": str(Path(ic_path).resolve()), "result": str(result_path.resolve()),
        "a_outputs": [float(a) for a in a_outputs], "n_steps": [int(n) for n in n_steps],
        "n_cola": float(n_cola), "mesh_factor": int(mesh_factor), "threads": int(threads),
    }), encoding="utf-8")
    tail: collections.deque[str] = collections.deque(maxlen=8)
    stats: dict = {}
    with subprocess.Popen([str(python), str(WORKER), "run", str(request)], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True,
                          env=_clean_environment(threads)) as process:
        try:
            for line in process.stdout:
                line = line.rstrip()
                if line.startswith(_STATS_PREFIX):
                    stats = json.loads(line[len(_STATS_PREFIX):])
                    continue
                tail.append(line)
                # pyCOLA prints every kick and drift; our worker's own lines are the summary
                level = logging.INFO if line.startswith("pycola_worker") else logging.DEBUG
                logger.log(level, "sim %d: pycola: %s", sim_id, line)
        except BaseException:  # interrupted: do not leave pyCOLA running
            process.kill()
            raise
        status = process.wait()
    if status != 0 or not result_path.is_file():
        if status < 0:
            try:
                how = f"was killed by signal {signal.Signals(-status).name}"
            except ValueError:
                how = f"was killed by signal {-status}"
        else:
            how = f"exited with status {status}"
        last = " | ".join(line for line in tail if line.strip())
        raise PipelineError(
            f"pyCOLA (simulation backend 'pycola', {python}) {how} while evolving simulation "
            f"{sim_id} from {ic_path}; no snapshot was written" + (f" (last output: {last})"
                                                                  if last else "") + ".")
    return stats


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m simulations.pycola_backend",
        description="pyCOLA's own environment for simulation.backend: pycola.")
    commands = parser.add_subparsers(dest="command", required=True)
    setup = commands.add_parser("setup", help="create the environment (numpy<2, pycola3)")
    setup.add_argument("--prefix", help=f"directory (default {default_environment()})")
    setup.add_argument("--python", help="interpreter to base it on (default this one)")
    check = commands.add_parser("check", help="print the versions in an environment")
    check.add_argument("--python", help="its interpreter (default the default environment's)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        if args.command == "setup":
            print(setup_environment(args.prefix, args.python))
        else:
            print(json.dumps(check_environment(args.python)))
    except (PipelineError, subprocess.CalledProcessError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main())
