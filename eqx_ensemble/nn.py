"""Layers for ensembles whose members share parts, and for ensembles inside one
network.

Each layer here is written for ONE member, like any Equinox layer; an ensemble of
them is built with [`ee.ensemble`][eqx_ensemble.ensemble] and `shared=` (see the
shared-parts guide):

- [`BatchEnsembleLinear`][eqx_ensemble.nn.BatchEnsembleLinear] and
  [`BatchEnsembleConv`][eqx_ensemble.nn.BatchEnsembleConv] (Wen, Tran & Ba 2020,
  "BatchEnsemble"): a slow weight shared by all members, modulated by per-member
  rank-1 fast weights `r` (input side) and `s` (output side). Share the slow weights
  with `shared=ee.nn.slow_weights` and train them with `train_shared=True`.
- [`LoRALinear`][eqx_ensemble.nn.LoRALinear] and [`lora`][eqx_ensemble.nn.lora] (Hu
  et al. 2022, "LoRA"): low-rank adapters added to the linear layers of any Equinox
  model; an ensemble of adapters over one frozen base model shares the base with
  `shared=ee.nn.lora_base`.

Under the member `vmap` a shared weight is not batched: the members' inputs meet ONE
weight matrix (one wide matmul or convolution), saving memory and time.

Implicit ensembles are ONE network holding several members, mapping one input to
per-member outputs `(members, ...)` ([`members_first`][eqx_ensemble.nn.members_first]
turns a batch of them into the metrics' layout):

- [`PackedLinear`][eqx_ensemble.nn.PackedLinear] and
  [`PackedConv2d`][eqx_ensemble.nn.PackedConv2d] (Laurent et al. 2023,
  "Packed-Ensembles"): members as groups of one grouped layer.
- [`MIMO`][eqx_ensemble.nn.MIMO] and [`mimo_batch`][eqx_ensemble.nn.mimo_batch]
  (Havasi et al. 2021): several inputs in, several heads out.
- [`Masksembles`][eqx_ensemble.nn.Masksembles] and
  [`masksembles_masks`][eqx_ensemble.nn.masksembles_masks] (Durasov et al.
  2021): fixed masks with a controlled overlap.

Single-pass uncertainty, one model's (or each member's) in closed form:

- [`VBLLRegression`][eqx_ensemble.nn.VBLLRegression] and
  [`VBLLClassification`][eqx_ensemble.nn.VBLLClassification] (Harrison et al.
  2024): variational Bayesian last layers.
- [`InducingPointGP`][eqx_ensemble.nn.InducingPointGP]: a sparse variational
  Gaussian-process head (DUE, van Amersfoort et al. 2021).
- [`BoundedSpectralNorm`][eqx_ensemble.nn.BoundedSpectralNorm],
  [`RandomFeatureGP`][eqx_ensemble.nn.RandomFeatureGP] and its posterior
  (`gp_covariance`, `gp_variance`, `mean_field_logits`): SNGP (Liu et al. 2020).

[`Epinet`][eqx_ensemble.nn.Epinet] (Osband et al. 2023): one network, many predictions.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jaxtyping import Array, Float, PRNGKeyArray

from ._layers.epinet import Epinet as Epinet, epinet_loss as epinet_loss
from ._layers.gp import InducingPointGP as InducingPointGP
from ._layers.implicit import (
    MIMO as MIMO,
    Masksembles as Masksembles,
    PackedConv2d as PackedConv2d,
    PackedLinear as PackedLinear,
    masksembles_masks as masksembles_masks,
    members_first as members_first,
    mimo_batch as mimo_batch,
)
from ._layers.sngp import (
    BoundedSpectralNorm as BoundedSpectralNorm,
    RandomFeatureGP as RandomFeatureGP,
    gp_covariance as gp_covariance,
    gp_variance as gp_variance,
    mean_field_logits as mean_field_logits,
)
from ._layers.vbll import (
    VBLLClassification as VBLLClassification,
    VBLLRegression as VBLLRegression,
)

__all__ = [
    "PackedLinear",
    "PackedConv2d",
    "MIMO",
    "mimo_batch",
    "Masksembles",
    "masksembles_masks",
    "members_first",
    "BatchEnsembleConv",
    "BatchEnsembleLinear",
    "LoRALinear",
    "lora",
    "lora_base",
    "slow_weights",
    "InducingPointGP",
    "VBLLRegression",
    "VBLLClassification",
    "BoundedSpectralNorm",
    "RandomFeatureGP",
    "gp_covariance",
    "gp_variance",
    "mean_field_logits",
    "Epinet",
    "epinet_loss",
]


def _fast_init(key: PRNGKeyArray, shape: tuple[int, ...], init: str) -> Array:
    if init == "sign":
        return jax.random.rademacher(key, shape, dtype=jnp.float32)
    if init == "ones":
        return jnp.ones(shape, jnp.float32)
    raise ValueError(f"`fast_init` must be 'sign' or 'ones', got {init!r}")


class BatchEnsembleLinear(eqx.Module):
    """One member of a BatchEnsemble linear layer: `s * (weight @ (r * x)) + bias`.

    `weight` is the slow weight (shared by all members when the ensemble is built
    with `shared=ee.nn.slow_weights`); `r` (in) and `s` (out) are this member's fast
    weights; `bias` is per member, as in Wen et al. (2020).

    **Arguments:**

    - `in_features`, `out_features`: sizes, as `eqx.nn.Linear`.
    - `key`: PRNG key. The slow weight is initialised as `eqx.nn.Linear`'s; the fast
      weights are random signs (`fast_init="sign"`, the paper's choice) or ones
      (`"ones"`: every member starts as the same layer).

    **Example:**

    ```python
    def make(key):
        k1, k2 = jax.random.split(key)
        return eqx.nn.Sequential([
            ee.nn.BatchEnsembleLinear(4, 16, key=k1),
            eqx.nn.Lambda(jax.nn.relu),
            ee.nn.BatchEnsembleLinear(16, 3, key=k2),
        ])

    ens = ee.ensemble(make, size=8, key=jax.random.key(0),
                      shared=ee.nn.slow_weights, train_shared=True)
    ens.shared.layers[0].weight.shape     # (16, 4): held once
    ens.members.layers[0].r.shape         # (8, 4): per member
    ee.predict(ens, jnp.ones((5, 4))).shape   # (8, 5, 3)
    ```
    """

    weight: Float[Array, "out in"]
    r: Float[Array, " in"]
    s: Float[Array, " out"]
    bias: Float[Array, " out"] | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        use_bias: bool = True,
        fast_init: str = "sign",
        key: PRNGKeyArray,
    ):
        k_linear, k_r, k_s = jax.random.split(key, 3)
        linear = eqx.nn.Linear(
            in_features, out_features, use_bias=use_bias, key=k_linear
        )
        self.weight = linear.weight
        self.bias = linear.bias
        self.r = _fast_init(k_r, (in_features,), fast_init)
        self.s = _fast_init(k_s, (out_features,), fast_init)

    def __call__(
        self, x: Float[Array, " in"], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, " out"]:
        del key
        out = self.s * (self.weight @ (self.r * x))
        return out if self.bias is None else out + self.bias


class BatchEnsembleConv(eqx.Module):
    """One member of a BatchEnsemble convolution: the slow convolution applied to the
    input scaled per channel by `r`, its output scaled per channel by `s`, plus a
    per-member bias (Wen et al. 2020).

    **Arguments:**

    - `num_spatial_dims`, `in_channels`, `out_channels`, `kernel_size`, `stride`,
      `padding`: as `eqx.nn.Conv`.
    - `key`, `fast_init`: as
      [`BatchEnsembleLinear`][eqx_ensemble.nn.BatchEnsembleLinear].

    **Example:**

    ```python
    make = lambda k: ee.nn.BatchEnsembleConv(2, 1, 4, 3, padding=1, key=k)
    ens = ee.ensemble(make, size=4, key=jax.random.key(0),
                      shared=ee.nn.slow_weights, train_shared=True)
    ee.predict(ens, jnp.ones((2, 1, 8, 8))).shape    # (4, 2, 4, 8, 8)
    ```
    """

    conv: eqx.nn.Conv
    r: Float[Array, " in"]
    s: Float[Array, " out"]
    bias: Float[Array, " out"] | None

    def __init__(
        self,
        num_spatial_dims: int,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, ...],
        stride: int | tuple[int, ...] = 1,
        padding: Any = 0,
        *,
        use_bias: bool = True,
        fast_init: str = "sign",
        key: PRNGKeyArray,
    ):
        k_conv, k_r, k_s, k_b = jax.random.split(key, 4)
        self.conv = eqx.nn.Conv(
            num_spatial_dims,
            in_channels,
            out_channels,
            kernel_size,
            stride=stride,
            padding=padding,
            use_bias=False,
            key=k_conv,
        )
        self.r = _fast_init(k_r, (in_channels,), fast_init)
        self.s = _fast_init(k_s, (out_channels,), fast_init)
        if use_bias:
            bound = 1 / (in_channels * self.conv.weight[0, 0].size) ** 0.5
            self.bias = jax.random.uniform(
                k_b, (out_channels,), minval=-bound, maxval=bound
            )
        else:
            self.bias = None

    def __call__(
        self, x: Float[Array, "in_channels ..."], *, key: PRNGKeyArray | None = None
    ) -> Float[Array, "out_channels ..."]:
        del key
        spatial = (1,) * (x.ndim - 1)
        out = self.conv(x * self.r.reshape(-1, *spatial))
        out = out * self.s.reshape(-1, *spatial)
        if self.bias is not None:
            out = out + self.bias.reshape(-1, *spatial)
        return out


def slow_weights(model: Any) -> tuple[Any, ...]:
    """The slow (shared) weights of every BatchEnsemble layer in `model`: pass it as
    `shared=` to [`ee.ensemble`][eqx_ensemble.ensemble].

    **Example:**

    ```python
    make = lambda k: ee.nn.BatchEnsembleLinear(3, 2, key=k)
    ens = ee.ensemble(make, size=4, key=jax.random.key(0),
                      shared=ee.nn.slow_weights, train_shared=True)
    ens.shared.weight.shape        # (2, 3)
    ```
    """
    nodes = []
    for layer in _layers(model, (BatchEnsembleLinear, BatchEnsembleConv)):
        if isinstance(layer, BatchEnsembleLinear):
            nodes.append(layer.weight)
        else:
            nodes.append(layer.conv.weight)
    if not nodes:
        raise ValueError(
            "`ee.nn.slow_weights` found no BatchEnsemble layer in the model"
        )
    return tuple(nodes)


class LoRALinear(eqx.Module):
    """A linear layer plus a low-rank adapter: `base(x) + scale * b @ (a @ x)` (Hu et
    al. 2022). `a` starts random and `b` at zero, so a fresh adapter leaves the base
    layer's output unchanged.

    **Arguments:**

    - `base`: the `eqx.nn.Linear` adapted.
    - `rank`: the adapter's rank.
    - `alpha`: `scale = alpha / rank` (the paper's scaling; default `alpha = rank`).
    - `key`: PRNG key for `a`.

    **Example:**

    ```python
    base = eqx.nn.Linear(8, 4, key=jax.random.key(0))
    layer = ee.nn.LoRALinear(base, rank=2, key=jax.random.key(1))
    x = jnp.ones(8)
    assert jnp.allclose(layer(x), base(x))   # b starts at zero
    ```
    """

    base: eqx.nn.Linear
    a: Float[Array, "rank in"]
    b: Float[Array, "out rank"]
    scale: float = eqx.field(static=True)

    def __init__(
        self,
        base: eqx.nn.Linear,
        rank: int,
        *,
        alpha: float | None = None,
        key: PRNGKeyArray,
    ):
        if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
            raise ValueError(f"`rank` must be a positive int, got {rank!r}")
        in_features = base.weight.shape[1]
        out_features = base.weight.shape[0]
        self.base = base
        self.a = jax.random.normal(key, (rank, in_features)) / in_features**0.5
        self.b = jnp.zeros((out_features, rank))
        self.scale = float(rank if alpha is None else alpha) / rank

    def __call__(
        self, x: Float[Array, " in"], *, key: PRNGKeyArray | None = None
    ) -> Array:
        return self.base(x, key=key) + self.scale * (self.b @ (self.a @ x))


def lora(
    model: Any,
    *,
    rank: int,
    key: PRNGKeyArray,
    where: Callable[[eqx.nn.Linear], bool] | None = None,
    alpha: float | None = None,
) -> Any:
    """`model` with every `eqx.nn.Linear` (or those `where(layer)` picks) wrapped in a
    [`LoRALinear`][eqx_ensemble.nn.LoRALinear] adapter. With `shared=ee.nn.lora_base`
    (see the example), an ensemble of adapters over ONE frozen base model: only the
    adapters are stacked and trained.

    **Arguments:**

    - `model`: any Equinox model.
    - `rank`, `alpha`: as [`LoRALinear`][eqx_ensemble.nn.LoRALinear].
    - `key`: PRNG key, split over the adapted layers.
    - `where`: optional `layer -> bool` picking the linear layers to adapt
      (default: all of them).

    **Example:**

    ```python
    base = eqx.nn.MLP(4, 2, 32, 2, key=jax.random.key(0))
    ens = ee.ensemble(lambda k: ee.nn.lora(base, rank=2, key=k), size=8,
                      key=jax.random.key(1), shared=ee.nn.lora_base)
    ens.shared.layers[1].base.weight.shape   # (32, 32): the base, once
    ens.members.layers[1].a.shape            # (8, 2, 32): one adapter per member
    ```
    """
    is_linear = lambda x: isinstance(x, eqx.nn.Linear)
    linears = [
        node
        for node in jtu.tree_leaves(model, is_leaf=is_linear)
        if is_linear(node) and (where is None or where(node))
    ]
    if not linears:
        raise ValueError("`ee.nn.lora` found no `eqx.nn.Linear` layer to adapt")
    keys = iter(jax.random.split(key, len(linears)))
    picked = {id(node) for node in linears}

    def adapt(node):
        if is_linear(node) and id(node) in picked:
            return LoRALinear(node, rank, alpha=alpha, key=next(keys))
        return node

    return jtu.tree_map(adapt, model, is_leaf=is_linear)


def lora_base(model: Any) -> tuple[Any, ...]:
    """Every array leaf of `model` except the LoRA adapters' `a` and `b`: the frozen
    base that an adapter ensemble shares (pass as `shared=`).

    **Example:**

    ```python
    base = eqx.nn.Linear(3, 2, key=jax.random.key(0))
    make = lambda k: ee.nn.lora(base, rank=1, key=k)
    ens = ee.ensemble(make, size=4, key=jax.random.key(1), shared=ee.nn.lora_base)
    ens.shared.base.weight.shape      # (2, 3)
    ```
    """
    adapters = {
        id(leaf)
        for layer in _layers(model, (LoRALinear,))
        for leaf in (layer.a, layer.b)
    }
    if not adapters:
        raise ValueError("`ee.nn.lora_base` found no LoRA adapter in the model")
    return tuple(
        leaf
        for leaf in jtu.tree_leaves(model)
        if (eqx.is_array(leaf) or isinstance(leaf, jax.ShapeDtypeStruct))
        and id(leaf) not in adapters
    )


def _layers(model: Any, types: tuple[type, ...]) -> list[Any]:
    is_layer = lambda x: isinstance(x, types)
    return [node for node in jtu.tree_leaves(model, is_leaf=is_layer) if is_layer(node)]
