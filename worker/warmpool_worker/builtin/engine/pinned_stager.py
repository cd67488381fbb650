"""Host-to-device weight copies through two pinned buffers on a side stream (CUDA only)."""

from __future__ import annotations

import torch

#: Pinned staging buffer size: big enough to keep the copy engine busy, small enough that
#: two of them cost nothing next to the weights (large tensors are copied in chunks).
STAGING_BYTES = 64 * 1024 * 1024


class PinnedStager:
    """Pageable memory (the mmap) cannot be DMA'd directly: the driver would stage it
    through its own small bounce buffer synchronously.  Copying into our own pinned
    buffers and issuing async copies lets the CPU memcpy of chunk n+1 (page faults
    included: that is where the disk read happens) overlap the DMA of chunk n.
    """

    def __init__(self, device: torch.device, nbytes: int = STAGING_BYTES) -> None:
        self.device = device
        self.nbytes = nbytes
        self.buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        self.turn = 0
        self.bytes_copied = 0

    def to_device(self, src: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        src = src.contiguous()
        flat = src.reshape(-1).view(torch.uint8)
        total = flat.numel()
        with torch.cuda.stream(self.stream):
            dst = torch.empty(total, dtype=torch.uint8, device=self.device)
        for start in range(0, total, self.nbytes):
            stop = min(start + self.nbytes, total)
            turn = self.turn
            self.turn ^= 1
            event = self.events[turn]
            if event is not None:
                event.synchronize()  # the DMA that last read this buffer is done: safe to overwrite
            staging = self.buffers[turn][: stop - start]
            staging.copy_(flat[start:stop])
            with torch.cuda.stream(self.stream):
                dst[start:stop].copy_(staging, non_blocking=True)
                done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                done.record(self.stream)
            self.events[turn] = done
        self.bytes_copied += total
        with torch.cuda.stream(self.stream):
            out = dst.view(src.dtype).view(src.shape)
            return out.to(dtype) if dtype != src.dtype else out

    def finish(self) -> None:
        """Wait for every copy: called before a layer is published to other streams/threads."""
        self.stream.synchronize()
