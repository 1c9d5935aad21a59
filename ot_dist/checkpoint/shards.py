"""Each rank's share of the training state, saved as the fragments it owns and read back into any layout.

A rank saves the tensors its optimizer steps (parallel/ownership.py: whole parameters, FSDP2 local
shards, ZeRO flat partitions), their EMA and their optimizer state, as flat safetensors, plus a JSON
list of which run of which named parameter each one holds. Loading asks, for every fragment the *new*
layout owns, which saved runs cover it, and copies those element ranges. So a checkpoint written by 2
fsdp ranks loads on 1 rank, on 4, or under zero2, without a conversion step and without pickle:
torch's distributed checkpoint keeps its index as a pickle and DeepSpeed's files are pickles loaded
with `weights_only=False`, which this project's security rules exclude.

Optimizer state entries are classified per parameter: `elementwise` (shaped like the parameter: Adam's
moments) reshards; `scalar` (a step count) is copied; `opaque` (Adafactor's factored rows, 8-bit
blocks) only loads into the same layout, and anything else is an error naming the entry.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch.distributed.tensor import DTensor

from ot_dist.errors import InputFileError, os_error_of
from ot_dist.parallel.ownership import Fragment, Ownership, local


def rank_stem(rank: int) -> str:
    return f"rank-{rank:05d}"


# -- saving ------------------------------------------------------------------------------------------


def optimizer_state_of(optimizer, param) -> dict:
    """An optimizer's state for one parameter, with selection-shaped entries expanded to the parameter's
    shape when the optimizer knows how (ShardedProdigy's p0 / s)."""
    expand = getattr(optimizer, "checkpoint_state", None)
    return expand(param) if expand else dict(optimizer.state.get(param, {}))


def classify(state: dict, owned_shape: torch.Size) -> dict[str, str]:
    kinds = {}
    for key, value in state.items():
        if not torch.is_tensor(value):
            continue
        shape = local(value).shape
        kinds[key] = "elementwise" if shape == owned_shape and len(shape) else "scalar" if not len(shape) else "opaque"
    if "opaque" in kinds.values():  # e.g. 8-bit moments with per-block scales: they only make sense together
        kinds = {k: ("opaque" if kind == "elementwise" else kind) for k, kind in kinds.items()}
    return kinds


def rank_state(ownership: Ownership, optimizer, ema, writes_owned: bool, extra_tensors: dict[str, torch.Tensor],
               extra_json: dict, to_host) -> tuple[dict[str, torch.Tensor], dict]:
    """This rank's share of the training state as (the tensors of rank-<r>.safetensors, the JSON of rank-<r>.json).
    `to_host(tensor)` gives each flat or scalar tensor's host copy (checkpoint/staging.py). `writes_owned` is false on
    ranks whose owned tensors duplicate another rank's (ddp replicas, hybrid-shard replicas): they save only their RNG."""
    tensors, owned_meta = {}, []
    for i, owned in enumerate(ownership.owned if writes_owned else []):
        values = owned.local()
        tensors[f"w/{i}"] = to_host(values.reshape(-1))
        if ema is not None:
            tensors[f"ema/{i}"] = to_host(ema.values[i].reshape(-1))
        state = optimizer_state_of(optimizer, owned.param)
        kinds = classify(state, values.shape)
        entries, python = {}, {}
        for key, value in state.items():
            if key not in kinds:
                python[key] = value
                continue
            plain = local(value)
            tensors[f"opt/{i}/{key}"] = to_host(plain.reshape(-1) if kinds[key] == "elementwise" else plain)
            entries[key] = {
                "kind": kinds[key],
                "dtensor": isinstance(value, DTensor),
                "on_param_device": plain.device == values.device,
            }
        owned_meta.append({
            "numel": values.numel(),
            "fragments": [[f.name, f.param_offset, f.local_offset, f.numel] for f in owned.fragments],
            "state": entries,
            "python_state": jsonable(python, f"optimizer state of {owned.fragments[0].name if owned.fragments else i}"),
        })
    for key, value in extra_tensors.items():
        tensors[key] = to_host(value)
    return tensors, {"owned": owned_meta, **extra_json}


def write_rank_state(folder: Path, rank: int, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    """rank-<r>.safetensors and rank-<r>.json in `folder`, from `rank_state`'s host copies."""
    path = folder / f"{rank_stem(rank)}.safetensors"
    try:
        save_file(tensors, path)
    except SafetensorError as err:
        raise as_os_error(err, path) from err
    (folder / f"{rank_stem(rank)}.json").write_text(json.dumps({"rank": rank, **meta}))


def as_os_error(err: SafetensorError, path: Path) -> Exception:
    """safetensors reports a failed write (disk full, quota, file size limit) as a SafetensorError that carries the
    OS error in its text ("I/O error: No space left on device (os error 28)"): that is the disk, which the commit
    protocol reports as exit 3 (checkpoint/writer.py), not a defect. Anything else stays as it is."""
    found = os_error_of(err)
    return OSError(found.errno, found.strerror, str(path)) if found else err


def jsonable(value, what: str):
    """`value` as plain JSON types (tuples as lists, one-element tensors as numbers), or a TypeError naming it."""
    if isinstance(value, (tuple, list)):
        return [jsonable(v, what) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v, what) for k, v in value.items()}
    if torch.is_tensor(value) and value.numel() == 1:
        return value.item()
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"checkpoint: the {what} holds a {type(value).__name__}, which a checkpoint cannot store")


# -- loading -----------------------------------------------------------------------------------------


def read_json(path: Path):
    """A checkpoint's JSON file; anything else (a pickle, a torn write) is an error naming it, never decoded."""
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise InputFileError(f"checkpoint {path.parent}: {path.name} is not readable JSON ({err})") from None


def read_rank_files(folder: Path, known: dict[str, dict] | None = None) -> dict[str, dict]:
    """Every rank-<r>.json of `folder`, by file name (those in `known` already read)."""
    known = known or {}
    paths = sorted(folder.glob("rank-*.json"))
    if not paths:
        raise InputFileError(f"checkpoint {folder}: no rank-*.json files")
    return {path.name: known[path.name] if path.name in known else read_json(path) for path in paths}


def _owned_list(meta, folder: Path, file: Path) -> list[dict]:
    """A rank file's `owned` entries, checked for the fields loading reads: a hand-edited or foreign JSON file is an
    error naming it, not a KeyError deep inside the load."""
    try:
        owned = meta["owned"]
        for entry in owned:
            if not (isinstance(entry["fragments"], list) and isinstance(entry["state"], dict)
                    and isinstance(entry["python_state"], dict)
                    and all(isinstance(f, list) and len(f) == 4 for f in entry["fragments"])):
                raise TypeError
        return list(owned)
    except (KeyError, TypeError, IndexError):
        raise InputFileError(f"checkpoint {folder}: {file.with_suffix('.json').name} is not an ot_dist rank file "
                             "(its owned fragments are missing or malformed)") from None


def _fragment_lists(meta, folder: Path, name: str) -> list | None:
    """The fragments of each owned tensor a rank file lists (None: a malformed file, which rank 0 names)."""
    try:
        return [owned["fragments"] for owned in _owned_list(meta, folder, folder / name)]
    except InputFileError:
        return None


def for_this_rank(folder: Path, ownership: Ownership, runtime) -> SavedShards:
    """The rank files this rank's `load_rank_state` needs, read with O(world size) opens over the whole job: every
    rank reading every rank's JSON made a resume N² small reads on shared storage (each a metadata round trip on
    NFS, Lustre or an object-store mount). Every rank calls this at the same point (`runtime`: the run's Runtime).

    At the layout that saved the checkpoint (same strategy and number of processes, the common resume) a rank's own
    rank-<r>.json lists exactly the fragments it owns now: that file is all it reads. Otherwise (another layout, or
    ranks whose file holds no owned state: ddp and hybrid-shard replicas) rank 0 reads every rank file and sends
    their JSON text to the others; a file it cannot read is an error naming it, raised on every rank."""
    own_name = f"{rank_stem(runtime.rank)}.json"
    try:
        own = read_json(folder / own_name)
    except InputFileError:
        own = None  # none here (more ranks than saved it) or damaged: rank 0's reading below names a damaged one
    now = [[[f.name, f.param_offset, f.local_offset, f.numel] for f in owned.fragments] for owned in ownership.owned]
    self_contained = own is not None and _fragment_lists(own, folder, own_name) == now
    if not runtime.any_rank(not self_contained):
        return SavedShards(folder, {own_name: own})
    # JSON text, parsed on arrival: the other ranks decode nothing of the files but JSON, as rank 0 does.
    text = runtime.main_answer(lambda: json.dumps(read_rank_files(folder, {own_name: own} if own is not None else None)),
                               f"checkpoint {folder}: reading the rank files")
    return SavedShards(folder, json.loads(text))


@dataclass(frozen=True)
class SavedPiece:
    file: Path
    index: int  # position in that rank's owned list
    fragment: Fragment


class SavedShards:
    """Rank files of a checkpoint, indexed by parameter name: every one (`metas` None: read here, in one process), or
    those `metas` holds, by JSON file name (`for_this_rank`: what one rank of a resume needs)."""

    def __init__(self, folder: Path, metas: dict[str, dict] | None = None):
        self.folder = folder
        if metas is None:
            metas = read_rank_files(folder)
        self.meta = {folder / Path(name).with_suffix(".safetensors").name: meta for name, meta in sorted(metas.items())}
        self.by_name: dict[str, list[SavedPiece]] = {}
        for file, meta in self.meta.items():
            for i, owned in enumerate(_owned_list(meta, folder, file)):
                for name, param_offset, local_offset, numel in owned["fragments"]:
                    self.by_name.setdefault(name, []).append(SavedPiece(file, i, Fragment(name, param_offset, local_offset, numel)))
        self._handles, self._keys = {}, {}

    def rank_file(self, rank: int) -> Path:
        return self.folder / f"{rank_stem(rank)}.safetensors"

    def rank_meta(self, rank: int) -> dict | None:
        return self.meta.get(self.rank_file(rank))

    def owned_meta(self, piece: SavedPiece) -> dict:
        return self.meta[piece.file]["owned"][piece.index]

    def tensor(self, file: Path, key: str) -> torch.Tensor:
        return self._handle(file).get_tensor(key)

    def has(self, file: Path, key: str) -> bool:
        if file not in self._keys:
            self._keys[file] = set(self._handle(file).keys())
        return key in self._keys[file]

    def _handle(self, file: Path):
        if file not in self._handles:
            try:
                self._handles[file] = safe_open(str(file), framework="pt")
            except Exception as err:  # a damaged or foreign file (a pickle, say): never deserialised any other way
                raise InputFileError(f"checkpoint {self.folder}: {file.name} is not a readable safetensors file ({err})") from None
        return self._handles[file]

    def dtype_of(self, kind: str, f: Fragment, key: str = "") -> torch.dtype:
        piece = self.reference(f)
        name = f"{kind}/{piece.index}" + (f"/{key}" if key else "")
        return self._handle(piece.file).get_slice(name)[0:1].dtype  # flat tensors: read one element

    def fill(self, kind: str, target: torch.Tensor, fragments: list[Fragment], key: str = "") -> None:
        """Copy the saved values of `kind` ("w", "ema", "opt") covering `fragments` into the flat `target`."""
        for f in fragments:
            covered = 0
            for piece in self.by_name.get(f.name, []):
                s = piece.fragment
                first, end = max(f.param_offset, s.param_offset), min(f.param_offset + f.numel, s.param_offset + s.numel)
                if first >= end:
                    continue
                name = f"{kind}/{piece.index}" + (f"/{key}" if key else "")
                if not self.has(piece.file, name):
                    raise InputFileError(f"checkpoint {self.folder}: {piece.file.name} has no {name} for {f.name}")
                source = self._handle(piece.file).get_slice(name)
                start = s.local_offset + first - s.param_offset
                values = source[start : start + end - first]
                at = f.local_offset + first - f.param_offset
                target[at : at + end - first].copy_(values)
                covered += end - first
            if covered != f.numel:
                raise InputFileError(
                    f"checkpoint {self.folder}: elements {f.param_offset}..{f.param_offset + f.numel} of {f.name} are "
                    f"covered {covered} times over {f.numel} elements in the saved shards (files missing or mixed "
                    "from different checkpoints)"
                )

    def reference(self, f: Fragment) -> SavedPiece:
        """The saved piece holding the first element of `f`: where scalar state is taken from. An empty `f` (FSDP2
        gives a rank no rows of a parameter with fewer rows than ranks, e.g. Stable Cascade's (1, 1, 1, C) GRN
        gammas) holds no element: the empty piece saved at the same place (the same layout), else any piece."""
        pieces = self.by_name.get(f.name, [])
        for piece in pieces:
            s = piece.fragment
            if s.param_offset <= f.param_offset < s.param_offset + s.numel:
                return piece
        if f.numel == 0 and pieces:
            same = [p for p in pieces if p.fragment.numel == 0 and p.fragment.param_offset == f.param_offset]
            return (same or pieces)[0]
        raise InputFileError(f"checkpoint {self.folder}: no saved shard holds {f.name}[{f.param_offset}]")


def load_rank_state(saved: SavedShards, ownership: Ownership, optimizer, ema, optimizer_name: str) -> None:
    """Fill this rank's owned weights, EMA and optimizer state from `saved`, whatever layout wrote it."""
    for i, owned in enumerate(ownership.owned):
        if not owned.fragments:
            continue
        values = owned.local()
        ref = saved.reference(owned.fragments[0])  # the saved piece this one starts in
        with torch.no_grad():
            fill_in_place(saved, "w", values, owned.fragments)
            if ema is not None and saved.has(ref.file, f"ema/{ref.index}"):
                fill_in_place(saved, "ema", ema.values[i], owned.fragments)
            # A checkpoint saved without EMA leaves the average at the current weights (its start value).
        restore = getattr(optimizer, "load_checkpoint_state", None)
        # torch's optimizers keep per-element state of a DTensor parameter as DTensors (whatever layout
        # saved it); optimizers with their own restore (ShardedProdigy) work on local tensors.
        state = _load_optimizer_state(saved, ref, owned, values, optimizer_name, elementwise_as_dtensor=restore is None)
        if state:
            if restore:
                restore(owned.param, state)
            else:
                optimizer.state[owned.param] = state


def fill_in_place(saved: SavedShards, kind: str, tensor: torch.Tensor, fragments: list[Fragment]) -> None:
    """Overwrite the elements of `tensor` the fragments cover (ZeRO's partition padding is left alone),
    directly when it is a contiguous CPU tensor, else through a CPU copy."""
    direct = tensor.device.type == "cpu" and tensor.is_contiguous()
    flat = tensor.detach().view(-1) if direct else tensor.detach().reshape(-1).to("cpu", copy=True)
    saved.fill(kind, flat, fragments)
    if not direct:
        tensor.detach().copy_(flat.view(tensor.shape))


def _load_optimizer_state(saved: SavedShards, ref: SavedPiece, owned, values: torch.Tensor, optimizer_name: str,
                          elementwise_as_dtensor: bool) -> dict:
    meta = saved.owned_meta(ref)
    same_layout = meta["fragments"] == [[f.name, f.param_offset, f.local_offset, f.numel] for f in owned.fragments]
    state = dict(meta["python_state"])
    for key, entry in meta["state"].items():
        kind = entry["kind"]
        if kind == "elementwise":
            target = torch.empty(values.numel(), dtype=saved.dtype_of("opt", owned.fragments[0], key))
            saved.fill("opt", target, owned.fragments, key)
            value = target.view(values.shape)
        elif kind == "scalar" or same_layout:  # a step count; or layout-bound state, into the same layout
            value = saved.tensor(ref.file, f"opt/{ref.index}/{key}")
        else:
            raise InputFileError(
                f"checkpoint {saved.folder}: the optimizer state '{key}' of {optimizer_name} is not per element (it "
                f"belongs to the layout that saved it), and this run splits {owned.fragments[0].name} differently; "
                "resume with the strategy and number of processes that saved it"
            )
        if entry["on_param_device"]:
            value = value.to(values.device)
        if isinstance(owned.param, DTensor) and (entry["dtensor"] or (kind == "elementwise" and elementwise_as_dtensor)):
            value = _as_dtensor(value, owned.param)
        state[key] = value
    return state


def _as_dtensor(value: torch.Tensor, param: DTensor) -> DTensor:
    from torch.distributed.tensor import Replicate

    if value.shape == local(param).shape:
        return DTensor.from_local(value, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
    return DTensor.from_local(value, param.device_mesh, [Replicate()] * param.device_mesh.ndim, run_check=False)


def gather_full_from_files(saved: SavedShards, shapes: dict[str, list[int]], kind: str = "w",
                           key: str = "") -> dict[str, torch.Tensor]:
    """Full parameters (kind "w"), EMA ("ema") or elementwise optimizer state ("opt", `key`) from the files
    alone, in one process (`ot-dist export CHECKPOINT`)."""
    full = {}
    for name, shape in shapes.items():
        numel = torch.Size(shape).numel()
        whole_param = [Fragment(name, 0, 0, numel)]
        out = torch.empty(numel, dtype=saved.dtype_of(kind, whole_param[0], key))
        saved.fill(kind, out, whole_param, key)
        full[name] = out.view(shape)
    return full
