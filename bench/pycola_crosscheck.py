"""Cross-check of our COLA against the real pyCOLA from the same initial conditions.

    python bench/pycola_crosscheck.py [--threads 2] [--particles 64] [--linear-particles 32]
                                      [--quick]

``--quick`` (16^3 particles in each set-up, about 30 s on 2 cores) checks that it runs; its
figures on so few particles are not the cross-check's.

pyCOLA (PyPI pycola3 0.0.7) runs in its own environment (python -m simulations.pycola_backend
setup). Fixed-amplitude 2LPT initial conditions at z = 20 (Omega_m 0.3, sigma_8 0.8, n_s 0.96),
64^3 particles (``--particles``), 10 COLA steps to z = 0, nCola -2.5. References: our plain PM
with 100 steps (same mesh) and pyCOLA's own 100-step run, and linear theory,
P(k, 0) / P(k, z_init) = [D1(0) / D1(z_init)]^2.

Printed per set-up: rms particle separations over the mean spacing, and per k-bin up to half
the particle Nyquist frequency the ratios of P(k) (CIC on a 2N mesh, deconvolved). Then the
large-scale growth over linear theory in 512 Mpc/h (32^3 particles, ``--linear-particles``) for
mesh factors 1-3. The last line is one JSON object: for each set-up, the positions rms (pyCOLA
vs ours) and the largest departure per bin up to half the particle Nyquist of pyCOLA/ours,
ours/PM100, pyCOLA/PM100 and pyCOLA100/PM100; and the large-scale growth over linear theory.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from workflow.process import configure_process

configure_process()  # first: numba's OpenMP reads these settings when it loads

import h5py
import numpy as np

from quick_mode import parse_arguments
from simulations import cola, mesh, pycola_backend
from simulations.cosmology import Background, Cosmology
from simulations.initial_conditions import generate_initial_conditions, read_initial_conditions
from workflow.config import schema_enum, validate_config

COSMOLOGY = Cosmology(Omega_m=0.3, sigma_8=0.8, n_s=0.96, **validate_config({})["cosmology"])
Z_INIT = 20.0
SETUPS = [  # (Mpc/h between particles, mesh factor)
    (2.0, 2),  # the set-up
    (2.0, 1),
    (1.0, 2),  # the paper's
]
LINEAR_BOX = 512.0
SOLVER = {key: validate_config({})["simulation"][key]
          for key in ("stepping", "cola", "n_cola", "mesh_factor", "backend")}
"""run_simulation's settings by default, as the simulate job passes them from the configuration."""


def make_ic(directory: Path, n: int, box: float) -> Path:
    path = directory / f"ic_{n}_{box:g}.h5"
    if not path.exists():
        generate_initial_conditions(path, COSMOLOGY, n, box, Z_INIT, seed=3, sim_id=3,
                                    lpt_order=2, fixed_amplitude=True, phase_flip=False)
    return path


def positions(ic_path: Path, out: Path, **settings) -> np.ndarray:
    cola.run_simulation(ic_path, out, [0.0], **{"n_steps": 10, **SOLVER, **settings})
    with h5py.File(out, "r") as handle:
        return handle["positions"][0]


def power(x: np.ndarray, box: float, n_mesh: int) -> tuple[np.ndarray, np.ndarray]:
    counts = mesh.paint_cic(np.asarray(x, np.float32), box, n_mesh)
    k, p, _ = mesh.power_spectrum(counts / counts.mean() - 1.0, box, deconvolve_cic=True)
    return k, p


def separation(a: np.ndarray, b: np.ndarray, box: float, n: int) -> float:
    """rms |a - b| (periodic) over the mean particle spacing."""
    d = (a - b + box / 2) % box - box / 2
    return float(np.sqrt(np.mean(np.sum(d.astype(np.float64) ** 2, axis=1))) / (box / n))


def linear_growth() -> float:
    background = Background(COSMOLOGY)
    return float(background.D1(1.0) / background.D1(1 / (1 + Z_INIT))) ** 2


def cross_check(directory: Path, n: int, box: float, factor: int, threads: int) -> dict:
    ic_path = make_ic(directory, n, box)
    common = {"mesh_factor": factor, "threads": threads}
    runs = {
        "ours": positions(ic_path, directory / "ours.h5", **common),
        "pycola": positions(ic_path, directory / "pycola.h5", backend="pycola", **common),
        "pm100": positions(ic_path, directory / "pm100.h5", n_steps=100, cola=False, **common),
        "pycola100": positions(ic_path, directory / "pycola100.h5", n_steps=100,
                               backend="pycola", **common),
    }
    spectra = {name: power(x, box, 2 * n)[1] for name, x in runs.items()}
    k, initial = power(read_initial_conditions(ic_path).positions(), box, 2 * n)
    half = k <= 0.5 * np.pi * n / box
    ratios = {
        "pycola/ours": spectra["pycola"] / spectra["ours"],
        "ours/PM100": spectra["ours"] / spectra["pm100"],
        "pycola/PM100": spectra["pycola"] / spectra["pm100"],
        "pycola100/PM100": spectra["pycola100"] / spectra["pm100"],
        "ours/linear": spectra["ours"] / initial / linear_growth(),
        "pycola/linear": spectra["pycola"] / initial / linear_growth(),
    }
    rms = {
        "pycola-ours": separation(runs["pycola"], runs["ours"], box, n),
        "ours-PM100": separation(runs["ours"], runs["pm100"], box, n),
        "pycola-PM100": separation(runs["pycola"], runs["pm100"], box, n),
        "pycola100-PM100": separation(runs["pycola100"], runs["pm100"], box, n),
    }
    print(f"\n{n}^3 particles, {box:g} Mpc/h ({box / n:g} Mpc/h apart), mesh factor {factor}, "
          f"10 steps z = {Z_INIT:g} -> 0")
    print("rms separation / mean spacing: " + ", ".join(f"{key} {value:.3f}"
                                                       for key, value in rms.items()))
    print("| k [h/Mpc] | " + " | ".join(ratios) + " |")
    print("|---" * (len(ratios) + 1) + "|")
    for i in np.flatnonzero(half):
        print(f"| {k[i]:.3f} | " + " | ".join(f"{r[i]:.3f}" for r in ratios.values()) + " |")
    return {"positions_rms_over_spacing": round(rms["pycola-ours"], 3),
            **{f"max_departure {name}": round(float(np.max(np.abs(r[half] - 1))), 3)
               for name, r in list(ratios.items())[:4]}}


def large_scale_growth(directory: Path, n: int, threads: int) -> dict:
    """P(k) / linear theory at the three largest scales in 512 Mpc/h with n^3 particles, ours
    and pyCOLA's."""
    box = LINEAR_BOX
    ic_path = make_ic(directory, n, box)
    k, initial = power(read_initial_conditions(ic_path).positions(), box, n)
    large = k < 4 * 2 * np.pi / box
    print(f"\n{n}^3 particles in {box:g} Mpc/h: P(k, z = 0) / linear theory at k = "
          + ", ".join(f"{value:.4f}" for value in k[large]) + " h/Mpc")
    figures = {}
    for factor in (1, 2, 3):
        for backend in schema_enum("simulation.backend"):
            x = positions(ic_path, directory / f"linear_{backend}.h5", mesh_factor=factor,
                          backend=backend, threads=threads)
            growth = power(x, box, n)[1][large] / initial[large] / linear_growth()
            print(f"  mesh factor {factor}, {backend:6s}: "
                  + ", ".join(f"{value:.3f}" for value in growth))
            figures[f"{backend} mesh_factor {factor}"] = [round(float(g), 3) for g in growth]
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--particles", type=int, default=64,
                        help="particles per side of the cross-checks (default 64)")
    parser.add_argument("--linear-particles", type=int, default=32,
                        help="particles per side in 512 Mpc/h for the growth (default 32)")
    args = parse_arguments(parser, {"particles": 16, "linear_particles": 16})
    print(f"pyCOLA: {pycola_backend.check_environment()}")
    n, n_linear = args.particles, args.linear_particles
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        for spacing, factor in SETUPS:
            box = spacing * n
            figures[f"{n}^3 {box:g} Mpc/h mesh_factor {factor}"] = cross_check(
                Path(tmp), n, box, factor, args.threads)
        figures[f"large-scale growth / linear, {n_linear}^3 {LINEAR_BOX:g} Mpc/h"] = (
            large_scale_growth(Path(tmp), n_linear, args.threads))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
