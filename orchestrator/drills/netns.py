"""Two emulated hosts joined by a cable you can cut: network namespaces and a veth pair.

Used by the `partition` drill. Needs Linux, root and iproute2. The addresses come from a /30 in
10.213.0.0/16, held only by these namespaces; nothing is routed anywhere else. This kernel has no
netem, so delay and loss cannot be emulated; the link can be set down (or packets dropped).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass, field

from orchestrator.errors import UnsupportedFeature

__all__ = ["NetnsPair", "netns_supported"]


def netns_supported() -> str | None:
    """None when namespaces can be made here, else the reason they cannot."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (run the partition drill as root, or in CI)"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class NetnsPair:
    """Namespaces `<prefix>-0` and `<prefix>-1` with addresses `addrs[0]` and `addrs[1]` on one veth link."""

    prefix: str = field(default_factory=lambda: "trg" + uuid.uuid4().hex[:6])
    subnet_octet: int = field(default_factory=lambda: int(uuid.uuid4().int % 250) + 1)
    created: bool = False

    @property
    def names(self) -> tuple[str, str]:
        return (f"{self.prefix}-0", f"{self.prefix}-1")

    @property
    def links(self) -> tuple[str, str]:
        return (f"{self.prefix}v0", f"{self.prefix}v1")

    @property
    def addrs(self) -> tuple[str, str]:
        base = f"10.213.{self.subnet_octet}"
        return (f"{base}.1", f"{base}.2")

    def create(self) -> NetnsPair:
        reason = netns_supported()
        if reason:
            raise UnsupportedFeature(f"partition: {reason}")
        (ns0, ns1), (v0, v1), (a0, a1) = self.names, self.links, self.addrs
        try:
            _ip("netns", "add", ns0)
            _ip("netns", "add", ns1)
            self.created = True
            _ip("link", "add", v0, "type", "veth", "peer", "name", v1)
            _ip("link", "set", v0, "netns", ns0)
            _ip("link", "set", v1, "netns", ns1)
            for ns, link, addr in ((ns0, v0, a0), (ns1, v1, a1)):
                _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", link)
                _ip("-n", ns, "link", "set", link, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as exc:
            self.destroy()
            raise UnsupportedFeature(f"partition: could not create namespaces: {exc.stderr.strip()}") from None
        return self

    def exec_prefix(self, index: int) -> list[str]:
        """Command prefix that runs a program inside namespace `index`."""
        return ["ip", "netns", "exec", self.names[index]]

    def cut(self, index: int = 1) -> None:
        """Take the link of namespace `index` down: packets stop, no connection is reset (like a pulled cable)."""
        _ip("-n", self.names[index], "link", "set", self.links[index], "down")

    def heal(self, index: int = 1) -> None:
        _ip("-n", self.names[index], "link", "set", self.links[index], "up")

    def destroy(self) -> None:
        """Delete both namespaces (and with them the veth pair). Safe to call twice."""
        for ns in self.names:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        self.created = False

    def __enter__(self) -> NetnsPair:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.destroy()
