"""Entry point run by pyCOLA's own interpreter: evolve one ic.h5 with pycola3's ``evolve()``.

This file is executed as a script (``<pycola python> pycola_worker.py ...``) by
:mod:`simulations.pycola_backend`; it imports only numpy, h5py and pycola3, never the
``simulations`` or ``workflow`` packages, because it runs in a separate environment.

Why a separate interpreter: pycola3 0.0.7 (PyPI; Tassev et al. 2015's pyCOLA ported to
Python 3) mixes float64 0-d arrays from its growth interpolation into its float32 particle
arrays; under NumPy 2's promotion rules (NEP 50) those arrays become float64 and its Cython
kernels refuse them ("Buffer dtype mismatch, expected 'float32_t' but got 'double'"). The
pipeline needs NumPy 2 (TensorFlow), so pycola3 lives in an environment with numpy<2 made by
``python -m simulations.pycola_backend setup``; arrays travel through HDF5 files.

The other known defect, the Python-2 style imports inside ``pycola3.ic.ic_2lpt_engine``
(``from acceleration import grad_phi``...), is avoided rather than patched: a full periodic
box is evolved with ``covers_full_box=True``, with which ``evolve()`` never calls that
function (it would only recompute the 2LPT fields we already pass in).

Conventions converted here (ours on the left, see simulations/cola.py):

* pyCOLA takes the 1LPT and 2LPT displacement fields extrapolated to a = 1 with its own growth
  factors: x(a) = q + D(a) s1 + D2(a) s2 with D(1) = 1 from its growth ODE and
  D2 = D^2 (Omega_m(a)/Omega_m)^(-1/143) > 0 (pycola3.growth.growth_2lpt). So
  s1 = psi1 / D(a_i), s2 = psi2 / D2(a_i), which reproduces our initial positions exactly;
  the later LPT frame follows pyCOLA's growth functions, its initial velocities are its own
  2LPT velocities T[D](a_i) s1 + T[D2](a_i) s2 (TZE13 eq. A.1), with zero COLA residual.
* pyCOLA's lattice is q = i L / N, ours is cell-centred, q = (i + 1/2) L / N: positions are
  shifted by half a particle spacing and wrapped into [0, L).
* pyCOLA's velocities are (dx/d eta) / (a H) in Mpc/h; peculiar velocities in km/s are
  v = 100 a E(a) times that, with E(a) = Q(a) / a^3 from pyCOLA's own Q(a).
* pyCOLA reads its thread count from ``multiprocessing.cpu_count()`` inside every kernel
  (ignoring OMP_NUM_THREADS); this process makes that function return ``--threads``.

Usage::

    python pycola_worker.py probe
    python pycola_worker.py run REQUEST.json

``probe`` prints one JSON line (pycola3, numpy and Python versions) or exits non-zero.
``run`` reads a JSON request (ic, result, a_outputs, n_steps, n_cola, mesh_factor,
threads) and writes ``result``, an HDF5 file with ``positions`` and ``velocities`` of shape
(n_outputs, N^3, 3) float32 (Mpc/h in [0, L), km/s; particles in the C order of the lattice)
in the order of ``a_outputs``; its last output line is ``pycola_worker stats: {JSON}`` (seconds
of each evolve(), wall and CPU, resident memory after the imports and at its peak, bytes). One evolve()
from a_init per output: pyCOLA starts only from LPT displacement fields, so it cannot
continue from an earlier output.
"""

import json
import multiprocessing
import sys
import time

import h5py
import numpy as np


def _versions():
    from importlib.metadata import version

    import pycola3.evolve  # noqa: F401  (the function used below must import)

    return {"pycola3": version("pycola3"), "numpy": np.__version__,
            "python": sys.version.split()[0]}


def _memory(key):
    """A /proc/self/status memory figure (VmRSS, VmHWM) in bytes, or None elsewhere."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _set_threads(threads):
    multiprocessing.cpu_count = lambda: threads


def _growth(omega_m):
    """pyCOLA's D(a) (D(1) = 1) and D2(a), as evolve() computes them."""
    from pycola3.growth import growth_2lpt, growth_factor_solution
    from scipy import interpolate

    table = growth_factor_solution(omega_m, 1.0 - omega_m)
    d1 = interpolate.interp1d(table[:, 0].tolist(), table[:, 1].tolist(), kind="linear")

    def d2(a):
        return growth_2lpt(a, d1(a), omega_m)

    return d1, d2


def _run(request):
    from pycola3.evolve import evolve
    from pycola3.growth import _q_factor

    threads = int(request["threads"])
    _set_threads(threads)
    baseline, seconds, cpu_seconds = _memory("VmRSS"), [], []
    with h5py.File(request["ic"], "r") as handle:
        psi1 = handle["psi1"][...]
        psi2 = handle["psi2"][...]
        omega_m = float(handle.attrs["Omega_m"])
        box = float(handle.attrs["box_size"])
        a_init = float(handle.attrs["a_init"])
    n = psi1.shape[1]
    cell = box / n
    mesh_factor = int(request["mesh_factor"])
    d1, d2 = _growth(omega_m)
    s1 = psi1 / np.float32(d1(a_init))
    s2 = psi2 / np.float32(d2(a_init))
    del psi1, psi2
    a_outputs = [float(a) for a in request["a_outputs"]]
    with h5py.File(request["result"], "w") as out:
        shape = (len(a_outputs), n**3, 3)
        positions = out.create_dataset("positions", shape, np.float32)
        velocities = out.create_dataset("velocities", shape, np.float32)
        for index, (a_final, n_steps) in enumerate(zip(a_outputs, request["n_steps"])):
            started, cpu_started = time.perf_counter(), time.process_time()
            # evolve() smooths its input arrays in place: give it fresh float32 copies.
            fields = [np.array(field[axis], dtype=np.float32, order="C", copy=True)
                      for field in (s1, s2) for axis in range(3)]
            result = evolve(
                cell, *fields, covers_full_box=True,
                ngrid_x=mesh_factor * n, ngrid_y=mesh_factor * n, ngrid_z=mesh_factor * n,
                gridcellsize=cell / mesh_factor, Om=omega_m, Ol=1.0 - omega_m,
                a_initial=a_init, a_final=a_final, n_steps=int(n_steps),
                ncola=float(request["n_cola"]), verbose=True)
            del fields
            x = np.stack([component.reshape(-1) for component in result[:3]], axis=1)
            x += np.float32(0.5 * cell)
            x -= np.float32(box) * np.floor(x / np.float32(box))
            x[x >= np.float32(box)] = 0.0  # rounding of values just below L
            positions[index] = x
            del x
            to_km_s = 100.0 * _q_factor(a_final, omega_m, 1.0 - omega_m) / a_final**2
            velocities[index] = np.stack(
                [component.reshape(-1) for component in result[3:6]], axis=1) * np.float32(to_km_s)
            del result
            seconds.append(time.perf_counter() - started)
            cpu_seconds.append(time.process_time() - cpu_started)
            print(f"pycola_worker: evolved to a = {a_final:.6g} in {int(n_steps)} steps, "
                  f"{seconds[-1]:.2f} s", flush=True)
    stats = {"evolve_seconds": seconds, "evolve_cpu_seconds": cpu_seconds,
             "baseline_rss_bytes": baseline,
             "peak_rss_bytes": _memory("VmHWM")}
    print("pycola_worker stats: " + json.dumps(stats), flush=True)


def main(argv):
    if len(argv) == 2 and argv[1] == "probe":
        print(json.dumps(_versions()), flush=True)
        return 0
    if len(argv) == 3 and argv[1] == "run":
        with open(argv[2], encoding="utf-8") as handle:
            _run(json.load(handle))
        return 0
    print("usage: pycola_worker.py probe | run REQUEST.json", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
