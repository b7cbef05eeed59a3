"""Learning-rate schedule, LARC against hand-computed steps, and the settings' validation."""

from __future__ import annotations

import numpy as np
import keras
import pytest
import tensorflow as tf

from mpi_training import training_settings
from training.optimizers import LARCAdam, LARCSGD, WarmupPolynomialDecay, make_optimizer
from training.settings import TrainingSettings
from workflow.config import validate_config
from workflow.errors import ConfigError


def test_warmup_then_linear_decay():
    schedule = WarmupPolynomialDecay(1e-2, warmup_steps=4, total_steps=14, end_factor=0.1)
    rates = [float(schedule(step)) for step in range(16)]
    np.testing.assert_allclose(rates[:4], [2.5e-3, 5e-3, 7.5e-3, 1e-2], rtol=1e-6)
    # decay over the 10 steps after warm-up: 1e-2 -> 1e-3, linearly (polynomial power 1)
    np.testing.assert_allclose(rates[4:15], np.linspace(1e-2, 1e-3, 11), rtol=1e-5)
    assert rates[15] == pytest.approx(1e-3)  # stays at the end value
    no_warmup = WarmupPolynomialDecay(1.0, 0, 5, 0.0)
    assert [float(no_warmup(s)) for s in (0, 5)] == [1.0, 0.0]


def one_step(optimizer, values, gradients):
    variables = [keras.Variable(np.array(v, np.float32)) for v in values]
    tf.function(lambda: optimizer.apply_gradients(
        [(tf.constant(g, tf.float32), v) for g, v in zip(gradients, variables)]))()
    return [v.numpy() for v in variables]


@pytest.mark.parametrize("optimizer_class, kwargs", [(LARCAdam, {}), (LARCSGD, {"momentum": 0.9})])
def test_larc_limits_each_tensors_step_to_eta_times_its_norm(optimizer_class, kwargs):
    rng = np.random.default_rng(0)
    small = rng.normal(0, 0.01, 50)        # ||w|| ~ 0.07: LARC clips its step
    large = rng.normal(0, 10.0, 50)        # ||w|| ~ 70: the nominal step is within eta ||w||
    zero = np.zeros(50)                    # zero norm: nominal rate
    gradients = [rng.normal(0, 1, 50) for _ in range(3)]
    lr, eta = 1e-2, 0.02
    plain = (keras.optimizers.Adam(lr) if optimizer_class is LARCAdam
             else keras.optimizers.SGD(lr, **kwargs))
    nominal = [after - before for after, before in
               zip(one_step(plain, [small, large, zero], gradients), [small, large, zero])]
    larc = one_step(optimizer_class(learning_rate=lr, eta=eta, **kwargs), [small, large, zero], gradients)
    steps = [after - before for after, before in zip(larc, [small, large, zero])]
    # first step of Adam: -lr g / (|g| + epsilon / sqrt(1 - beta_2)) per element; of SGD: -lr g
    g = gradients[0]
    expected_nominal = (-lr * g / (np.abs(g) + 1e-7 / np.sqrt(1 - 0.999))
                        if optimizer_class is LARCAdam else -lr * g)
    np.testing.assert_allclose(nominal[0], expected_nominal, rtol=1e-4, atol=1e-9)
    assert np.linalg.norm(steps[0]) == pytest.approx(eta * np.linalg.norm(small), rel=1e-4)
    shortened = nominal[0] * eta * np.linalg.norm(small) / np.linalg.norm(nominal[0])
    np.testing.assert_allclose(steps[0], shortened, rtol=1e-4, atol=1e-10)  # same direction, shorter
    np.testing.assert_allclose(steps[1], nominal[1], rtol=1e-4, atol=1e-7)
    np.testing.assert_allclose(steps[2], nominal[2], rtol=1e-5, atol=1e-9)


def test_settings_choose_the_optimiser():
    optimizer = make_optimizer(training_settings({"larc": True}), steps_per_epoch=10)
    assert isinstance(optimizer, LARCAdam) and optimizer.eta == 0.01
    sgd = make_optimizer(
        training_settings({"optimizer": "sgd", "larc": False, "momentum": 0.8}), 10)
    assert type(sgd) is keras.optimizers.SGD and sgd.momentum == 0.8
    settings = training_settings({"warmup_epochs": 0.5, "epochs": 3})
    schedule = make_optimizer(settings, 10)._learning_rate
    assert (schedule.warmup_steps, schedule.total_steps) == (5, 30)


@pytest.mark.parametrize("changes, message", [
    ({"model": "vgg"}, "key 'training.model' = 'vgg' is not allowed; choose one of: cosmoflow_paper, mlperf"),
    ({"batch_size": 0}, "key 'training.batch_size' = 0 is out of range; it must be at least 1"),
    ({"batch_size": True}, "key 'training.batch_size' = True must be of type integer"),
    ({"learning_rate": 0}, "key 'training.learning_rate' = 0 is out of range; it must be greater than 0"),
    ({"momentum": 1.0}, "key 'training.momentum' = 1.0 is out of range; it must be less than 1"),
    ({"precision": "float16"}, "key 'training.precision' = 'float16' is not allowed"),
    ({"larc": "yes"}, "key 'training.larc' = 'yes' must be of type boolean"),
    ({"validation_split": "train"},
     "key 'training.validation_split' = 'train' is also 'training.train_split'"),
])
def test_invalid_settings_name_key_value_and_range(changes, message):
    """The settings are checked once, with the configuration, before any job starts."""
    with pytest.raises(ConfigError, match=message):
        validate_config({"training": changes})


def test_settings_from_config_section():
    settings = TrainingSettings.from_mapping(validate_config({"training": {"epochs": 3}})["training"])
    assert settings.epochs == 3 and "ranks" not in settings.to_dict()
    assert TrainingSettings.from_mapping(settings.to_dict()) == settings
    with pytest.raises(ConfigError, match="unknown key 'epoch' in 'training'"):
        validate_config({"training": {"epoch": 3}})
