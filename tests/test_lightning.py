"""``precompile.lightning``: a real Lightning Trainer fits over a build per split; Lightning sets the
epoch (each epoch's order and copies are the Loader's for that epoch), rank and world size."""
from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if importlib.util.find_spec("lightning") is None and importlib.util.find_spec("pytorch_lightning") is None:
    pytest.skip("Lightning is not installed (extra 'lightning': pip install 'precompile[lightning]')",
                allow_module_level=True)

from conftest import image_recipe, make_image_tree  # noqa: E402
from precompile import build  # noqa: E402
from precompile import open as precompile_open  # noqa: E402
from precompile.reader.loader import Loader  # noqa: E402

pl = pytest.importorskip("lightning.pytorch" if importlib.util.find_spec("lightning") else "pytorch_lightning")
# Lightning's own advice (few workers, no logger, ...) and torch deprecations it triggers are not ours
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::DeprecationWarning",
                                        "ignore::PendingDeprecationWarning", "ignore::FutureWarning")


@pytest.fixture(scope="module")
def splits(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pl")
    root = make_image_tree(tmp / "data", per_class=6)
    recipe = image_recipe(root, copies=2, steps=[{"resize": {"size": [16, 16]}}, {"random_flip": {}}],
                          split={"fractions": {"train": 0.7, "val": 0.3}})
    build(recipe, out_dir=tmp / "out")
    return {s: str(tmp / "out" / f"imgs.{s}.h5") for s in ("train", "val")}


class Recorder(pl.LightningModule):
    """A linear model that records what every training and validation batch held."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(16 * 16 * 3, 2)
        self.seen: dict[int, list[float]] = {}
        self.val_batches = 0

    def training_step(self, batch, i):
        x = batch["image"].float().flatten(1) / 255
        self.seen.setdefault(self.current_epoch, []).extend(x.sum(1).tolist())
        return torch.nn.functional.cross_entropy(self.lin(x), batch["label"])

    def validation_step(self, batch, i):
        self.val_batches += 1

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _trainer(**kw):
    kw = {"max_epochs": 3, "enable_checkpointing": "callbacks" in kw, **kw}
    return pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, **kw)


def test_fit_sets_each_epoch_like_the_loader_does(splits):
    from precompile.lightning import LightningLoader, PrecompileDataModule

    kw = dict(device="cpu", num_threads=0, seed=5)
    dm = PrecompileDataModule(train=splits["train"], val=splits["val"], batch_size=4, **kw)
    model = Recorder()
    _trainer().fit(model, datamodule=dm)
    assert sorted(model.seen) == [0, 1, 2]
    assert isinstance(dm.loaders["train"], LightningLoader) and dm.loaders["train"].loader.epoch == 2
    ref = Loader(splits["train"], 4, shuffle=True, **kw)
    for e in range(3):   # Lightning set the epoch: each epoch's batches are the Loader's for that epoch
        ref.set_epoch(e)
        want = [v for b in ref for v in (b["image"].float().flatten(1) / 255).sum(1).tolist()]
        np.testing.assert_allclose(model.seen[e], want, rtol=1e-6)
    assert model.seen[0] != model.seen[1]                       # a new order (and copies) each epoch
    val = Loader(splits["val"], 4, shuffle=False, **kw)
    assert model.val_batches == 3 * len(val)                    # validation in order, every epoch


def test_rank_and_world_size_come_from_the_trainer(splits):
    from precompile.lightning import PrecompileDataModule

    dm = PrecompileDataModule(train=splits["train"], val=splits["val"], batch_size=2, device="cpu", num_threads=0)
    dm.trainer = SimpleNamespace(global_rank=1, world_size=2)
    mine = dm.train_dataloader().loader
    assert (mine.rank, mine.world_size) == (1, 2)
    other = Loader(splits["train"], 2, rank=0, world_size=2, device="cpu", num_threads=0)
    a = np.concatenate(mine.batch_indices())
    b = np.concatenate(other.batch_indices())
    assert len(a) == len(b) and not set(a.tolist()) & set(b.tolist())   # two disjoint shares
    dm.trainer = SimpleNamespace(global_rank=0, world_size=1)            # one process: everything
    assert dm.train_dataloader().loader.world_size == 1


def test_missing_split_and_state(splits, tmp_path):
    from precompile.lightning import PrecompileDataModule

    with pytest.raises(FileNotFoundError, match="the val build .*nope.h5.* does not exist"):
        PrecompileDataModule(train=splits["train"], val=str(tmp_path / "nope.h5"))
    dm = PrecompileDataModule(train=splits["train"], batch_size=3, device="cpu", num_threads=0)
    assert dm.val_dataloader() == []
    with pytest.raises(ValueError, match="no test build was given"):
        dm.test_dataloader()
    ld = dm.train_dataloader()
    it = iter(ld)
    next(it)
    state = ld.state_dict()
    assert state["batch"] == 1 and ld.loader.state_dict() == state


class _BytesRecorder(pl.LightningModule):
    """Records every training batch's image bytes, in order, with the epoch and batch index."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(1, 1)
        self.seen: list[tuple[int, int, bytes]] = []

    def training_step(self, batch, i):
        self.seen.append((self.current_epoch, i, batch["image"].numpy().tobytes()))
        return self.lin(torch.ones(1, 1)).sum()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


def test_a_mid_epoch_checkpoint_resumes_with_exactly_the_remaining_batches(splits, tmp_path):
    """Lightning restores the loader's state, calls ``iter`` on it, then ``set_epoch`` on its sampler, then
    ``next``. Before, ``iter`` ended the restored position and ``set_epoch`` then restarted the epoch: a run
    resumed from a checkpoint after batch k trained on the epoch's first batches again and never saw its last
    k (no error). The truth: the uninterrupted fit's batches after the checkpoint."""
    from precompile.lightning import PrecompileDataModule

    ModelCheckpoint = pl.callbacks.ModelCheckpoint   # lightning.pytorch's or pytorch_lightning's, as installed

    kw = dict(device="cpu", num_threads=0, seed=3)
    full = _BytesRecorder()
    ck = ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    _trainer(callbacks=[ck], max_epochs=2).fit(full, datamodule=PrecompileDataModule(train=splits["train"],
                                                                                    batch_size=2, **kw))
    per_epoch = sum(1 for e, _, _ in full.seen if e == 0)
    assert per_epoch >= 3 and len(full.seen) == 2 * per_epoch
    for k in (1, per_epoch - 1, per_epoch, per_epoch + 1):   # mid-epoch, at the end of the first, in the second
        resumed = _BytesRecorder()
        _trainer(max_epochs=2).fit(resumed, datamodule=PrecompileDataModule(train=splits["train"], batch_size=2, **kw),
                                   ckpt_path=str(tmp_path / f"step={k}.ckpt"))
        assert [(e, i) for e, i, _ in resumed.seen] == [(e, i) for e, i, _ in full.seen[k:]]
        assert [b for _, _, b in resumed.seen] == [b for _, _, b in full.seen[k:]], f"resumed after step {k}"


def test_evaluation_reads_every_sample_when_training_drops_its_last_batch(splits):
    """The module's promise: val, test and predict read in order, without dropping the last partial batch.
    Before: a ``drop_last=True`` given for training (a keyword for every split) reached them too, so validation
    silently left its last samples out. ``eval_kwargs`` may still ask for it."""
    from precompile.lightning import PrecompileDataModule

    n = len(set(precompile_open(splits["val"]).keys))   # an augmented build: an epoch shows each key once
    assert n % 4, "the test needs a val split that 4 does not divide"
    dm = PrecompileDataModule(train=splits["train"], val=splits["val"], test=splits["val"], batch_size=4,
                              drop_last=True, device="cpu", num_threads=0)
    assert dm.train_dataloader().loader.drop_last is True
    for ld in (dm.val_dataloader(), dm.test_dataloader()):
        assert not ld.loader.drop_last and sum(len(b["label"]) for b in ld) == n
    dm = PrecompileDataModule(train=splits["train"], val=splits["val"], batch_size=4, device="cpu", num_threads=0,
                              drop_last=True, eval_kwargs={"drop_last": True})
    assert sum(len(b["label"]) for b in dm.val_dataloader()) == n - n % 4


def test_a_split_given_as_a_list_of_builds_is_mixed(splits):
    """A split may be several builds, as issue 35's mixing wants: the DataModule took one path per split and a list
    failed in os.path.exists (TypeError). A list is read through precompile.Mix, with its kwargs per side: every
    training epoch is the Mix's own for that epoch (its batches' __source say which build each sample came from)."""
    from precompile import Mix
    from precompile.lightning import PrecompileDataModule

    kw = dict(device="cpu", num_threads=0, seed=3)
    dm = PrecompileDataModule(train=[splits["train"], splits["val"]], val=splits["val"], batch_size=4,
                              train_kwargs={"weights": [1, 1], "stop": "all_exhausted"}, **kw)
    model = Recorder()
    _trainer(max_epochs=2).fit(model, datamodule=dm)
    ref = Mix([splits["train"], splits["val"]], 4, weights=[1, 1], stop="all_exhausted", shuffle=True, **kw)
    for e in range(2):
        ref.set_epoch(e)
        batches = list(ref)
        want = [v for b in batches for v in (b["image"].float().flatten(1) / 255).sum(1).tolist()]
        np.testing.assert_allclose(model.seen[e], want, rtol=1e-6)
        assert {int(s) for b in batches for s in b["__source"]} == {0, 1}
    with pytest.raises(FileNotFoundError, match="the train build '.*nope.h5' does not exist"):
        PrecompileDataModule(train=[splits["train"], splits["train"].replace("train.h5", "nope.h5")])
