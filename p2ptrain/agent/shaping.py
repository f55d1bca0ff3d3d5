"""The network an agent plays (``[emulation]``): its links and access line shaped in the emulator, and the access
line its peer record publishes.

    shaping = LinkShaping(config)          # loads the cluster file; shapes our own access line at once
    transport = Transport(..., emulator=shaping.emulator)
    shaping.shape_link(peer, record)       # the poller, once per new peer: the link to the device it plays
    record = PeerRecord(..., **shaping.line(prober.access))  # the access line: declared, emulated or measured

Which access line a peer record says (``links.line_to_publish``): what ``[links]`` declares, else an emulated
device's own (in the emulated frame its links are measured in), else what the link prober measured. The
prober measures it only when nothing declares both directions and nothing is emulated (``measures_access``).
Used by the poller's thread only (the main thread, or the step-boundary thread while an epoch trains) and,
for ``line``, the prober's (reads of the config and the emulator's access, which is set once, here).
"""

from __future__ import annotations

import logging
import math

from p2ptrain.agent.config import AgentConfig
from p2ptrain.agent.links import line_to_publish
from p2ptrain.net.dht.records import PeerRecord
from p2ptrain.net.transport.emulation import EmulationConfig, LinkEmulator, scaled_bandwidth, scaled_link
from p2ptrain.planning import Cluster, load_cluster

logger = logging.getLogger(__name__)


class LinkShaping:
    """The emulated network's links of one agent (module docstring); no network where ``[emulation]`` is off."""

    def __init__(self, config: AgentConfig):
        self.config = config
        self.emulator = LinkEmulator()
        self.network: Cluster | None = load_cluster(config.emulation.cluster_file) if config.emulation.enabled else None
        if self.network is not None and not config.emulation.device_index < self.network.num_devices:
            raise ValueError(f"emulation.device_index={config.emulation.device_index} is not a device of "
                             f"{config.emulation.cluster_file} ({self.network.num_devices} devices)")
        self._shaped: set[str] = set()
        if self.network is not None:
            self._shape_access()

    def line(self, measured: dict) -> dict[str, float]:
        """The access link to publish (``PeerRecord.uplink_gbps``/``downlink_gbps``; ``links.line_to_publish``):
        what ``[links]`` declares, else an emulated device's own (in the emulated frame its links are measured
        in), else what the prober measured (``measured``: ``LinkProber.access``)."""
        links = self.config.links
        declared = {"uplink_gbps": links.uplink_mbps, "downlink_gbps": links.downlink_mbps}
        emulated = None
        if self.network is not None:
            up, down = self.emulator.access()  # bytes/s
            emulated = {"uplink_gbps": up, "downlink_gbps": down}
        return line_to_publish(declared, emulated, measured)

    def measures_access(self) -> bool:
        """Whether the prober measures our line: asked to, and neither declared both ways nor emulated."""
        links = self.config.links
        declared = links.uplink_mbps is not None and links.downlink_mbps is not None
        return links.measure_access and not declared and self.network is None

    def _shape_access(self) -> None:
        """Emulate our device's access link (a home's uplink and downlink, shared by all our flows), if the
        network gives it one."""
        me = self.config.emulation.device_index
        emulation = EmulationConfig(self.config.emulation.time_scale, self.config.emulation.size_factor)
        up, down = (None if v is None or not math.isfinite(v[me]) else scaled_bandwidth(float(v[me]), emulation)
                    for v in (self.network.uplink_gbps, self.network.downlink_gbps))
        if up is not None or down is not None:
            self.emulator.set_access(up, down)
            logger.info("access link emulated: uplink %s, downlink %s", *(
                f"{v * 8 / 1e6:.3f} Mbit/s" if v is not None else "unlimited" for v in (up, down)))

    def shape_link(self, peer: str, record: PeerRecord) -> None:
        """Emulate the link to ``peer`` as the network's link from our device to the one it plays."""
        if self.network is None or peer in self._shaped:
            return
        me, other = self.config.emulation.device_index, record.emulated_device
        self._shaped.add(peer)
        if other is None or other == me or other >= self.network.num_devices:
            logger.warning("peer %s plays device %s: not a device of the emulated network other than ours (%d); "
                           "its link is not shaped", peer, other, me)
            return
        emulation = EmulationConfig(self.config.emulation.time_scale, self.config.emulation.size_factor)
        link = scaled_link(self.network.latency_ms[me, other], self.network.bandwidth_gbps[me, other], emulation)
        self.emulator.set_link(peer, link.latency_s, link.bandwidth_bytes_per_s)
        logger.info("link to peer %s (device %d) emulated: %.2f ms, %.3f Mbit/s", peer, other,
                    link.latency_s * 1e3, link.bandwidth_bytes_per_s * 8 / 1e6)
