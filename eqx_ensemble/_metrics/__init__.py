"""Metrics on stacked predictions (`ee.metrics` re-exports them): input
checks, classification, calibration, regression, uncertainty, OOD, selective
prediction and temperature scaling."""
