"""Compiled programs kept on disk across processes: JAX's persistent cache."""

import os
import pathlib

import jax
from jax.experimental.compilation_cache import compilation_cache as _jax_cache

# The folder `compilation_cache()` uses unless told (else the user's cache folder).
ENVIRONMENT_VARIABLE = "EQX_ENSEMBLE_COMPILATION_CACHE"


def _default_directory() -> pathlib.Path:
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base) / "eqx_ensemble" / "xla"


def compilation_cache(
    directory: str | os.PathLike[str] | None = None,
    *,
    min_compile_seconds: float = 0.0,
) -> pathlib.Path:
    """Keep every compiled program on disk, so that a script run again, a
    restarted notebook or another process compiles nothing it compiled before.

    Opt-in and process-wide: it turns on JAX's persistent compilation cache
    (`jax_compilation_cache_dir`) for every program compiled after the call.
    Tracing still happens, XLA's compilation does not. Only trusted users
    should write to the folder (JAX loads what it finds there).

    **Arguments:**

    - `directory`: the cache folder (created if missing). Default: the
      `EQX_ENSEMBLE_COMPILATION_CACHE` environment variable, else
      `~/.cache/eqx_ensemble/xla` (under `XDG_CACHE_HOME` when set).
    - `min_compile_seconds`: only programs that took at least this long to
      compile are written (JAX's `jax_persistent_cache_min_compile_time_secs`;
      default 0: all of them).

    **Returns:**

    The cache folder, as a `pathlib.Path`.

    **Example:**

    ```python
    import tempfile

    folder = ee.compilation_cache(tempfile.mkdtemp())
    ens = ee.ensemble(lambda k: eqx.nn.MLP(1, 1, 8, 1, key=k), size=2,
                      key=jax.random.key(0))
    ens(jnp.ones(1)).shape     # (2, 1): compiled once, then read from `folder`
    ```
    """
    if directory is not None and not isinstance(directory, str | os.PathLike):
        raise TypeError(
            "`directory` must be a folder's path (a str or pathlib.Path) or None, "
            f"got {type(directory).__name__} {directory!r}"
        )
    if min_compile_seconds < 0:
        raise ValueError(
            f"`min_compile_seconds` must be at least 0, got {min_compile_seconds}"
        )
    if directory is None:
        directory = os.environ.get(ENVIRONMENT_VARIABLE) or _default_directory()
    path = pathlib.Path(directory).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    if not os.access(path, os.W_OK):
        raise PermissionError(f"The compilation cache folder {path} is not writable")
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", min_compile_seconds)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # JAX decides at its first compilation whether to use the cache: decide again.
    _jax_cache.reset_cache()
    return path
