"""Checkpoints: the verified file format, structure records, leaves on one or
many processes, checkpoint folders, and `fit`'s `Checkpoints` component."""
