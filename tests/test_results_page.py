"""`benchmarks/results.py`, the results page's generator: its splits, its
summaries and its verdicts, against NumPy and hand-made tables; the whole run at
toy size in the slow tier."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location(
    "results_script", ROOT / "benchmarks" / "results.py"
)
assert _spec is not None and _spec.loader is not None
results = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(results)


def test_regression_splits_are_90_10_and_standardised_on_the_training_part():
    rng = np.random.default_rng(0)
    x = rng.normal(3.0, 2.0, (100, 4))
    y = rng.normal(10.0, 5.0, 100)
    (x_train, y_train), (x_test, y_test), (y_mean, y_std) = results.regression_split(
        x, y, seed=3
    )
    assert len(y_train) == 90 and len(y_test) == 10
    np.testing.assert_allclose(x_train.mean(0), 0.0, atol=1e-5)
    np.testing.assert_allclose(x_train.std(0), 1.0, atol=1e-5)
    np.testing.assert_allclose(y_train.mean(), 0.0, atol=1e-5)
    # The test targets stay in their units (the metrics are in them), and the
    # split is the seed's permutation: another seed, another split.
    order = np.random.default_rng(3).permutation(100)
    np.testing.assert_array_equal(y_test, y[order[90:]])
    np.testing.assert_allclose(y_mean, y[order[:90]].mean())
    np.testing.assert_allclose(y_std, y[order[:90]].std())
    other = results.regression_split(x, y, seed=4)[1][1]
    assert not np.array_equal(other, y_test)


def test_cells_are_the_mean_and_standard_error_and_times_the_median():
    values = [1.0, 2.0, 4.0, 9.0]
    se = np.std(values, ddof=1) / np.sqrt(len(values))
    assert results.cell(values) == f"{np.mean(values):.3f} ± {se:.3f}"
    assert results.cell(values, 1, median=True) == f"{np.median(values):.1f}"
    assert results.cell([2.0]) == "2.000"  # one seed: no error bar


def test_claims_follow_the_tables():
    recipe = results.RECIPE
    regression = {
        # Boston within the paper's deviations, Concrete's RMSE outside them.
        "Boston": {
            recipe: {"RMSE": [3.0, 3.4], "NLL": [2.3, 2.5]},
            "deep ensemble (NLL)": {"RMSE": [3.0], "NLL": [2.6]},
        },
        "Concrete": {
            recipe: {"RMSE": [7.0, 7.2], "NLL": [3.0, 3.1]},
            "deep ensemble (NLL)": {"RMSE": [7.0], "NLL": [3.0]},
            "MC dropout (1 x 20 passes, NLL)": {"RMSE": [7.0], "NLL": [3.0]},
        },
    }
    deep = f"deep ensemble ({results.MEMBERS})"
    rows = {
        "single model": {"NLL": [0.5, 0.5], "ECE": [0.1, 0.1], "parameters": [10]},
        deep: {"NLL": [0.29, 0.31], "ECE": [0.2, 0.2], "parameters": [50],
               "AUROC far": [0.8, 0.8], "AUROC near": [0.7, 0.7]},
        f"{deep}, Mahalanobis OOD score": {"AUROC far": [0.9, 0.9],
                                           "AUROC near": [0.6, 0.6]},
        f"{deep} + temperature": {"NLL": [0.3, 0.3], "ECE": [0.05, 0.05],
                                  "parameters": [51]},
        f"Packed-Ensembles ({results.MEMBERS}, alpha 2)": {
            "NLL": [0.30, 0.32], "parameters": [20]},
        "Laplace mixture (KFAC, marglik)": {"NLL": [0.4, 0.4], "parameters": [50]},
        "MC dropout (1 x 20 passes)": {"NLL": [0.35, 0.35], "parameters": [10]},
        f"MultiSWAG ({results.MEMBERS} x 4)": {"NLL": [0.2, 0.2], "parameters": [200]},
        f"hyper-deep ({results.MEMBERS} of {2 * results.MEMBERS}: L2, label "
        "smoothing)": {"NLL": [0.28, 0.28], "parameters": [50]},
        "MC BatchNorm (1 x 20 batches)": {"NLL": [0.6, 0.6], "parameters": [11]},
        f"repulsive, function space ({results.MEMBERS})": {
            "AUROC far": [0.85, 0.85], "AUROC near": [0.65, 0.65]},
    }  # fmt: skip
    lines = results.claims(regression, {"toy": rows})
    text = "\n".join(lines)
    assert "Table 1 on Boston" in text and "Table 1 on Concrete" in text
    boston = next(line for line in lines if "Table 1 on Boston" in line)
    concrete = next(line for line in lines if "Table 1 on Concrete" in line)
    assert "**reproduced**" in boston and "**not reproduced**" in concrete
    adversarial = [line for line in lines if "Adversarial training" in line]
    assert "**supported**" in adversarial[0]  # 2.4 < 2.6 on Boston
    assert "**not supported**" in adversarial[1]  # 3.05 > 3.0 on Concrete

    def verdict(fragment):
        line = next(line for line in lines if fragment in line)
        return "**supported**" in line

    assert verdict("a deep ensemble beats a single model")
    assert verdict("Packed-Ensembles match")  # 0.31 within 2 s.e. of 0.30, fewer
    assert not verdict("Laplace approximations beats")
    assert verdict("a deep ensemble beats MC dropout")  # 0.30 < 0.35
    assert verdict("MultiSWAG beats")
    assert verdict("temperature scaling lowers")
    assert verdict("hyper-deep ensemble beats")  # 0.28 < 0.30
    assert not verdict("MC BatchNorm beats")  # 0.6 > 0.5
    # MC dropout in regression: Concrete only (Boston has no such row), 3.05 > 3.0.
    dropout = [line for line in lines if "beats MC dropout on NLL on" in line]
    assert len(dropout) == 1 and "**not supported**" in dropout[0]
    repulsion = [line for line in lines if "function-space repulsion" in line]
    assert len(repulsion) == 2
    assert "**supported**" in next(r for r in repulsion if "far" in r)  # 0.85 > 0.8
    assert "**not supported**" in next(r for r in repulsion if "near" in r)
    mahalanobis = [line for line in lines if "Mahalanobis distance" in line]
    assert len(mahalanobis) == 2  # one per OOD set
    assert "**supported**" in next(m for m in mahalanobis if "far" in m)
    assert "**not supported**" in next(m for m in mahalanobis if "near" in m)


def test_the_page_in_the_docs_is_generated():
    page = (ROOT / "docs" / "results.md").read_text()
    assert "Generated by `python benchmarks/results.py`" in page
    for image in ("reliability-digits.png", "ood-mnist-5k.png"):
        assert f"images/results/{image}" in page
        assert (ROOT / "docs" / "images" / "results" / image).exists()


@pytest.mark.slow
def test_the_whole_run_at_toy_size_writes_every_row(tmp_path):
    out = tmp_path / "results.md"
    subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "results.py"), "--smoke",
         "--out", str(out)],
        check=True, timeout=900,
    )  # fmt: skip
    page = out.read_text()
    rows = [line for line in page.splitlines() if line.startswith("| ")]
    for row in ("single model", results.RECIPE, "MultiSWAG", "BatchEnsemble",
                "Packed-Ensembles", "MIMO", "Masksembles", "heterogeneous",
                "snapshot ensemble", "Laplace mixture (KFAC, validation)",
                "MC dropout", "cyclical SG-MCMC", "+ temperature", "SVGD",
                "Mahalanobis OOD score", "DDU density OOD score",
                "KNN OOD score", "MC dropout (1 x 20 passes, NLL)",
                "MC BatchNorm", "hyper-deep", "repulsive, function space"):  # fmt: skip
        assert any(row in line for line in rows), row
    assert "## Claims checked" in page
    assert len(list((tmp_path / "images" / "results").glob("*.png"))) == 6
    # Every cell of every table is a finite number (`mean ± se`, a median, a
    # count with thousands separators).
    for line in rows:
        cells = [cell.strip() for cell in line.strip("|").split("|")][1:]
        if line.startswith("| method") or not cells:
            continue
        for cell in cells:
            for number in cell.replace(",", "").split(" ± "):
                assert np.isfinite(float(number)), (line, cell)
