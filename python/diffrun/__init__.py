"""diffrun: read, write and validate diffrun's HDF5 checkpoint dumps with numpy and h5py.

    import diffrun
    with diffrun.open("run/reference.h5") as d:
        d.meta["arch"], d.steps(), d.names(step=0)
        ids, q = d.get("tokens", step=0), d.get("Qcur-3", step=0)  # numpy arrays ([T, H, Dh]), read on demand
    with diffrun.writer.open("mine.h5", backend="mine", precision="f32", like="run/reference.h5") as w:
        w.step(0)
        w.put("tokens", ids)  # every step records its tokens first
        w.put("Qcur-3", q)
    diffrun.fingerprint("model.gguf")  # the model_fingerprint of dumps of that model
    diffrun.validate.validate("mine.h5").problems  # every departure from docs/dump-format.md

Modules that need more than numpy and h5py (plot, torch, adapters) are not imported here; import them directly.
"""

from .dump import FORMAT, FORMAT_VERSION, DatasetInfo, Dump, DumpFormatError, open
from .shards import RankDumps, open_ranks
from . import vocabulary, writer
from .fingerprint import fingerprint
from .writer import DumpWriteError, Writer

__all__ = ["FORMAT", "FORMAT_VERSION", "DatasetInfo", "Dump", "DumpFormatError", "DumpWriteError", "RankDumps",
           "Writer", "fingerprint", "open", "open_ranks", "validate", "vocabulary", "writer"]


def __getattr__(name: str):
    # diffrun.validate is imported on first use, so that `python -m diffrun.validate` runs it as __main__ cleanly.
    if name == "validate":
        import importlib

        return importlib.import_module(".validate", __name__)
    raise AttributeError(f"module 'diffrun' has no attribute '{name}'")
