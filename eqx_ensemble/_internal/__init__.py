"""Helpers every family uses: PyTree utilities, argument checks, key derivation.

Nothing here knows what an ensemble is."""
