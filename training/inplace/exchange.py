"""What members of a generation send each other: JSON and tensors, never pickles.

torch's object collectives (`broadcast_object_list`, `send_object_list`, `all_gather_object`) unpickle
whatever a peer sends, and a peer is whoever got into the group's mesh: its address is a key in the
store (`pg/<g>/`), which any client of the store can write. So in-place recovery moves its small records
as JSON and the model and optimizer as `torch.save` bytes read back with `torch.load(weights_only=True)`
(tensors and plain containers only: no code runs on load), each as a length then a `uint8` tensor.
"""

from __future__ import annotations

import io
import json
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["MAX_RECORD_BYTES", "all_gather_json", "broadcast_json", "recv_state", "send_state"]

MAX_RECORD_BYTES = 1 << 20  # a JSON record longer than this is refused (a member's holdings are ~100 bytes)


def _encode(obj: Any) -> torch.Tensor:
    data = json.dumps(obj).encode()
    if len(data) > MAX_RECORD_BYTES:
        raise ValueError(f"in-place: a record of {len(data)} bytes is over {MAX_RECORD_BYTES}")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def _decode(buf: torch.Tensor) -> Any:
    return json.loads(bytes(buf.numpy().tobytes()).decode())


def _checked_size(size: int) -> int:
    if not 0 < size <= MAX_RECORD_BYTES:
        raise ValueError(f"in-place: a peer announced a record of {size} bytes")
    return size


def broadcast_json(obj: Any, src: int, group: Any = None) -> Any:
    """`obj` (JSON-able) of rank `src`, on every rank of `group` (two broadcasts: its length, its bytes)."""
    mine = _encode(obj) if dist.get_rank() == src else None
    size = torch.tensor([0 if mine is None else mine.numel()], dtype=torch.int64)
    dist.broadcast(size, src=src, group=group)
    buf = mine if mine is not None else torch.empty(_checked_size(int(size.item())), dtype=torch.uint8)
    dist.broadcast(buf, src=src, group=group)
    return obj if mine is not None else _decode(buf)


def all_gather_json(obj: Any, world_size: int, group: Any = None) -> list[Any]:
    """Every rank's `obj` (JSON-able), in rank order (two all-gathers: the lengths, the padded bytes)."""
    mine = _encode(obj)
    size = torch.tensor([mine.numel()], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world_size)]
    dist.all_gather(sizes, size, group=group)
    lengths = [_checked_size(int(s.item())) for s in sizes]
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: mine.numel()] = mine
    gathered = [torch.empty(longest, dtype=torch.uint8) for _ in range(world_size)]
    dist.all_gather(gathered, padded, group=group)
    return [_decode(buf[:n]) for buf, n in zip(gathered, lengths, strict=True)]


def send_state(state: Any, dst: int) -> None:
    """Send `state` (state dicts: tensors and plain containers) to rank `dst` as `torch.save` bytes."""
    out = io.BytesIO()
    torch.save(state, out)
    data = torch.frombuffer(bytearray(out.getbuffer()), dtype=torch.uint8)
    dist.send(torch.tensor([data.numel()], dtype=torch.int64), dst=dst)
    dist.send(data, dst=dst)


def recv_state(src: int, *, max_bytes: int) -> Any:
    """The state rank `src` sent (`send_state`), read with `weights_only=True`; at most `max_bytes` long."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src=src)
    n = int(size.item())
    if not 0 < n <= max_bytes:
        raise ValueError(f"in-place: rank {src} announced a state of {n} bytes (at most {max_bytes} expected)")
    buf = torch.empty(n, dtype=torch.uint8)
    dist.recv(buf, src=src)
    return torch.load(io.BytesIO(buf.numpy().tobytes()), weights_only=True)
