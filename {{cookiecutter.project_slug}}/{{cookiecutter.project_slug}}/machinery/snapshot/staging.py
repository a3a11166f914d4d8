"""Copies of a state taken off the training thread: CPU staging buffers kept from one save to the next (or none:
the state itself is written), CUDA tensors copied into pinned memory on a side stream, and DTensors split into their
local shards and joined again."""

import copy
from typing import Any

import torch
from torch.distributed.tensor import DTensor


def _map_state(obj: Any, fn, path: tuple = ()) -> Any:
    """A copy of a state's dicts, lists and tuples with every other value replaced by fn(place, value), where
    place is the tuple of keys and indices that leads to the value from `path`."""
    if isinstance(obj, dict):
        return {key: _map_state(value, fn, path + (key,)) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_map_state(value, fn, path + (index,)) for index, value in enumerate(obj)]
        return items if isinstance(obj, list) else tuple(items)
    return fn(path, obj)


def copied(obj: Any) -> Any:
    """A copy of a state taken now, on the training thread, on the tensors' own devices: for a state that the next
    step may change before the writer thread copies it (a part that the forward pass changes)."""
    return _map_state(
        obj, lambda place, value: value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)
    )


def _same_tensor(value: torch.Tensor) -> tuple | None:
    """What two names of one tensor share (tied weights: an embedding and the output layer), None for a layout
    other than strided: one copy per tensor, not per name."""
    if value.layout != torch.strided:
        return None
    try:
        storage = value.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor subclass without a storage of its own
        return None
    return (value.device, storage, value.storage_offset(), tuple(value.shape), value.stride(), value.dtype)


def copy_to_cpu(obj, staging, path=(), staged=None, used=None, live=None):
    """A deep copy with every tensor in CPU memory, what the writer thread serializes: tensors go into the buffers
    of the previous save (`staging`, keyed by place), as fresh memory costs several times the copy in page faults,
    at the price of one copy of the state kept in memory. A place in `staged` (CUDA tensors, see DeviceCopies) is
    already on its way to that pinned buffer; `used` collects the places of the staging buffers this copy used.
    `staging` None: CPU tensors are not copied, the writer serializes the state itself (--no-snapshot-copy), and
    `live` collects their places; other tensors get fresh copies. A tensor the state names twice is copied once,
    and both names get that copy (torch.save then writes it once)."""
    copies = {}  # what _same_tensor says of a tensor -> its copy

    def copy_one(place, value):
        if not isinstance(value, torch.Tensor):
            return copy.deepcopy(value)
        if staged and place in staged:
            return staged[place]
        if staging is None:
            if value.device.type == "cpu":
                if live is not None:
                    live.add(place)
                return value.detach()
            return value.detach().to("cpu", copy=True)
        same = _same_tensor(value)
        if same in copies:
            return copies[same]
        if used is not None:
            used.add(place)
        buffer = staging.get(place)
        reusable = buffer is not None and value.layout == torch.strided
        if reusable and buffer.shape == value.shape and buffer.dtype == value.dtype:
            buffer.copy_(value.detach())
        else:
            buffer = staging[place] = value.detach().to("cpu", copy=True)
        if same is not None:
            copies[same] = buffer
        return buffer

    return _map_state(obj, copy_one, path)


class DeviceCopies:
    """The copies of one save's CUDA tensors into pinned CPU buffers (kept between saves: allocating them is slow),
    on a side stream per device. save() only enqueues them, so the training thread never waits for the device.
    The side stream first waits for the training stream (each copy sees every change enqueued before save()); the
    training stream waits for the copies on the device at wait_until_copied(), before the optimizer changes the
    tensors; the writer thread waits for them on the host before it serializes. Only a copy into pinned memory leaves
    the host free while the device copies."""

    def __init__(self, pinned: dict, streams: dict):
        self.pinned = pinned  # place in the state -> pinned CPU buffer, kept by Snapshots
        self.streams = streams  # device -> its side stream, kept by Snapshots
        self.staged: dict[tuple, torch.Tensor] = {}  # place -> the pinned buffer this save copies that tensor into
        self.events: list[tuple[torch.device, torch.cuda.Event]] = []  # recorded on each side stream after its copies

    def start(self, states: dict) -> None:
        """Enqueue a copy of every strided CUDA tensor in `states` ({place prefix: state}), one stream per device."""
        by_device: dict[torch.device, list[tuple[tuple, torch.Tensor]]] = {}

        def collect(place, value):
            if isinstance(value, torch.Tensor) and value.is_cuda and value.layout == torch.strided:
                by_device.setdefault(value.device, []).append((place, value.detach()))

        for prefix, state in states.items():
            _map_state(state, collect, prefix)
        for device, tensors in by_device.items():
            stream = self.streams.get(device)
            if stream is None:
                stream = self.streams[device] = torch.cuda.Stream(device=device)
            stream.wait_stream(torch.cuda.current_stream(device))  # see every change enqueued before save()
            with torch.cuda.stream(stream):
                copies: dict[tuple | None, torch.Tensor] = {}  # one copy of a tensor the state names twice
                for path, tensor in tensors:
                    same = _same_tensor(tensor)
                    if same in copies:
                        self.staged[path] = copies[same]
                        continue
                    buffer = self.pinned.get(path)
                    if buffer is None or buffer.shape != tensor.shape or buffer.dtype != tensor.dtype:
                        buffer = self.pinned[path] = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                    buffer.copy_(tensor, non_blocking=True)
                    # The copy reads `tensor` on the side stream: its memory must not go back to the training
                    # stream's pool before the copy is done, even if the caller drops the tensor at once.
                    tensor.record_stream(stream)
                    self.staged[path] = copies[same] = buffer
            event = torch.cuda.Event(blocking=True)  # the writer thread sleeps while it waits, leaving the core free
            event.record(stream)
            self.events.append((device, event))

    def order_training_stream(self) -> None:
        """Make the training stream wait, on the device, until the copies are done; the host does not wait."""
        for device, event in self.events:
            torch.cuda.current_stream(device).wait_event(event)

    def wait(self) -> None:
        """Block this (the writer) thread until every copy has landed in its pinned buffer."""
        for _, event in self.events:
            event.synchronize()


def split_dtensors(obj: Any) -> tuple[Any, dict[tuple, tuple]]:
    """(obj with each DTensor replaced by this rank's local shard, {place: how to put the DTensor back}): the copies
    off the training thread then treat shards as the plain tensors they are."""
    layouts: dict[tuple, tuple] = {}

    def local(place, value):
        if not isinstance(value, DTensor):
            return value
        layouts[place] = (value.device_mesh, value.placements, value.shape, value.stride())
        return value.to_local()

    return _map_state(obj, local), layouts


def join_dtensors(obj: Any, layouts: dict[tuple, tuple]) -> Any:
    """The inverse of split_dtensors, around the (copied) local shards."""

    def wrap(place, value):
        if place not in layouts:
            return value
        mesh, placements, shape, stride = layouts[place]
        return DTensor.from_local(value, mesh, placements, run_check=False, shape=shape, stride=stride)

    return _map_state(obj, wrap)
