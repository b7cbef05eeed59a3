"""Training stage: the CosmoFlow networks trained synchronously over MPI ranks.

Modules: ``models`` (the two networks), ``flops`` (analytic parameter and FLOP counts),
``pipeline`` (tf.data input: shuffle-then-shard, normalisation, augmentation), ``optimizers``
(Adam/SGD with LARC, warm-up + polynomial decay), ``distributed`` (gradient allreduce inside
``train_step``, broadcasts, metric averaging, abort on failure), ``checkpoints`` (atomic,
resumable state), ``settings`` (the ``training`` config section) and ``run`` (:func:`train`).

Outputs, in the run's ``training/`` directory: ``checkpoints/``, ``model.keras``,
``history.csv``, ``tensorboard/``, ``run.json`` (see :mod:`training.run`).
"""
