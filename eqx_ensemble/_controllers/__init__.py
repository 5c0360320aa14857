"""Controllers: components that change a `fit` run between dispatches
(`Controller`, population-based training)."""
