"""Many-task execution with Parsl, beside Snakemake (docs/execution.md, "Parsl").

* :mod:`workflow.parsl.configs`: Parsl ``Config`` objects built from the validated
  configuration's ``parsl`` section (local HighThroughputExecutor, SlurmProvider blocks, the
  MPIExecutor of sweep trials), and the submit script a Slurm block would get;
* :mod:`workflow.parsl.ensemble`: ``cosmoflow ensemble``, the simulation ensemble to the
  TFRecord manifest as Parsl apps over the stage table (workflow/stages.py), in the same run
  directory as the Snakemake rules, each engine skipping what the other finished;
* :mod:`workflow.parsl.sweep`: ``cosmoflow sweep``, training trials of a hyperparameter search
  launched with MPI ranks through the MPIExecutor, resumed from Parsl's checkpoints;
* :mod:`workflow.parsl.apps`: the functions the workers run (kept light to import);
* :mod:`workflow.parsl.progress`: the live console report (done / running / pending per stage).

Their files in the run directory, ``parsl/`` and ``sweeps/<name>/``: docs/run-directory.md.
"""
