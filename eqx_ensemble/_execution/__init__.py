"""How work executes, never what it computes: `Execution`, the member layout,
profiles read from jaxprs, XLA compiler options and the bounded caches of
compiled programs. The heuristics that choose automatically live here."""
