"""Layers for ensembles inside one network (implicit ensembles)."""
