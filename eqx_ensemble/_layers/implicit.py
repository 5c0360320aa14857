"""Implicit ensembles: several members inside ONE network. Packed-Ensembles
(grouped layers), MIMO (several inputs in, several heads out) and Masksembles
(fixed masks with a controlled overlap). Each network maps one input to
per-member outputs `(members, ...)`."""

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, PRNGKeyArray, PyTree

from .._internal.checks import check_positive_int
from .._internal.keys import check_key
from .._internal.tree import as_array


def _check_alpha(alpha: Any) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, int | float):
        raise TypeError(f"`alpha` must be a number, got {alpha!r}")
    if not (math.isfinite(alpha) and alpha > 0):
        raise ValueError(f"`alpha` must be positive and finite, got {alpha}")
    return float(alpha)


def _packed_sizes(
    name: str,
    in_size: int,
    out_size: int,
    members: int,
    alpha: float | int,
    gamma: int,
    first: bool,
    last: bool,
    names: tuple[str, str] = ("in_features", "out_features"),
) -> tuple[int, int, int]:
    """`(extended in, extended out, groups)` of a packed layer."""
    check_positive_int(in_size, f"{name}.{names[0]}")
    check_positive_int(out_size, f"{name}.{names[1]}")
    check_positive_int(members, f"{name}.members")
    check_positive_int(gamma, f"{name}.gamma")
    alpha = _check_alpha(alpha)
    extended_in = in_size if first else round(in_size * alpha)
    extended_out = out_size * members if last else round(out_size * alpha)
    groups = 1 if first else members * gamma
    for side, size in (("input", extended_in), ("output", extended_out)):
        if size % (members * gamma if side == "output" or not first else 1):
            raise ValueError(
                f"{name}: the {side} width {size} (after `alpha={alpha:g}`) must be "
                f"divisible by `members * gamma` = {members} * {gamma} = "
                f"{members * gamma}, so every member gets whole groups; choose "
                "widths, `alpha` or `gamma` that divide"
            )
    return extended_in, extended_out, groups


class PackedLinear(eqx.Module):
    """A Packed-Ensembles linear layer (Laurent et al. 2023, "Packed-Ensembles
    for efficient uncertainty estimation"): `members` independent linear layers
    of width `alpha * width / members` as one grouped (block-diagonal) layer,
    `gamma` groups per member. In a network of them, member `m` reads and writes
    only its own `1/members` of the features.

    **Arguments:**

    - `in_features`, `out_features`: the widths of the network being packed
      (the layer's are `alpha` times these, except the first layer's input and
      the last layer's output); they must divide into `members * gamma` groups.
    - `members`: the number of members `M`.
    - `alpha`: the width factor (`alpha = M`: each member the original width).
    - `gamma`: groups per member (the paper's `gamma`).
    - `first`: the network's first layer (it reads the shared input); `last`:
      its last (it returns `(members, out_features)`).
    - `use_bias`: as `eqx.nn.Linear`.
    - `key`: PRNG key; each group is initialised as an `eqx.nn.Linear`.

    **Example:**

    ```python
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    layers = [
        ee.nn.PackedLinear(8, 32, members=4, alpha=2, first=True, key=k1),
        ee.nn.PackedLinear(32, 32, members=4, alpha=2, key=k2),
        ee.nn.PackedLinear(32, 3, members=4, alpha=2, last=True, key=k3),
    ]

    def net(x):
        for layer in layers[:-1]:
            x = jax.nn.relu(layer(x))
        return layers[-1](x)

    net(jnp.ones(8)).shape        # (4, 3): one output per member
    ```
    """

    weight: Float[Array, "groups out_per_group in_per_group"]
    bias: Float[Array, " out"] | None
    members: int = eqx.field(static=True)
    first: bool = eqx.field(static=True)
    last: bool = eqx.field(static=True)

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        members: int,
        alpha: float | int = 1.0,
        gamma: int = 1,
        first: bool = False,
        last: bool = False,
        use_bias: bool = True,
        key: PRNGKeyArray,
    ):
        check_key(key)
        extended_in, extended_out, groups = _packed_sizes(
            "PackedLinear", in_features, out_features, members, alpha, gamma,
            first, last,
        )  # fmt: skip
        in_group, out_group = extended_in // groups, extended_out // groups
        w_key, b_key = jax.random.split(key)
        bound = 1 / math.sqrt(in_group)
        self.weight = jax.random.uniform(
            w_key, (groups, out_group, in_group), minval=-bound, maxval=bound
        )
        self.bias = (
            jax.random.uniform(b_key, (extended_out,), minval=-bound, maxval=bound)
            if use_bias
            else None
        )
        self.members, self.first, self.last = members, first, last

    def __call__(
        self, x: Float[Array, " in"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, " out"] | Float[Array, "members out_per_member"]:
        del key
        groups, _, in_group = self.weight.shape
        if x.shape != (groups * in_group,):
            raise ValueError(
                f"PackedLinear expects inputs of shape ({groups * in_group},) (one "
                f"example; `jax.vmap` over a batch), got {x.shape}"
            )
        out = jnp.einsum("goi,gi->go", self.weight, x.reshape(groups, in_group))
        out = out.reshape(-1)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(self.members, -1) if self.last else out


class PackedConv2d(eqx.Module):
    """A Packed-Ensembles 2-D convolution (Laurent et al. 2023): `members`
    independent convolutions of `alpha * channels / members` channels, held as
    one grouped convolution (`members * gamma` groups). One image `(channels,
    height, width)` per call, as `eqx.nn.Conv2d`; with `last=True` the output is
    `(members, out_channels, height, width)`.

    **Arguments:**

    - `in_channels`, `out_channels`: the channels of the network being packed.
    - `kernel_size`, `stride`, `padding`, `use_bias`: as `eqx.nn.Conv2d`.
    - `members`, `alpha`, `gamma`, `first`, `last`, `key`: as
      [`PackedLinear`][eqx_ensemble.nn.PackedLinear].

    **Example:**

    ```python
    conv = ee.nn.PackedConv2d(1, 8, 3, members=4, alpha=2, padding=1, first=True,
                              key=jax.random.key(0))
    conv(jnp.ones((1, 8, 8))).shape           # (16, 8, 8): 4 members x 4 channels
    ```
    """

    conv: eqx.nn.Conv2d
    members: int = eqx.field(static=True)
    last: bool = eqx.field(static=True)

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        *,
        members: int,
        alpha: float | int = 1.0,
        gamma: int = 1,
        first: bool = False,
        last: bool = False,
        stride: int | tuple[int, int] = 1,
        padding: Any = 0,
        use_bias: bool = True,
        key: PRNGKeyArray,
    ):
        check_key(key)
        extended_in, extended_out, groups = _packed_sizes(
            "PackedConv2d", in_channels, out_channels, members, alpha, gamma,
            first, last, names=("in_channels", "out_channels"),
        )  # fmt: skip
        self.conv = eqx.nn.Conv2d(
            extended_in, extended_out, kernel_size, stride=stride, padding=padding,
            groups=groups, use_bias=use_bias, key=key,
        )  # fmt: skip
        self.members, self.last = members, last

    def __call__(
        self,
        x: Float[Array, "channels height width"],
        *,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "..."]:
        del key
        out = self.conv(x)
        return out.reshape(self.members, -1, *out.shape[1:]) if self.last else out


class MIMO(eqx.Module):
    """A multi-input multi-output network (Havasi et al. 2021, "Training
    independent subnetworks for robust prediction"): `members` inputs are
    concatenated along their first axis (features, or channels of an image),
    one `body` computes on them, and its output is split into `members` heads.

    Train it on [`mimo_batch`][eqx_ensemble.nn.mimo_batch]'s independently
    shuffled inputs, each head on its own input's label; predict with
    [`predict`][eqx_ensemble.nn.MIMO.predict] (the same input to every head).

    **Arguments:**

    - `body`: ONE model from the concatenated inputs `(members * features,
      ...)` to `members * outputs` numbers (e.g. an `eqx.nn.MLP(members *
      features, members * classes, ...)`).
    - `members`: the number of inputs and heads.

    **Example:**

    ```python
    body = eqx.nn.MLP(3 * 4, 3 * 2, 32, 2, key=jax.random.key(0))
    mimo = ee.nn.MIMO(body, members=3)
    mimo(jnp.ones((3, 4))).shape        # (3, 2): head m reads input m
    mimo.predict(jnp.ones(4)).shape     # (3, 2): every head reads this input
    ```
    """

    body: PyTree[Any]
    members: int = eqx.field(static=True)

    def __init__(self, body: Any, *, members: int):
        if not callable(body):
            raise TypeError(f"`body` must be a model (callable), got {body!r}")
        self.body = body
        self.members = check_positive_int(members, "MIMO.members")

    def __call__(
        self, xs: Float[Array, "members ..."], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "members ..."]:
        if xs.ndim < 2 or xs.shape[0] != self.members:
            raise ValueError(
                f"MIMO takes one input per member, shape ({self.members}, ...), got "
                f"{xs.shape}; for one input to every head use `MIMO.predict`"
            )
        stacked = xs.reshape(self.members * xs.shape[1], *xs.shape[2:])
        out = self.body(stacked) if key is None else self.body(stacked, key=key)
        if out.size % self.members:
            raise ValueError(
                f"MIMO's body returned shape {out.shape}, which does not split into "
                f"{self.members} heads"
            )
        return out.reshape(self.members, -1)

    def predict(
        self, x: Float[Array, "..."], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "members ..."]:
        """Every head on the same input `x` (one example): `(members, outputs)`.

        **Example:**

        ```python
        mimo = ee.nn.MIMO(eqx.nn.Linear(2 * 3, 2 * 5, key=jax.random.key(0)),
                          members=2)
        mimo.predict(jnp.ones(3)).shape     # (2, 5)
        ```
        """
        return self(jnp.broadcast_to(x, (self.members, *x.shape)), key=key)


def mimo_batch(
    key: PRNGKeyArray,
    batch: PyTree[Any],
    members: int,
    *,
    input_repetition: float | int = 0.0,
    batch_repetition: int = 1,
) -> PyTree[Any]:
    """A MIMO training batch (Havasi et al. 2021): the batch is repeated
    `batch_repetition` times and shuffled; each member gets its own shuffle of
    the first `1 - input_repetition` of it, the rest the same for every member.

    **Arguments:**

    - `key`: PRNG key (e.g. the loss's key).
    - `batch`: a PyTree of arrays with a leading example axis `n`, e.g. `(x, y)`.
    - `members`: the MIMO network's members.
    - `input_repetition`: the fraction in `[0, 1)` of examples every member sees
      at the same position (the paper's `rho`).
    - `batch_repetition`: how many times the batch is repeated (`>= 1`).

    **Returns:**

    The batch with leading axes `(n * batch_repetition, members)`: example
    `i`'s member `m` entry is what head `m` trains on.

    **Example:**

    ```python
    x, y = jnp.ones((16, 4)), jnp.arange(16) % 3
    xs, ys = ee.nn.mimo_batch(jax.random.key(0), (x, y), 3, batch_repetition=2)
    xs.shape, ys.shape                  # (32, 3, 4), (32, 3)
    ```
    """
    check_key(key)
    members = check_positive_int(members, "members")
    repeats = check_positive_int(batch_repetition, "batch_repetition")
    if isinstance(input_repetition, bool) or not isinstance(
        input_repetition, int | float
    ):
        raise TypeError(
            f"`input_repetition` must be a number, got {input_repetition!r}"
        )
    if not 0 <= input_repetition < 1:
        raise ValueError(
            f"`input_repetition` must be in [0, 1) (the fraction of the batch every "
            f"member sees at the same position), got {input_repetition}"
        )
    leaves = jax.tree.leaves(batch)
    if not leaves:
        raise ValueError("`batch` holds no array")
    sizes = {int(np.shape(leaf)[0]) if np.ndim(leaf) else -1 for leaf in leaves}
    if len(sizes) != 1 or min(sizes) < 1:
        raise ValueError(
            "every array of `batch` needs the same, non-empty leading example axis; "
            f"got shapes {[tuple(np.shape(leaf)) for leaf in leaves]}"
        )
    (n,) = sizes
    total = n * repeats
    shuffled = int(total * (1.0 - input_repetition))
    main_key, *member_keys = jax.random.split(key, members + 1)
    main = jax.random.permutation(main_key, jnp.tile(jnp.arange(n), repeats))
    indices = jnp.stack(
        [
            jnp.concatenate(
                [jax.random.permutation(k, main[:shuffled]), main[shuffled:]]
            )
            for k in member_keys
        ],
        axis=1,
    )  # (total, members)
    return jax.tree.map(lambda leaf: jnp.asarray(leaf)[indices], batch)


def masksembles_masks(
    features: int, members: int, scale: float | int, *, key: PRNGKeyArray
) -> Bool[Array, "members features"]:
    """`members` binary masks over `features` channels with a controlled overlap
    (Durasov et al. 2021, "Masksembles for uncertainty estimation"): every mask
    keeps the same number `m` of channels, drawn at random among `m * scale`
    positions, and every channel is kept by at least one mask.

    `scale = 1` gives identical all-ones masks (one model); larger scales give
    less overlap. The scale is bisected, as in the authors' code, until exactly
    `features` positions are used.

    **Arguments:**

    - `features`: channels to mask (at least 10 for `scale > 1`).
    - `members`: the number of masks.
    - `scale`: the overlap control, in `[1, 6]`.
    - `key`: PRNG key.

    **Returns:**

    A boolean array `(members, features)`.

    **Example:**

    ```python
    masks = ee.nn.masksembles_masks(64, 4, 2.0, key=jax.random.key(0))
    masks.shape, masks.sum(axis=1)      # (4, 64), the same count for every mask
    ```
    """
    check_key(key)
    features = check_positive_int(features, "features")
    members = check_positive_int(members, "members")
    if isinstance(scale, bool) or not isinstance(scale, int | float):
        raise TypeError(f"`scale` must be a number, got {scale!r}")
    if not 1 <= scale <= 6:
        raise ValueError(f"`scale` must be in [1, 6], got {scale}")
    if scale == 1:
        return jnp.ones((members, features), bool)
    if features < 10:
        raise ValueError(
            f"Masksembles needs at least 10 features to mask with `scale > 1`, got "
            f"{features}"
        )
    seed = np.asarray(jax.random.key_data(jax.random.fold_in(key, 0))).ravel()
    rng = np.random.default_rng(seed.tolist())
    # Kept channels per mask so `members` masks use `features` on average.
    kept = int(features / (scale * (1 - (1 - 1 / scale) ** members)))
    low, high = scale * 0.8, scale * 1.2
    for _ in range(1000):
        middle = (low + high) / 2
        positions = max(int(kept * middle), kept)
        masks = np.zeros((members, positions), bool)
        for row in masks:
            row[rng.choice(positions, kept, replace=False)] = True
        masks = masks[:, masks.any(axis=0)]
        if masks.shape[1] == features:
            return as_array(masks)
        if masks.shape[1] > features:
            high = middle
        else:
            low = middle
    raise ValueError(
        f"could not draw {members} masks over exactly {features} features at scale "
        f"{scale}; try another scale"
    )


class Masksembles(eqx.Module):
    """Masksembles (Durasov et al. 2021): member `m`'s features multiplied by
    its fixed binary mask. Inputs and outputs are `(members, features, ...)`:
    broadcast the input to `(members, ...)` at the start of the network and
    `jax.vmap` the shared layers over the member axis. The masks are drawn once
    by [`masksembles_masks`][eqx_ensemble.nn.masksembles_masks] and not trained.

    **Arguments:**

    - `features`, `members`, `scale`, `key`: as `masksembles_masks`.

    **Example:**

    ```python
    masks = ee.nn.Masksembles(16, 4, 2.0, key=jax.random.key(0))
    h = jnp.ones((4, 16))               # (members, features)
    masks(h).shape                      # (4, 16): zeros where a member's mask is off
    ```
    """

    masks: Bool[Array, "members features"]

    def __init__(
        self, features: int, members: int, scale: float | int, *, key: PRNGKeyArray
    ):
        self.masks = masksembles_masks(features, members, scale, key=key)

    def __call__(
        self,
        x: Float[Array, "members features ..."],
        *,
        key: PRNGKeyArray | None = None,
    ) -> Float[Array, "members features ..."]:
        del key
        members, features = self.masks.shape
        if x.shape[:2] != (members, features):
            raise ValueError(
                f"Masksembles expects (members, features, ...) = ({members}, "
                f"{features}, ...), got {x.shape}"
            )
        mask = self.masks.reshape(members, features, *(1,) * (x.ndim - 2))
        return jnp.where(mask, x, jnp.zeros((), x.dtype))


def members_first(outputs: Float[Array, "batch members ..."]) -> Array:
    """An implicit ensemble's batched outputs `(batch, members, ...)` as
    `(members, batch, ...)`, the layout `ee.metrics` and `ee.conformal` take.

    **Example:**

    ```python
    outputs = jnp.zeros((32, 4, 10))          # 32 inputs, 4 members, 10 classes
    ee.nn.members_first(outputs).shape        # (4, 32, 10)
    ```
    """
    outputs = jnp.asarray(outputs)
    if outputs.ndim < 2:
        raise ValueError(
            f"`outputs` must be (batch, members, ...), got shape {outputs.shape}"
        )
    return jnp.swapaxes(outputs, 0, 1)
