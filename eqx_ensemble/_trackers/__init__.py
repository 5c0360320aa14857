"""Trackers: weight-trajectory methods updated inside `fit`'s compiled loop
(`Tracker`, EMA/SWA, SWAG, snapshots, cyclic schedules)."""
