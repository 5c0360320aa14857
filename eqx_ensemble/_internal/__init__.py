"""Helpers every family uses; nothing here knows what an ensemble is."""
