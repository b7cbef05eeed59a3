"""The report is one HTML page that parses, holds every section, and embeds every image as a
data URI that decodes to a PNG."""

from __future__ import annotations

import base64
import html.parser
import io

import matplotlib.image
import numpy as np
import pytest

from analysis import figures, metrics, report
from workflow.errors import PipelineError

NAMES = ("Omega_m", "sigma_8", "n_s")


class Collector(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.images, self.tags, self.text = [], [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag == "img":
            self.images.append(dict(attrs))

    def handle_data(self, data):
        self.text.append(data)


@pytest.fixture
def content(tmp_path):
    rng = np.random.default_rng(0)
    sims = np.repeat(np.arange(6), 4)
    truth = np.repeat(np.array([0.3, 0.85, 0.95]) + 0.02 * rng.normal(size=(6, 3)), 4, axis=0)
    noisy = truth + 0.005 * rng.normal(size=truth.shape)
    models = {"network": metrics.Predictions(NAMES, sims, truth, noisy),
              "mean": metrics.Predictions(NAMES, sims, truth, np.tile(truth.mean(0), (24, 1)))}
    ranges = {"Omega_m": (0.25, 0.35), "sigma_8": (0.78, 0.95), "n_s": (0.9, 1.0)}
    evaluated = {name: metrics.evaluate(p, ranges) for name, p in models.items()}
    figure_list = [
        figures.predicted_vs_true(tmp_path / "pvt.png", models["network"], ("mean", models["mean"]), ranges),
        figures.model_comparison(tmp_path / "bars.png", {
            name: {n: e["per_simulation"]["parameters"][n]["relative_error"] for n in NAMES}
            for name, e in evaluated.items()}),
    ]
    return {
        "title": "CosmoFlow analysis: tiny",
        "configuration": {"run_name": "tiny", "simulation": {"box_size": 256.0, "n_particles": 64},
                          "sampling": {"parameters": list(NAMES)}},
        "dataset": {"simulations": {"train": 96, "val": 16, "test": 16}, "sample_shape": [16, 16, 16, 2]},
        "metrics": evaluated,
        "figures": figure_list,
        "flagged": [{"sim_id": 17, "path": "sims/17/snapshot.h5",
                     "reasons": ["z = 0: P(k) / linear theory = 1.96 <script>"]}],
        "n_validated": 128,
        "fisher": {"forecast": {"marginal_errors": {n: 0.01 for n in NAMES},
                                "conditional_errors": {n: 0.005 for n in NAMES},
                                "n_repetitions": 8, "n_covariance": 64},
                   "convergence": {"converged": False, "tolerance": 0.1}},
        "notes": ["The mean baseline beats the network on n_s."],
    }


def test_report_parses_and_embeds_every_image(tmp_path, content):
    path = report.write_report(tmp_path / "report.html", **content)
    text = path.read_text(encoding="utf-8")
    parser = Collector()
    parser.feed(text)
    parser.close()
    assert len(parser.images) == len(content["figures"]) == 2
    for image in parser.images:
        prefix = "data:image/png;base64,"
        assert image["src"].startswith(prefix)
        data = base64.b64decode(image["src"][len(prefix):], validate=True)
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert matplotlib.image.imread(io.BytesIO(data), format="png").shape[0] > 100
        assert image["alt"]
    assert "http://" not in text and "https://" not in text and "<link" not in text
    body = " ".join(parser.text)
    for expected in ("Metrics", "per simulation", "per sample", "Fisher forecast", "Figures",
                     "Simulation validation", "1 of 128 simulations flagged", "Data set",
                     "Configuration", "simulation.box_size", "network", "mean", "0.0022",
                     "not converged", "The mean baseline beats the network on n_s."):
        assert expected in body, expected
    assert "<script>" not in text  # text from files is escaped
    for figure in content["figures"]:
        assert figure.caption in body


def test_metrics_table_marks_the_best_model(content):
    text = report.render_report(**content)
    network_mae = content["metrics"]["network"]["per_simulation"]["parameters"]["Omega_m"]["mae"]
    assert f"<b>{network_mae:.4g}</b>" in text


def test_no_flagged_simulation_and_no_fisher(content):
    content = dict(content, flagged=[], fisher=None)
    text = report.render_report(**content)
    assert "No simulation flagged (of 128 validated)" in text
    assert "Fisher forecast" not in text


def test_missing_figure_is_named(tmp_path, content):
    missing = figures.Figure(tmp_path / "gone.png", "caption", "alt")
    with pytest.raises(PipelineError, match="gone.png"):
        report.render_report(**dict(content, figures=[missing]))
    with pytest.raises(PipelineError, match="at least one model"):
        report.render_report(**dict(content, metrics={}))
