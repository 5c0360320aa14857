"""`ee.Ensemble` and `ee.ensemble`: construction, calling, indexing, keys, state."""

import equinox as eqx
import jax
import jax.numpy as jnp
import jaxtyping
import numpy as np
import pytest
from conftest import assert_tree_allclose, tree_equal

import eqx_ensemble as ee
from eqx_ensemble._internal.keys import check_key, split_member_keys

SIZE = 6


def _equal(a, b) -> bool:
    return bool(tree_equal(a, b))


@pytest.fixture
def ens(getkey):
    return ee.ensemble(lambda k: eqx.nn.MLP(3, 2, 8, 2, key=k), size=SIZE, key=getkey())


# --------------------------------------------------------------------------------
# Construction
# --------------------------------------------------------------------------------


def test_ensemble_members_made_with_split_keys(getkey):
    key = getkey()
    make = lambda k: eqx.nn.MLP(3, 2, 8, 2, key=k)
    ens = ee.ensemble(make, size=4, key=key)
    assert isinstance(ens, ee.Ensemble) and len(ens) == 4 and ens.size == 4
    expected = [make(k) for k in jax.random.split(key, 4)]
    assert_tree_allclose(ee.unstack(ens), expected)
    # Members are distinct (different keys), not copies of one model.
    weights = ens.members.layers[0].weight
    assert not np.allclose(weights[0], weights[1])


def test_ensemble_raw_uint32_key():
    key = jax.random.PRNGKey(3)
    make = lambda k: eqx.nn.Linear(2, 3, key=k)
    ens = ee.ensemble(make, size=3, key=key)
    expected = [make(k) for k in jax.random.split(key, 3)]
    assert_tree_allclose(ee.unstack(ens), expected)


def test_ensemble_traces_make_once(getkey):
    traces = 0

    def make(key):
        nonlocal traces
        traces += 1
        return eqx.nn.MLP(4, 2, 16, 2, key=key)

    ens = ee.ensemble(make, size=256, key=getkey())
    assert traces == 1
    assert ens.members.layers[0].weight.shape == (256, 16, 4)


def test_ensemble_errors(getkey):
    make = lambda k: eqx.nn.Linear(2, 2, key=k)
    for size in (0, -3):
        with pytest.raises(ValueError, match=f"`size` must be at least 1, got {size}"):
            ee.ensemble(make, size=size, key=getkey())
    # A key array of the wrong shape: beartype (the jaxtyping hook) may reject it
    # before the library does; either way the call fails before any work.
    keys = jax.random.split(getkey(), 3)
    with pytest.raises(
        (jaxtyping.TypeCheckError, ValueError), match="key|Type-check error"
    ):
        ee.ensemble(make, size=3, key=keys)


def test_check_key_messages():
    check_key(jax.random.key(0))
    check_key(jax.random.PRNGKey(0))
    with pytest.raises(
        ValueError,
        match=r"single PRNG key of shape \(\), got a key array of shape \(3,\)",
    ):
        check_key(jax.random.split(jax.random.key(0), 3))
    with pytest.raises(ValueError, match=r"`member_key` must be a single PRNG key"):
        check_key(jax.random.split(jax.random.key(0), 3), what="member_key")
    with pytest.raises(ValueError, match=r"shape \(3, 2\) and dtype uint32"):
        check_key(jax.random.split(jax.random.PRNGKey(0), 3))
    with pytest.raises(ValueError, match=r"shape \(2,\) and dtype float32"):
        check_key(jnp.zeros(2))
    with pytest.raises(TypeError, match="must be a JAX PRNG key .* got int"):
        check_key(0)


def test_split_member_keys(getkey):
    key = getkey()
    member_keys = split_member_keys(key, 5)
    np.testing.assert_array_equal(
        jax.random.key_data(member_keys),
        jax.random.key_data(jax.random.split(key, 5)),
    )


def test_ensemble_needs_a_member_axis():
    with pytest.raises(ValueError, match="no array leaves"):
        ee.Ensemble({"name": "x"})
    with pytest.raises(ValueError, match=r"leaf `\['b'\]` has shape \(2,\)"):
        ee.Ensemble({"a": jnp.ones((3, 1)), "b": jnp.ones(2)})
    with pytest.raises(ValueError, match="scalar"):
        ee.Ensemble(jnp.ones(()))
    with pytest.raises(ValueError, match="at least one member.*has size 0"):
        ee.Ensemble({"w": jnp.ones((0, 3))})


# --------------------------------------------------------------------------------
# Calling: member i of ens(x) equals unstack(ens)[i](x)
# --------------------------------------------------------------------------------


def test_call_independence(ens, getkey):
    x = jax.random.normal(getkey(), (3,))
    out = ens(x)
    assert out.shape == (SIZE, 2)
    for i, member in enumerate(ee.unstack(ens)):
        assert_tree_allclose(out[i], member(x))
    # Under jit too.
    assert_tree_allclose(eqx.filter_jit(lambda e, x: e(x))(ens, x), out)


def test_call_kwargs_are_shared(getkey):
    ens = ee.ensemble(lambda k: eqx.nn.GRUCell(3, 4, key=k), size=3, key=getkey())
    x = jax.random.normal(getkey(), (3,))
    hidden = jax.random.normal(getkey(), (4,))
    out = ens(x, hidden=hidden)
    for i, member in enumerate(ee.unstack(ens)):
        assert_tree_allclose(out[i], member(x, hidden))


class _Dropped(eqx.Module):
    linear: eqx.nn.Linear
    dropout: eqx.nn.Dropout

    def __init__(self, key):
        self.linear = eqx.nn.Linear(4, 32, key=key)
        self.dropout = eqx.nn.Dropout(0.5)

    def __call__(self, x, *, key):
        return self.dropout(self.linear(x), key=key)


def test_call_with_key_dropout(getkey):
    ens = ee.ensemble(_Dropped, size=5, key=getkey())
    x = jax.random.normal(getkey(), (4,))
    key = getkey()
    out = ens(x, key=key)
    member_keys = jax.random.split(key, 5)
    for i, member in enumerate(ee.unstack(ens)):
        assert_tree_allclose(out[i], member(x, key=member_keys[i]))
    # Each member got its own key: the dropout masks differ.
    masks = np.asarray(out == 0)
    assert not (masks[0] == masks[1]).all()


class _Normed(eqx.Module):
    linear: eqx.nn.Linear
    norm: eqx.nn.BatchNorm

    def __init__(self, key):
        self.linear = eqx.nn.Linear(3, 4, key=key)
        self.norm = eqx.nn.BatchNorm(4, axis_name="batch", mode="ema")

    def __call__(self, x, state):
        return self.norm(self.linear(x), state)


def _forward(model, state, xs):
    return jax.vmap(model, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(
        xs, state
    )


def test_stateful_ensemble_per_member_state(getkey):
    make = lambda k: eqx.nn.make_with_state(_Normed)(k)
    ens, state = ee.ensemble(make, size=4, key=getkey())
    assert isinstance(ens, ee.Ensemble) and isinstance(state, eqx.nn.State)
    # Every state array carries the member axis.
    for leaf in jax.tree.leaves(state):
        assert leaf.shape[0] == 4
    xs = jax.random.normal(getkey(), (4, 8, 3))  # different data per member
    models = ee.unstack(ens)
    member_states = [jax.tree.map(lambda leaf: leaf[i], state) for i in range(4)]
    for chunk_size in (None, 3):
        new_state = state
        states = list(member_states)
        for step in range(2):
            outs, new_state = ee.map(
                _forward,
                ens,
                new_state,
                xs + step,
                in_axes=(0, 0),
                chunk_size=chunk_size,
            )
            for i in range(4):
                expected_out, states[i] = _forward(models[i], states[i], xs[i] + step)
                assert_tree_allclose(outs[i], expected_out)
                assert_tree_allclose(
                    jax.tree.map(lambda leaf: leaf[i], new_state), states[i]
                )
        # The running statistics really are per member.
        running = [leaf for leaf in jax.tree.leaves(new_state) if leaf.ndim == 2]
        assert any(not np.allclose(leaf[0], leaf[1]) for leaf in running)


# --------------------------------------------------------------------------------
# Indexing
# --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "index",
    [0, 3, SIZE - 1, -1, -SIZE, np.int64(2), np.int32(-2), jnp.int32(4), jnp.array(1)],
)
def test_getitem_int(ens, index):
    member = ens[index]
    assert isinstance(member, eqx.nn.MLP)
    assert _equal(member, ee.unstack(ens)[int(index)])


@pytest.mark.parametrize(
    "index, positions",
    [
        (slice(2, 5), [2, 3, 4]),
        (slice(None, None, -2), [5, 3, 1]),
        (slice(-2, None), [4, 5]),
        (np.array([4, 0, 0, -1]), [4, 0, 0, 5]),
        (jnp.array([1, 3]), [1, 3]),
        ([2, 1], [2, 1]),
        (np.array([True, False, True, False, False, True]), [0, 2, 5]),
        (jnp.array([False, True, False, False, False, False]), [1]),
    ],
)
def test_getitem_sub_ensemble(ens, index, positions):
    sub = ens[index]
    assert isinstance(sub, ee.Ensemble) and len(sub) == len(positions)
    models = ee.unstack(ens)
    assert _equal(ee.unstack(sub), [models[p] for p in positions])


def test_getitem_traced_under_jit(ens):
    get_member = eqx.filter_jit(lambda e, i: e[i])
    get_sub = eqx.filter_jit(lambda e, idx: e[idx])
    models = ee.unstack(ens)
    for i in (0, 4, -1):
        assert _equal(get_member(ens, jnp.int32(i)), models[i])
    sub = get_sub(ens, jnp.array([5, 0]))
    assert _equal(ee.unstack(sub), [models[5], models[0]])


def test_getitem_errors(ens):
    with pytest.raises(IndexError, match="out of range for an ensemble of 6 members"):
        ens[6]
    with pytest.raises(IndexError, match="-7 is out of range for an ensemble of 6"):
        ens[-7]
    with pytest.raises(IndexError, match="out of range for an ensemble of 6"):
        ens[jnp.int32(10)]
    with pytest.raises(IndexError, match=r"\[6, -9\] are out of range .* of 6"):
        ens[np.array([0, 6, -9])]
    with pytest.raises(IndexError, match="must have length 6 .* got length 3"):
        ens[np.array([True, False, True])]
    with pytest.raises(IndexError, match="selects no members"):
        ens[3:3]
    with pytest.raises(IndexError, match="must be 1-D"):
        ens[np.zeros((2, 2), dtype=np.int32)]
    with pytest.raises(IndexError, match="must be integers"):
        ens[np.array([0.0, 1.0])]
    with pytest.raises(TypeError, match="must be an integer, got dtype float32"):
        ens[jnp.array(1.0)]
    with pytest.raises(TypeError, match="cannot be indexed by a single bool"):
        ens[True]
    with pytest.raises(TypeError, match="indexed by an int, a slice"):
        ens["0"]
    with pytest.raises(IndexError, match="must be concrete"):
        eqx.filter_jit(lambda e, m: e[m])(ens, jnp.ones(SIZE, dtype=bool))


def test_len_and_size(getkey):
    for size in (1, 2, 7):
        ens = ee.ensemble(lambda k: eqx.nn.Linear(2, 2, key=k), size=size, key=getkey())
        assert len(ens) == size == ens.size


# -------------------------------- empty indices, batches, sizes, member counts


def _ensemble(size, seed=0):
    return ee.ensemble(
        lambda k: eqx.nn.MLP(3, 2, 4, 1, key=k), size=size, key=jax.random.key(seed)
    )


@pytest.mark.parametrize("index", [[], np.array([], dtype=np.int32)])
def test_empty_index_is_named(index):
    ens = _ensemble(3)
    with pytest.raises((IndexError, ValueError), match="at least one member|empty"):
        ens[index]


def test_calling_an_ensemble_on_a_batch_explains_members_take_one_example():
    ens = _ensemble(3)
    with pytest.raises(Exception, match="ONE example") as info:
        ens(jnp.ones((8, 3)))
    assert "dot_general" in str(info.value) or info.value.__cause__ is not None


@pytest.mark.parametrize("size", [2**31, 2**40])
def test_impossible_ensemble_size_is_refused_before_xla(size):
    # 2**40 members would abort the process inside XLA: refused before.
    with pytest.raises(ValueError, match="members"):
        ee.ensemble(
            lambda k: eqx.nn.Linear(1, 1, key=k), size=size, key=jax.random.key(0)
        )


# The member count takes a path-free fast route; its errors still name the
# leaves (the route with paths runs only on bad input).


def test_member_count_errors_name_the_leaves_and_shapes():
    good = {"a": jnp.zeros((3, 2)), "b": jnp.zeros((3,))}
    assert len(ee.Ensemble(good)) == 3
    with pytest.raises(ValueError, match=r"leaf `\['a'\]` has shape \(3, 2\).*"
                       r"leaf `\['b'\]` has shape \(4,\)"):  # fmt: skip
        ee.Ensemble({"a": jnp.zeros((3, 2)), "b": jnp.zeros((4,))})
    with pytest.raises(ValueError, match=r"leaf `\['b'\]` is a scalar"):
        ee.Ensemble({"b": jnp.zeros(()), "c": jnp.zeros((3,))})
    with pytest.raises(ValueError, match=r"`\['c'\]` has shape \(\)"):
        ee.Ensemble({"b": jnp.zeros((3,)), "c": jnp.zeros(())})
    with pytest.raises(ValueError, match="no array leaves"):
        ee.Ensemble({"f": jax.nn.relu})
