"""Emulated hosts for the multi-host tests: network namespaces, each with an
``eth0`` on one bridge of this machine (the bridge holds ``<subnet>.1``, host
``i`` holds ``<subnet>.<i + 2>``). All traffic stays on that bridge."""

import subprocess


def ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


class BridgedNamespaces:
    """``namespaces`` on a bridge named ``bridge``; ``veth_prefix`` names the
    bridge's ends of the links (``<veth_prefix><index>``).

    ``build()`` makes them (on an error it removes what it made, then raises);
    ``remove()`` deletes them, whatever was made; both may be called again.
    """

    def __init__(self, bridge: str, subnet: str, namespaces: list[str], veth_prefix: str):
        self.bridge, self.subnet, self.namespaces = bridge, subnet, namespaces
        self.veth_prefix = veth_prefix
        self.addresses = [f"{subnet}.{index + 2}" for index in range(len(namespaces))]
        self._made: list[tuple[str, ...]] = []

    def build(self) -> None:
        try:
            ip("link", "add", self.bridge, "type", "bridge")
            self._made.append(("link", "del", self.bridge))
            ip("addr", "add", f"{self.subnet}.1/24", "dev", self.bridge)
            ip("link", "set", self.bridge, "up")
            for index, (namespace, address) in enumerate(zip(self.namespaces, self.addresses)):
                veth = f"{self.veth_prefix}{index}"
                ip("netns", "add", namespace)
                self._made.append(("netns", "del", namespace))
                ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns",
                   namespace)
                ip("link", "set", veth, "master", self.bridge, "up")
                ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
                ip("-n", namespace, "link", "set", "eth0", "up")
                ip("-n", namespace, "link", "set", "lo", "up")
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        for command in reversed(self._made):
            subprocess.run(["ip", *command], capture_output=True, timeout=30)
        self._made.clear()
