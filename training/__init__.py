"""Training stage: the CosmoFlow networks trained synchronously over MPI ranks.

Modules: ``models`` (the two networks), ``layers`` (the leaky ReLU that fuses with its
convolution in training), ``flops`` (analytic parameter and FLOP counts),
``pipeline`` (tf.data input: shuffle-then-shard, normalisation, augmentation), ``optimizers``
(Adam/SGD with LARC, warm-up + polynomial decay), ``mpi`` (the MPI world, launch check, abort
on failure; no TensorFlow), ``distributed`` (gradient allreduce inside ``train_step``,
broadcasts, metric averaging), ``checkpoints`` (atomic, resumable state), ``settings`` (the
``training`` config section), ``validation`` (per-parameter MSE against the
predict-the-training-mean baseline), ``run`` (:func:`train_network`: the data plan, the model, the
steps in order), ``resume`` (the checkpoint identity, restoring, checkpointing), ``fit`` (the
fit loop, synchronous or asynchronous, and its callbacks), ``record`` (``run.json`` and
``model.keras``), ``asynchronous`` (the one-sided MPI window of asynchronous training) and
``jobs`` (the ``train`` stage's job).

Outputs, in the run's ``training/`` directory: ``checkpoints/``, ``model.keras``,
``history.csv``, ``tensorboard/``, ``run.json`` (see :mod:`training.run`, :mod:`training.record`).
"""
