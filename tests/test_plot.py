"""`ee.plot`: figures render to PNG with the Agg backend and hold what they claim;
matplotlib stays an optional, lazily imported dependency."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import jaxtyping
import matplotlib
import numpy as np
import pytest

import eqx_ensemble as ee


@pytest.fixture(autouse=True)
def _agg_backend():
    matplotlib.use("Agg")
    yield
    import matplotlib.pyplot as plt

    plt.close("all")


def _classification(seed=0, members=5, batch=400, classes=4):
    key_logits, key_labels = jax.random.split(jax.random.key(seed))
    logits = 2 * jax.random.normal(key_logits, (members, batch, classes))
    labels = jax.random.randint(key_labels, (batch,), 0, classes)
    return jax.nn.softmax(logits, axis=-1), labels


def _saved(fig, path):
    fig.savefig(path)
    assert path.exists() and path.stat().st_size > 1000
    with open(path, "rb") as file:
        assert file.read(8) == b"\x89PNG\r\n\x1a\n"


def test_reliability_diagram(tmp_path):
    probs, labels = _classification()
    fig, ax = ee.plot.reliability_diagram(probs, labels, n_bins=10, title="test")
    _saved(fig, tmp_path / "reliability.png")
    accuracy_bars, gap_bars = ax.containers
    assert len(accuracy_bars) == len(gap_bars) == 10
    bins = ee.metrics.calibration_bins(probs, labels, 10)
    heights = [bar.get_height() for bar in accuracy_bars]
    np.testing.assert_allclose(heights, bins.accuracy, rtol=1e-6)
    gap_tops = [bar.get_y() + bar.get_height() for bar in gap_bars]
    np.testing.assert_allclose(gap_tops, bins.confidence, rtol=1e-5, atol=1e-6)
    ece = float(ee.metrics.expected_calibration_error(probs, labels, 10))
    assert ax.get_title() == f"test: ECE = {100 * ece:.2f}%"
    assert len(ax.lines) == 1  # the diagonal


def test_reliability_diagram_on_given_axes_from_logits(tmp_path):
    import matplotlib.pyplot as plt

    probs, labels = _classification(seed=1, members=1)
    fig, axes = plt.subplots(1, 2)
    returned_fig, ax = ee.plot.reliability_diagram(
        jnp.log(probs), labels, n_bins=5, from_logits=True, ax=axes[1]
    )
    assert returned_fig is fig and ax is axes[1]
    assert len(axes[1].containers[0]) == 5 and not axes[0].containers
    _saved(fig, tmp_path / "two.png")


def test_predictive_band(tmp_path):
    x = jnp.linspace(-4, 4, 50)[::-1]  # unsorted input order is fine
    means = jnp.stack([x**3 + shift for shift in (-3.0, 0.0, 3.0)])
    variances = jnp.full((3, 50), 4.0)
    fig, ax = ee.plot.predictive_band(
        x,
        means,
        variances,
        k=2,
        x_train=x[::5],
        y_train=x[::5] ** 3,
        show_members=True,
        show_aleatoric=True,
    )
    _saved(fig, tmp_path / "band.png")
    assert len(ax.lines) == 1 + 3  # ensemble mean + members
    assert len(ax.collections) == 3  # total band, aleatoric band, training points
    mean_line = ax.lines[0]
    xs, ys = mean_line.get_data()
    assert np.all(np.diff(xs) > 0)
    np.testing.assert_allclose(ys, np.sort(np.asarray(x)) ** 3, rtol=1e-5, atol=1e-4)
    # The band spans mean +- 2 sigma of the mixture (variance 4 + 6 = 10).
    band = ax.collections[0].get_paths()[0].vertices
    assert band[:, 1].max() == pytest.approx(64 + 2 * np.sqrt(10), rel=1e-5)
    assert ax.collections[2].get_offsets().shape == (10, 2)


def test_predictive_band_minimal(tmp_path):
    x = jnp.linspace(0, 1, 20)
    fig, ax = ee.plot.predictive_band(x, x[None], jnp.full((1, 20), 0.1))
    _saved(fig, tmp_path / "minimal.png")
    assert len(ax.lines) == 1 and len(ax.collections) == 1


def test_uncertainty_histogram(tmp_path):
    key_in, key_out = jax.random.split(jax.random.key(2))
    in_scores = jax.random.uniform(key_in, (300,))
    out_scores = 0.5 + jax.random.uniform(key_out, (200,))
    fig, ax = ee.plot.uncertainty_histogram(in_scores, out_scores, bins=12)
    _saved(fig, tmp_path / "ood.png")
    assert len(ax.containers) == 2
    assert all(len(container) == 12 for container in ax.containers)
    assert len(ax.patches) == 24
    auroc = float(ee.metrics.ood_auroc(in_scores, out_scores))
    assert ax.get_title() == f"AUROC = {auroc:.3f}"
    # Shared bins: both histograms start and end at the same edges.
    first = [container[0].get_x() for container in ax.containers]
    assert first[0] == first[1] == pytest.approx(float(in_scores.min()))


def test_bad_input(monkeypatch):
    # The library's own messages, as seen without runtime type checking (whose
    # shape check would catch the first case with its own TypeError).
    monkeypatch.setattr(jaxtyping.config, "jaxtyping_disable", True)
    with pytest.raises(ValueError, match=r"`x` must have shape \(batch,\) = \(3,\)"):
        ee.plot.predictive_band(jnp.zeros(4), jnp.zeros((2, 3)), jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="both `x_train` and `y_train`"):
        ee.plot.predictive_band(
            jnp.zeros(3), jnp.zeros((2, 3)), jnp.ones((2, 3)), x_train=jnp.zeros(2)
        )
    with pytest.raises(ValueError, match="`bins` must be a positive int"):
        ee.plot.uncertainty_histogram(jnp.zeros(3), jnp.ones(3), bins=0)


def test_importing_the_package_does_not_import_matplotlib():
    code = (
        "import sys, eqx_ensemble as ee; "
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported'; "
        "ee.plot, ee.metrics; "
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported'"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr


def test_missing_matplotlib_gives_install_hint(monkeypatch):
    probs, labels = _classification(members=1, batch=20)
    for name in list(sys.modules):
        if name == "matplotlib" or name.startswith("matplotlib."):
            monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r"pip install eqx_ensemble\[plot\]"):
        ee.plot.reliability_diagram(probs, labels)


def test_risk_coverage(tmp_path):
    rng = np.random.default_rng(0)
    confidence = rng.random(100).astype(np.float32)
    errors = rng.random(100) > confidence
    shuffled = rng.permutation(confidence)
    fig, ax = ee.plot.risk_coverage(
        {"good": (confidence, errors), "random": (shuffled, errors)}
    )
    fig.savefig(tmp_path / "rc.png")
    assert len(ax.lines) == 2
    coverage, risk = ax.lines[0].get_data()
    expected_coverage, expected_risk = ee.metrics.risk_coverage_curve(
        confidence, errors
    )
    np.testing.assert_allclose(coverage, expected_coverage)
    np.testing.assert_allclose(risk, expected_risk)
    aurc = float(ee.metrics.aurc(confidence, errors))
    assert f"AURC {aurc:.4f}" in ax.lines[0].get_label()
    with pytest.raises(ValueError, match="non-empty dict"):
        ee.plot.risk_coverage({})
    with pytest.raises(ValueError, match="pair"):
        ee.plot.risk_coverage({"a": confidence})


def test_lineage(tmp_path):
    steps, children, parents = (
        np.array([10, 10, 20]),
        np.array([3, 2, 0]),
        np.array([0, 1, 1]),
    )
    fig, ax = ee.plot.lineage(
        steps, children, parents, size=4, last_step=30, scores=np.arange(4.0)
    )
    fig.savefig(tmp_path / "lineage.png")
    assert len(ax.lines) == 4 + 3
    x, y = ax.lines[4 + 2].get_data()  # the third copy: member 1 -> member 0
    assert list(y) == [1, 0] and x[-1] == 20
    assert ax.get_title() == "PBT lineage: 3 copies"
    with pytest.raises(ValueError, match=r"member indices in \[0, 4\)"):
        ee.plot.lineage(steps, children + 2, parents, size=4)
