"""Training stage: the CosmoFlow networks trained synchronously over MPI ranks.

Modules: ``models`` (the two networks), ``flops`` (analytic parameter and FLOP counts),
``pipeline`` (tf.data input: shuffle-then-shard, normalisation, augmentation), ``optimizers``
(Adam/SGD with LARC, warm-up + polynomial decay), ``mpi`` (the MPI world, launch check, abort
on failure; no TensorFlow), ``distributed`` (gradient allreduce inside ``train_step``,
broadcasts, metric averaging), ``checkpoints`` (atomic, resumable state), ``settings`` (the
``training`` config section), ``validation`` (per-parameter MSE against the
predict-the-training-mean baseline), ``run`` (:func:`train_network`) and ``jobs`` (the ``train``
stage's job).

Outputs, in the run's ``training/`` directory: ``checkpoints/``, ``model.keras``,
``history.csv``, ``tensorboard/``, ``run.json`` (see :mod:`training.run`).
"""

import os

# TensorFlow turns its oneDNN kernels on by default only on CPUs with AVX512_VNNI, AVX512_BF16
# or AMX (TensorFlow 2.9 release notes); elsewhere (plain AVX2 or AVX-512) Conv3D and its
# gradients run on Eigen kernels: the paper network at 128^3 trains at 14 Gflop/s without oneDNN
# and 82 with it on 2 AVX2 cores of an AMD EPYC (bench/training.py). TensorFlow reads the
# variable when it is imported, so it is set here, before any training module imports
# TensorFlow; export TF_ENABLE_ONEDNN_OPTS=0 to opt out. run.json records whether oneDNN was on
# ("threads": {"onednn": ...}).
os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "1")
