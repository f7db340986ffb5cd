"""diffrun: read diffrun's HDF5 checkpoint dumps with numpy and h5py.

    import diffrun
    with diffrun.open("run/reference.h5") as d:
        d.meta["arch"], d.steps(), d.names(step=0)
        q = d.get("Qcur-3", step=0)  # numpy array [T, H, Dh], read on demand

Modules that need more than numpy and h5py (plots) are not imported here; import them directly.
"""

from .dump import FORMAT, FORMAT_VERSION, DatasetInfo, Dump, DumpFormatError, open
from . import vocabulary

__all__ = ["FORMAT", "FORMAT_VERSION", "DatasetInfo", "Dump", "DumpFormatError", "open", "vocabulary"]
