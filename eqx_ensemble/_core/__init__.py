"""The ensemble itself: `Ensemble`, `ensemble`, stack/unstack, the map engine
behind `map`, `predict` and `ens(x)`, data checks, and placement on a mesh."""
