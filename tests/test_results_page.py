"""`benchmarks/results.py`, the results page's generator: its splits, its
summaries and its verdicts, against NumPy and hand-made tables; the whole run at
toy size in the slow tier."""

import importlib.util
import math
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


def test_paired_differences_use_the_corrected_resampled_t_test():
    a, b, ratio = [1.0, 1.2, 0.9, 1.1], [1.1, 1.25, 1.05, 1.2], 0.25
    d = np.subtract(a, b)
    # Nadeau and Bengio (2003): (1/J + n_test/n_train) s^2, J = 4 splits.
    want = math.sqrt((1 / 4 + 0.25) * np.var(d, ddof=1))
    got = results.paired(a, b, ratio)
    np.testing.assert_allclose(got, (np.mean(d), want))
    assert got[1] > np.std(d, ddof=1) / 2  # wider than the naive s / sqrt(J)
    assert results.verdict(-0.1, 0.04) == "supported"
    assert results.verdict(-0.1, 0.06) == "no difference measured"
    assert results.verdict(0.1, 0.04) == "not supported"
    assert results.verdict(0.1, 0.04, lower_is_better=False) == "supported"
    assert results.verdict(-0.1, float("nan")) == "no difference measured"
    assert results.verdict(-1e-9, 0.0) == "no difference measured"  # rounding
    with pytest.raises(ValueError, match="equal lengths"):
        results.paired([1.0, 2.0], [1.0], ratio)


def test_claims_follow_the_paired_differences():
    recipe = results.RECIPE
    regression = {
        "Boston": {  # within the paper's error bars; NLL lower beyond 2 s.e.
            recipe: {"RMSE": [3.0, 3.4, 3.2], "NLL": [2.3, 2.5, 2.4]},
            "deep ensemble (NLL)": {"RMSE": [3.0] * 3, "NLL": [2.6, 2.7, 2.65]},
        },
        "Concrete": {  # RMSE far outside; NLL inside the noise; dropout better
            recipe: {"RMSE": [7.0, 7.2, 7.1], "NLL": [3.0, 3.1, 3.05]},
            "deep ensemble (NLL)": {"RMSE": [7.0] * 3, "NLL": [3.02, 3.05, 3.1]},
            results.DROPOUT_REGRESSION: {
                "RMSE": [7.0] * 3, "NLL": [2.9, 2.95, 2.92]},
        },
    }  # fmt: skip
    deep = f"deep ensemble ({results.MEMBERS})"
    rows = {
        "single model": {"NLL": [0.5, 0.52, 0.48], "parameters": [10],
                         "AUROC far": [0.8] * 3, "AUROC near": [0.7] * 3},
        deep: {"NLL": [0.29, 0.31, 0.30], "ECE": [0.2, 0.21, 0.19],
               "parameters": [50], "AUROC far": [0.8] * 3, "AUROC near": [0.7] * 3},
        f"{deep}, Mahalanobis OOD score": {"AUROC far": [0.9, 0.91, 0.89],
                                           "AUROC near": [0.6, 0.61, 0.59]},
        f"{deep} + temperature": {"ECE": [0.05, 0.06, 0.04], "parameters": [51]},
        f"Packed-Ensembles ({results.MEMBERS}, alpha 2)": {
            "NLL": [0.31, 0.30, 0.32], "parameters": [20]},
        "Laplace mixture (KFAC, validation)": {"NLL": [0.4, 0.42, 0.41]},
        results.DROPOUT_CLASSIFICATION: {"NLL": [0.35, 0.36, 0.34]},
        f"MultiSWAG ({results.MEMBERS} x 4)": {"NLL": [0.2, 0.21, 0.19]},
        f"hyper-deep ({results.MEMBERS} of {2 * results.MEMBERS}: L2, label "
        "smoothing)": {"NLL": [0.30, 0.29, 0.31]},
        f"tuned deep ensemble ({results.MEMBERS} of "
        f"{len(results.TUNED_L2) * results.MEMBERS}: L2, early stopping)": {
            "NLL": [0.35, 0.34, 0.36]},
        "SNGP (1 model)": {"AUROC far": [0.95, 0.96, 0.94],
                           "AUROC near": [0.5, 0.52, 0.48]},
        "MC BatchNorm (1 x 20 batches)": {"NLL": [0.6, 0.62, 0.61]},
        results.MAP_ROW: {"AUROC far": [0.8] * 3, "AUROC near": [0.7] * 3},
        f"repulsive, function space ({results.MEMBERS})": {
            "AUROC far": [0.85, 0.86, 0.84], "AUROC near": [0.65, 0.66, 0.64]},
    }  # fmt: skip
    aci = f"EnbPI + ACI (gamma {results.ACI_GAMMA})"
    series = {"a series": {
        aci: {"coverage after the shift": [0.88, 0.89, 0.87]},
        "EnbPI, a sliding residual window": {
            "coverage after the shift": [0.75, 0.77, 0.76]},
        "EnbPI, the training residuals": {
            "coverage after the shift": [0.89, 0.87, 0.88]},
    }}  # fmt: skip
    lines = results.claims(regression, {"digits": rows}, series)

    def verdict(*fragments):
        line = next(ln for ln in lines if all(f in ln for f in fragments))
        return line.rsplit("**", 2)[-2]

    assert verdict("Table 1 on Boston") == "reproduced"
    assert verdict("Table 1 on Concrete") == "not reproduced"
    assert verdict("Adversarial", "Boston") == "supported"
    assert verdict("Adversarial", "Concrete") == "no difference measured"
    assert verdict("beats MC dropout on NLL on Concrete") == "not supported"
    assert verdict("a deep ensemble beats a single model") == "supported"
    assert verdict("Packed-Ensembles match") == "supported"  # inside 2 s.e., fewer
    assert verdict("Laplace approximations (its prior") == "not supported"
    assert verdict("digits: a deep ensemble beats MC dropout") == "supported"
    assert verdict("MultiSWAG beats") == "supported"
    assert verdict("temperature scaling lowers") == "supported"
    assert verdict("hyper-deep ensemble beats the deep") == "no difference measured"
    assert verdict("hyper-deep ensemble beats a deep ensemble tuned") == "supported"
    assert verdict("adaptive conformal", "sliding") == "supported"
    assert verdict("adaptive conformal", "training residuals") == (
        "no difference measured"
    )
    assert verdict("SNGP's distance-aware", "far") == "supported"
    assert verdict("SNGP's distance-aware", "near") == "not supported"
    assert not [ln for ln in lines if "DUE" in ln]  # (no DUE row: no claim)
    assert verdict("MC BatchNorm beats") == "not supported"
    assert verdict("function-space repulsion", "far") == "supported"
    assert verdict("function-space repulsion", "near") == "not supported"
    assert verdict("Mahalanobis distance", "far") == "supported"
    assert verdict("Mahalanobis distance", "near") == "not supported"
    assert all("paired difference" in ln for ln in lines if "Table 1" not in ln)


def test_mnist_ood_images_are_test_images_no_member_trained_on():
    x = np.arange(40, dtype=np.float64)[:, None] * np.ones((1, 3))
    data = {
        "x": x, "y": np.arange(40) % 2, "sizes": (20, 5),
        "ood": {"shifted": x + 0.5}, "ood_of_its_images": True,
    }  # fmt: skip
    for seed in range(3):
        split = results.classification_split(data, seed)
        order = np.random.default_rng(seed).permutation(40)
        train, test = set(order[:20]), set(order[25:])
        rows = set(np.asarray(split["ood_rows"]["shifted"]).tolist())
        assert rows == test and not rows & train


def test_the_pages_cells_and_verdicts_are_those_of_its_per_split_numbers():
    import json

    raw = json.loads((ROOT / "docs" / "results-per-split.json").read_text())
    page = (ROOT / "docs" / "results.md").read_text()
    deep = f"deep ensemble ({results.MEMBERS})"
    digits = raw["classification"]["digits"]
    section = page[page.index("### digits") :]
    row = next(ln for ln in section.splitlines() if ln.startswith(f"| {deep} |"))
    for column in ("NLL", "ECE", "APS coverage", "AURC"):
        digits_of = 4 if column == "AURC" else 3
        assert f"| {results.cell(digits[deep][column], digits_of)} |" in row, column
    # Every claim line on the page is the one the numbers give.
    for line in results.claims(
        raw["regression"], raw["classification"], raw.get("time series")
    ):
        assert line in page, line


def test_the_per_split_csv_is_the_json_and_gives_the_pages_cells():
    import csv
    import json

    raw = json.loads((ROOT / "docs" / "results-per-split.json").read_text())
    with open(ROOT / "docs" / "results-per-split.csv", newline="") as file:
        records = list(csv.DictReader(file))
    rebuilt: dict = {}
    for record in records:
        values = (
            rebuilt.setdefault(record["part"], {})
            .setdefault(record["data set"], {})
            .setdefault(record["method"], {})
            .setdefault(record["column"], [])
        )
        assert int(record["index"]) == len(values)
        text = record["value"]  # an int (a count) or a float's repr
        values.append(int(text) if text.lstrip("-").isdigit() else float(text))
    assert rebuilt == raw  # every number, exactly, and nothing else
    # So the page's cells and claims follow from the CSV alone.
    page = (ROOT / "docs" / "results.md").read_text()
    boston = rebuilt["regression"]["Boston"][results.RECIPE]
    assert f"| {results.cell(boston['RMSE'])} |" in page
    for line in results.claims(
        rebuilt["regression"], rebuilt["classification"], rebuilt.get("time series")
    ):
        assert line in page, line


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
