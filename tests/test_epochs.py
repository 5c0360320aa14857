"""`ee.epochs`: epoch-based loaders as resumable streams (issue 31), and the
check that a resumed stream gives the batches the checkpoint recorded."""

import itertools
import json

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import tree_equal

import eqx_ensemble as ee
from eqx_ensemble._checkpoints.io import load_manifest

X = np.random.default_rng(0).normal(size=(100, 3)).astype(np.float32)
Y = X.sum(axis=1, keepdims=True)


def numpy_epoch(epoch, start=None, *, size=100, batch=16, reads=None):
    """A seeded shuffle of `size` examples in batches of `batch` (short last
    batch dropped)."""
    order = np.random.default_rng(epoch).permutation(size)
    first = 0 if start is None else start
    for i in range(first, size // batch):
        if reads is not None:
            reads.append((epoch, i))
        rows = order[i * batch : (i + 1) * batch]
        yield X[rows], Y[rows]


def reference(step, count, per_epoch=6):
    """Batches `step .. step + count` written out by hand: epoch after epoch."""
    out = []
    for s in range(step, step + count):
        epoch, position = divmod(s, per_epoch)
        out.append(list(numpy_epoch(epoch))[position])
    return out


def same_batches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert jax.tree.structure(x) == jax.tree.structure(y)
        for p, q in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True):
            np.testing.assert_array_equal(p, q)


@pytest.mark.parametrize("step", [0, 1, 5, 6, 13, 40])
@pytest.mark.parametrize("per_epoch", [None, 6])
def test_epochs_is_step_indexed_and_endless(step, per_epoch):
    # Without `len` or `batches_per_epoch`, epochs are counted by reading.
    data = ee.epochs(lambda epoch: numpy_epoch(epoch), batches_per_epoch=per_epoch)
    got = list(itertools.islice(data(step), 15))
    same_batches(got, reference(step, 15))


def test_a_loader_with_start_reads_no_batch_before_it():
    reads: list = []
    data = ee.epochs(lambda epoch, start: numpy_epoch(epoch, start, reads=reads))
    got = list(itertools.islice(data(16), 4))  # epoch 2, batch 4 on
    same_batches(got, reference(16, 4))
    assert reads[0] == (0, 0) or reads[0] == (2, 4)
    # Epoch 0 is read once to learn the epoch length (no `len`); epochs 1 and
    # the skipped part of epoch 2 are never read.
    assert (1, 0) not in reads and (2, 0) not in reads


def test_a_loader_with_len_and_start_reads_nothing_before_it():
    reads: list = []

    class Loader:
        def __init__(self, epoch, start):
            self.epoch, self.start = epoch, start

        def __len__(self):
            return 6 - self.start

        def __iter__(self):
            return numpy_epoch(self.epoch, self.start, reads=reads)

    data = ee.epochs(lambda epoch, start: Loader(epoch, start))
    same_batches(list(itertools.islice(data(16), 4)), reference(16, 4))
    assert reads[0] == (2, 4)


def test_per_member_loaders_are_stacked_along_a_member_axis():
    def loader(epoch, member):
        return numpy_epoch(10 * epoch + member)

    data = ee.epochs(loader, batches_per_epoch=6, members=3)
    got = list(itertools.islice(data(4), 4))
    for offset, (xb, yb) in enumerate(got):
        epoch, position = divmod(4 + offset, 6)
        for member in range(3):
            want = list(numpy_epoch(10 * epoch + member))[position]
            np.testing.assert_array_equal(xb[member], want[0])
            np.testing.assert_array_equal(yb[member], want[1])


def test_bad_loaders_get_errors_that_name_the_epoch():
    with pytest.raises(ValueError, match="epoch 0 yielded no batch"):
        next(ee.epochs(lambda e: iter(()))(0))
    with pytest.raises(ValueError, match="epoch 0 yielded no batch"):
        next(ee.epochs(lambda e: [])(0))
    with pytest.raises(ValueError, match=r"batches_per_epoch=4.*has 6 batches"):
        next(ee.epochs(lambda e: list(numpy_epoch(e)), batches_per_epoch=4)(0))
    # Without `len`: found while reading.
    stream = ee.epochs(lambda e: numpy_epoch(e), batches_per_epoch=8)(0)
    with pytest.raises(ValueError, match="epoch 0, the loader ended after 6 batches"):
        list(itertools.islice(stream, 10))
    stream = ee.epochs(lambda e: numpy_epoch(e), batches_per_epoch=4)(0)
    with pytest.raises(ValueError, match="more than `batches_per_epoch=4`"):
        list(itertools.islice(stream, 10))
    with pytest.raises(TypeError, match="returned int"):
        next(ee.epochs(lambda e: 3)(0))
    with pytest.raises(TypeError, match="`member` argument"):
        ee.epochs(lambda e: numpy_epoch(e), members=2)
    with pytest.raises(ValueError, match="batches_per_epoch"):
        ee.epochs(lambda e: numpy_epoch(e), batches_per_epoch=0)
    with pytest.raises(TypeError, match="loader_for_epoch"):
        ee.epochs([1, 2, 3])  # type: ignore[arg-type]


def _loss(model, batch, key):
    xb, yb = batch
    return jnp.mean((jax.vmap(model)(xb) - yb) ** 2)


def _ens():
    return ee.ensemble(
        lambda k: eqx.nn.MLP(3, 1, 8, 1, key=k), size=3, key=jax.random.key(0)
    )


def _fit(data, steps, checkpoints=None, sampling=ee.Shared()):
    return ee.fit(
        _ens(),
        _loss,
        optax.adam(1e-2),
        data,
        steps=steps,
        key=jax.random.key(1),
        callbacks=(),
        checkpoints=checkpoints,
        sampling=sampling,
    )


def _same_run(a, b):
    assert bool(tree_equal(a.ensemble, b.ensemble))
    np.testing.assert_array_equal(a.history.losses, b.history.losses)


def test_torch_dataloader_resumes_mid_epoch_bit_for_bit(tmp_path):
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader, TensorDataset

    dataset = TensorDataset(torch.from_numpy(X), torch.from_numpy(Y))

    def loader(epoch):
        generator = torch.Generator().manual_seed(epoch)
        return DataLoader(
            dataset, batch_size=16, shuffle=True, generator=generator, drop_last=True
        )

    data = ee.epochs(loader)
    full = _fit(data, 40)
    run = ee.Checkpoints(tmp_path, every=10)
    stopped = _fit(data, 15, run)  # stopped mid-epoch (6 batches per epoch)
    assert stopped.step == 15
    resumed = _fit(data, 40, run)
    assert resumed.resumed_from == 15
    _same_run(resumed, full)


def test_grain_resumes_from_its_saved_state_without_replay(tmp_path):
    grain = pytest.importorskip("grain")
    reads = []

    def loader(epoch):
        def read(row):
            reads.append(epoch)
            return row

        return (
            grain.MapDataset.source(np.concatenate([X, Y], axis=1))
            .shuffle(seed=epoch)
            .map(read)
            .batch(16, drop_remainder=True)
            .map(lambda b: (b[:, :3], b[:, 3:]))
            # No read-ahead threads: the rows read are counted exactly.
            .to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
        )

    data = ee.epochs(loader, batches_per_epoch=6)
    full = _fit(data, 40)
    run = ee.Checkpoints(tmp_path, every=10)
    _fit(data, 16, run)
    saved = load_manifest(tmp_path / "step_0000000016.ckpt")["metadata"]["data"]
    assert saved["step"] == 16
    assert saved["stream_state"]["epoch"] == 2
    assert saved["stream_state"]["position"] == 4
    assert saved["stream_state"]["loaders"], "grain's iterator state was not saved"
    json.dumps(saved)
    reads.clear()
    resumed = _fit(data, 40, run)
    _same_run(resumed, full)
    # Resumed at batch 4 of epoch 2: its last 2 batches are read, not the 4
    # before them (a replay would read all 6).
    assert reads.count(2) == 2 * 16
    assert min(reads) == 2


def test_per_member_epochs_train_with_independent_sampling(tmp_path):
    def loader(epoch, member):
        return numpy_epoch(10 * epoch + member)

    data = ee.epochs(loader, batches_per_epoch=6, members=3)
    full = _fit(data, 20, sampling=ee.Independent())
    run = ee.Checkpoints(tmp_path, every=7)
    _fit(data, 9, run, sampling=ee.Independent())
    _same_run(_fit(data, 20, run, sampling=ee.Independent()), full)
    # Against members trained one by one on their own loaders.
    for member in range(3):
        alone = ee.fit(
            ee.ensemble(
                lambda k: eqx.nn.MLP(3, 1, 8, 1, key=k), size=3, key=jax.random.key(0)
            )[member : member + 1],
            _loss,
            optax.adam(1e-2),
            ee.epochs(lambda e, m=member: numpy_epoch(10 * e + m), batches_per_epoch=6),
            steps=20,
            key=jax.random.key(1),
            callbacks=(),
        )
        np.testing.assert_allclose(
            alone.history.losses[:, 0], full.history.losses[:, member], rtol=1e-5
        )


@pytest.mark.parametrize("stop", [10, 15])  # a periodic and the final checkpoint
def test_a_stream_that_resumes_onto_other_batches_is_refused(tmp_path, stop):
    def unseeded(step):  # the old recipe's mistake: seeded with the resumed step
        rng = np.random.default_rng(step)
        while True:
            rows = rng.integers(0, 100, 16)
            yield X[rows], Y[rows]

    run = ee.Checkpoints(tmp_path, every=10)
    _fit(unseeded, stop, run)
    with pytest.raises(ValueError, match=f"different batch for step {stop}"):
        _fit(unseeded, 40, run)
    # A stream that does resume to the same batches is accepted.


def test_a_deterministic_factory_resumes_bit_for_bit(tmp_path):
    def seeded(step):
        for s in itertools.count(step):
            rows = np.random.default_rng(s).integers(0, 100, 16)
            yield X[rows], Y[rows]

    full = _fit(seeded, 30)
    run = ee.Checkpoints(tmp_path, every=10)
    _fit(seeded, 15, run)
    _same_run(_fit(seeded, 30, run), full)


def test_torch_tensors_and_jax_arrays_are_accepted_as_batches():
    torch = pytest.importorskip("torch")

    def loader(epoch):
        for xb, yb in numpy_epoch(epoch):
            yield torch.from_numpy(xb), jnp.asarray(yb)

    want = _fit(ee.epochs(lambda e: numpy_epoch(e)), 8)
    got = _fit(ee.epochs(loader), 8)
    _same_run(got, want)


def test_a_stream_factory_that_returns_nothing_is_named():
    with pytest.raises(TypeError, match="returned NoneType for step 0"):
        _fit(lambda step: None, 5)


def test_a_stream_of_strings_is_named():
    def strings(step):
        while True:
            yield np.array(["a", "b"]), np.zeros((2, 1), np.float32)

    with pytest.raises(TypeError, match=r"not an array of numbers \(dtype <U1\)"):
        _fit(strings, 5)


def test_a_failed_read_keeps_the_run_and_its_checkpoint_resumes(tmp_path):
    failed = []

    def seeded(step):
        for s in itertools.count(step):
            rows = np.random.default_rng(s).integers(0, 100, 16)
            yield X[rows], Y[rows]

    def flaky(step):  # the same batches, but the read of step 8 fails once
        for s, batch in zip(itertools.count(step), seeded(step)):
            if s == 8 and not failed:
                failed.append(s)
                raise OSError("the disk hiccuped")
            yield batch

    run = ee.Checkpoints(tmp_path, every=5)
    with pytest.raises(OSError, match="hiccuped") as error:
        ee.fit(
            _ens(), _loss, optax.adam(1e-2), flaky, steps=20, key=jax.random.key(1),
            callbacks=(), checkpoints=run,
            execution=ee.Execution(steps_per_dispatch=5),
        )  # fmt: skip
    assert error.value.result.step == 5  # pyright: ignore[reportAttributeAccessIssue]
    # The checkpoint of step 5, written after the failed read, resumes.
    _same_run(_fit(flaky, 20, run), _fit(seeded, 20))


class _Counter:
    """A loader whose iterator hands out its live state dict (and restores it)."""

    def __init__(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        return _CounterIterator(self.epoch)


class _CounterIterator:
    def __init__(self, epoch):
        self.epoch, self.live = epoch, {"i": 0}

    def __next__(self):
        i = self.live["i"]
        if i == 6:
            raise StopIteration
        self.live["i"] += 1
        return list(numpy_epoch(self.epoch))[i]

    def get_state(self):
        return self.live  # live: the library must copy it

    def set_state(self, state):
        self.live = dict(state)


def test_a_loaders_live_state_is_copied_when_it_is_taken(tmp_path):
    data = ee.epochs(_Counter, batches_per_epoch=6)
    full = _fit(data, 20)
    run = ee.Checkpoints(tmp_path, every=5)
    _fit(data, 10, run)
    _same_run(_fit(data, 20, run), full)


def test_a_plain_factory_whose_iterator_has_a_bytes_state_checkpoints(tmp_path):
    class Stream:
        def __init__(self, step):
            self.step = step

        def __iter__(self):
            return self

        def __next__(self):
            rows = np.random.default_rng(self.step).integers(0, 100, 16)
            self.step += 1
            return X[rows], Y[rows]

        def get_state(self):  # as grain's DataLoader iterator: bytes
            return b"opaque"

    full = _fit(Stream, 20)
    run = ee.Checkpoints(tmp_path, every=5)
    _fit(Stream, 10, run)
    _same_run(_fit(Stream, 20, run), full)


def test_members_loaders_of_different_lengths_are_refused_at_once():
    def loader(epoch, member):
        return numpy_epoch(epoch, size=100 if member == 0 else 80)

    stream = ee.epochs(loader, members=2)(0)
    with pytest.raises(ValueError, match="member 1's loader ended after 5 batches"):
        list(itertools.islice(stream, 8))


def test_a_slow_stream_reports_progress_about_once_a_second():
    # 6 ms per batch and 1000 steps per dispatch: one dispatch would read for
    # 3 s before its report (issue 26, 12).
    import time

    def slow(step):
        for s in itertools.count(step):
            time.sleep(0.006)
            rows = np.random.default_rng(s).integers(0, 100, 16)
            yield X[rows], Y[rows]

    def fast(step):
        for s in itertools.count(step):
            rows = np.random.default_rng(s).integers(0, 100, 16)
            yield X[rows], Y[rows]

    class Times(ee.ProgressMeter):
        def start(self, total, done, resumed):
            return [time.monotonic()]

        def update(self, handle, done, losses, diverged_at):
            handle.append(time.monotonic())

        def close(self, handle):
            seen.append(handle)

    seen = []
    result = ee.fit(
        _ens(), _loss, optax.adam(1e-2), slow, steps=500, key=jax.random.key(1),
        callbacks=[Times()], execution=ee.Execution(steps_per_dispatch=1000),
    )  # fmt: skip
    gaps = np.diff(seen[0])[1:]  # after the first report (which waits to compile)
    assert len(gaps) >= 2 and gaps.max() < 1.8, gaps
    # Shorter dispatches train the same run.
    _same_run(result, _fit(fast, 500))


def test_a_stream_factory_without_a_step_argument_is_named():
    def no_step():
        while True:
            yield X[:16], Y[:16]

    with pytest.raises(TypeError, match=r"calls it as `data\(step\)`.*pass the iter"):
        _fit(no_step, 5)
