"""Device puts for diffrun.writer: torch CUDA tensors recorded without synchronizing the caller's stream.

`Writer.put(name, cuda_tensor)` copies the tensor asynchronously (non_blocking) into a slot of a page-locked
staging buffer on the tensor's device's current stream, records an event after the copy, and returns; the data
reach the file later, when the event has completed: at `Writer.step()` once the staged bytes pass half the staging
size, at `flush()` / `close()`, or when the staging has no room for a put (below). A put allocates no pinned
memory and calls nothing that synchronizes: the caller's stream is never synchronized, and the writer waits only
on its own events, where this docstring says so. A put launches a kernel only to convert int64 tokens (int()) or
to copy a non-contiguous tensor (contiguous()); with CUDA's lazy module loading (CUDA_MODULE_LOADING=LAZY, the
default) the first launch of a kernel in a process loads its module, which may wait for the device, in put() as
anywhere else.

The staging buffer (default 64 MiB, DIFFRUN_DUMP_STAGING_MB, or `Writer.reserve_device(nbytes)`) is host memory
page-locked once with cudaHostRegister: by reserve_device(), else by the first put of a CUDA tensor outside a
capture. Page-locking takes milliseconds and may synchronize the device, so a program that must never wait
calls reserve_device() before its first device put. The buffer holds two disjoint regions:

- graph slots, from its start: each put inside a capture takes the next slot, `[0, used)`, for good (a graph may
  replay into its slots until the writer closes);
- the ring, the rest `[used, end)`: each put outside a capture takes the next free slot after the newest one,
  wrapping to the ring's start; a slot is free again once its put was written to the file. When the ring has
  no room, the oldest pending puts are written out first (in put order, through the writer's usual write),
  which waits for their copies: a put waits only when the staging is full. A put bigger than the whole ring
  takes a one-off pinned allocation instead (torch's pinned allocator), which may synchronize the device.

A capture takes its slots where the ring may still hold pending puts: `Writer.capture_end()` (called after the
capture, before the first replay) writes out the ring's pending puts (waiting for their copies) and the ring
restarts after the new graph slots. Puts between the capture and capture_end() do the same.

Inside `torch.cuda.graph` capture (any capture_error_mode) a put records nothing: its copy becomes a node of the
graph, into its graph slot (no allocation and no CUDA event during the capture). After the capture,
`Writer.capture_end()` names the graph's slots; after each `graph.replay()`, `Writer.replay(graph_id)` says that
launch's copies are the current step's checkpoints. The next `Writer.step()` copies them out of the slots
(waiting for that launch if it is still running) before the graph may be replayed again, the same rules as the
C API (capi/include/diffrun/dump_writer.h, "Graphs"):

- replay a recording graph at most once per step and call `Writer.step()` before replaying it again;
- checkpoints with an S dimension (kq_soft_max, cache_k, cache_v) are refused inside a capture;
- the first graph slot needs the staging buffer: `Writer.reserve_device(nbytes)` before capturing (or a put of a
  CUDA tensor outside the capture, which reserves the default size);
- call `Writer.capture_end()` before the graph's first replay;
- do not replay the graph after the writer closed (the buffer is released).

torch is imported only here, when a CUDA tensor is put.
"""

from __future__ import annotations

import collections
import dataclasses
import os
from typing import Any, Callable

import numpy as np

ALIGN = 256


def is_cuda_tensor(x: Any) -> bool:
    return bool(getattr(x, "is_cuda", False)) and hasattr(x, "detach") and hasattr(x, "element_size")


def capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (torch is imported by then)."""
    import torch

    return bool(torch.cuda.is_current_stream_capturing())


def default_bytes() -> int:
    mb = os.environ.get("DIFFRUN_DUMP_STAGING_MB", "")
    return (int(mb) if mb.isdigit() and int(mb) > 0 else 64) << 20


def aligned(nbytes: int) -> int:
    return (int(nbytes) + ALIGN - 1) // ALIGN * ALIGN


def numpy_dtype(t: Any) -> np.dtype | None:
    """The numpy dtype the writer takes for a torch dtype (bfloat16 as its uint16 bits)."""
    name = str(t.dtype).replace("torch.", "")
    return {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16), "float64": np.dtype(np.float64),
            "bfloat16": np.dtype(np.uint16), "int32": np.dtype(np.int32)}.get(name)


@dataclasses.dataclass
class Pending:
    """One device put on its way to the file: `host` (uint8 CPU tensor) holds its bytes once `event` completed."""
    step: int
    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    layer: int | None
    layout: str | None
    native_dtype: str | None
    host: Any
    event: Any = None
    graph: int | None = None  # the graph whose slot `host` is, until copied out
    slot: tuple[int, int] | None = None  # [start, end) of its ring slot in the staging buffer, until written

    def array(self) -> np.ndarray:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.host.numpy().view(self.dtype).reshape(self.shape)


# Writes one pending put into the file (the writer's checks and dataset); the put's buffer is free afterwards.
Write = Callable[[Pending], None]


class Staging:
    """Pending device puts, and the page-locked buffer holding the graphs' slots and the ring of eager puts."""

    def __init__(self) -> None:
        self.pending: collections.deque[Pending] = collections.deque()  # in put order, oldest first
        self.names: set[tuple[int, str]] = set()  # (step, name) of the pending puts
        self.bytes = 0  # staged bytes of the pending puts
        self.limit = default_bytes()
        self.buffer: np.ndarray | None = None  # page-locked with cudaHostRegister
        self.tensor: Any = None  # the buffer as a uint8 CPU tensor
        self.used = 0  # the graph slots: [0, used)
        self.base = 0  # the ring: [base, limit); base < used only until the ring is empty again
        self.ring: collections.deque[tuple[int, int]] = collections.deque()  # pending puts' ring slots, oldest first
        self.capturing: list[Pending] = []
        self.graphs: list[list[Pending]] = []

    def reserve(self, nbytes: int) -> None:
        import torch

        if self.buffer is not None:
            return
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the staging buffer cannot be page-locked during a capture: call reserve_device() "
                               "(or put a CUDA tensor outside the capture) before capturing")
        nbytes = aligned(nbytes)
        buf = np.empty(nbytes + ALIGN, np.uint8)
        start = (-buf.ctypes.data) % ALIGN
        buf = buf[start:start + nbytes]
        # cudaHostRegisterPortable: page-locked for every device's context, not only the current one
        rc = int(torch.cuda.cudart().cudaHostRegister(buf.ctypes.data, nbytes, 1))
        if rc != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed (cudaError {rc})")
        self.buffer, self.tensor = buf, torch.from_numpy(buf)
        self.limit = nbytes

    def room(self, size: int) -> int | None:
        """Where the ring has `size` free bytes (None: not before the oldest pending puts are written)."""
        if self.base != self.used:  # graph slots took the ring's start: it restarts after them once empty
            if self.ring:
                return None
            self.base = self.used
        if not self.ring:
            return self.base if self.base + size <= self.limit else None
        oldest, head = self.ring[0][0], self.ring[-1][1]
        if self.ring[-1][0] >= oldest:  # not wrapped: free after the newest, and before the oldest
            if head + size <= self.limit:
                return head
            return self.base if self.base + size <= oldest else None
        return head if head + size <= oldest else None  # wrapped: free between the newest and the oldest

    def write_oldest(self, write: Write) -> None:
        """Writes the oldest pending put to the file (waiting for its copy), which frees its ring slot."""
        p = self.pending.popleft()
        self.names.discard((p.step, p.name))
        if p.graph is None:
            self.bytes -= p.host.numel()
        p.array()  # its copy has landed
        if p.slot is not None:
            self.ring.popleft()  # puts leave in order: the ring's oldest slot is this one
        write(p)

    def copy(self, t: Any, pending: Pending, write: Write) -> None:
        """Enqueues the copy of `t` into pending.host: a graph slot while capturing, else a slot of the ring."""
        import torch

        nbytes = t.numel() * t.element_size()
        size = aligned(nbytes)
        if torch.cuda.is_current_stream_capturing():
            # No allocation, event or device switch here: a copy node into a fixed slot of the buffer.
            if self.tensor is None:
                raise RuntimeError("the first graph slot needs the staging buffer: call reserve_device() before "
                                   "capturing")
            if self.used + size > self.tensor.numel():
                raise RuntimeError(f"no room for a {nbytes}-byte graph slot: the staging buffer holds "
                                   f"{self.tensor.numel()} bytes, {self.used} used (reserve_device(nbytes))")
            pending.host = self.tensor[self.used:self.used + nbytes]
            self.used += size
            pending.host.view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
            self.capturing.append(pending)
            return
        with torch.cuda.device(t.device):
            self.reserve(default_bytes())  # once: may synchronize (reserve_device() beforehand avoids it here)
            if size <= self.limit - self.used:
                start = self.room(size)
                while start is None:  # the staging is full: the only wait of a put
                    self.write_oldest(write)
                    start = self.room(size)
                pending.host, pending.slot = self.tensor[start:start + nbytes], (start, start + size)
                self.ring.append(pending.slot)
            else:  # bigger than the whole ring: a one-off pinned allocation, which may synchronize
                pending.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            pending.host.view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
            pending.event = torch.cuda.Event()
            pending.event.record()
        self.pending.append(pending)
        self.names.add((pending.step, pending.name))
        self.bytes += nbytes

    def capture_end(self, write: Write) -> int:
        """The puts captured since the last call form one graph (its id). Its new slots may lie where the ring's
        pending puts are: those are written out now (waiting for their copies), before the graph can replay."""
        self.graphs.append(self.capturing)
        self.capturing = []
        while self.ring and self.base != self.used:
            self.write_oldest(write)
        return len(self.graphs) - 1

    def flush(self, write: Write) -> None:
        """Writes every pending put (waiting for each copy)."""
        while self.pending:
            self.write_oldest(write)

    def launched(self, graph: int, step: int, checked: list[Pending]) -> None:
        """A launch of `graph` (on the current stream) holds the current step's `checked` puts."""
        import torch

        event = torch.cuda.Event()
        event.record()
        for p in checked:
            self.pending.append(dataclasses.replace(p, step=step, event=event, graph=graph))
            self.names.add((step, p.name))

    def settle(self) -> None:
        """Copies every graph launch's data out of its slots (waiting for the launch), freeing them for the next."""
        for p in self.pending:
            if p.graph is not None:
                p.event.synchronize()
                p.host, p.event, p.graph = p.host.clone(), None, None
                self.bytes += p.host.numel()

    def wait(self) -> None:
        for p in self.pending:
            if p.event is not None:
                p.event.synchronize()

    def release(self) -> None:
        """Waits for copies in flight and unlocks the buffer (no graph may replay into it afterwards)."""
        self.wait()
        self.pending, self.capturing, self.graphs = collections.deque(), [], []
        self.names.clear()
        self.ring.clear()
        self.bytes = 0
        if self.buffer is not None:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.buffer.ctypes.data)
            self.buffer = self.tensor = None
