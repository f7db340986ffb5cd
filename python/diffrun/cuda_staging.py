"""Device puts for diffrun.writer: torch CUDA tensors recorded without synchronizing the caller's stream.

`Writer.put(name, cuda_tensor)` copies the tensor asynchronously (non_blocking) into pinned host memory on the
tensor's device's current stream, records an event after the copy, and returns; the data reach the file later,
when the event has completed: at `Writer.step()` once the staged bytes pass half the staging size, or at
`flush()` / `close()`. The caller's stream is never synchronized (the writer waits on its own events).

Inside `torch.cuda.graph` capture (any capture_error_mode) a put records nothing: its copy becomes a node of the
graph, into a fixed slot of a staging buffer page-locked with cudaHostRegister beforehand (no allocation and no
CUDA event during the capture). After the capture, `Writer.capture_end()` names the graph's slots; after each
`graph.replay()`, `Writer.replay(graph_id)` says that launch's copies are the current step's checkpoints. The next
`Writer.step()` copies them out of the slots (waiting for that launch if it is still running) before the graph may
be replayed again, the same rules as the C API (capi/include/diffrun/dump_writer.h, "Graphs"):

- replay a recording graph at most once per step and call `Writer.step()` before replaying it again;
- checkpoints with an S dimension (kq_soft_max, cache_k, cache_v) are refused inside a capture;
- the first graph slot needs the staging buffer: `Writer.reserve_device(nbytes)` before capturing (or a put of a
  CUDA tensor outside the capture, which reserves the default 64 MiB, DIFFRUN_DUMP_STAGING_MB);
- do not replay the graph after the writer closed (the buffer is released).

torch is imported only here, when a CUDA tensor is put.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

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

    def array(self) -> np.ndarray:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.host.numpy().view(self.dtype).reshape(self.shape)


class Staging:
    """Pending device puts, and the page-locked buffer holding the slots of captured graphs."""

    def __init__(self) -> None:
        self.pending: list[Pending] = []
        self.names: set[tuple[int, str]] = set()  # (step, name) of the pending puts
        self.bytes = 0  # staged bytes of the pending puts
        self.limit = default_bytes()
        self.buffer: np.ndarray | None = None  # page-locked with cudaHostRegister
        self.tensor: Any = None  # the buffer as a uint8 CPU tensor
        self.used = 0
        self.capturing: list[Pending] = []
        self.graphs: list[list[Pending]] = []

    def reserve(self, nbytes: int) -> None:
        import torch

        if self.buffer is not None:
            return
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the staging buffer cannot be page-locked during a capture: call reserve_device() "
                               "(or put a CUDA tensor outside the capture) before capturing")
        nbytes = (int(nbytes) + ALIGN - 1) // ALIGN * ALIGN
        buf = np.empty(nbytes + ALIGN, np.uint8)
        start = (-buf.ctypes.data) % ALIGN
        buf = buf[start:start + nbytes]
        rc = int(torch.cuda.cudart().cudaHostRegister(buf.ctypes.data, nbytes, 0))
        if rc != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed (cudaError {rc})")
        self.buffer, self.tensor = buf, torch.from_numpy(buf)
        self.limit = nbytes

    def copy(self, t: Any, pending: Pending) -> None:
        """Enqueues the copy of `t` into pending.host: a graph slot while capturing, else fresh pinned memory."""
        import torch

        nbytes = t.numel() * t.element_size()
        if torch.cuda.is_current_stream_capturing():
            # No allocation, event or device switch here: a copy node into a fixed slot of the buffer.
            if self.tensor is None:
                raise RuntimeError("the first graph slot needs the staging buffer: call reserve_device() before "
                                   "capturing")
            size = (nbytes + ALIGN - 1) // ALIGN * ALIGN
            if self.used + size > self.tensor.numel():
                raise RuntimeError(f"no room for a {nbytes}-byte graph slot: the staging buffer holds "
                                   f"{self.tensor.numel()} bytes, {self.used} used (reserve_device(nbytes))")
            pending.host = self.tensor[self.used:self.used + nbytes]
            self.used += size
            pending.host.view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
            self.capturing.append(pending)
            return
        with torch.cuda.device(t.device):
            pending.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            pending.host.view(t.dtype).view(t.shape).copy_(t, non_blocking=True)
            pending.event = torch.cuda.Event()
            pending.event.record()
        self.pending.append(pending)
        self.names.add((pending.step, pending.name))
        self.bytes += nbytes

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
        self.pending, self.capturing, self.graphs = [], [], []
        self.names.clear()
        if self.buffer is not None:
            import torch

            torch.cuda.cudart().cudaHostUnregister(self.buffer.ctypes.data)
            self.buffer = self.tensor = None
