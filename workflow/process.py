"""Process-wide settings of the pipeline's programs, in one place.

Some libraries read environment variables once, when they are loaded: TensorFlow reads
``TF_ENABLE_ONEDNN_OPTS`` and ``TF_CPP_MIN_LOG_LEVEL`` at ``import tensorflow``, libgomp reads
``GOMP_SPINCOUNT`` when numba's first parallel loop loads it. So each entry point (the
``cosmoflow`` command, the Parsl workers through ``worker_init``, the scripts in ``bench/`` and
the tests' MPI script) calls :func:`configure_process` first, before anything imports those
libraries; no library module sets process state when it is imported. A value the user exported
is kept. Subprocesses inherit them (the pyCOLA worker's OpenMP included).
"""

from __future__ import annotations

import os
import shlex

PROCESS_ENVIRONMENT = {
    # TensorFlow turns its oneDNN kernels on by default only on CPUs with AVX512_VNNI,
    # AVX512_BF16 or AMX (TensorFlow 2.9 release notes); elsewhere (plain AVX2 or AVX-512)
    # Conv3D and its gradients run on Eigen kernels: the paper network at 128^3 trains at
    # 14 Gflop/s without oneDNN and 82 with it on 2 AVX2 cores of an AMD EPYC
    # (bench/training_throughput.py). Export TF_ENABLE_ONEDNN_OPTS=0 to opt out; run.json
    # records whether oneDNN was on ("threads": {"onednn": ...}).
    "TF_ENABLE_ONEDNN_OPTS": "1",
    # numba runs parallel loops on OpenMP threads, which libgomp lets spin for 300,000 pauses
    # after each loop, so that they take cores from the scipy.fft threads that follow a painting
    # or a Poisson kernel. A tenth of that made a COLA step ~7% faster on a 2-core AMD EPYC.
    # (Passive waiting gains as much but makes scikit-learn's short OpenMP loops ~10x slower in
    # the same process.)
    "GOMP_SPINCOUNT": "30000",
    # TensorFlow's C++ messages up to ERROR are dropped (e.g. "failed call to cuInit" on machines
    # without a GPU, Grappler's "remapper failed" notes); FATAL still shows. Export
    # TF_CPP_MIN_LOG_LEVEL=0 to see them all (workflow.logs.quiet_tensorflow).
    "TF_CPP_MIN_LOG_LEVEL": "3",
}


def configure_process() -> None:
    """Set :data:`PROCESS_ENVIRONMENT` in this process, keeping any value already exported.

    Call it at a program's entry, before TensorFlow or numba is imported."""
    for variable, value in PROCESS_ENVIRONMENT.items():
        os.environ.setdefault(variable, value)


def shell_exports() -> str:
    """The same settings as ``export`` lines for a shell that starts a worker (Parsl's
    ``worker_init``), with this process's values where it has them."""
    return "".join(f"export {variable}={shlex.quote(os.environ.get(variable, value))}\n"
                   for variable, value in PROCESS_ENVIRONMENT.items())
