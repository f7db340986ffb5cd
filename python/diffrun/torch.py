"""Forward hooks that record a PyTorch module's activations into a diffrun dump (diffrun.writer).

    import diffrun, diffrun.torch
    with diffrun.writer.open("mine.h5", backend="torch", precision="f32", like="ref.h5") as w, \\
         diffrun.torch.record(model, w, ["model.layers.0.self_attn.q_proj", "model.norm"]):
        w.step(0)
        model(ids)

Any nn.Module: each listed submodule's output (the first element when it returns a tuple) is recorded
under the module's name, or under names[module_name] when a mapping is given (a dict, or a function
returning a name or None to skip). pre=True records the module's first input instead (e.g. what enters
o_proj). A leading batch dimension of 1 is dropped (dumps hold one sequence). A module called again
within a step is recorded as NAME#2, NAME#3 ... (the convention of raw llama.cpp dumps). Foreign names
are compared through `diffrun compare --names hf` (fixtures/names/hf.json).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping

import numpy as np
import torch

from .writer import Writer


def to_numpy(t: torch.Tensor, squeeze_batch: bool = True) -> np.ndarray:
    """A tensor as numpy for Writer.put: detached, on the CPU, bf16 as uint16 bits, batch of 1 dropped."""
    t = t.detach()
    if squeeze_batch and t.dim() > 1 and t.shape[0] == 1:
        t = t[0]
    t = t.to("cpu").contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


class Recording:
    """Hooks registered by record(); remove() (or leaving the with block) unregisters them."""

    def __init__(self, writer: Writer):
        self.writer = writer
        self.handles: list[Any] = []
        self._seen: dict[tuple[int, str], int] = {}

    def put(self, name: str, tensor: torch.Tensor, squeeze_batch: bool = True) -> None:
        step = self.writer.current_step if self.writer.current_step is not None else 0
        n = self._seen.get((step, name), 0) + 1
        self._seen[(step, name)] = n
        self.writer.put(name if n == 1 else f"{name}#{n}", to_numpy(tensor, squeeze_batch))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()

    def __enter__(self) -> "Recording":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()


def _first_tensor(value: Any) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value and isinstance(value[0], torch.Tensor):
        return value[0]
    return None


def record(model: torch.nn.Module, writer: Writer, modules: Iterable[str] | None = None,
           names: Mapping[str, str] | Callable[[str], str | None] | None = None, pre: bool = False,
           squeeze_batch: bool = True) -> Recording:
    """Registers a forward hook on each named submodule of `model` (all of them when modules is None)."""
    table = dict(model.named_modules())
    wanted = list(modules) if modules is not None else [n for n in table if n]
    missing = [m for m in wanted if m not in table]
    if missing:
        raise KeyError(f"no submodule named {', '.join(missing[:5])} in {type(model).__name__}")
    rec = Recording(writer)
    for module_name in wanted:
        if callable(names):
            target = names(module_name)
        elif names is not None:
            target = names.get(module_name)
        else:
            target = module_name
        if target is None:
            continue

        def hook(_module, inputs, output=None, _target=target):
            t = _first_tensor(inputs if pre else output)
            if t is not None:
                rec.put(_target, t, squeeze_batch)

        m = table[module_name]
        rec.handles.append(m.register_forward_pre_hook(hook) if pre else m.register_forward_hook(hook))
    return rec
