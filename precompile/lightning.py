"""``precompile.lightning``: a Lightning ``LightningDataModule`` over precompile builds, one per split.

    from precompile.lightning import PrecompileDataModule

    dm = PrecompileDataModule(train="build/imgs.train.h5", val="build/imgs.val.h5",
                              batch_size=64, mean="stats", std="stats")
    trainer.fit(model, datamodule=dm)

Each split's dataloader is a :class:`~precompile.reader.loader.Loader` over that split's
index (a ``split:`` recipe writes ``<name>.<split>.h5``); a split given as a list of builds is read
through :class:`~precompile.reader.mix.Mix` (``weights``, ``stop``, ``cycle`` in its kwargs). The module sets what a
``torch.utils.data.DataLoader`` would get from Lightning:

- **rank and world size**: the trainer's ``global_rank`` and ``world_size`` (each rank
  reads its share of every epoch); without a trainer (or a single process), the Loader's
  own choice (an initialised ``torch.distributed`` group, else everything);
- **the epoch**: Lightning calls ``set_epoch`` on a dataloader's ``sampler`` at the start
  of every training epoch, so the loaders are handed over wrapped
  (:class:`LightningLoader`) with ``sampler`` = the wrapper, whose ``set_epoch`` is the
  Loader's: each epoch gets its own order (and, in an augmented build, its own copies);
- **resuming**: the wrapper's ``state_dict`` / ``load_state_dict`` are the Loader's.

``train`` shuffles (``shuffle`` option, default True); ``val``, ``test`` and ``predict``
read in order, without dropping the last partial batch (a ``drop_last`` given for every split is
the train side's; ``eval_kwargs={"drop_last": True}`` asks for it there). Every other keyword goes to
every Loader; ``train_kwargs`` / ``eval_kwargs`` override them per side. Needs the
``lightning`` extra (``pip install 'precompile[lightning]'``): package ``lightning`` or
``pytorch-lightning``, whichever is installed.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Any, Iterator, Optional, Sequence, Union

from .errors import MissingDependencyError

LIGHTNING_EXTRA = "pip install 'precompile[lightning]' (pytorch-lightning)"


def _lightning_base() -> type:
    """``LightningDataModule`` from ``lightning`` (preferred) or ``pytorch_lightning``."""
    for mod in ("lightning.pytorch", "pytorch_lightning"):
        if importlib.util.find_spec(mod.split(".")[0]) is not None:
            return importlib.import_module(mod).LightningDataModule
    raise MissingDependencyError(f"precompile.lightning needs Lightning: {LIGHTNING_EXTRA}")


class LightningLoader:
    """A :class:`~precompile.reader.loader.Loader` as Lightning expects a dataloader: iterable with a
    length, and a ``sampler`` whose ``set_epoch`` Lightning calls at every epoch start."""

    def __init__(self, loader: Any):
        self.loader = loader
        self.sampler = self          # Lightning: set_epoch on a dataloader's sampler at each epoch start
        self.batch_sampler = None    # (read by Lightning's checks of DataLoader-like objects)

    def set_epoch(self, epoch: int) -> None:
        self.loader.set_epoch(epoch)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.loader)

    def __len__(self) -> int:
        return len(self.loader)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.load_state_dict(state)


SPLITS = ("train", "val", "test", "predict")
#: a split's build: one index path (a Loader), or a list of them (a precompile.Mix)
Build = Union[str, os.PathLike, Sequence[Union[str, os.PathLike]]]


def _make_class() -> type:
    base = _lightning_base()

    class PrecompileDataModule(base):  # type: ignore[misc, valid-type]
        """Loaders over one build per split; see :mod:`precompile.lightning`."""

        def __init__(self, train: Optional[Build] = None, val: Optional[Build] = None,
                     test: Optional[Build] = None, predict: Optional[Build] = None,
                     batch_size: int = 32, shuffle: bool | str = True,
                     train_kwargs: Optional[dict[str, Any]] = None, eval_kwargs: Optional[dict[str, Any]] = None,
                     **loader_kwargs: Any):
            super().__init__()
            self.paths = {"train": train, "val": val, "test": test, "predict": predict}
            for split, p in self.paths.items():
                for one in (p if isinstance(p, (list, tuple)) else [p]):   # a list: the builds a Mix reads
                    if one is not None and not os.path.exists(one):
                        raise FileNotFoundError(f"precompile.lightning: the {split} build {str(one)!r} does not exist")
            self.batch_size, self.shuffle = int(batch_size), shuffle
            self.loader_kwargs = dict(loader_kwargs)
            self.train_kwargs, self.eval_kwargs = dict(train_kwargs or {}), dict(eval_kwargs or {})
            self.loaders: dict[str, LightningLoader] = {}

        def _distribution(self) -> dict[str, Any]:
            """rank / world size from the attached trainer (several processes), else the Loader's choice."""
            trainer = getattr(self, "trainer", None)
            world = int(getattr(trainer, "world_size", 1) or 1) if trainer is not None else 1
            if world <= 1:
                return {}
            return {"rank": int(trainer.global_rank), "world_size": world}

        def loader(self, split: str) -> LightningLoader:
            """The (wrapped) Loader of ``split``: one of train, val, test, predict."""
            from .reader.loader import Loader

            path = self.paths.get(split)
            if path is None:
                raise ValueError(f"precompile.lightning: no {split} build was given")
            train = split == "train"
            shared = dict(self.loader_kwargs)
            if not train:   # evaluation reads every sample: a drop_last for training is not its (eval_kwargs may)
                shared.pop("drop_last", None)
            kw: dict[str, Any] = {"shuffle": self.shuffle if train else False, **self._distribution(),
                                  **shared, **(self.train_kwargs if train else self.eval_kwargs)}
            if isinstance(path, (list, tuple)):   # several builds: mixed (weights, stop, cycle from the kwargs)
                from .reader.mix import Mix

                self.loaders[split] = LightningLoader(Mix([str(p) for p in path], self.batch_size, **kw))
            else:
                self.loaders[split] = LightningLoader(Loader(str(path), self.batch_size, **kw))
            return self.loaders[split]

        def train_dataloader(self) -> LightningLoader:
            return self.loader("train")

        def val_dataloader(self) -> Any:
            return self.loader("val") if self.paths["val"] is not None else []

        def test_dataloader(self) -> LightningLoader:
            return self.loader("test")

        def predict_dataloader(self) -> LightningLoader:
            return self.loader("predict")

    return PrecompileDataModule


def __getattr__(name: str) -> Any:
    """``PrecompileDataModule`` is made on first use, so this module imports without Lightning."""
    if name == "PrecompileDataModule":
        cls = _make_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)
