"""Saving a sharded optimizer's state whole, and loading it back re-sharded (ZeRO-1).

A ``DistributedOptimizer(shard_optimizer_state=True)`` holds on each rank the
wrapped optimizer's state for its share of the trainable variables only
(``zero.Shards``). A file must hold the *unsharded layout* instead: the
variables, in the order, that the same ``DistributedOptimizer`` without
sharding would save, so that the file loads into a sharded or an unsharded
optimizer at any number of ranks.

The layout is found without building that optimizer: a copy of the wrapped
optimizer (from its config) builds on the variables with ``add_variable``
replaced by a recorder that allocates nothing, and every variable it would
create is attributed to the trainable variable it was made for (the
reference of ``add_variable_from_reference``; a variable made with
``add_variable`` belongs to the next reference, as Adafactor's factored
moments do). The same recording on the rank's own share (its whole variables
and row-block proxies) names which of its slots is which.

Writing (``gathering``, entered on every rank by ``kd.save_model``): rank 0
runs Keras's save; where it reaches the optimizer, it announces the part
(the wrapper's variables, or the wrapped optimizer's own entry) and every
rank sends its pieces of each slot in turn, one broadcast per piece from its
owner. Rank 0 writes each slot whole before the next: beyond its share, no
rank holds more than the slot being written and the piece in flight.

Loading: each rank reads the file itself and keeps its rows of every slot;
inside ``rank_zero_io`` (``BackupAndRestore``), rank 0 reads it and sends each
piece to its owner.

Elastic commits (``kd.elastic.KerasState``): the same gather, kept on every
rank (``gather_everywhere``), so that any rank's or machine's copy holds the
whole state; a restore at any number of ranks keeps this rank's rows of it
(``keep_share``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref

import keras
import numpy as np

from keras_dist import _compat as compat
from keras_dist._runtime import context
from keras_dist.tensor import ops as kd_ops

#: Announced by rank 0 after the parts it writes or reads: the save or load is over.
_DONE = "done"


@dataclasses.dataclass(frozen=True)
class Slot:
    """The ``ordinal``-th optimizer variable made for trainable variable ``index``."""

    index: int
    ordinal: int
    shape: tuple[int, ...]
    dtype: str


@dataclasses.dataclass(frozen=True)
class _Spec:
    """What ``add_variable`` was asked to make (nothing is allocated)."""

    shape: tuple[int, ...]
    dtype: str
    name: str | None = None


def _record(optimizer, variables) -> list[tuple[int, _Spec]]:
    """The variables ``optimizer``'s ``build(variables)`` would create, each with the
    position in ``variables`` of the variable it was made for, in creation order."""
    template = type(optimizer).from_config(optimizer.get_config())
    positions = {id(v): i for i, v in enumerate(variables)}
    made: list[_Spec] = []
    owners: list[int | None] = []

    def add_variable(shape, initializer="zeros", dtype=None, aggregation="none",
                     layout=None, name=None, **kwargs):
        spec = _Spec(tuple(int(d) for d in shape),
                     keras.backend.standardize_dtype(dtype or keras.backend.floatx()), name)
        made.append(spec)
        owners.append(None)
        return spec

    def add_variable_from_reference(reference_variable, name=None, initializer="zeros"):
        spec = type(template).add_variable_from_reference(
            template, reference_variable, name=name, initializer=initializer)
        position = positions.get(id(reference_variable))
        for i in range(len(owners) - 1, -1, -1):
            if owners[i] is not None:
                break
            owners[i] = position
        return spec

    template.add_variable = add_variable
    template.add_variable_from_reference = add_variable_from_reference
    template.build(list(variables))
    if any(owner is None for owner in owners):
        raise NotImplementedError(
            f"{type(optimizer).__name__} creates optimizer state that belongs to no "
            "trainable variable, which a sharded optimizer cannot save or load yet; pass "
            "shard_optimizer_state=False. Received: optimizer="
            f"{type(optimizer).__name__}")
    return list(zip(owners, made))


class Layout:
    """How this rank's sharded state maps onto the unsharded layout.

    Args:
        wrapper: the ``DistributedOptimizer`` (built, sharding its state).
        shards: its ``zero.Shards``.
        variables: its trainable variables, in the order every rank shares.
    """

    def __init__(self, wrapper, shards, variables):
        inner = wrapper.inner_optimizer
        self.shards = shards
        self.variables = list(variables)
        proxies = {id(target) for _, _, target in shards.own}
        everything = list(wrapper.variables)
        own = everything[:len(everything) - len(inner.variables)]
        self.wrapper_own = [v for v in own if id(v) not in proxies]
        self.inner_own = list(shards.replicated_inner)
        # The unsharded slots, in the order the wrapped optimizer makes them.
        counts: dict[int, int] = {}
        self.slots: list[Slot] = []
        for index, spec in _record(inner, self.variables):
            ordinal = counts.get(index, 0)
            counts[index] = ordinal + 1
            self.slots.append(Slot(index, ordinal, spec.shape, spec.dtype))
        # This rank's slot variables: (variable index, piece start, ordinal) -> variable.
        built = list(inner.variables)[len(self.inner_own):]
        recorded = _record(inner, shards.held)
        if len(recorded) != len(built) or any(
                spec.shape != tuple(int(d) for d in v.shape)
                for (_, spec), v in zip(recorded, built)):
            raise NotImplementedError(
                f"{type(inner).__name__} built a state this rank cannot map to the "
                "unsharded layout, so it cannot be saved or loaded sharded; pass "
                f"shard_optimizer_state=False. Received: optimizer={type(inner).__name__}")
        self.held: dict[tuple[int, int, int], object] = {}
        counts = {}
        for (position, _), variable in zip(recorded, built):
            index, piece, _ = shards.own[position]
            ordinal = counts.get(position, 0)
            counts[position] = ordinal + 1
            self.held[(index, piece.start, ordinal)] = variable
        for slot in self.slots:
            pieces = shards.pieces[slot.index]
            if len(pieces) > 1 and slot.shape[:1] != (pieces[-1].stop,):
                raise NotImplementedError(
                    f"{type(inner).__name__} keeps a state of shape {slot.shape} for a "
                    "variable whose rows are split between ranks; pass "
                    f"shard_optimizer_state=False. Received: optimizer={type(inner).__name__}")

    def entries(self, part: str) -> list:
        """The unsharded layout of ``part`` ("wrapper": everything the wrapper saves;
        "inner": the wrapped optimizer's own entry): variables every rank holds
        alike, and ``Slot``s."""
        alike = self.wrapper_own + self.inner_own if part == "wrapper" else self.inner_own
        return alike + self.slots

    def piece_value(self, slot: Slot, piece):
        """This rank's rows of ``slot`` for ``piece`` (a numpy array), or None."""
        variable = self.held.get((slot.index, piece.start, slot.ordinal))
        return None if variable is None else keras.ops.convert_to_numpy(variable.value)

    def gather(self, slot: Slot, everywhere: bool = False) -> np.ndarray | None:
        """``slot`` whole on rank 0, or on every rank with ``everywhere`` (None
        elsewhere): a broadcast per piece from its owner."""
        group = context.get()
        pieces = self.shards.pieces[slot.index]
        whole = np.empty(slot.shape, slot.dtype) if everywhere or group.rank == 0 else None
        for piece in pieces:
            shape = slot.shape if len(pieces) == 1 else (
                piece.stop - piece.start, *slot.shape[1:])
            value = self.piece_value(slot, piece) if piece.rank == group.rank else None
            if group.size > 1:
                if value is None:
                    value = np.zeros(shape, slot.dtype)
                value = kd_ops.broadcast(value, root_rank=piece.rank,
                                         name="sharded optimizer state")
            if whole is not None:
                whole[slice(piece.start, piece.stop) if len(pieces) > 1 else ...] = value
        return whole

    def values(self, part: str, everywhere: bool = False):
        """The unsharded ``part``'s values in order (numpy arrays), gathered a
        variable at a time: on rank 0, or on every rank with ``everywhere``
        (None elsewhere for the slots). A collective."""
        for entry in self.entries(part):
            yield self.gather(entry, everywhere) if isinstance(entry, Slot) else (
                keras.ops.convert_to_numpy(entry.value))

    def specs(self, part: str) -> list[tuple[str, tuple[int, ...], str]]:
        """(name, shape, dtype) of each entry of the unsharded ``part``."""
        return [(f"{self.variables[e.index].path}'s optimizer state {e.ordinal}", e.shape,
                 e.dtype) if isinstance(e, Slot) else (
                     e.path, tuple(int(d) for d in e.shape),
                     keras.backend.standardize_dtype(e.dtype))
                for e in self.entries(part)]

    def write(self, part: str, store) -> None:
        """The unsharded ``part`` into ``store`` (rank 0; ``store`` None elsewhere)."""
        for i, value in enumerate(self.values(part)):
            if store is not None:
                store[str(i)] = value

    def check(self, part: str, store) -> None:
        """Raises unless ``store`` holds the unsharded layout of ``part``."""
        entries = self.entries(part)
        if len(store.keys()) != len(entries):
            raise ValueError(
                f"The file's optimizer state must have the unsharded layout of this "
                f"optimizer, {len(entries)} variables (a file written by kd.save_model or "
                f"by an unsharded run). Received: {len(store.keys())} variables")

    def read(self, part: str, store) -> None:
        """This rank's share of the unsharded ``part`` from ``store``."""
        self.check(part, store)
        for i, entry in enumerate(self.entries(part)):
            if not isinstance(entry, Slot):
                entry.assign(store[str(i)])
                continue
            pieces = self.shards.pieces[entry.index]
            owned = [p for p in pieces if p.rank == self.shards.rank]
            if not owned:
                continue
            value = store[str(i)]
            for piece in owned:
                target = self.held[(entry.index, piece.start, entry.ordinal)]
                target.assign(value if len(pieces) == 1 else value[piece.start:piece.stop])

    def scatter(self, part: str, store) -> None:
        """Rank 0's ``store`` (None elsewhere) to every rank's share: rank 0 reads each
        variable and sends each piece to its owner (a broadcast per piece)."""
        group = context.get()
        for i, entry in enumerate(self.entries(part)):
            value = None if store is None else store[str(i)]
            if not isinstance(entry, Slot):
                if value is None:
                    value = np.zeros(tuple(entry.shape), entry.dtype)
                entry.assign(kd_ops.broadcast(np.asarray(value), root_rank=0,
                                              name="sharded optimizer state"))
                continue
            pieces = self.shards.pieces[entry.index]
            for piece in pieces:
                rows = ... if len(pieces) == 1 else slice(piece.start, piece.stop)
                shape = entry.shape if len(pieces) == 1 else (
                    piece.stop - piece.start, *entry.shape[1:])
                if piece.rank != 0:
                    part_value = (np.zeros(shape, entry.dtype) if value is None
                                  else np.ascontiguousarray(value[rows]))
                    part_value = kd_ops.broadcast(part_value, root_rank=0,
                                                  name="sharded optimizer state")
                elif group.rank == 0:
                    part_value = value[rows]
                if piece.rank == group.rank:
                    self.held[(entry.index, piece.start, entry.ordinal)].assign(part_value)


#: Non-empty while rank 0 saves or loads inside ``rank_zero_io`` (the others serve it).
_ACTIVE: list[bool] = []


#: Each sharding ``DistributedOptimizer``'s ``zero.Shards`` (``install``), and its
#: ``Layout`` once a save or load needed it.
_SHARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_LAYOUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _layout(wrapper) -> Layout:
    if wrapper not in _LAYOUTS:
        _LAYOUTS[wrapper] = Layout(wrapper, _SHARDS[wrapper], compat.built_variables(wrapper))
    return _LAYOUTS[wrapper]


def install(wrapper, shards) -> None:
    """Gives a sharding ``wrapper`` (its share: ``shards``) and its wrapped
    optimizer the unsharded layout in files (Keras saves and loads the wrapped
    optimizer under its own entry, beside the wrapper's)."""
    _SHARDS[wrapper] = shards
    _LAYOUTS.pop(wrapper, None)
    inner = wrapper.inner_optimizer
    inner.save_own_variables = functools.partial(save_part, wrapper, "inner")
    inner.load_own_variables = functools.partial(load_part, wrapper, "inner")


def save_part(wrapper, part: str, store) -> None:
    """``save_own_variables`` of a sharding ``wrapper`` (``part``: "wrapper" or
    "inner"): the unsharded layout, gathered from every rank inside
    ``kd.save_model``; at one rank, without any collective."""
    group = context.get()
    if group.size > 1 and not _ACTIVE:
        raise ValueError(
            "A DistributedOptimizer with shard_optimizer_state=True holds only this "
            "rank's share of the optimizer state, so a save must be made by every rank "
            "together: call `kd.save_model(model, filepath)` on every rank (rank 0 "
            "writes the file), or give kd.callbacks.BestModelCheckpoint to every rank, "
            "instead of `model.save`, `model.save_weights` or ModelCheckpoint on one "
            "rank. Received: a save on rank "
            f"{group.rank} of {group.size} alone")
    layout = _layout(wrapper)
    if group.size > 1:
        kd_ops.broadcast_object(("write", part), root_rank=0)
    layout.write(part, store)


def load_part(wrapper, part: str, store) -> None:
    """``load_own_variables`` of a sharding ``wrapper``: this rank's share of a file's
    unsharded layout. Inside ``rank_zero_io``, rank 0 reads the file and sends
    each rank its share; otherwise every rank reads the file itself."""
    layout = _layout(wrapper)
    if not _ACTIVE:
        layout.read(part, store)
        return
    layout.check(part, store)
    kd_ops.broadcast_object(("read", part), root_rank=0)
    layout.scatter(part, store)


def gather_everywhere(wrapper) -> list[np.ndarray]:
    """The whole state of a sharding ``wrapper`` in the unsharded layout (what
    ``kd.save_model`` writes of it), on every rank: a collective, each slot
    gathered in turn (a broadcast per piece from its owner), for an elastic
    commit that must survive the loss of any rank and re-shard at another size."""
    return list(_layout(wrapper).values("wrapper", everywhere=True))


def unsharded_specs(wrapper) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, dtype) of each array ``gather_everywhere`` gives, at any size."""
    return _layout(wrapper).specs("wrapper")


def keep_share(wrapper, arrays) -> None:
    """This rank's share of ``arrays`` (as ``gather_everywhere`` gives them, at
    this or any other number of ranks) into a sharding ``wrapper``: no collective."""
    _layout(wrapper).read("wrapper", {str(i): a for i, a in enumerate(arrays)})


def sharding(model) -> list:
    """``model``'s optimizer, if it is a ``DistributedOptimizer`` sharding its state
    (a list of it, or an empty list)."""
    optimizer = getattr(model, "optimizer", None)
    while optimizer is not None and not hasattr(optimizer, "shard_optimizer_state"):
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return [optimizer] if optimizer is not None and optimizer.shard_optimizer_state else []


def served(model, when: bool = True):
    """``rank_zero_io`` for ``model``'s sharding optimizer (where ``when``), else a
    block that does nothing more: for callbacks whose write or read runs on rank 0."""
    wrappers = sharding(model) if when else []
    return rank_zero_io(wrappers) if wrappers else contextlib.nullcontext()


@contextlib.contextmanager
def rank_zero_io(wrappers):
    """Rank 0 saves or loads inside this block; every other rank serves it meanwhile.

    On rank 0 the block runs (a save or a load) and then tells the other
    ranks it is done; on every other rank the block's body must do nothing,
    and this rank sends its pieces of each part rank 0 writes (or receives
    them of each part rank 0 reads) until it is done. Rank 0's error, if the
    block fails there, is raised on every rank.

    Args:
        wrappers: the sharding ``DistributedOptimizer``s rank 0 may reach (built).
    """
    group = context.get()
    if group.size == 1:
        yield
        return
    wrappers = list(wrappers)
    error = None
    if group.rank == 0:
        _ACTIVE.append(True)
        try:
            yield
        except Exception as failure:  # every rank learns of it below
            error = failure
        finally:
            _ACTIVE.pop()
        kd_ops.broadcast_object(_DONE, root_rank=0)
        message = None if error is None else f"{type(error).__name__}: {error}"
    else:
        yield
        while True:
            announced = kd_ops.broadcast_object(None, root_rank=0)
            if announced == _DONE:
                break
            if len(wrappers) != 1:
                raise RuntimeError(
                    "A model's state is saved or loaded by every rank with one sharded "
                    f"DistributedOptimizer at most. Received: {len(wrappers)}")
            operation, part = announced
            layout = _layout(wrappers[0])
            if operation == "write":
                layout.write(part, None)
            else:
                layout.scatter(part, None)
        message = None
    message = kd_ops.broadcast_object(message, root_rank=0)
    if error is not None:
        raise error
    if message is not None:
        from keras_dist.errors import KerasDistError

        raise KerasDistError(f"Rank 0 failed to save or load the model: {message}")
