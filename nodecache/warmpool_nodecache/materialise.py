"""Putting a held block's bytes at an offset of a revision's file (``partial.PartialView`` calls these).

A held block is a range of another file: a block file (offset 0) or a published revision's file
(``blocks.BlockStore.locate``).  Where the filesystem shares extents (XFS with reflink, btrfs,
bcachefs) it is cloned into place with ``ioctl(FICLONERANGE)``: no bytes written.  Elsewhere (ext4,
tmpfs, overlayfs) it is copied with ``copy_file_range``, in the kernel.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct

#: _IOW(0x94, 13, struct file_clone_range) from <linux/fs.h>.
_FICLONERANGE = 0x4020940D
#: errnos that mean "this filesystem (pair) cannot clone", not "something is wrong".
_NO_CLONE = {errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EPERM}


def clone_range(src_fd: int, dst_fd: int, length: int, dest_offset: int, src_offset: int = 0) -> bool:
    try:
        fcntl.ioctl(dst_fd, _FICLONERANGE, struct.pack("qQQQ", src_fd, src_offset, length, dest_offset))
    except OSError as exc:
        if exc.errno in _NO_CLONE:
            return False
        raise
    return True


def copy_range(src_fd: int, dst_fd: int, length: int, dest_offset: int, src_offset: int = 0) -> None:
    done = 0
    while done < length:
        try:
            n = os.copy_file_range(src_fd, dst_fd, length - done, src_offset + done, dest_offset + done)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL):
                raise
            n = os.pwrite(dst_fd, os.pread(src_fd, length - done, src_offset + done), dest_offset + done)
        if n == 0:
            raise OSError(errno.EIO, f"block ended early at {done} of {length} bytes")
        done += n
