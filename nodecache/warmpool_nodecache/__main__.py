"""``python -m warmpool_nodecache fill|evict``: the cache core from a shell (the node agent runs the same core).

``fill`` takes one source: ``--source-http URL``, or ``--source-s3 s3://bucket/prefix --endpoint URL``
with credentials from ``--credentials-file`` (AWS shared-credentials format) or the standard
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` (neither: unsigned requests, a public bucket).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from warmpool.contract.files import DEFAULT_BLOCK_CACHE_ROOT
from warmpool_nodecache.blocks import BlockCorruptError
from warmpool_nodecache.evict import evict
from warmpool_nodecache.fill import FillOptions, FillTimeoutError, fill_revision
from warmpool_nodecache.layout import CacheLayout
from warmpool_nodecache.manifest import ManifestError
from warmpool_nodecache.order import files_first
from warmpool_nodecache.source import HttpSource, HttpSourceConfig, Source, SourceError


def _source(args: argparse.Namespace) -> Source:
    if args.source_http is not None:
        return HttpSource(HttpSourceConfig(args.source_http))
    # Imported here: the S3 side pulls in boto3, which the HTTP path does not need.
    from warmpool_nodecache.s3 import (
        S3Source,
        S3SourceConfig,
        credentials_from_env,
        credentials_from_file,
        parse_s3_url,
    )

    if not args.endpoint:
        raise SourceError("--source-s3 needs --endpoint (the store's S3 URL)")
    bucket, prefix = parse_s3_url(args.source_s3)
    creds = credentials_from_file(args.credentials_file) if args.credentials_file else credentials_from_env()
    return S3Source(S3SourceConfig(args.endpoint, bucket, prefix, credentials=creds))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m warmpool_nodecache")
    parser.add_argument("--root", type=Path, default=Path(DEFAULT_BLOCK_CACHE_ROOT), help="the cache root")
    sub = parser.add_subparsers(dest="command", required=True)
    fill = sub.add_parser("fill", help="fill one revision from an HTTP or S3 source and publish it")
    which = fill.add_mutually_exclusive_group(required=True)
    which.add_argument("--source-http", help="base URL: <url>/<file> and <url>/warmpool-manifest.json")
    which.add_argument("--source-s3", help="s3://bucket/prefix: <prefix>/<file> and <prefix>/warmpool-manifest.json")
    fill.add_argument("--endpoint", help="the S3 endpoint URL (with --source-s3)")
    fill.add_argument("--credentials-file", type=Path, default=None,
                      help="AWS shared-credentials file (with --source-s3; default: the AWS_* environment)")
    fill.add_argument("--lease-ttl", type=float, default=FillOptions.lease_ttl_s)
    fill.add_argument("--wait-timeout", type=float, default=FillOptions.wait_timeout_s)
    fill.add_argument("--first", action="append", default=[], help="a file to fetch first (repeatable, in order)")
    ev = sub.add_parser("evict", help="evict revisions (LRU-2) down to a size budget")
    ev.add_argument("--budget-bytes", type=int, required=True)
    args = parser.parse_args(argv)
    layout = CacheLayout(args.root)
    if args.command == "fill":
        options = FillOptions(lease_ttl_s=args.lease_ttl, wait_timeout_s=args.wait_timeout)
        try:
            result = fill_revision(layout, _source(args),
                                   order=files_first(args.first) if args.first else None, options=options)
        except (SourceError, ManifestError, BlockCorruptError, FillTimeoutError) as error:  # said, not a traceback
            print(f"fill: {error}", file=sys.stderr)
            return 1
        print(json.dumps({**asdict(result), "path": str(result.path)}))
    else:
        print(json.dumps(asdict(evict(layout, args.budget_bytes))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
