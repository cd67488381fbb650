"""madvise(2) over the pages of a CPU tensor that views a mapped weight file.

"Loading" a zero-copy layer on CPU means mapping its pages now, in order, so the first
request pays no page fault; a file cut short under the mapping must be an error here,
never a SIGBUS later.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from typing import Any

import torch
from warmpool_worker.engine_api import WeightsChangedError

#: madvise(2) advice values (Linux).  POPULATE_READ (5.14+) maps every page of a range
#: in one call -- far cheaper than a fault per page; WILLNEED starts readahead of a range
#: without waiting for it.
MADV_WILLNEED = 3
MADV_POPULATE_READ = 22
_PAGE = mmap.PAGESIZE
_libc: Any = None


def madvise(tensor: torch.Tensor, advice: int) -> bool:
    """madvise over the pages holding this (contiguous, CPU) tensor's bytes; False if refused."""
    global _libc
    ctypes.set_errno(0)  # callers read ctypes.get_errno() after a False: never a stale one
    nbytes = tensor.numel() * tensor.element_size()
    if nbytes == 0 or os.name != "posix" or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return False
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        _libc.madvise.restype = ctypes.c_int
    start = tensor.data_ptr()
    aligned = start - start % _PAGE
    return bool(_libc.madvise(aligned, start + nbytes - aligned, advice) == 0)


def read_ahead(tensor: torch.Tensor) -> None:
    """Start reading this view of the file in the background (cold cache); never waits."""
    madvise(tensor, MADV_WILLNEED)


def fault_in(tensor: torch.Tensor) -> None:
    """Map every page of a view of the file now, in order, so first use pays no page faults."""
    if madvise(tensor, MADV_POPULATE_READ):
        return
    if ctypes.get_errno() == errno.EFAULT:
        # POPULATE_READ answers EFAULT where touching the page would raise SIGBUS: the file
        # was cut short under the mapping after our identity check.  Never touch it.
        raise WeightsChangedError("pages of a mapped weight lie beyond the end of its file "
                                  "(truncated in place)")
    # Older kernels: read one byte per page, front to back (the fault path reads ahead).
    flat = tensor.reshape(-1).view(torch.uint8)
    if flat.numel():
        _ = int(flat[::_PAGE].sum()) + int(flat[-1])
