"""Benchmark of the COLA solver: step time over its FFT floor and over pyCOLA, memory, a tiny run.

    python bench/cola.py [--threads 2] [--particles 128] [--repeats 5] [--pycola-repeats 3]
                         [--quick]

About a minute on 2 cores; ``--quick`` (32^3 particles, fewest repeats) about 20 s, to check
that it runs. pyCOLA (PyPI pycola3 0.0.7) runs in its own environment (python -m
simulations.pycola_backend setup), on the same initial conditions (``--particles``^3, 4 Mpc/h
apart), the same mesh (twice as fine) and the same threads.

Figures (last output line, one JSON object):
  step_over_fft        time of one COLA step (128^3 particles by default, 256^3 mesh,
                       finite-difference gradient) over the FFTs such a step must do (one
                       rfftn and one irfftn of the mesh, scipy.fft, same threads). Goal <= 2.0.
  naive_step_over_fft  the same ratio for a direct numpy step (np.add.at painting, fancy-index
                       readout, broadcast Fourier kernels with an i k gradient, scipy.fft).
  bytes_per_particle   peak resident memory of a run_simulation call on these IC above the
                       interpreter's baseline after imports (measured in a subprocess), per
                       particle, meshes included. Goal <= 160.
  tiny_sim_s           wall time of run_simulation for the tiny default (64^3 particles,
                       128 Mpc/h, mesh factor 2, 10 COLA steps, z = 20 -> 0), IC excluded.
  step_over_pycola     our time per COLA step over pyCOLA's, measured alike: runs of 2 and of
                       10 steps of the same size, interleaved, best of --pycola-repeats each,
                       the difference over 8 steps, so set-up and I/O cancel. Goal <= 0.5.
  step_cpu_over_pycola the same ratio in CPU seconds of all threads (less sensitive to other
                       work on a shared machine than wall time).
  pycola_bytes_per_particle  peak resident memory of pyCOLA's process above its baseline after
                       imports (reading the IC, evolve() and its meshes), per particle.
                       Goal: bytes_per_particle <= this.
Also printed: the time of each part of a step (painting, the two FFTs, the Poisson kernel, the
gradient readout, a kick, a drift), the minor page faults per step (memory a step gets afresh
from the kernel; 0 when the meshes are reused), and the extrapolation to the paper preset
(512^3 particles on a 1024^3 mesh).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from workflow.process import configure_process

configure_process()  # first: numba's OpenMP reads these settings when it loads

import numba
import numpy as np
import scipy.fft

from machine import cpu_line
from quick_mode import parse_arguments
from simulations import cola, mesh, pycola_backend
from simulations.cosmology import Background, Cosmology
from simulations.initial_conditions import generate_initial_conditions, read_initial_conditions
from workflow.config import validate_config

DEFAULTS = validate_config({})
COSMOLOGY = Cosmology(Omega_m=0.3, sigma_8=0.8, n_s=0.96, **DEFAULTS["cosmology"])
Z_INIT = 20.0
SPACING, MESH_FACTOR = 4.0, 2  # the benchmark's problem: Mpc/h between particles, mesh cells
TINY = {"n_particles": 64, "box_size": 128.0, "mesh_factor": 2, "n_steps": 10}
SOLVER = {key: DEFAULTS["simulation"][key]
          for key in ("stepping", "cola", "n_cola", "mesh_factor", "backend")}
"""run_simulation's settings by default, as the simulate job passes them from the configuration."""
PAPER = {"n_particles": 512, "n_mesh": 1024, "n_steps": 10}


def fft_floor(n_mesh: int, threads: int) -> float:
    """Seconds for one rfftn and one irfftn of a float32 n_mesh^3 field (scipy.fft)."""
    field = np.random.default_rng(0).random((n_mesh,) * 3, dtype=np.float32)
    started = time.perf_counter()
    spectrum = scipy.fft.rfftn(field, workers=threads)
    scipy.fft.irfftn(spectrum, s=field.shape, workers=threads)
    return time.perf_counter() - started


def solver_step(integrator: cola.Integrator, state: cola.ParticleState, a_to: float) -> float:
    """Seconds for one kick-drift-kick step of ``state`` to ``a_to`` (linear in a)."""
    a_from = state.a_positions
    started = time.perf_counter()
    for action, start, end in list(cola.leapfrog(np.array([a_from, a_to]), "linear_a"))[1:]:
        getattr(integrator, action)(state, start, end)
    return time.perf_counter() - started


def step_parts(integrator: cola.Integrator, state: cola.ParticleState, repeats: int) -> dict:
    """Seconds (best of ``repeats``) of each part of a step: the PM force's, in the order
    ParticleMeshForce runs them, then one kick and one drift (of zero length: the same work), so
    that a CPU on which the step is slow shows where. ``state`` must be synchronous."""
    force, grid, a = integrator.pm_force, integrator.pm_force.density, state.a_positions
    parts = {
        "paint": lambda: mesh.paint_cic(state.positions, force.box_size, force.n_mesh,
                                        out=grid.real),
        "fft_forward": grid.forward,
        "poisson": lambda: mesh.inverse_laplacian(grid.fourier, force.box_size,
                                                  force.poisson_factor),
        "fft_inverse": grid.inverse,
        "readout": lambda: mesh.readout_gradient_fd4(grid.real, state.positions, force.box_size,
                                                     out=state.force),
        "kick": lambda: integrator.kick(state, a, a),
        "drift": lambda: integrator.drift(state, a, a),
    }
    times = {name: [] for name in parts}
    for _ in range(repeats):
        for name, part in parts.items():
            started = time.perf_counter()
            part()
            times[name].append(time.perf_counter() - started)
    return {name: min(values) for name, values in times.items()}


def naive_step(positions, momentum, psi1, psi2, box_size, n_mesh, threads) -> float:
    """Seconds for a direct numpy COLA-like step: paint, FFTs, kernels, readout, kick, drift."""
    started = time.perf_counter()
    cells = n_mesh / box_size
    u = positions * cells - 0.5
    lower = np.floor(u)
    weight_upper = (u - lower).astype(np.float32)
    index = lower.astype(np.int64) % n_mesh
    upper = (index + 1) % n_mesh
    corners = [(ci, cj, cl) for ci in (0, 1) for cj in (0, 1) for cl in (0, 1)]

    def corner(c):
        idx = tuple(np.where(c[d], upper[:, d], index[:, d]) for d in range(3))
        w = np.prod([np.where(c[d], weight_upper[:, d], 1 - weight_upper[:, d])
                     for d in range(3)], axis=0)
        return idx, w

    density = np.zeros((n_mesh,) * 3, np.float32)
    for c in corners:
        idx, w = corner(c)
        np.add.at(density, idx, w)
    spectrum = scipy.fft.rfftn(density, workers=threads)
    k = 2 * np.pi / box_size * np.fft.fftfreq(n_mesh, 1.0 / n_mesh)
    k_last = 2 * np.pi / box_size * np.arange(n_mesh // 2 + 1)
    k2 = k[:, None, None] ** 2 + k[None, :, None] ** 2 + k_last[None, None, :] ** 2
    k2[0, 0, 0] = 1.0
    spectrum *= 1.5 * 0.3 * n_mesh**3 / len(positions) / k2
    spectrum[0, 0, 0] = 0.0
    force = np.zeros_like(positions)
    for axis, k_axis in enumerate((k[:, None, None], k[None, :, None], k_last[None, None, :])):
        component = scipy.fft.irfftn(1j * k_axis * spectrum, s=density.shape, workers=threads)
        for c in corners:
            idx, w = corner(c)
            force[:, axis] += w * component[idx]
    momentum += 0.01 * force + 0.001 * psi1 + 0.001 * psi2
    positions += 0.01 * momentum + 0.001 * psi1 + 0.001 * psi2
    np.mod(positions, box_size, out=positions)
    return time.perf_counter() - started


def make_ic(directory: Path, n_particles: int, box_size: float) -> Path:
    path = directory / f"ic_{n_particles}.h5"
    generate_initial_conditions(path, COSMOLOGY, n_particles, box_size, Z_INIT, seed=1,
                                sim_id=0, lpt_order=2, fixed_amplitude=True, phase_flip=False)
    return path


def step_ratios(ic_path: Path, threads: int, repeats: int) -> dict:
    """Interleaved timings of solver steps, a naive step and the FFT floor (seconds, best)."""
    ic = read_initial_conditions(ic_path)
    background = Background(ic.cosmology)
    n_mesh = MESH_FACTOR * ic.n_particles
    integrator, state = cola.setup_solver(cola.load_particles(ic), background, ic.a_init,
                                          ic.box_size, SOLVER["cola"], SOLVER["n_cola"],
                                          MESH_FACTOR, threads)
    integrator.force(state, ic.a_init, ic.a_init)
    naive = [array.copy() for array in cola.load_particles(ic)]
    times = {"fft": [], "naive": [], "step": []}
    faults = 0  # minor page faults in our steps: memory that a step gets afresh from the kernel
    a_steps = np.linspace(ic.a_init, 1.0, 11)  # steps of the 10-step run, repeats <= 10
    for repeat in range(repeats):
        times["fft"].append(fft_floor(n_mesh, threads))
        faults -= resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        times["step"].append(solver_step(integrator, state, a_steps[repeat + 1]))
        faults += resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        times["naive"].append(naive_step(naive[0], naive[1], naive[2], naive[3],
                                         ic.box_size, n_mesh, threads))
    best = {name: min(values) for name, values in times.items()}
    print(f"{ic.n_particles}^3 particles on a {n_mesh}^3 mesh, {threads} thread(s), best of "
          f"{repeats}: FFT floor {best['fft']:.3f} s, COLA step {best['step']:.3f} s, "
          f"naive numpy step {best['naive']:.3f} s")
    print(f"  medians: FFT {statistics.median(times['fft']):.3f} s, COLA step "
          f"{statistics.median(times['step']):.3f} s; page faults per COLA step "
          f"{faults / repeats:.0f}")
    parts = step_parts(integrator, state, repeats)
    print("  parts of a step (a force, two kicks, a drift), ms: "
          + ", ".join(f"{name} {1e3 * seconds:.1f}" for name, seconds in parts.items()))
    return best


def memory_probe(ic_path: str, threads: int) -> None:
    """(Subprocess) print the peak RSS of one short run above the post-import baseline."""
    with tempfile.TemporaryDirectory() as tmp:
        warm = make_ic(Path(tmp), 8, 64.0)  # compile/load every kernel before the baseline
        cola.run_simulation(warm, Path(tmp) / "warm.h5", [0.0], 2, threads=threads, **SOLVER)
        baseline = _proc_status("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        cola.run_simulation(ic_path, Path(tmp) / "snapshot.h5", [0.0], 2, threads=threads, **SOLVER)
        peak = _proc_status("VmHWM")
    print(json.dumps({"baseline": baseline, "peak": peak}))


def _proc_status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def peak_memory(ic_path: Path, n_particles: int, threads: int) -> float:
    result = subprocess.run(
        [sys.executable, __file__, "--memory-probe", str(ic_path), "--threads", str(threads)],
        capture_output=True, text=True, check=True)
    figures = json.loads(result.stdout.strip().splitlines()[-1])
    per_particle = (figures["peak"] - figures["baseline"]) / n_particles**3
    print(f"peak RSS above baseline: {(figures['peak'] - figures['baseline']) / 2**20:.0f} MiB "
          f"= {per_particle:.1f} B/particle (baseline {figures['baseline'] / 2**20:.0f} MiB)")
    return per_particle


def tiny_simulation(directory: Path, threads: int) -> float:
    ic_path = make_ic(directory, TINY["n_particles"], TINY["box_size"])
    started = time.perf_counter()
    cola.run_simulation(ic_path, directory / "tiny.h5", [0.0], TINY["n_steps"], threads=threads,
                        **(SOLVER | {"mesh_factor": TINY["mesh_factor"]}))
    elapsed = time.perf_counter() - started
    print(f"tiny default simulation ({TINY['n_particles']}^3, {TINY['box_size']:g} Mpc/h, "
          f"{TINY['n_steps']} COLA steps): {elapsed:.2f} s")
    return elapsed


def pycola_figures(ic_path: Path, directory: Path, threads: int, repeats: int) -> dict:
    """Seconds per step of pyCOLA and of ours, measured alike and interleaved on ``ic_path``
    (MESH_FACTOR's mesh), and pyCOLA's peak bytes per particle.

    Both run 2 and 10 steps of the size of the 10-step run (as :func:`step_ratios`), from
    a_init to a_init + n da: pyCOLA's evolve() as timed by its worker, ours as the wall time
    of run_simulation. The set-up (reading the IC; pyCOLA's growth table, smoothing and
    initial positions; writing the snapshot) is the same for both n, so the difference of the
    best times over 8 steps is the time per step. Runs of ~5-30 s each see the machine's load
    alike, where single steps of ours could pick its quiet moments.
    """
    print(f"pyCOLA: {pycola_backend.check_environment()}")
    ic = read_initial_conditions(ic_path)
    a_init, n = ic.a_init, ic.n_particles
    del ic
    step = (1.0 - a_init) / 10
    best = {"pycola": {}, "ours": {}, "pycola_cpu": {}, "ours_cpu": {}}
    peak = 0.0
    for _ in range(repeats):
        for n_steps in (2, 10):
            a_final = min(1.0, a_init + n_steps * step)
            stats = pycola_backend.run_pycola(ic_path, directory / f"pycola_{n_steps}.h5", 0,
                                              [a_final], [n_steps], -2.5, MESH_FACTOR,
                                              threads)
            theirs = stats["evolve_seconds"][0]
            peak = max(peak, (stats["peak_rss_bytes"] - stats["baseline_rss_bytes"]) / n**3)
            started, cpu_started = time.perf_counter(), time.process_time()
            cola.run_simulation(ic_path, directory / f"ours_{n_steps}.h5", [1 / a_final - 1],
                                n_steps, threads=threads, **(SOLVER | {"mesh_factor": MESH_FACTOR}))
            ours = time.perf_counter() - started
            samples = (("pycola", theirs), ("ours", ours),
                       ("pycola_cpu", stats["evolve_cpu_seconds"][0]),
                       ("ours_cpu", time.process_time() - cpu_started))
            for name, seconds in samples:
                best[name][n_steps] = min(best[name].get(n_steps, math.inf), seconds)
            print(f"  {n_steps} steps: pyCOLA evolve() {theirs:.2f} s, our run_simulation "
                  f"{ours:.2f} s")
    per_step = {name: (times[10] - times[2]) / 8 for name, times in best.items()}
    set_up = {name: times[2] - 2 * per_step[name] for name, times in best.items()}
    print(f"{n}^3 particles, {MESH_FACTOR * n}^3 mesh, {threads} threads: pyCOLA "
          f"{per_step['pycola']:.3f} s per step (set-up {set_up['pycola']:.2f} s), ours "
          f"{per_step['ours']:.3f} s per step (set-up {set_up['ours']:.2f} s); pyCOLA's peak "
          f"{peak:.1f} B/particle above its baseline; CPU seconds per step (all threads): pyCOLA "
          f"{per_step['pycola_cpu']:.3f}, ours {per_step['ours_cpu']:.3f}")
    return {"step": per_step["pycola"], "our_step": per_step["ours"], "bytes_per_particle": peak,
            "cpu_step": per_step["pycola_cpu"], "our_cpu_step": per_step["ours_cpu"]}


def paper_extrapolation(best: dict, bytes_per_particle: float, n_particles: int) -> None:
    """Scale the step measured with n_particles^3 to 512^3 particles on 1024^3: particle work
    ~ N, FFTs ~ N log N."""
    volume = (PAPER["n_particles"] / n_particles) ** 3
    log_factor = math.log(PAPER["n_mesh"] ** 3) / math.log((MESH_FACTOR * n_particles) ** 3)
    fft_share = min(best["fft"], best["step"])
    step = volume * (fft_share * log_factor + (best["step"] - fft_share))
    total_hours = step * (PAPER["n_steps"] + 1) / 3600
    memory_gib = bytes_per_particle * PAPER["n_particles"] ** 3 / 2**30
    print(f"paper preset (512^3 particles, 1024^3 mesh, {PAPER['n_steps']} steps) on one node "
          f"with these threads: ~{step:.0f} s per step, ~{total_hours:.2f} h per simulation, "
          f"~{memory_gib:.0f} GiB")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--particles", type=int, default=128,
                        help="particles per side of the benchmark's problem (default 128)")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps, at most 10")
    parser.add_argument("--pycola-repeats", type=int, default=3)
    parser.add_argument("--memory-probe", metavar="IC_PATH", help=argparse.SUPPRESS)
    args = parse_arguments(parser, {"particles": 32, "repeats": 1, "pycola_repeats": 2})
    if not 1 <= args.repeats <= 10:
        parser.error(f"--repeats {args.repeats}: the steps of a 10-step run, 1 to 10")
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    if args.memory_probe:
        memory_probe(args.memory_probe, args.threads)
        return
    print(cpu_line())
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        started = time.perf_counter()
        ic_path = make_ic(directory, args.particles, SPACING * args.particles)
        print(f"{args.particles}^3 initial conditions: {time.perf_counter() - started:.1f} s")
        tiny_s = tiny_simulation(directory, args.threads)  # also compiles the kernels
        best = step_ratios(ic_path, args.threads, args.repeats)
        bytes_per_particle = peak_memory(ic_path, args.particles, args.threads)
        pycola = pycola_figures(ic_path, directory, args.threads, args.pycola_repeats)
    print(f"step / FFT floor: COLA {best['step'] / best['fft']:.2f}, naive "
          f"{best['naive'] / best['fft']:.2f}; step / pyCOLA's step "
          f"{pycola['our_step'] / pycola['step']:.2f}")
    paper_extrapolation(best, bytes_per_particle, args.particles)
    print(json.dumps({
        "step_over_fft": round(best["step"] / best["fft"], 3),
        "naive_step_over_fft": round(best["naive"] / best["fft"], 3),
        "bytes_per_particle": round(bytes_per_particle, 1),
        "tiny_sim_s": round(tiny_s, 3),
        "step_over_pycola": round(pycola["our_step"] / pycola["step"], 3),
        "pycola_bytes_per_particle": round(pycola["bytes_per_particle"], 1),
        "step_cpu_over_pycola": round(pycola["our_cpu_step"] / pycola["cpu_step"], 3),
    }))


if __name__ == "__main__":
    main()
