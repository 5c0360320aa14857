"""Plots of an ensemble's uncertainty: reliability diagram, predictive band for 1-D
regression, histogram of an uncertainty score for in- vs out-of-distribution data,
risk-coverage curves, a PBT lineage.

matplotlib is an optional dependency (`pip install eqx_ensemble[plot]`). Every
function draws on `ax` if given, else on a new figure, and returns `(figure, axes)`.

```python
probs = jax.nn.softmax(jax.random.normal(jax.random.key(0), (5, 200, 3)), axis=-1)
labels = jax.random.randint(jax.random.key(1), (200,), 0, 3)
fig, ax = ee.plot.reliability_diagram(probs, labels, n_bins=10)
fig.savefig("reliability.png")
```
"""

from typing import Any

import jax.numpy as jnp
import numpy as np
from jaxtyping import ArrayLike, Float, Int

from . import metrics
from ._metrics.checks import as_float_array, check_regression
from .combine import gaussian_mixture

__all__ = ["reliability_diagram", "predictive_band", "uncertainty_histogram"]


def _figure_and_axes(ax: Any) -> tuple[Any, Any]:
    try:
        import matplotlib.pyplot as plt
    except ImportError as error:
        raise ImportError(
            "`ee.plot` needs matplotlib, an optional dependency of eqx_ensemble: "
            "install it with `pip install eqx_ensemble[plot]` (or `pip install "
            "matplotlib`)."
        ) from error
    if ax is None:
        return plt.subplots()
    return ax.figure, ax


def reliability_diagram(
    probs: Float[ArrayLike, " members batch classes"],
    labels: Int[ArrayLike, " batch"],
    n_bins: int = 15,
    *,
    from_logits: bool = False,
    ax: Any = None,
    title: str | None = None,
) -> tuple[Any, Any]:
    """Reliability diagram of the ensemble's mean prediction (Guo et al. 2017).

    For each of `n_bins` equal-width bins of top-label confidence (as
    `ee.metrics.calibration_bins`), a bar shows the accuracy and a hatched bar the gap
    to the bin's mean confidence (above the bar: overconfident). The dashed diagonal
    is perfect calibration; the title reports the ECE.

    **Arguments:**

    - `probs`, `labels`, `n_bins`, `from_logits`: as
      `ee.metrics.calibration_bins`.
    - `ax`: a matplotlib `Axes` to draw on; a new figure if `None`.
    - `title`: text put before the ECE in the title.

    **Returns:**

    `(figure, axes)`. The accuracy bars are `axes.containers[0]`, the gap bars
    `axes.containers[1]` (each with `n_bins` patches).

    **Example:**

    ```python
    logits = 3 * jax.random.normal(jax.random.key(0), (5, 500, 4))
    labels = jax.random.randint(jax.random.key(1), (500,), 0, 4)
    fig, ax = ee.plot.reliability_diagram(logits, labels, from_logits=True,
                                          title="random logits")
    fig.savefig("reliability.png")
    ```
    """
    bins = metrics.calibration_bins(probs, labels, n_bins, from_logits=from_logits)
    fig, ax = _figure_and_axes(ax)
    count = np.asarray(bins.count)
    accuracy, confidence = np.asarray(bins.accuracy), np.asarray(bins.confidence)
    lower, upper = np.asarray(bins.lower), np.asarray(bins.upper)
    ece = float(np.sum(count * np.abs(accuracy - confidence)) / np.sum(count))
    width = upper - lower
    ax.bar(
        lower,
        accuracy,
        width,
        align="edge",
        color="C0",
        edgecolor="black",
        linewidth=0.5,
        label="accuracy",
    )
    ax.bar(
        lower,
        confidence - accuracy,
        width,
        bottom=accuracy,
        align="edge",
        color="C3",
        alpha=0.3,
        edgecolor="C3",
        hatch="//",
        linewidth=0.5,
        label="gap to confidence",
    )
    ax.plot([0, 1], [0, 1], linestyle="--", color="gray", label="perfect calibration")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("confidence")
    ax.set_ylabel("accuracy")
    ax.set_aspect("equal")
    ece_text = f"ECE = {100 * ece:.2f}%"
    ax.set_title(f"{title}: {ece_text}" if title else ece_text)
    ax.legend(loc="upper left")
    return fig, ax


def predictive_band(
    x: Float[ArrayLike, " batch"],
    means: Float[ArrayLike, " members batch"],
    variances: Float[ArrayLike, " members batch"],
    *,
    k: float | int = 2.0,
    x_train: Float[ArrayLike, " train"] | None = None,
    y_train: Float[ArrayLike, " train"] | None = None,
    show_members: bool = False,
    show_aleatoric: bool = False,
    ax: Any = None,
) -> tuple[Any, Any]:
    """Predictive band of a 1-D regression ensemble: the mixture mean with a band of
    `+- k` predictive standard deviations (aleatoric plus epistemic, as
    `ee.metrics.predictive_variance`). Inputs may come in any order of `x`.

    **Arguments:**

    - `x`: the 1-D inputs, shape `(batch,)`.
    - `means`: the members' predicted means at `x`, shape `(members, batch)`.
    - `variances`: the members' predicted variances at `x`, same shape.
    - `k`: the band's half-width in standard deviations.
    - `x_train`, `y_train`: training points to scatter, shape `(train,)` each.
    - `show_members`: also draw each member's mean as a thin line.
    - `show_aleatoric`: also draw the narrower `+- k` band of the aleatoric
      standard deviation alone (the gap between the bands is epistemic).
    - `ax`: a matplotlib `Axes` to draw on; a new figure if `None`.

    **Returns:**

    `(figure, axes)`. `axes.lines` holds the ensemble mean first, then the members'
    means if `show_members`.

    **Example:**

    ```python
    x = jnp.linspace(-4, 4, 100)
    means = jnp.stack([x**3 + shift for shift in (-5.0, 0.0, 5.0)])  # 3 members
    variances = jnp.full((3, 100), 9.0)
    fig, ax = ee.plot.predictive_band(x, means, variances, k=2, show_members=True,
                                      x_train=x[::10], y_train=x[::10] ** 3)
    fig.savefig("band.png")
    ```
    """
    means = as_float_array(means, "means")
    variances = as_float_array(variances, "variances")
    x = as_float_array(x, "x")
    check_regression(means, variances)
    if x.ndim != 1 or x.shape[0] != means.shape[1]:
        raise ValueError(
            f"`x` must have shape (batch,) = ({means.shape[1]},) to match `means` of "
            f"shape {tuple(means.shape)} (members, batch), got shape {tuple(x.shape)}"
        )
    if (x_train is None) != (y_train is None):
        raise ValueError("pass both `x_train` and `y_train`, or neither")
    fig, ax = _figure_and_axes(ax)
    order = np.argsort(np.asarray(x))
    mean, variance = gaussian_mixture(means, variances)
    xs = np.asarray(x)[order]
    mean_np = np.asarray(mean)[order]
    std = np.sqrt(np.asarray(variance))[order]
    ax.plot(xs, mean_np, color="C0", linewidth=2, label="ensemble mean")
    if show_members:
        for member, member_mean in enumerate(np.asarray(means)[:, order]):
            ax.plot(
                xs,
                member_mean,
                color="C0",
                alpha=0.4,
                linewidth=0.8,
                label="member means" if member == 0 else None,
            )
    bands = [(std, "C0", "total")]
    if show_aleatoric:
        aleatoric = np.sqrt(np.asarray(jnp.mean(variances, axis=0)))[order]
        bands.append((aleatoric, "C1", "aleatoric"))
    for spread, color, name in bands:
        ax.fill_between(
            xs,
            mean_np - k * spread,
            mean_np + k * spread,
            color=color,
            alpha=0.2,
            label=f"$\\pm{k:g}\\sigma$ ({name})",
        )
    if x_train is not None and y_train is not None:
        ax.scatter(
            np.asarray(x_train),
            np.asarray(y_train),
            s=10,
            color="black",
            zorder=3,
            label="training data",
        )
    ax.set_xlabel("x")
    ax.set_ylabel("y")
    ax.legend()
    return fig, ax


def uncertainty_histogram(
    in_scores: Float[ArrayLike, " n_in"],
    out_scores: Float[ArrayLike, " n_out"],
    *,
    bins: int = 30,
    ax: Any = None,
    xlabel: str = "uncertainty score",
    names: tuple[str, str] = ("in-distribution", "out-of-distribution"),
) -> tuple[Any, Any]:
    """Overlaid histograms (densities) of an uncertainty score on in- and
    out-of-distribution inputs, on shared bins, with the AUROC (`ee.metrics.ood_auroc`)
    in the title.

    **Arguments:**

    - `in_scores`, `out_scores`: the score of each in- and out-of-distribution
      input, shapes `(n_in,)` and `(n_out,)`, e.g. `ee.metrics.mutual_information`.
    - `bins`: the number of shared, equal-width bins.
    - `ax`: a matplotlib `Axes` to draw on; a new figure if `None`.
    - `xlabel`: the name of the score, for the x axis.
    - `names`: the legend labels of the two histograms.

    **Returns:**

    `(figure, axes)`; `axes.containers` holds the two histograms' bars.

    **Example:**

    ```python
    key_in, key_out = jax.random.split(jax.random.key(0))
    in_scores = jax.random.uniform(key_in, (300,))
    out_scores = 0.5 + jax.random.uniform(key_out, (200,))
    fig, ax = ee.plot.uncertainty_histogram(in_scores, out_scores,
                                            xlabel="mutual information")
    fig.savefig("ood.png")
    ```
    """
    auroc = float(metrics.ood_auroc(in_scores, out_scores))
    if isinstance(bins, bool) or not isinstance(bins, int) or bins < 1:
        raise ValueError(f"`bins` must be a positive int, got {bins!r}")
    fig, ax = _figure_and_axes(ax)
    inside, outside = np.asarray(in_scores), np.asarray(out_scores)
    edges = np.histogram_bin_edges(np.concatenate([inside, outside]), bins=bins)
    ax.hist(inside, edges, density=True, alpha=0.5, color="C0", label=names[0])
    ax.hist(outside, edges, density=True, alpha=0.5, color="C3", label=names[1])
    ax.set_xlabel(xlabel)
    ax.set_ylabel("density")
    ax.set_title(f"AUROC = {auroc:.3f}")
    ax.legend()
    return fig, ax


def risk_coverage(
    curves: dict[str, Any],
    *,
    ax: Any = None,
    ylabel: str = "selective risk (error rate)",
) -> tuple[Any, Any]:
    """Risk-coverage curves of several models on the same data, each curve's AURC
    (`ee.metrics.aurc`) in its legend entry: e.g. the ensemble against its members.

    **Arguments:**

    - `curves`: name -> `(confidence, losses)`, each of shape `(batch,)`, as
      [`ee.metrics.risk_coverage_curve`][eqx_ensemble.metrics.risk_coverage_curve]
      takes them.
    - `ax`: a matplotlib `Axes` to draw on; a new figure if `None`.
    - `ylabel`: the name of the risk, for the y axis.

    **Returns:**

    `(figure, axes)`; `axes.lines` holds one line per curve, in order.

    **Example:**

    ```python
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(0), (4, 200, 5)))
    labels = jnp.arange(200) % 5
    mean = probs.mean(0)
    curves = {"ensemble": (mean.max(-1), mean.argmax(-1) != labels)}
    for i in range(4):
        curves[f"member {i}"] = (probs[i].max(-1), probs[i].argmax(-1) != labels)
    fig, ax = ee.plot.risk_coverage(curves)
    fig.savefig("risk_coverage.png")
    ```
    """
    if not isinstance(curves, dict) or not curves:
        raise ValueError(
            "`curves` must be a non-empty dict: name -> (confidence, losses)"
        )
    computed = {}
    for name, pair in curves.items():
        if not isinstance(pair, tuple | list) or len(pair) != 2:
            raise ValueError(
                f"`curves[{name!r}]` must be a (confidence, losses) pair, got "
                f"{type(pair).__name__}"
            )
        confidence, losses = pair
        coverage, risk = metrics.risk_coverage_curve(confidence, losses)
        computed[name] = (np.asarray(coverage), np.asarray(risk), float(np.mean(risk)))
    fig, ax = _figure_and_axes(ax)
    for index, (name, (coverage, risk, area)) in enumerate(computed.items()):
        ax.plot(
            coverage,
            risk,
            color=f"C{index % 10}",
            linewidth=2 if index == 0 else 1,
            label=f"{name} (AURC {area:.4f})",
        )
    ax.set_xlim(0, 1)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("coverage")
    ax.set_ylabel(ylabel)
    ax.legend()
    return fig, ax


def lineage(
    steps: Int[ArrayLike, " events"],
    children: Int[ArrayLike, " events"],
    parents: Int[ArrayLike, " events"],
    *,
    size: int,
    last_step: int | None = None,
    scores: Float[ArrayLike, " size"] | None = None,
    ax: Any = None,
) -> tuple[Any, Any]:
    """The family tree of a population-based training run
    ([`ee.PBT`][eqx_ensemble.PBT]): one line per member slot over the steps, and at
    each copy an arrow from the parent's slot to the child's.

    **Arguments:**

    - `steps`, `children`, `parents`: what
      [`PBT.lineage`][eqx_ensemble.PBT.lineage] returns.
    - `size`: the number of members.
    - `last_step`: where the lines end (default: the last copy's step).
    - `scores`: optional final score per member, written at the lines' ends.
    - `ax`: a matplotlib `Axes`; a new figure if `None`.

    **Returns:**

    `(figure, axes)`; `axes.lines` holds the `size` member lines, then one per copy.

    **Example:**

    ```python
    fig, ax = ee.plot.lineage(jnp.array([10, 10, 20]), jnp.array([3, 2, 0]),
                              jnp.array([0, 1, 1]), size=4, last_step=30)
    fig.savefig("lineage.png")
    ```
    """
    steps_np, children_np, parents_np = (
        np.asarray(a, dtype=np.int64) for a in (steps, children, parents)
    )
    if not (steps_np.shape == children_np.shape == parents_np.shape) or (
        steps_np.ndim != 1
    ):
        raise ValueError(
            "`steps`, `children` and `parents` must be 1-D of one length, got "
            f"{steps_np.shape}, {children_np.shape}, {parents_np.shape}"
        )
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"`size` must be a positive int, got {size!r}")
    for name, values in (("children", children_np), ("parents", parents_np)):
        if values.size and (values.min() < 0 or values.max() >= size):
            raise ValueError(f"`{name}` must be member indices in [0, {size})")
    end = int(last_step if last_step is not None else (steps_np.max(initial=1)))
    fig, ax = _figure_and_axes(ax)
    for member in range(size):
        ax.plot([0, end], [member, member], color="lightgray", linewidth=1)
    for step, child, parent in zip(steps_np, children_np, parents_np, strict=True):
        ax.plot([step - end * 0.01, step], [parent, child], color="C3", linewidth=1)
    if scores is not None:
        for member, value in enumerate(np.asarray(scores, dtype=float)):
            ax.annotate(f"{value:.3g}", (end, member), fontsize=7, va="center")
    ax.set_xlabel("step")
    ax.set_ylabel("member")
    ax.set_title(f"PBT lineage: {steps_np.size} copies")
    return fig, ax
