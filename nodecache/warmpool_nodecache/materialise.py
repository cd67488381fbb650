"""Turning a revision's blocks into ordinary files the worker maps exactly as any checkpoint.

A file of one block is a hard link to the block (no bytes copied; both are read-only, so
nothing can write through the link into the shared block).  A file of several blocks cannot be
a hard link, so each block is cloned into place with ``ioctl(FICLONERANGE)`` where the
filesystem shares extents (XFS with reflink, btrfs, bcachefs): no bytes copied either.
Elsewhere (ext4, tmpfs, overlayfs) the block is copied with ``copy_file_range``, in the
kernel.  The result is fsynced and made read-only.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
from pathlib import Path

from warmpool_nodecache.blocks import BlockStore
from warmpool_nodecache.manifest import ManifestFile

#: _IOW(0x94, 13, struct file_clone_range) from <linux/fs.h>.
_FICLONERANGE = 0x4020940D
#: errnos that mean "this filesystem (pair) cannot clone", not "something is wrong".
_NO_CLONE = {errno.EOPNOTSUPP, errno.ENOTTY, errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EPERM}


def clone_range(src_fd: int, dst_fd: int, length: int, dest_offset: int) -> bool:
    try:
        fcntl.ioctl(dst_fd, _FICLONERANGE, struct.pack("qQQQ", src_fd, 0, length, dest_offset))
    except OSError as exc:
        if exc.errno in _NO_CLONE:
            return False
        raise
    return True


def copy_range(src_fd: int, dst_fd: int, length: int, dest_offset: int) -> None:
    done = 0
    while done < length:
        try:
            n = os.copy_file_range(src_fd, dst_fd, length - done, done, dest_offset + done)
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL):
                raise
            n = os.pwrite(dst_fd, os.pread(src_fd, length - done, done), dest_offset + done)
        if n == 0:
            raise OSError(errno.EIO, f"block ended early at {done} of {length} bytes")
        done += n


def materialise_file(store: BlockStore, entry: ManifestFile, block_size: int, dest: Path) -> str:
    """Write `entry` at `dest` from its stored blocks; returns how: "hardlink", "reflink", "copy" or "empty"."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    if len(entry.blocks) == 1:
        try:
            os.link(store.layout.block(entry.blocks[0]), dest)
            return "hardlink"
        except OSError as exc:
            if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK):
                raise
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    method = "empty" if not entry.blocks else "reflink"
    try:
        for index, sha in enumerate(entry.blocks):
            offset = index * block_size
            length = min(block_size, entry.size - offset)
            src_fd = os.open(store.layout.block(sha), os.O_RDONLY)
            try:
                if method == "reflink" and clone_range(src_fd, fd, length, offset):
                    continue
                method = "copy"  # once a clone fails on this filesystem, the rest copy
                copy_range(src_fd, fd, length, offset)
            finally:
                os.close(src_fd)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(dest, 0o444)
    return method
