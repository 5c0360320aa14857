"""Checkpoints: the verified file format, PyTree structure records, leaves on
one or many processes, checkpoint folders, and the `Checkpoints` component of
`fit`."""
