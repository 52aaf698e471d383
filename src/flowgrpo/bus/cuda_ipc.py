"""The same-host fast path for weights: tensors packed back to back into one GPU allocation (a
bucket) that another process on the host opens through CUDA IPC and copies from device to
device — no host copy, no socket. The bucket travels as ``flowgrpo.v1.CudaIpcBucket``: the raw
``cudaIpcMemHandle`` bytes and a table of tensors (never pickle).

Rules of use: the producer keeps its ``Bucket`` alive while consumers may open it (the trainer
keeps the same two versions the bus keeps); a consumer copies what it needs and drops the views
(``open_bucket``'s tensors alias the producer's memory). The one exception is the trainer's
shared base (``trainer.share_base``): a rollout on its GPU keeps those views as its weights.
``host_id`` and the GPU's UUID decide whether a consumer can use a bucket at all; when it
cannot, it takes the bus path.

Built on torch's own IPC primitives (``UntypedStorage._share_cuda_`` / ``_new_shared_cuda``,
what ``torch.multiprocessing`` uses under its pickling), which keep the allocation mapped with a
shared reference counter and order the consumer's reads after the producer's writes with an
IPC event.
"""

from __future__ import annotations

import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch
from torch import Tensor

from flowgrpo.v1 import common_pb2

ALIGN = 256  # bytes: every tensor starts aligned for vectorised copies
CUDA_IPC_HANDLE_BYTES = 64  # sizeof(cudaIpcMemHandle_t) == sizeof(cudaIpcEventHandle_t)
CUDA_MALLOC_HANDLE = ord("c")  # torch's handle type of a cudaMalloc block (SHAREABLE_CUDA_MALLOC)
EXPANDABLE_SEGMENT_HANDLE = ord("e")  # ... of an expandable segment (SHAREABLE_CUDA_EXPANDABLE_SEGMENT)
REF_COUNTER_SLOTS = 10000  # torch's CUDA_IPC_REF_COUNTER_FILE_SIZE: slots of one counter file
REF_COUNTER_FILE = re.compile(r"/[A-Za-z0-9_.-]{1,63}")  # a shared-memory name (torch: /torch_<pid>_...)


@cache
def host_id() -> str:
    """This boot of this host: two processes see the same value iff they share the host."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    return boot.read_text().strip() if boot.is_file() else socket.gethostname()


def device_uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


class CudaIpcError(RuntimeError):
    """A bucket this process cannot open (another host, an invisible GPU, a malformed table)."""


def check_handles(bucket: common_pb2.CudaIpcBucket) -> None:
    """The two CUDA handles of ``bucket`` in the layouts torch's opener parses, else ValueError
    naming the field. Needs no GPU: the rollout checks a request before it touches CUDA.

    The memory handle (``handle``), as ``_share_cuda_`` writes it (``shareIpcHandle`` in torch's
    caching allocator) and ``_new_shared_cuda`` reads it (``getIpcDevPtr``):

    - 64 bytes: a bare ``cudaIpcMemHandle_t`` (torch before versioned handles);
    - ``[version][type][payload]``: torch 2.11 writes version 2, type ``'c'`` and the 64-byte
      ``cudaIpcMemHandle_t``, 66 bytes (recorded on a GPU: tests/bus/cuda_ipc_layouts.json);
      torch 2.13 writes version 3 with the same payload. The opener itself refuses a version
      newer than its own torch's.

    Refused: any other length (the opener reads 64 bytes after the header whatever the length,
    past the end of a shorter one), a version of 0, and type ``'e'``, an expandable segment: its
    payload names a process and file descriptors the opener takes from that process, and a count
    of them, which no check here can bound. (torch 2.11 exports such handles for a block of an
    expandable segment, ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True``: the trainer refuses
    its own, :meth:`BucketWriter.finish`.)

    The event handle: a ``cudaIpcEventHandle_t`` (64 bytes) when ``event_sync_required``, else
    64 bytes that are not read, or none."""
    handle = bucket.handle
    if len(handle) != CUDA_IPC_HANDLE_BYTES:
        if len(handle) < 2:
            raise ValueError(
                f"handle: {len(handle)} bytes; a CUDA IPC memory handle has 64, or 66 with torch's header"
            )
        version, kind = handle[0], handle[1]
        if kind == EXPANDABLE_SEGMENT_HANDLE:
            raise ValueError(
                "handle: an expandable-segment handle (type 'e'), which names another process's file "
                "descriptors; only cudaMalloc blocks (type 'c') are taken"
            )
        if kind != CUDA_MALLOC_HANDLE:
            raise ValueError(f"handle: type byte {kind:#04x}; torch writes 'c' (0x63) for a cudaMalloc block")
        if version == 0:
            raise ValueError("handle: version byte 0; torch's versions start at 1")
        if len(handle) != 2 + CUDA_IPC_HANDLE_BYTES:
            raise ValueError(
                f"handle: {len(handle)} bytes; a version-{version} 'c' handle has {2 + CUDA_IPC_HANDLE_BYTES}"
            )
    event = bucket.event_handle
    sync = bucket.event_sync_required
    if len(event) not in (0, CUDA_IPC_HANDLE_BYTES) or (sync and not event):
        need = "64" if sync else "0 or 64"
        raise ValueError(f"event_handle: {len(event)} bytes; need {need} (event_sync_required={sync})")


@dataclass
class Bucket:
    """Producer side: the allocation and its exported description."""

    buffer: Tensor  # uint8 on the GPU
    proto: common_pb2.CudaIpcBucket


class BucketWriter:
    """Fills one new allocation of ``total_bytes`` (see ``bucket_bytes``) on ``device`` with
    tensors added one at a time — a gather loop needs only one whole tensor alive at once —
    then exports it."""

    def __init__(self, total_bytes: int, device: torch.device) -> None:
        self.buffer = torch.empty(total_bytes, dtype=torch.uint8, device=device)
        self.entries: list[common_pb2.BucketTensor] = []
        self.offset = 0

    def add(self, name: str, tensor: Tensor) -> None:
        self.reserve(name, tensor.shape, tensor.dtype).copy_(tensor)

    def reserve(self, name: str, shape: torch.Size, dtype: torch.dtype) -> Tensor:
        """The bucket's next tensor, uninitialised: a view the caller fills (or keeps using, as
        the trainer keeps its shared base weights)."""
        nbytes = shape.numel() * dtype.itemsize
        if self.offset + nbytes > self.buffer.numel():
            raise ValueError(f"a bucket of {self.buffer.numel()} bytes is too small for {name}")
        view = self.buffer[self.offset : self.offset + nbytes].view(dtype).view(shape)
        self.entries.append(
            common_pb2.BucketTensor(
                name=name, dtype=str(dtype).removeprefix("torch."), shape=shape, offset=self.offset
            )
        )
        self.offset = _aligned(self.offset + nbytes)
        return view

    def finish(self) -> Bucket:
        device = self.buffer.device
        torch.cuda.current_stream(device).synchronize()  # the copies are done before anyone reads
        try:
            (_, handle, size, storage_offset, counter, counter_offset, event, event_sync) = (
                self.buffer.untyped_storage()._share_cuda_()  # type: ignore[no-untyped-call]
            )
        except RuntimeError as error:  # an allocation torch cannot export (stays a one-line error)
            raise CudaIpcError(
                f"torch cannot export the bucket by CUDA IPC ({str(error).splitlines()[0]}): run the "
                "trainer without PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, or publish over the "
                "bus (trainer.publish_bus=true, trainer.publish_cuda_ipc=false)"
            ) from None
        proto = common_pb2.CudaIpcBucket(
            host_id=host_id(),
            device_uuid=device_uuid(device),
            handle=handle,
            storage_bytes=size,
            storage_offset=storage_offset,
            ref_counter_handle=counter,
            ref_counter_offset=counter_offset,
            event_handle=event or b"",
            event_sync_required=event_sync,
            tensors=self.entries,
        )
        try:  # what this torch wrote, in the layout every consumer checks (check_handles)
            check_handles(proto)
        except ValueError as error:
            raise CudaIpcError(
                f"torch {torch.__version__} exported a CUDA IPC bucket that consumers refuse ({error}): "
                "publish over the bus instead (trainer.publish_bus=true, trainer.publish_cuda_ipc=false)"
            ) from None
        return Bucket(self.buffer, proto)


def bucket_bytes(tensors: Iterable[tuple[str, torch.Size, torch.dtype]]) -> int:
    """The size of a bucket holding tensors of these shapes and dtypes."""
    offset = 0
    for _, shape, dtype in tensors:
        offset = _aligned(offset + shape.numel() * dtype.itemsize)
    return max(offset, ALIGN)


def can_open(bucket: common_pb2.CudaIpcBucket) -> bool:
    """Whether this process can open ``bucket``: same host, the producer's GPU visible here."""
    return bucket.host_id == host_id() and _local_index(bucket.device_uuid) is not None


def open_bucket(bucket: common_pb2.CudaIpcBucket) -> dict[str, Tensor]:
    """Views of the producer's tensors (on the producer's GPU, as seen from here)."""
    if bucket.host_id != host_id():
        raise CudaIpcError(f"the bucket lives on host {bucket.host_id}, this is {host_id()}: use the bus")
    index = _local_index(bucket.device_uuid)
    if index is None:
        raise CudaIpcError(
            f"GPU {bucket.device_uuid} holds the bucket but is not visible to this process "
            "(CUDA_VISIBLE_DEVICES): make it visible or use the bus"
        )
    try:
        storage = torch.UntypedStorage._new_shared_cuda(
            index,
            bucket.handle,
            bucket.storage_bytes,
            bucket.storage_offset,
            bucket.ref_counter_handle,
            bucket.ref_counter_offset,
            bucket.event_handle or None,
            bucket.event_sync_required,
        )
    except RuntimeError as error:  # a handle CUDA or torch could not open (stale, forged)
        raise CudaIpcError(f"cannot open the bucket of GPU {bucket.device_uuid}: {error}") from error
    flat = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index)).set_(storage)
    out = {}
    for entry in bucket.tensors:
        dtype = getattr(torch, entry.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise CudaIpcError(f"bucket tensor {entry.name}: unknown dtype {entry.dtype!r}")
        nbytes = torch.Size(entry.shape).numel() * dtype.itemsize
        if entry.offset < 0 or entry.offset + nbytes > flat.numel():
            raise CudaIpcError(f"bucket tensor {entry.name} lies outside the bucket's {flat.numel()} bytes")
        out[entry.name] = flat[entry.offset : entry.offset + nbytes].view(dtype).view(tuple(entry.shape))
    return out


def _aligned(offset: int) -> int:
    return -(-offset // ALIGN) * ALIGN


def _local_index(uuid: str) -> int | None:
    if not torch.cuda.is_available():
        return None
    for index in range(torch.cuda.device_count()):
        if device_uuid(torch.device("cuda", index)) == uuid:
            return index
    return None
