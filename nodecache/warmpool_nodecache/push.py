"""``warmpool model push DIR s3://bucket/prefix --endpoint URL``: publish one model revision to a store.

1. DIR is validated as a safetensors model directory by the worker's own checkpoint reader
   (config.json, every safetensors header, the shard index): a directory a worker could not
   load is refused before anything is uploaded.
2. The revision's manifest (files, sizes, 4 MiB block hashes: `manifest.build_manifest`) is
   made once, from one read of the files.
3. Each file is uploaded as ``<prefix>/<path>`` with the hash of its block list in the
   object's metadata; an object already there with the same size and that hash is skipped,
   so pushing again, or after an interrupted push, sends only what is missing.
4. The manifest goes up LAST: a reader that sees a manifest finds every file it names.

Credentials: ``--credentials-file`` (an AWS shared-credentials file), else the standard
``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY`` environment variables.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from warmpool.contract.files import MANIFEST_FILENAME
from warmpool_nodecache.manifest import DEFAULT_BLOCK_SIZE, Manifest, ManifestError, ManifestFile, build_manifest
from warmpool_nodecache.s3 import (
    S3Credentials,
    S3SourceConfig,
    SourceAuthError,
    credentials_from_env,
    credentials_from_file,
    explain,
    make_client,
    parse_s3_url,
    require_boto3,
)
from warmpool_nodecache.source import SourceError, SourceMissingError

#: Object metadata key holding SHA-256 of the file's block-hash list (S3 sends it as x-amz-meta-*).
BLOCKS_DIGEST_METADATA = "warmpool-blocks-sha256"
#: Files above this go up in parts, several at a time (boto3's managed transfer).
MULTIPART_THRESHOLD = 64 * 1024 * 1024
UPLOAD_CONCURRENCY = 4


class PushError(RuntimeError):
    """The push cannot go on; the message names the directory, object or store and why."""


@dataclass(frozen=True)
class PushResult:
    digest: str
    uploaded: tuple[str, ...]
    skipped: tuple[str, ...]
    bytes_uploaded: int


def blocks_digest(entry: ManifestFile) -> str:
    """One hash naming a file's content (its size and block hashes), without reading it again."""
    return hashlib.sha256(f"{entry.size}:{','.join(entry.blocks)}".encode()).hexdigest()


def check_model_dir(directory: Path) -> None:
    """Refuse a directory the worker could not load, with the checkpoint reader's own message."""
    from warmpool_worker.checkpoint import open_checkpoint
    from warmpool_worker.engine_api import ModelLoadError

    try:
        open_checkpoint(directory).close()
    except ModelLoadError as exc:
        raise PushError(f"{directory} is not a valid safetensors model directory: {exc}") from None


class Progress:
    """Bytes sent so far: a rewritten line on a terminal, a plain log line every 10 % otherwise."""

    def __init__(self, total: int, stream: Any = sys.stderr) -> None:
        self.total, self.sent, self.stream = max(total, 1), 0, stream
        self._tty = bool(getattr(stream, "isatty", lambda: False)())
        self._lock = threading.Lock()  # boto3 calls back from its transfer threads
        self._next_decile = 1
        self._started = time.monotonic()

    def log(self, message: str) -> None:
        if self._tty:
            self.stream.write("\r\033[K")
        self.stream.write(f"[warmpool push] {message}\n")
        self.stream.flush()

    def add(self, count: int) -> None:
        with self._lock:
            self.sent += count
            percent = 100 * self.sent / self.total
            rate = self.sent / max(time.monotonic() - self._started, 1e-6) / 2**20
            if self._tty:
                self.stream.write(f"\r[warmpool push] {percent:5.1f}% {self.sent / 2**20:.0f} MiB {rate:.0f} MiB/s")
                self.stream.flush()
            elif percent >= 10 * self._next_decile:
                self._next_decile = int(percent // 10) + 1
                self.log(f"{percent:.0f}% ({self.sent / 2**20:.1f} of {self.total / 2**20:.1f} MiB, {rate:.0f} MiB/s)")


def _present(client: Any, config: S3SourceConfig, key: str, entry: ManifestFile) -> bool:
    """The object is there with this file's size and content hash."""
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        head = client.head_object(Bucket=config.bucket, Key=key)
    except (ClientError, BotoCoreError) as exc:
        error = explain(exc, config, key)
        if isinstance(error, SourceMissingError):  # the bucket was checked first: the object is absent
            return False
        raise error from None
    metadata = {k.lower(): v for k, v in (head.get("Metadata") or {}).items()}
    same_hash = metadata.get(BLOCKS_DIGEST_METADATA) == blocks_digest(entry)
    return bool(head.get("ContentLength") == entry.size and same_hash)


def _check_bucket(client: Any, config: S3SourceConfig) -> None:
    from botocore.exceptions import BotoCoreError, ClientError

    try:
        client.head_bucket(Bucket=config.bucket)
    except (ClientError, BotoCoreError) as exc:
        error = explain(exc, config, None)
        if isinstance(error, SourceMissingError):
            raise PushError(f"bucket {config.bucket!r} does not exist at {config.endpoint}; create it first") from None
        raise error from None


def push_model(
    directory: Path, config: S3SourceConfig, *, client: Any = None, progress: Progress | None = None,
    validate: Callable[[Path], None] = check_model_dir, block_size: int = DEFAULT_BLOCK_SIZE,
) -> PushResult:
    """Push `directory` as the revision at ``s3://{config.bucket}/{config.prefix}`` (module docstring).

    `block_size`: the manifest's block size (the default everywhere; tests use smaller blocks so a
    tiny checkpoint spans many).
    """
    require_boto3()
    from boto3.s3.transfer import TransferConfig
    from botocore.exceptions import BotoCoreError, ClientError

    if not directory.is_dir():
        raise PushError(f"{directory}: not a directory")
    validate(directory)
    try:
        manifest: Manifest = build_manifest(directory, block_size)
    except ManifestError as exc:
        raise PushError(str(exc)) from None
    client = client if client is not None else make_client(config)
    _check_bucket(client, config)
    progress = progress or Progress(manifest.total_bytes)
    prefix = f"{config.prefix}/" if config.prefix else ""
    transfer = TransferConfig(multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=MULTIPART_THRESHOLD,
                              max_concurrency=UPLOAD_CONCURRENCY)
    uploaded: list[str] = []
    skipped: list[str] = []
    sent = 0
    for entry in manifest.files:
        key = prefix + entry.path
        if _present(client, config, key, entry):
            skipped.append(entry.path)
            progress.add(entry.size)
            continue
        try:
            client.upload_file(str(directory / entry.path), config.bucket, key, Config=transfer,
                               ExtraArgs={"Metadata": {BLOCKS_DIGEST_METADATA: blocks_digest(entry)}},
                               Callback=progress.add)
        except (ClientError, BotoCoreError) as exc:
            raise explain(exc, config, key) from None
        except Exception as exc:  # boto3's S3UploadFailedError wraps the ClientError's text
            cause = exc.__cause__ or exc.__context__
            if isinstance(cause, (ClientError, BotoCoreError)):
                raise explain(cause, config, key) from None
            raise
        uploaded.append(entry.path)
        sent += entry.size
    # Last, so that a manifest a reader sees never names a file that is not there yet.
    try:
        client.put_object(Bucket=config.bucket, Key=prefix + MANIFEST_FILENAME, Body=manifest.to_text().encode(),
                          ContentType="application/json")
    except (ClientError, BotoCoreError) as exc:
        raise explain(exc, config, prefix + MANIFEST_FILENAME) from None
    return PushResult(manifest.digest, tuple(uploaded), tuple(skipped), sent)


def _credentials(args: argparse.Namespace) -> S3Credentials:
    if args.credentials_file is not None:
        return credentials_from_file(args.credentials_file, args.profile)
    found = credentials_from_env()
    if found is None:
        raise PushError("no credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or pass --credentials-file")
    return found


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="warmpool model push", description=__doc__.splitlines()[0])
    parser.add_argument("directory", type=Path, help="a safetensors model directory (config.json, *.safetensors)")
    parser.add_argument("url", help="where the revision goes: s3://bucket/prefix")
    parser.add_argument("--endpoint", required=True, help="the store's S3 endpoint, e.g. http://127.0.0.1:8333")
    parser.add_argument("--credentials-file", type=Path, default=None,
                        help="an AWS shared-credentials file (default: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)")
    parser.add_argument("--profile", default="default", help="the profile to read from --credentials-file")
    args = parser.parse_args(argv)
    started = time.monotonic()
    try:
        bucket, prefix = parse_s3_url(args.url)
        config = S3SourceConfig(args.endpoint, bucket, prefix, credentials=_credentials(args))
        result = push_model(args.directory, config)
    except (PushError, SourceAuthError, SourceError) as error:
        print(f"warmpool model push: {error}", file=sys.stderr)
        return 1
    print(f"[warmpool push] {args.url}: {len(result.uploaded)} files uploaded ({result.bytes_uploaded} bytes), "
          f"{len(result.skipped)} already there, manifest {result.digest} last, in {time.monotonic() - started:.1f}s",
          file=sys.stderr)
    print(result.digest)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
