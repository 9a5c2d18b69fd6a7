"""The digest a manifest records for each file: a 256-bit hash over fixed-size parts, computed in parallel.

One hash stream is sequential: one core hashes it, below what a disk or a network delivers, so a restore
that verifies a rank's file with one stream waits for the hash. Manifests of version 3 and later record
`digest_part_bytes` (P) and, for each file, the digest

- `H(file)` when the file has at most P bytes (for SHA-256 the same as `sha256sum`), else
- `H(H(part 0) || H(part 1) || ...)`, the parts being the file's consecutive P-byte pieces (the last
  one shorter), each part digest the 32 raw bytes.

The parts are hashed independently (on several threads: both hashes release the GIL), then the root
over their digests, a one-level hash tree. It guards exactly what the whole-file hash did: changing any
byte changes its part's digest, and so the root, short of a collision of H; the file's size is in the
manifest too, so a file cannot pass for one of another number of parts. Manifests before version 3 have
`digest_part_bytes` 0: the whole file's SHA-256.

H is the manifest's `digest_algorithm` (version 4): `blake3`, what the writer uses, or `sha256`, what
every manifest before version 4 means. BLAKE3 has SHA-256's 256-bit output and 128-bit collision
resistance, so it guards the same thing (a byte changed by a disk, a network or a hostile bucket; the
manifest itself is HMAC-signed, `signing.py`), at twice the speed per core on this machine (AVX2:
2.6-2.9 GB/s against SHA-256's 1.3-1.4 GB/s with SHA-NI; docs/performance.md). The checkpoint path
hashes every byte it writes and every byte it restores on the CPU, next to the training loop.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from blake3 import blake3

__all__ = [
    "DIGEST_ALGORITHM",
    "DIGEST_ALGORITHMS",
    "DIGEST_PART_BYTES",
    "PartDigest",
    "digest_of",
    "new_hash",
    "root_of",
    "valid_part_bytes",
]

DIGEST_PART_BYTES = 4 * 1024 * 1024  # what the writer uses (measured: 4 MiB parts verify as fast as 16 MiB)
DIGEST_ALGORITHM = "blake3"  # what the writer uses
DIGEST_ALGORITHMS = ("sha256", "blake3")  # what a manifest may name
_MIN_PART, _MAX_PART = 64 * 1024, 1024**3


def new_hash(algorithm: str, data: Any = b"") -> Any:
    """A fresh hash object of `algorithm` (one of `DIGEST_ALGORITHMS`), fed `data`."""
    if algorithm == "blake3":
        return blake3(data)
    if algorithm == "sha256":
        return hashlib.sha256(data)
    raise ValueError(f"unknown digest algorithm {algorithm!r} (known: {', '.join(DIGEST_ALGORITHMS)})")


def valid_part_bytes(value: Any) -> bool:
    """0 (whole-file SHA-256) or a power of two from 64 KiB to 1 GiB."""
    if not isinstance(value, int) or isinstance(value, bool):
        return False
    return value == 0 or (_MIN_PART <= value <= _MAX_PART and value & (value - 1) == 0)


def root_of(part_digests: list[bytes], algorithm: str = "sha256") -> str:
    """The file digest from its parts' raw digests, in order (one part: that part's digest itself)."""
    if len(part_digests) == 1:
        return part_digests[0].hex()
    return str(new_hash(algorithm, b"".join(part_digests)).hexdigest())


class PartDigest:
    """The digest of a stream fed in order (any chunking), for parts of `part_bytes` (0: the whole file's)."""

    def __init__(self, part_bytes: int, algorithm: str = "sha256") -> None:
        self.part_bytes = part_bytes
        self.algorithm = algorithm
        self._current = new_hash(algorithm)
        self._filled = 0  # bytes in the current part
        self._done: list[bytes] = []

    def update(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        if not self.part_bytes:
            self._current.update(view)
            return
        while view.nbytes:
            take = min(view.nbytes, self.part_bytes - self._filled)
            self._current.update(view[:take])  # releases the GIL for large pieces (both algorithms)
            self._filled += take
            view = view[take:]
            if self._filled == self.part_bytes:
                self._done.append(self._current.digest())
                self._current, self._filled = new_hash(self.algorithm), 0

    def hexdigest(self) -> str:
        if not self.part_bytes:
            return str(self._current.hexdigest())
        parts = list(self._done)
        if self._filled or not parts:  # the last, shorter part (or the one part of an empty file)
            parts.append(self._current.digest())
        return root_of(parts, self.algorithm)


def digest_of(chunks: Iterable[Any], part_bytes: int, algorithm: str = "sha256") -> tuple[str, int]:
    """The digest and size of a stream given as chunks, in order."""
    digest = PartDigest(part_bytes, algorithm)
    size = 0
    for chunk in chunks:
        digest.update(chunk)
        size += memoryview(chunk).nbytes
    return digest.hexdigest(), size
