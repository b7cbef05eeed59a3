"""Parameter-estimation analysis (rule ``analyze``): metrics, baselines, Fisher forecasts,
simulation validation, figures and the HTML report.

Modules (each a library of functions over arrays and files; the stage wires them together):

* :mod:`analysis.power_spectrum`: binned P(k) of density grids and particle counts, and the
  per-sample summary statistics of the regression baselines;
* :mod:`analysis.metrics`: per-parameter errors of predictions, per sample and per simulation;
* :mod:`analysis.baselines`: predict-the-training-mean and summary-statistics regressors;
* :mod:`analysis.fisher`: Fisher forecast from the ``fiducial_derivatives`` design;
* :mod:`analysis.simulation_validation`: snapshot P(k) against linear theory (and halofit);
* :mod:`analysis.figures`: the PNG figures, each with its caption;
* :mod:`analysis.report`: the self-contained ``report.html``.
"""
