"""Implicit ensembles: packed layers equal M independent small layers built from
their blocks, MIMO against a hand-written version of the paper's layout, the
Masksembles masks' properties, and bad input."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import eqx_ensemble as ee

M = 4


def _blocks(layer: ee.nn.PackedLinear) -> list[eqx.nn.Linear]:
    """Member m's own small layers, cut out of the packed weights (gamma groups
    each: a block-diagonal member)."""
    groups, out_g, in_g = layer.weight.shape
    gamma = groups // M
    bias = None if layer.bias is None else layer.bias.reshape(groups, out_g)
    members = []
    for m in range(M):
        linears = []
        for g in range(m * gamma, (m + 1) * gamma):
            linear = eqx.nn.Linear(in_g, out_g, key=jax.random.key(0))
            linear = eqx.tree_at(lambda lin: lin.weight, linear, layer.weight[g])
            linear = eqx.tree_at(lambda lin: lin.bias, linear, bias[g])
            linears.append(linear)
        members.append(linears)
    return members


@pytest.mark.parametrize("gamma", [1, 2])
def test_packed_mlp_is_m_independent_mlps(gamma):
    keys = jax.random.split(jax.random.key(0), 3)
    first = ee.nn.PackedLinear(
        6, 16, members=M, alpha=2, gamma=gamma, first=True, key=keys[0]
    )
    middle = ee.nn.PackedLinear(16, 16, members=M, alpha=2, gamma=gamma, key=keys[1])
    last = ee.nn.PackedLinear(
        16, 4, members=M, alpha=2, gamma=gamma, last=True, key=keys[2]
    )

    def packed(x):
        return last(jax.nn.relu(middle(jax.nn.relu(first(x)))))

    x = jax.random.normal(jax.random.key(1), (6,))
    got = packed(x)
    assert got.shape == (M, 4)
    # By hand: member m's rows of the dense first layer, then its own blocks.
    width = 32 // M  # alpha * 16 / M features per member
    h = jax.nn.relu(first.weight[0] @ x + first.bias).reshape(M, width)
    mids, lasts = _blocks(middle), _blocks(last)
    for m in range(M):
        chunks = h[m].reshape(gamma, -1)
        h2 = jax.nn.relu(
            jnp.concatenate([lin(c) for lin, c in zip(mids[m], chunks, strict=True)])
        )
        chunks = h2.reshape(gamma, -1)
        out = jnp.concatenate([lin(c) for lin, c in zip(lasts[m], chunks, strict=True)])
        np.testing.assert_allclose(got[m], out, rtol=1e-5, atol=1e-6)


def test_packed_conv_is_m_independent_convs():
    conv = ee.nn.PackedConv2d(
        8, 8, 3, members=M, alpha=1, padding=1, key=jax.random.key(0)
    )
    x = jax.random.normal(jax.random.key(1), (8, 6, 6))
    got = conv(x)
    per = 8 // M
    weight, bias = conv.conv.weight, conv.conv.bias
    for m in range(M):
        alone = eqx.nn.Conv2d(per, per, 3, padding=1, key=jax.random.key(2))
        alone = eqx.tree_at(lambda c: c.weight, alone, weight[m * per : (m + 1) * per])
        alone = eqx.tree_at(lambda c: c.bias, alone, bias[m * per : (m + 1) * per])
        np.testing.assert_allclose(
            got[m * per : (m + 1) * per], alone(x[m * per : (m + 1) * per]),
            rtol=1e-5, atol=1e-5,
        )  # fmt: skip
    last = ee.nn.PackedConv2d(
        8, 5, 3, members=M, alpha=1, last=True, key=jax.random.key(3)
    )
    assert last(x).shape == (M, 5, 4, 4)


def test_packed_layers_train_through_fit():
    keys = jax.random.split(jax.random.key(0), 2)

    class Net(eqx.Module):
        a: ee.nn.PackedLinear
        b: ee.nn.PackedLinear

        def __call__(self, x):
            return self.b(jax.nn.relu(self.a(x)))

    net = Net(
        ee.nn.PackedLinear(2, 16, members=M, alpha=2, first=True, key=keys[0]),
        ee.nn.PackedLinear(16, 2, members=M, alpha=2, last=True, key=keys[1]),
    )
    x = jax.random.normal(jax.random.key(1), (256, 2))
    y = (x[:, 0] * x[:, 1] > 0).astype(jnp.int32)

    def loss(model, batch, key):
        logits = jax.vmap(model)(batch[0])  # (batch, members, classes)
        labels = jnp.broadcast_to(batch[1][:, None], logits.shape[:2])
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    ens = ee.stack([net])
    trained = ee.fit(
        ens, loss, optax.adam(1e-2), (x, y), steps=300, batch_size=64,
        key=jax.random.key(2), callbacks=(),
    ).ensemble[0]  # fmt: skip
    logits = ee.nn.members_first(jax.vmap(trained)(x))
    assert logits.shape == (M, 256, 2)
    assert float(ee.metrics.accuracy(logits, y, from_logits=True)) > 0.9
    assert float(ee.metrics.disagreement(logits, from_logits=True).mean()) >= 0.0


def test_mimo_batch_follows_the_papers_layout():
    x = jnp.arange(10.0)[:, None] * jnp.ones((10, 3))
    y = jnp.arange(10)
    key = jax.random.key(0)
    xs, ys = ee.nn.mimo_batch(key, (x, y), 3, input_repetition=0.4, batch_repetition=2)
    # By hand, as the authors' code: tile, shuffle, then per member a shuffle of
    # the first (1 - rho) of it.
    main_key, *member_keys = jax.random.split(key, 4)
    main = np.asarray(jax.random.permutation(main_key, jnp.tile(jnp.arange(10), 2)))
    cut = int(20 * 0.6)
    for m, k in enumerate(member_keys):
        expected = np.concatenate(
            [np.asarray(jax.random.permutation(k, main[:cut])), main[cut:]]
        )
        np.testing.assert_array_equal(ys[:, m], expected)
        np.testing.assert_array_equal(xs[:, m, 0], expected.astype(np.float32))
    # The repeated part is the same for every member; each member sees every
    # example batch_repetition times.
    assert (ys[cut:] == ys[cut:, :1]).all()
    for m in range(3):
        assert sorted(np.asarray(ys[:, m]).tolist()) == sorted(list(range(10)) * 2)


def test_mimo_network_against_a_hand_written_version():
    body = eqx.nn.MLP(3 * 4, 3 * 2, 16, 1, key=jax.random.key(0))
    mimo = ee.nn.MIMO(body, members=3)
    xs = jax.random.normal(jax.random.key(1), (3, 4))
    # The paper: inputs concatenated, one body, outputs split into heads.
    np.testing.assert_allclose(mimo(xs), body(xs.reshape(-1)).reshape(3, 2), rtol=1e-6)
    x = xs[0]
    np.testing.assert_allclose(
        mimo.predict(x), body(jnp.tile(x, 3)).reshape(3, 2), rtol=1e-6
    )
    # Images: concatenated along channels.
    conv_body = eqx.nn.Sequential(
        [
            eqx.nn.Conv2d(3 * 1, 3 * 2, 3, key=jax.random.key(2)),
            eqx.nn.Lambda(jnp.ravel),
        ]
    )
    images = jax.random.normal(jax.random.key(3), (3, 1, 5, 5))
    out = ee.nn.MIMO(conv_body, members=3)(images)
    np.testing.assert_allclose(
        out, conv_body(images.reshape(3, 5, 5)).reshape(3, -1), rtol=1e-6
    )


def test_mimo_trains_heads_to_independent_members():
    body = eqx.nn.MLP(3 * 2, 3 * 2, 32, 2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (512, 2))
    y = (x[:, 0] * x[:, 1] > 0).astype(jnp.int32)

    def loss(model, batch, key):
        xs, ys = ee.nn.mimo_batch(key, batch, 3)
        logits = jax.vmap(model)(xs)  # (batch, members, classes)
        return optax.softmax_cross_entropy_with_integer_labels(logits, ys).mean()

    trained = ee.fit(
        ee.stack([ee.nn.MIMO(body, members=3)]), loss, optax.adam(1e-2), (x, y),
        steps=400, batch_size=64, key=jax.random.key(2), callbacks=(),
    ).ensemble[0]  # fmt: skip
    logits = ee.nn.members_first(jax.vmap(trained.predict)(x))
    assert float(ee.metrics.accuracy(logits, y, from_logits=True)) > 0.85


@pytest.mark.parametrize("scale", [1.5, 2.0, 3.0])
def test_masksembles_masks(scale):
    masks = np.asarray(ee.nn.masksembles_masks(64, M, scale, key=jax.random.key(0)))
    assert masks.shape == (M, 64) and masks.dtype == bool
    counts = masks.sum(axis=1)
    assert (counts == counts[0]).all() and counts[0] < 64  # same size, not all
    assert masks.any(axis=0).all()  # every feature used by some member


def test_masksembles_overlap_falls_with_scale():
    def overlap(scale):
        masks = np.asarray(
            ee.nn.masksembles_masks(120, M, scale, key=jax.random.key(1))
        )
        inter = masks[:, None] & masks[None]
        union = masks[:, None] | masks[None]
        iou = inter.sum(-1) / union.sum(-1)
        return iou[~np.eye(M, dtype=bool)].mean()

    values = [overlap(s) for s in (1.0, 1.5, 2.5, 4.0)]
    assert values[0] == 1.0
    assert values == sorted(values, reverse=True) and values[-1] < values[1]


def test_masksembles_layer_masks_each_member():
    layer = ee.nn.Masksembles(16, M, 2.0, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (M, 16, 3, 3))
    out = layer(x)
    expected = np.asarray(x) * np.asarray(layer.masks)[:, :, None, None]
    np.testing.assert_array_equal(out, expected)
    # The masks are not trained: not inexact arrays.
    assert not jax.tree.leaves(eqx.filter(layer, eqx.is_inexact_array))


# ------------------------------------------------------------------ bad input


def test_packed_widths_must_divide():
    with pytest.raises(ValueError, match="divisible by `members \\* gamma`"):
        ee.nn.PackedLinear(10, 10, members=4, key=jax.random.key(0))
    with pytest.raises(ValueError, match="divisible"):
        ee.nn.PackedConv2d(8, 6, 3, members=4, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"`PackedConv2d\.out_channels`"):
        ee.nn.PackedConv2d(8, 0, 3, members=4, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"`PackedLinear\.in_features`"):
        ee.nn.PackedLinear(0, 8, members=4, key=jax.random.key(0))
    with pytest.raises(ValueError, match="PackedLinear.members"):
        ee.nn.PackedLinear(8, 8, members=0, key=jax.random.key(0))
    with pytest.raises(ValueError, match="alpha"):
        ee.nn.PackedLinear(8, 8, members=2, alpha=-1.0, key=jax.random.key(0))
    layer = ee.nn.PackedLinear(8, 8, members=2, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"inputs of shape \(8,\)"):
        layer(jnp.ones(6))


def test_mimo_bad_input():
    mimo = ee.nn.MIMO(eqx.nn.Linear(6, 6, key=jax.random.key(0)), members=3)
    with pytest.raises(ValueError, match="one input per member"):
        mimo(jnp.ones((2, 2)))
    with pytest.raises(ValueError, match="input_repetition"):
        ee.nn.mimo_batch(jax.random.key(0), jnp.ones((4, 2)), 3, input_repetition=1.0)
    with pytest.raises(ValueError, match="batch_repetition"):
        ee.nn.mimo_batch(jax.random.key(0), jnp.ones((4, 2)), 3, batch_repetition=0)
    with pytest.raises(ValueError, match="leading example axis"):
        ee.nn.mimo_batch(jax.random.key(0), (jnp.ones((4, 2)), jnp.ones(3)), 3)


def test_masksembles_bad_input():
    with pytest.raises(ValueError, match="scale"):
        ee.nn.masksembles_masks(32, 4, 7.0, key=jax.random.key(0))
    with pytest.raises(ValueError, match="^`features` must be at least 1"):
        ee.nn.masksembles_masks(0, 4, 2.0, key=jax.random.key(0))
    with pytest.raises(ValueError, match="at least 10 features"):
        ee.nn.masksembles_masks(8, 4, 2.0, key=jax.random.key(0))
    layer = ee.nn.Masksembles(16, M, 2.0, key=jax.random.key(0))
    with pytest.raises((ValueError, TypeError), match="members"):
        layer(jnp.ones((16,)))
