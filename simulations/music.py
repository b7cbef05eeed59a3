"""MUSIC (Hahn & Abel 2011, MNRAS 415, 2101) as the initial-conditions backend ``music``.

The CosmoFlow ensemble was started from MUSIC 2LPT initial conditions. This module writes a
unigrid MUSIC configuration, runs the real executable (MUSIC or MUSIC2, `generic` HDF5 output)
and converts its output into our ``ic.h5`` (see :mod:`simulations.initial_conditions`), so
that everything downstream is identical for both backends.

MUSIC's `generic` output holds, per refinement level NNN, datasets ``level_NNN_DM_{dx,dy,dz,
vx,vy,vz,rho}`` (float64, (n + 8)^3 with 4 ghost cells per side, index [ix, iy, iz]):
displacements in units of the box length (particle (i, j, k) at ((i + 1/2)/n + dx) L),
velocities in units of the box length (v [km/s] = value * L [Mpc/h]) and the linear density
contrast at z_start. The displacement is the total 1LPT + 2LPT one; the first-order part is
recovered from the density (psi1_k = i k delta_k / k^2) and psi2 is the remainder.

Outputs (run directory): ``sims/<sim_id>/music.conf`` (the configuration),
``sims/<sim_id>/music.log`` (MUSIC's stdout and stderr) and ``sims/<sim_id>/ic.h5``.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import h5py
import numpy as np
import scipy.fft

from simulations.cosmology import Background, Cosmology
from simulations.initial_conditions import (
    LPT_ORDERS,
    InitialConditions,
    check_ic_arguments,
    growth_attributes,
    write_initial_conditions,
    zeldovich_displacement,
)
from workflow.errors import PipelineError
from workflow.io import atomic_write_text
from workflow.version import CODE_VERSION

log = logging.getLogger(__name__)

MUSIC_TRANSFER = {"eisenstein_hu": "eisenstein"}  # our transfer -> MUSIC's plug-in
_GHOST_CELLS = 4
_GENERIC_OUTPUT = "music_generic.hdf5"
_MAX_SEED = 2**31 - 1


def _levelmax(n_particles: int) -> int:
    level = int(n_particles).bit_length() - 1
    if n_particles < 4 or n_particles != 2**level:
        raise PipelineError(f"MUSIC needs n_particles to be a power of two >= 4 (levelmin = "
                            f"levelmax = log2 N); got n_particles = {n_particles}.")
    return level


def write_music_conf(
    path: str | Path,
    cosmo: Cosmology,
    box_size: float,
    n_particles: int,
    z_init: float,
    seed: int,
    lpt_order: int,
    output_file: str,
) -> Path:
    """Write a unigrid MUSIC configuration file for one simulation (atomically).

    box_size in Mpc/h; n_particles per side, a power of two (levelmin = levelmax = log2 N);
    seed: MUSIC's ``seed[levelmin]``, in [1, 2^31 - 1]; lpt_order 2 sets ``use_2LPT = yes``;
    output_file: MUSIC's ``[output] filename`` (generic HDF5), relative to where MUSIC runs.
    Radiation is switched off (``ZeroRadiation``) and neutrinos are massless, matching
    :class:`simulations.cosmology.Background`.
    """
    level = _levelmax(n_particles)
    if cosmo.transfer not in MUSIC_TRANSFER:
        raise PipelineError(f"MUSIC backend: transfer = {cosmo.transfer!r} has no MUSIC "
                            f"equivalent; use one of {', '.join(MUSIC_TRANSFER)}.")
    if not 1 <= int(seed) <= _MAX_SEED:
        raise PipelineError(f"MUSIC backend: seed = {seed!r} must be in [1, {_MAX_SEED}].")
    if lpt_order not in LPT_ORDERS:
        raise PipelineError(f"MUSIC backend: lpt_order = {lpt_order!r} must be one of "
                            f"{', '.join(map(str, LPT_ORDERS))}.")
    if not (box_size > 0 and z_init > 0):
        raise PipelineError(f"MUSIC backend: box_size = {box_size!r} and z_init = {z_init!r} "
                            f"must both be positive.")
    text = f"""\
# MUSIC configuration written by cosmoflow {CODE_VERSION}: unigrid {n_particles}^3 particles,
# {box_size!r} Mpc/h box, z_start = {z_init!r}, generic HDF5 output.
[setup]
boxlength       = {box_size!r}
zstart          = {z_init!r}
levelmin        = {level}
levelmin_TF     = {level}
levelmax        = {level}
padding         = 8
overlap         = 4
ref_center      = 0.5, 0.5, 0.5
ref_extent      = 0.2, 0.2, 0.2
align_top       = no
baryons         = no
use_2LPT        = {"yes" if lpt_order == 2 else "no"}
use_LLA         = no

[cosmology]
Omega_m         = {cosmo.Omega_m!r}
Omega_L         = {cosmo.Omega_L!r}
Omega_b         = {cosmo.Omega_b!r}
H0              = {100.0 * cosmo.h!r}
sigma_8         = {cosmo.sigma_8!r}
nspec           = {cosmo.n_s!r}
Tcmb            = {cosmo.T_cmb!r}
w_0             = -1.0
w_a             = 0.0
transfer        = {MUSIC_TRANSFER[cosmo.transfer]}
m_nu1           = 0.0
ZeroRadiation   = true

[random]
generator       = MUSIC
{f'seed[{level}]':<16}= {int(seed)}
disk_cached     = no

[output]
format          = generic
filename        = {output_file}

[poisson]
fft_fine        = yes
accuracy        = 1e-5
grad_order      = 6
laplace_order   = 6
"""
    atomic_write_text(path, text)
    return Path(path)


def read_music_generic(hdf5_path: str | Path, box_size: float) -> dict[str, np.ndarray]:
    """Fields of a unigrid MUSIC `generic` HDF5 file in our layout and units.

    box_size: the run's box length in Mpc/h (the file does not record it). Returns float32
    arrays ``psi1``, ``psi2`` (Mpc/h) and ``velocity`` (km/s), shape (3, N, N, N) indexed
    [component, ix, iy, iz], for level ``levelmax`` with the ghost cells removed.
    """
    path = Path(hdf5_path)
    if not path.is_file():
        raise PipelineError(f"MUSIC output {path} does not exist.")
    try:
        with h5py.File(path, "r") as handle:
            if "header" not in handle or "levelmax" not in handle["header"].attrs:
                raise PipelineError(f"MUSIC output {path} has no header/levelmax attribute; "
                                    f"expected MUSIC's generic HDF5 format.")
            header = handle["header"]
            level = int(header.attrs["levelmax"])
            if int(header.attrs.get("levelmin", level)) != level:
                raise PipelineError(
                    f"MUSIC output {path} is a zoom (levelmin = {header.attrs['levelmin']}, "
                    f"levelmax = {level}); only unigrid runs are supported.")
            n = 2**level
            lengths = [int(header[f"grid_len_{axis}"][-1]) for axis in "xyz"
                       if f"grid_len_{axis}" in header]
            if lengths and lengths != [n, n, n]:
                raise PipelineError(f"MUSIC output {path}: grid lengths {lengths} at level "
                                    f"{level} do not cover the box ({n}^3).")
            interior = slice(_GHOST_CELLS, _GHOST_CELLS + n)

            def field(name: str) -> np.ndarray:
                key = f"level_{level:03d}_DM_{name}"
                if key not in handle:
                    raise PipelineError(f"MUSIC output {path} lacks dataset {key}.")
                if handle[key].shape != (n + 2 * _GHOST_CELLS,) * 3:
                    raise PipelineError(
                        f"MUSIC output {path}: dataset {key} has shape {handle[key].shape}; "
                        f"expected {(n + 2 * _GHOST_CELLS,) * 3}.")
                return handle[key][interior, interior, interior]

            total = box_size * np.stack([field(f"d{axis}") for axis in "xyz"])
            velocity = box_size * np.stack([field(f"v{axis}") for axis in "xyz"])
            density = field("rho")
    except OSError as error:
        raise PipelineError(f"MUSIC output {path} is not a readable HDF5 file: {error}.") \
            from error

    psi1 = zeldovich_displacement(scipy.fft.rfftn(density), box_size)
    return {"psi1": psi1.astype(np.float32), "psi2": (total - psi1).astype(np.float32),
            "velocity": velocity.astype(np.float32)}


def run_music(executable: str | os.PathLike, conf_path: str | Path, workdir: str | Path,
              log_path: str | Path) -> Path:
    """Run ``executable conf_path`` in ``workdir``; return ``log_path``, its stdout and stderr.

    Raises PipelineError when the executable is missing or not executable, or when MUSIC exits
    with a non-zero status.
    """
    found = shutil.which(str(executable))
    if found is None:
        reason = ("is not executable" if Path(executable).is_file()
                  else "was not found (neither a file nor a command on PATH)")
        raise PipelineError(f"MUSIC executable {str(executable)!r} {reason}; set the path of "
                            f"the MUSIC binary or use the native initial-conditions backend.")
    workdir = Path(workdir)
    log_path = Path(log_path)
    log.info("running %s %s in %s (log %s)", found, conf_path, workdir, log_path)
    with open(log_path, "w", encoding="utf-8") as log_file:
        completed = subprocess.run([found, str(Path(conf_path).resolve())], cwd=workdir,
                                   stdout=log_file, stderr=subprocess.STDOUT, check=False)
    if completed.returncode != 0:
        tail = log_path.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-5:]
        raise PipelineError(
            f"MUSIC ({found}) exited with status {completed.returncode} for {conf_path}; see "
            f"{log_path}" + (f" (last lines: {' | '.join(tail)})" if tail else "") + ".")
    return log_path


def music_initial_conditions(
    out_path: str | Path,
    conf_path: str | Path,
    log_path: str | Path,
    executable: str | os.PathLike,
    cosmo: Cosmology,
    n_particles: int,
    box_size: float,
    z_init: float,
    seed: int,
    sim_id: int,
    lpt_order: int,
    provenance: str = "",
) -> InitialConditions:
    """Run MUSIC for one simulation and write its initial conditions to ``out_path`` (ic.h5).

    The configuration MUSIC reads is kept as ``conf_path`` and its output as ``log_path``;
    MUSIC's own HDF5 file lives in a temporary directory beside ``out_path`` and is removed
    after conversion. Growth factors in the attributes are ours (MUSIC's D+ agrees to 1e-6).
    """
    check_ic_arguments(n_particles, box_size, z_init, seed, sim_id, lpt_order)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    conf_path = write_music_conf(conf_path, cosmo, box_size,
                                 n_particles, z_init, seed, lpt_order, _GENERIC_OUTPUT)
    with tempfile.TemporaryDirectory(dir=out_path.parent, prefix=".music-") as workdir:
        run_music(executable, conf_path, workdir, log_path)
        fields = read_music_generic(Path(workdir) / _GENERIC_OUTPUT, box_size)
    ic = InitialConditions(
        **fields, cosmology=cosmo, box_size=float(box_size), z_init=float(z_init),
        seed=int(seed), sim_id=int(sim_id), lpt_order=int(lpt_order), fixed_amplitude=False,
        phase_flip=False, backend="music",
        **growth_attributes(Background(cosmo), 1.0 / (1.0 + z_init)))
    write_initial_conditions(out_path, ic, provenance)
    return ic
