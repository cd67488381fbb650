"""The blocking half of one node-agent fill and the renewal of its Lease (the agent's loop starts
them; ``agent_loop.Agent._fill`` holds the Lease and records the outcome)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

from warmpool.kube import KubeError
from warmpool.lease import Lease, LeaseLostError
from warmpool_nodecache import agent
from warmpool_nodecache.blocks import BlockStore
from warmpool_nodecache.eviction_lock import gc_lock
from warmpool_nodecache.fill import FillOptions, FillResult, fill_revision
from warmpool_nodecache.layout import CacheLayout
from warmpool_nodecache.manifest import Manifest
from warmpool_nodecache.source import Source
from warmpool_nodecache.trust import DomainBlocks

log = logging.getLogger("warmpool.node_agent")


async def keep_renewing(lease: Lease) -> None:
    """Renew the fill Lease every third of its duration until cancelled or lost."""
    while True:
        await asyncio.sleep(lease.duration_s / 3)
        try:
            await lease.renew()
        except LeaseLostError:
            return  # the fence refuses the next block and the publish
        except (KubeError, OSError, TimeoutError) as error:
            log.warning("node agent: renewing %s failed (%s); retrying", lease.name, error)


def fill_blocking(layout: CacheLayout, source: Source, manifest: Manifest, heat: str | None,
                  fence: Callable[[], None], partial: bool, lease_duration_s: float, domain: str) -> FillResult:
    """In a thread: the header blocks, then the fill in heat order, published under both leases, in
    the WarmModel's trust domain (``trust.py``: a header block it did not verify is fetched too)."""
    blocks = DomainBlocks(BlockStore(layout), domain)
    headers: dict[str, Mapping[str, Any]] = {}
    header_blocks = header_bytes = 0
    options = FillOptions(lease_ttl_s=lease_duration_s, fence=fence, partial_view=partial, domain=domain)
    # Shared, like the fill's own: an eviction meanwhile would free the header blocks (no
    # manifest names them yet) and the fill would fetch them a second time.
    with gc_lock(layout, exclusive=False, timeout_s=options.wait_timeout_s):
        for ref in agent.header_blocks(manifest):
            if not blocks.usable(ref.sha256):
                blocks.store.put(ref.sha256, source.fetch_range(ref.path, ref.offset, ref.length))  # verifies
                blocks.vouch(ref.sha256)
                header_blocks, header_bytes = header_blocks + 1, header_bytes + ref.length
            header = agent.safetensors_header(blocks.store.read(ref.sha256), ref.path)
            if header is not None:
                headers[ref.path] = header
        order = (agent.start_order if partial else agent.heat_order)(manifest, headers, heat)
        result = fill_revision(layout, source, order=order, options=options)
    # The header blocks came over the wire too: "fetched here" counts them (a checkpoint of
    # one block per file was reported as 0 bytes fetched, and not as a download).
    return dataclasses.replace(result, blocks_fetched=result.blocks_fetched + header_blocks,
                               bytes_fetched=result.bytes_fetched + header_bytes)
