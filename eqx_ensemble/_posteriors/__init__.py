"""Posterior approximations: Laplace around trained members, MC dropout."""
