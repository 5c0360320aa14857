"""Posterior approximations around trained members: Laplace."""
