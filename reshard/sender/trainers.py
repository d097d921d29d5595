"""What a trainer rank holds, read from whichever trainer wraps the model,
and which trainer readers (:mod:`reshard.sender.readers`) do the reading.

:func:`describe_trainer` is what ``Sender(model)`` runs at construction and
at every push, through :func:`readers` (each hook is described in
:mod:`reshard.sender.readers`):

1. a reader that owns the source outright describes it all (Megatron's
   ``MegatronSource``, a PEFT policy, a PEFT adapter);
2. unwrap, through every reader's ``unwrap``: ``DeepSpeedEngine``
   (``.module``), ``DistributedDataParallel`` / ``DataParallel``
   (``.module``: replicas), ``torch.compile`` (``._orig_mod``); Accelerate's
   ``prepare`` returns one of these, an FSDP1 unit, or a module with DTensor
   parameters (FSDP2);
3. readers of whole modules (FSDP1 units, AutoEP layers) and of single
   tensors (ZeRO-3 partitions) give boxes of the rank's own storage
   (:class:`~reshard.sender.held.Held`), no gather and no copy;
4. everything else (DTensors: FSDP2, TP; plain tensors: replicas, ZeRO-1/2,
   DDP) goes to :func:`~reshard.sender.pieces.describe_module`.

The readers are :data:`BUILTIN`, in its order, then those registered with
:func:`register_reader`, in theirs. One object (a source, a wrapper, a
tensor) is claimed by one reader at most: two claimants are an error naming
both, so no reader relies on going first. The order decides only which
reader's refusal a tensor meets first, the order of the views that readers
of whole modules give, and how :func:`known_trainers` lists the trainers in
errors: the trainers that keep the weights (their wrappers and storage)
first, then the sources a reader describes whole, then users' readers.

Never silent: a tensor or module that a reader recognizes as one reshard
cannot read raises at once, naming the parameter, the wrapper and the rank
(an empty tensor that is no known partition, a flat parameter outside an
FSDP1 unit, a Megatron tensor-parallel shard, a layer of DeepSpeed's AutoTP).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from reshard.errors import ReshardError
from reshard.models.names import CheckpointNames
from reshard.plan.specs import GridSpec, PieceSpec
from reshard.sender import deepspeed, fsdp1, lora_adapter, megatron, peft
from reshard.sender.held import Held, held_pieces
from reshard.sender.pieces import default_rename, describe_module
from reshard.sender.readers import Description, ReadContext, TrainerReader
from reshard.transport.locals import LocalTensors, Tensors

if TYPE_CHECKING:
    import torch

__all__ = ["BUILTIN", "describe_trainer", "known_trainers", "readers", "register_reader", "unwrap"]

_T = TypeVar("_T")


def _ddp_module(obj: Any) -> Any | None:
    import torch

    if isinstance(obj, torch.nn.parallel.DistributedDataParallel | torch.nn.DataParallel):
        return obj.module
    return None


def _compiled_module(obj: Any) -> Any | None:
    return obj._orig_mod if type(obj).__name__ == "OptimizedModule" and hasattr(obj, "_orig_mod") else None


BUILTIN: tuple[TrainerReader, ...] = (
    deepspeed.READER,
    fsdp1.READER,
    TrainerReader(name="DistributedDataParallel", unwrap=_ddp_module),
    TrainerReader(name="torch.compile", unwrap=_compiled_module),
    megatron.READER,
    peft.READER,
    lora_adapter.READER,
)
"""The trainers ``Sender(model)`` reads without being told, in the order the
module docstring explains: the trainers that keep the weights (DeepSpeed
ZeRO and AutoEP, FSDP1, DDP, ``torch.compile``), then the sources read whole
(Megatron-Core, a PEFT policy merged, a PEFT adapter alone)."""

_REGISTERED: list[TrainerReader] = []


def register_reader(reader: TrainerReader) -> TrainerReader:
    """Add a user's ``reader`` after every reader there is; a name already
    taken (a built-in's, or one registered before) is refused. Returns it."""
    taken = next((r for r in readers() if r.name == reader.name), None)
    if taken is not None:
        raise ValueError(
            f"a trainer reader named {reader.name!r} is already registered"
            + (" (a built-in)" if taken in BUILTIN else "")
            + "; give the new one another name"
        )
    _REGISTERED.append(reader)
    return reader


def readers() -> tuple[TrainerReader, ...]:
    """Every reader: :data:`BUILTIN`, then the registered ones in registration order."""
    return (*BUILTIN, *_REGISTERED)


def known_trainers() -> str:
    """What ``Sender(model)`` reads, for error messages."""
    return ", ".join([*(r.name for r in readers()), "FSDP2 / DTensor", "plain tensors"])


def _one(claims: Sequence[tuple[TrainerReader, _T]], what: str, rank: int | None) -> _T | None:
    """The one claim on an object, ``None`` for none; two or more are refused."""
    if len(claims) > 1:
        raise _claimed_twice([r for r, _ in claims], what, rank)
    return claims[0][1] if claims else None


def _claimed_twice(claimants: Sequence[TrainerReader], what: str, rank: int | None) -> TypeError:
    who = " and ".join(repr(r.name) for r in claimants)
    return TypeError(
        (f"rank {rank}: " if rank is not None else "")
        + f"{what} is claimed by {len(claimants)} trainer readers, {who}; an object is read by one reader "
        "only (each reader's hooks must decline what another reads)"
    )


def unwrap(source: Any, *, rank: int | None = None) -> tuple[Any, list[str]]:
    """The model inside the wrappers the readers unwrap, and the wrappers'
    type names, outermost first. ``rank``: named in errors."""
    chain: list[str] = []
    while True:
        claims = [(r, inner) for r in readers() if r.unwrap is not None and (inner := r.unwrap(source)) is not None]
        inner = _one(claims, f"the wrapper {type(source).__name__}", rank)
        if inner is None:
            return source, chain
        chain.append(type(source).__name__)
        source = inner


def describe_trainer(
    source: torch.nn.Module | Mapping[str, torch.Tensor] | Any,
    *,
    rank: int,
    rename: Callable[[str], str | None] | None = default_rename,
    model_type: str | None = None,
    include_buffers: bool = True,
    source_rank_of: Callable[[int], int] | None = None,
) -> Description:
    """What this trainer rank holds, in checkpoint names (see the module
    docstring). ``model_type`` defaults to the unwrapped model's
    ``config.model_type``."""

    def inner(src: Any, inner_rename: Callable[[str], str | None] | None) -> Description:
        return _read(src, ctx_of(inner_rename))

    def ctx_of(r: Callable[[str], str | None] | None) -> ReadContext:
        return ReadContext(
            source=source,
            rank=rank,
            where=type(source).__name__,
            rename=r,
            model_type=model_type,
            include_buffers=include_buffers,
            source_rank_of=source_rank_of,
            unwrap=functools.partial(unwrap, rank=rank),
            inner=inner,
        )

    ctx = ctx_of(rename)
    claims = [
        (r, whole) for r in readers() if r.describe is not None and (whole := r.describe(source, ctx)) is not None
    ]
    whole = _one(claims, f"the source {type(source).__name__}", rank)
    if whole is None:
        return _read(source, ctx)
    if not isinstance(whole, Description):
        raise TypeError(
            f"rank {rank}: trainer reader {claims[0][0].name!r} described {type(source).__name__} as a "
            f"{type(whole).__name__}, not a reshard.sender.readers.Description"
        )
    return whole


def _read(source: Any, ctx: ReadContext) -> Description:
    """Steps 2-4 of :func:`describe_trainer`."""
    import torch

    rank, rename, include_buffers = ctx.rank, ctx.rename, ctx.include_buffers
    model_type = ctx.model_type
    model, chain = ctx.unwrap(source)
    if model_type is None:
        model_type = getattr(getattr(model, "config", None), "model_type", None)
    ctx = dataclasses.replace(ctx, where=" > ".join([*chain, type(model).__name__]), model_type=model_type)
    held: list[Held] = []
    owner: dict[int, TrainerReader] = {}
    """The reader of whole modules that accounts for a tensor, by the tensor's id."""
    if isinstance(model, torch.nn.Module):
        for reader in readers():
            if reader.refuse_module is not None and (why := reader.refuse_module(model, ctx)) is not None:
                raise TypeError(why)
        items = _named_tensors(model, include_buffers)
        by_id = {id(t): (n, t) for n, t in items}
        for reader in readers():
            for h, ids in reader.modules(model, ctx) if reader.modules is not None else ():
                for i in ids:
                    first = owner.setdefault(i, reader)
                    if first is not reader:
                        tname, tensor = by_id.get(i, ("?", None))
                        raise _claimed_twice([first, reader], _tensor_what(tname, tensor, ctx), rank)
                held += h
    else:
        items = list(model.items())
    rest: dict[str, torch.Tensor] = {}
    for name, t in items:
        read = _read_tensor(name, t, ctx, owner.get(id(t)))
        if read is not None:
            held += read
        elif id(t) not in owner:
            rest[name] = t
    pieces, grids, local = describe_module(
        rest, rank=rank, rename=rename, model_type=model_type, source_rank_of=ctx.source_rank_of
    )
    names = CheckpointNames(model_type)
    more, more_local = held_pieces(held, names=names, rename=rename, rank=rank)
    _refuse_twice(pieces, grids, more, rank)
    local.update(more_local)
    return Description(pieces + more, grids, local)


def _read_tensor(name: str, t: torch.Tensor, ctx: ReadContext, owner: TrainerReader | None) -> list[Held] | None:
    """Views of ``t`` from the reader that reads it; ``None``: a DTensor, a
    plain tensor, or one that ``owner`` (a reader of whole modules) already
    accounts for. Raises for a tensor a reader refuses, one that holds
    nothing no reader can account for, or one two readers claim."""
    import torch
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return None
    if owner is None:
        for reader in readers():
            if reader.refuse is not None and (why := reader.refuse(name, t, ctx)) is not None:
                raise ValueError(why)
    claims = [
        (r, views)
        for r in readers()
        if r is not owner and r.tensor is not None and (views := r.tensor(name, t, ctx)) is not None
    ]
    if owner is not None:
        if claims:
            raise _claimed_twice([owner, *(r for r, _ in claims)], _tensor_what(name, t, ctx), ctx.rank)
        return None
    views = _one(claims, _tensor_what(name, t, ctx), ctx.rank)
    if views is not None:
        return views
    if isinstance(t, torch.nn.Parameter) and t.numel() == 0:
        raise ValueError(
            f"rank {ctx.rank}: parameter {name!r} of {ctx.where} is empty (shape {list(t.shape)}) and is not a "
            f"partition reshard knows ({known_trainers()}); the trainer keeps its weights somewhere reshard "
            "cannot see. Pass the model as the trainer wrapped it, or describe its tensors with Sender.from_pieces"
        )
    return None


def _tensor_what(name: str, t: torch.Tensor | None, ctx: ReadContext) -> str:
    shape = f", shape {list(t.shape)}" if t is not None else ""
    return f"{name!r} of {ctx.where} ({type(t).__name__ if t is not None else 'a tensor'}{shape})"


def _named_tensors(model: torch.nn.Module, include_buffers: bool) -> list[tuple[str, torch.Tensor]]:
    """Parameters, then persistent buffers, each tensor once. (Not through
    ``state_dict()``: FSDP1 and DeepSpeed hook it, and FSDP1's gathers.)"""
    out: list[tuple[str, torch.Tensor]] = []
    seen: set[int] = set()
    for n, p in model.named_parameters():
        seen.add(id(p))
        out.append((n, p))
    if include_buffers:
        for mname, mod in model.named_modules():
            for bname, b in mod.named_buffers(recurse=False):
                if b is None or id(b) in seen or bname in mod._non_persistent_buffers_set:
                    continue
                seen.add(id(b))
                out.append((f"{mname}.{bname}" if mname else bname, b))
    return out


def _refuse_twice(pieces: list[PieceSpec], grids: list[GridSpec], more: list[PieceSpec], rank: int) -> None:
    """One checkpoint tensor read from a flat parameter and from a plain one."""
    plain = {p.tensor.name for p in pieces} | {g.tensor.name for g in grids}
    both = sorted(plain & {p.tensor.name for p in more})
    if both:
        raise ValueError(
            f"rank {rank}: {both[0]!r} is held both in a flat parameter and as a tensor of its own"
            + (f" (and {len(both) - 1} more)" if len(both) > 1 else "")
            + "; pass a rename function that drops one"
        )


DRAFT_NAMES = "draft."
"""The canonical prefix of a draft module's tensors beside a policy (the
names a vLLM engine gives a drafter with a checkpoint of its own:
``reshard.adapters.vllm.drafter.DRAFT_NAMES``)."""


def with_draft(policy: Description, draft: Description, names: str = DRAFT_NAMES) -> Description:
    """``policy`` and a draft module trained beside it (``draft``) as one
    trainer rank's tensors: the draft's checkpoint names under ``names``
    (``"draft."`` for a separate draft model or an EAGLE head, ``""`` for
    MTP layers kept in a module of their own under the policy's names), its
    local tensors apart from the policy's. A name both publish is refused."""
    from reshard.plan.layout import TensorMeta

    def plain(tensors: Any, what: str) -> Mapping[str, Any]:
        if isinstance(tensors, Tensors):
            return tensors.tensors
        if isinstance(tensors, LocalTensors):
            raise ReshardError(
                f"the {what} is read with a lifecycle of its own ({type(tensors).__name__}): "
                "a draft module beside it is not supported"
            )
        return tensors

    local = "draft:"
    pieces = [
        dataclasses.replace(
            p, tensor=TensorMeta(names + p.tensor.name, p.tensor.shape, p.tensor.dtype), local=local + p.local
        )
        for p in draft.pieces
    ]
    # A grid's chunk is the local tensor named like its canonical tensor.
    grids = [
        dataclasses.replace(g, tensor=TensorMeta(names + g.tensor.name, g.tensor.shape, g.tensor.dtype))
        for g in draft.grids
    ]
    gridded = {g.tensor.name: names + g.tensor.name for g in draft.grids}
    ours = {p.tensor.name for p in policy.pieces} | {g.tensor.name for g in policy.grids}
    theirs = {p.tensor.name for p in pieces} | {g.tensor.name for g in grids}
    both = sorted(ours & theirs)
    if both:
        raise ReshardError(f"the policy and its draft module both publish {both[:5]}: give the draft its own names")
    tensors = dict(plain(policy.tensors, "policy"))
    for k, v in plain(draft.tensors, "draft module").items():
        tensors[gridded.get(k, local + k)] = v
    return Description(list(policy.pieces) + pieces, list(policy.grids) + grids, tensors)
