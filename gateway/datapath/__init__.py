"""The eBPF datapath: TC classifier loader (loader), its maps (maps), the gateway-side sync
loop (sync.Datapath) and the `sluice ebpf` command (commands). bcc and pyroute2 are imported
only inside functions, so importing this package costs nothing when the datapath is off.
"""

from __future__ import annotations

from gateway.datapath.sync import Datapath

__all__ = ["Datapath"]
