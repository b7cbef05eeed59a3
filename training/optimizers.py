"""Optimisers of the two model presets: Adam + LARC (the paper) and SGD with momentum (MLPerf),
with a linear warm-up followed by polynomial (power 1) learning-rate decay.

LARC (layer-wise adaptive rate control; You, Gitman & Ginsburg 2017, arXiv:1708.03888) gives
each weight tensor w the local rate eta ||w|| / ||u||, where u is the optimiser's step per unit
learning rate, and clips it at the nominal rate lr (the paper, Sec. III-B: "LARC clips each
layer's effective rate at Adam's nominal rate"). The step actually applied is therefore

    delta_w = -min(lr, eta ||w|| / ||u||) u = s * delta_base,   s = min(1, eta ||w|| / ||delta_base||),

with delta_base the base optimiser's own step. For plain SGD u is the gradient (LARC as
published); for Adam, whose step does not change when a gradient is rescaled, u is Adam's
normalised update, as in LAMB (You et al. 2019, arXiv:1904.00962). Tensors with zero norm
(freshly initialised biases) or a zero step take the nominal rate.
"""

from __future__ import annotations

import keras
from keras import ops

from training.settings import TrainingSettings


class WarmupPolynomialDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warm-up to ``peak`` over ``warmup_steps``, then linear decay to ``end_factor * peak``.

    lr(s) = peak (s + 1) / warmup_steps for s < warmup_steps, else
    peak [1 - (1 - end_factor) min(1, (s - warmup_steps) / (total_steps - warmup_steps))].
    """

    def __init__(self, peak: float, warmup_steps: int, total_steps: int, end_factor: float):
        self.peak = float(peak)
        self.warmup_steps = int(warmup_steps)
        self.total_steps = max(int(total_steps), self.warmup_steps + 1)
        self.end_factor = float(end_factor)

    def __call__(self, step):
        step = ops.cast(step, "float32")
        warmup = self.peak * (step + 1.0) / max(self.warmup_steps, 1)
        progress = ops.minimum(
            1.0, (step - self.warmup_steps) / (self.total_steps - self.warmup_steps))
        decay = self.peak * (1.0 - (1.0 - self.end_factor) * progress)
        return ops.where(step < self.warmup_steps, warmup, decay)

    def get_config(self) -> dict:
        return {"peak": self.peak, "warmup_steps": self.warmup_steps,
                "total_steps": self.total_steps, "end_factor": self.end_factor}


class LARC:
    """Mix-in for a Keras optimiser: rescale each tensor's step by LARC's clipped trust ratio."""

    def __init__(self, *args, eta: float = 0.01, **kwargs):
        super().__init__(*args, **kwargs)
        self.eta = float(eta)

    def update_step(self, gradient, variable, learning_rate):
        before = ops.copy(variable)  # a plain read may alias the buffer the update overwrites
        super().update_step(gradient, variable, learning_rate)
        step = ops.copy(variable) - before
        weight_norm, step_norm = ops.norm(ops.reshape(before, [-1])), ops.norm(ops.reshape(step, [-1]))
        trust = ops.where(
            (weight_norm > 0) & (step_norm > 0),
            ops.minimum(1.0, self.eta * weight_norm / ops.maximum(step_norm, 1e-30)),
            1.0,
        )
        variable.assign(before + ops.cast(trust, step.dtype) * step)

    def get_config(self) -> dict:
        return {**super().get_config(), "eta": self.eta}


class LARCAdam(LARC, keras.optimizers.Adam):
    """Adam whose per-tensor steps are limited by LARC (the CosmoFlow paper's optimiser)."""


class LARCSGD(LARC, keras.optimizers.SGD):
    """SGD (with momentum) whose per-tensor steps are limited by LARC."""


def make_optimizer(settings: TrainingSettings, steps_per_epoch: int,
                   wrap_schedule=None) -> keras.optimizers.Optimizer:
    """The optimiser and learning-rate schedule that ``settings`` describe.

    ``wrap_schedule``: called with the schedule, returns the one the optimiser uses
    (asynchronous training evaluates it at the shared training position).
    """
    schedule = WarmupPolynomialDecay(
        settings.learning_rate,
        warmup_steps=round(settings.warmup_epochs * steps_per_epoch),
        total_steps=settings.epochs * steps_per_epoch,
        end_factor=settings.decay_end_factor,
    )
    if wrap_schedule is not None:
        schedule = wrap_schedule(schedule)
    if settings.optimizer == "adam":
        if settings.larc:
            return LARCAdam(learning_rate=schedule, eta=settings.larc_eta)
        return keras.optimizers.Adam(learning_rate=schedule)
    if settings.larc:
        return LARCSGD(learning_rate=schedule, momentum=settings.momentum, eta=settings.larc_eta)
    return keras.optimizers.SGD(learning_rate=schedule, momentum=settings.momentum)
