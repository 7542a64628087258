"""Compile the TC classifier with bcc, attach it through pyroute2, detach it, report attachment.

Configuration reaches C only as -D cflags (table sizes) and maps (everything else): the C text
is never edited (the eBPF rules in docs/contributing.md). Maps are pinned in bpffs under
/sys/fs/bpf/sluice/<netns>_<iface>/<layout>/ when bpffs is mounted, so a restarted gateway (or
`sluice ebpf status`, another process) reopens the same counters, buckets and deny entries; the
layout directory name encodes the ABI header hash and the table sizes, so a changed layout gets
fresh maps instead of a mismatched one. Attaching uses `replace-filter` with a fixed
priority/handle: re-attaching swaps the program atomically (no window without a filter) and is
idempotent.

Everything here blocks (clang, the verifier, netlink); from asyncio call it through
asyncio.to_thread: pyroute2's sync IPRoute refuses to run on a thread whose event loop runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, TracebackType
from typing import Any

from gateway.errors import DatapathError
from gateway.resources import ebpf_dir

EBPF_DIR = ebpf_dir()  # the checkout's ebpf/, or the copy an installed package carries
SOURCE = EBPF_DIR / "tc_classifier.bpf.c"
HEADER = EBPF_DIR / "sluice_maps.h"
BPFFS = Path("/sys/fs/bpf")
PIN_ROOT = BPFFS / "sluice"
BCC_PATH = "/usr/lib/python3/dist-packages"

INGRESS_PARENT = 0xFFFFFFF2  # clsact ingress hook (ffff:fff2)
EGRESS_PARENT = 0xFFFFFFF3  # clsact egress hook (ffff:fff3)
FILTER_PRIO = 0x5E1  # our fixed tc priority ("pref"); handle 1: replace targets exactly this
FILTER_HANDLE = 1
PROGRAMS = {"ingress": "sluice_ingress", "egress": "sluice_egress"}
BPFFS_MAGIC = 0xCAFE4A11


@dataclass(frozen=True)
class BuildOptions:
    """Table sizes: the only things that reach C as -D flags."""

    max_flows: int = 65536
    max_sources: int = 65536
    max_deny: int = 16384
    h2_max_frames: int = 64

    def cflags(self) -> list[str]:
        return [
            f"-DMAX_FLOWS={self.max_flows}",
            f"-DMAX_SOURCES={self.max_sources}",
            f"-DMAX_DENY={self.max_deny}",
            f"-DH2_MAX_FRAMES={self.h2_max_frames}",
        ]

    def layout(self) -> str:
        abi = hashlib.sha256(HEADER.read_bytes()).hexdigest()[:10]
        return (
            f"abi{abi}-f{self.max_flows}-s{self.max_sources}-d{self.max_deny}-h{self.h2_max_frames}"
        )

    @classmethod
    def from_layout(cls, name: str) -> BuildOptions | None:
        parts = dict((p[0], p[1:]) for p in name.split("-")[1:] if p)
        try:
            return cls(int(parts["f"]), int(parts["s"]), int(parts["d"]), int(parts["h"]))
        except (KeyError, ValueError):
            return None


def import_bcc() -> ModuleType:
    """bcc is Debian's python3-bpfcc in the system dist-packages: add the path, never vendor."""
    try:
        import bcc
    except ImportError:
        if BCC_PATH not in sys.path and Path(BCC_PATH, "bcc").is_dir():
            sys.path.append(BCC_PATH)
        try:
            import bcc
        except ImportError as exc:
            raise DatapathError(
                "bcc is not installed (Debian: apt-get install python3-bpfcc; "
                "or run deploy/host-setup.sh)"
            ) from exc
    module: ModuleType = bcc
    return module


def preflight() -> ModuleType:
    """Check root, bcc and kernel headers; raise one DatapathError naming what is missing."""
    if os.geteuid() != 0:
        raise DatapathError("the eBPF datapath needs root (CAP_BPF and CAP_NET_ADMIN)")
    bcc = import_bcc()
    build = Path(f"/lib/modules/{os.uname().release}/build")
    if not (build / "include").exists() and not Path("/sys/kernel/kheaders.tar.xz").exists():
        raise DatapathError(
            f"kernel headers missing: {build} does not exist "
            "(install linux-headers-amd64 and run deploy/host-setup.sh to link them)"
        )
    if not SOURCE.exists():
        raise DatapathError(f"classifier source missing: {SOURCE}")
    return bcc


def bpffs_mounted() -> bool:
    """True when /sys/fs/bpf is a bpffs (statfs magic), i.e. maps can be pinned."""

    class _StatFs(ctypes.Structure):
        _fields_ = [("f_type", ctypes.c_long), ("rest", ctypes.c_byte * 120)]

    libc = ctypes.CDLL(None, use_errno=True)
    buf = _StatFs()
    if libc.statfs(str(BPFFS).encode(), ctypes.byref(buf)) != 0:
        return False
    return int(buf.f_type) & 0xFFFFFFFF == BPFFS_MAGIC


def pin_base(iface: str, netns: str | None) -> Path:
    return PIN_ROOT / f"{netns or 'root'}_{iface}"


def pinned_layouts(iface: str, netns: str | None) -> list[Path]:
    base = pin_base(iface, netns)
    if not base.is_dir():
        return []
    return sorted(p for p in base.iterdir() if p.is_dir())


def _ipr(netns: str | None) -> Any:
    from pyroute2 import IPRoute

    try:
        return IPRoute(netns=netns) if netns else IPRoute()
    except OSError as exc:
        raise DatapathError(f"cannot open netlink in netns {netns!r}: {exc}") from exc


def _ifindex(ipr: Any, iface: str) -> int:
    found = ipr.link_lookup(ifname=iface)
    if not found:
        raise DatapathError(f"no such interface: {iface}")
    return int(found[0])


def attachment(iface: str, netns: str | None = None) -> dict[str, str | None]:
    """Which of our programs are attached to `iface` now: {"ingress": name|None, "egress": ...}."""
    out: dict[str, str | None] = {}
    with _ipr(netns) as ipr:
        idx = _ifindex(ipr, iface)
        for hook, parent in (("ingress", INGRESS_PARENT), ("egress", EGRESS_PARENT)):
            out[hook] = None
            try:
                filters = list(ipr.get_filters(index=idx, parent=parent))
            except Exception:  # noqa: BLE001 - no clsact qdisc: nothing attached
                filters = []
            for f in filters:
                if (int(f.get("info", 0)) >> 16) != FILTER_PRIO:
                    continue
                opts = f.get_attr("TCA_OPTIONS")
                name = opts.get_attr("TCA_BPF_NAME") if opts is not None else None
                if name:
                    out[hook] = str(name)
    return out


def detach(iface: str, netns: str | None = None, *, unpin: bool = True) -> bool:
    """Remove our filters (only ours: other clsact filters stay), the clsact qdisc if it is left
    empty, and the pinned maps. Returns True when something was attached. Idempotent."""
    from pyroute2.netlink.exceptions import NetlinkError

    removed = False
    with _ipr(netns) as ipr:
        idx = _ifindex(ipr, iface)
        for parent in (INGRESS_PARENT, EGRESS_PARENT):
            try:
                ipr.tc("del-filter", "bpf", idx, FILTER_HANDLE, parent=parent, prio=FILTER_PRIO)
                removed = True
            except NetlinkError as exc:
                if exc.code not in (errno.ENOENT, errno.EINVAL):
                    raise DatapathError(f"detach from {iface}: {exc}") from exc
        remaining = 0
        for parent in (INGRESS_PARENT, EGRESS_PARENT):
            with contextlib.suppress(NetlinkError):
                remaining += len(list(ipr.get_filters(index=idx, parent=parent)))
        if remaining == 0:
            with contextlib.suppress(NetlinkError):
                ipr.tc("del", "clsact", idx)
    if unpin:
        shutil.rmtree(pin_base(iface, netns), ignore_errors=True)
    return removed


_SYS_BPF = 321  # x86_64
_BPF_OBJ_GET_INFO_BY_FD = 15
_INFO_RUN_TIME_NS = 192  # offsetof(struct bpf_prog_info, run_time_ns), uapi/linux/bpf.h


def prog_run_stats(fd: int) -> tuple[int, int]:
    """(run_time_ns, run_cnt) of a loaded program; both stay 0 unless the global sysctl
    kernel.bpf_stats_enabled is 1 (it costs two clock reads per run, so it is off by default)."""

    class _Attr(ctypes.Structure):
        _fields_ = [("fd", ctypes.c_uint32), ("len", ctypes.c_uint32), ("info", ctypes.c_uint64)]

    buf = ctypes.create_string_buffer(256)
    attr = _Attr(fd, len(buf), ctypes.addressof(buf))
    libc = ctypes.CDLL(None, use_errno=True)
    rc = libc.syscall(_SYS_BPF, _BPF_OBJ_GET_INFO_BY_FD, ctypes.byref(attr), ctypes.sizeof(attr))
    if rc != 0:
        raise DatapathError(f"BPF_OBJ_GET_INFO_BY_FD: {os.strerror(ctypes.get_errno())}")
    raw = buf.raw[_INFO_RUN_TIME_NS : _INFO_RUN_TIME_NS + 16]
    return int.from_bytes(raw[:8], "little"), int.from_bytes(raw[8:], "little")


class BpfProgram:
    """The classifier compiled for one interface.

    `with BpfProgram(iface) as prog:` loads and attaches, and detaches on exit; a gateway that
    must leave the program in place across a restart calls load()/attach() and close().
    """

    def __init__(
        self,
        iface: str,
        *,
        netns: str | None = None,
        options: BuildOptions | None = None,
        pin: bool | None = None,
        egress: bool = True,
    ) -> None:
        self.iface = iface
        self.netns = netns
        self.options = options or BuildOptions()
        self.egress = egress
        self._pin = pin
        self.pin_dir: Path | None = None
        self._bpf: Any = None
        self._fns: dict[str, Any] = {}

    # -- build --------------------------------------------------------------------------
    def load(self) -> None:
        """Compile and load into the kernel (verifier). Raises DatapathError with the reason."""
        bcc = preflight()
        with _ipr(self.netns) as ipr:
            _ifindex(ipr, self.iface)  # fail before the slow compile
        cflags = [f"-I{EBPF_DIR}", *self.options.cflags()]
        pin = bpffs_mounted() if self._pin is None else self._pin
        if pin:
            if not bpffs_mounted():
                raise DatapathError(f"{BPFFS} is not a bpffs: mount -t bpf bpf {BPFFS}")
            base = pin_base(self.iface, self.netns)
            layout = base / self.options.layout()
            for stale in pinned_layouts(self.iface, self.netns):
                if stale != layout:  # the layout changed: its maps cannot be reused
                    shutil.rmtree(stale, ignore_errors=True)
            layout.mkdir(parents=True, exist_ok=True)
            self.pin_dir = layout
            cflags.append(f'-DSLUICE_PIN_DIR="{layout}"')
        try:
            self._bpf = bcc.BPF(src_file=str(SOURCE).encode(), cflags=cflags)
        except Exception as exc:  # bcc raises bare Exception; clang's message went to stderr
            raise DatapathError(f"compiling {SOURCE.name} failed: {exc}") from exc
        hooks = ["ingress", "egress"] if self.egress else ["ingress"]
        for hook in hooks:
            try:
                self._fns[hook] = self._bpf.load_func(PROGRAMS[hook], bcc.BPF.SCHED_CLS)
            except Exception as exc:
                raise DatapathError(
                    f"the verifier rejected {PROGRAMS[hook]}: {exc} (log above)"
                ) from exc

    @classmethod
    def open_pinned(cls, iface: str, netns: str | None = None) -> BpfProgram:
        """Reopen the pinned maps of an attached classifier (for `status`); loads no filter."""
        layouts = pinned_layouts(iface, netns)
        if not layouts:
            raise DatapathError(
                f"no pinned maps for {iface} (not attached, or attached without bpffs)"
            )
        options = BuildOptions.from_layout(layouts[-1].name)
        if options is None or options.layout() != layouts[-1].name:
            raise DatapathError(f"pinned maps at {layouts[-1]} have another ABI: re-attach")
        prog = cls(iface, netns=netns, options=options, pin=True, egress=False)
        prog.load()
        return prog

    # -- attach -------------------------------------------------------------------------
    def attach(self) -> None:
        """Attach (or atomically replace) our filters on clsact ingress and egress."""
        from pyroute2.netlink.exceptions import NetlinkError

        if self._bpf is None:
            self.load()
        with _ipr(self.netns) as ipr:
            idx = _ifindex(ipr, self.iface)
            try:
                ipr.tc("add", "clsact", idx)
            except NetlinkError as exc:
                if exc.code != errno.EEXIST:
                    raise DatapathError(f"cannot add clsact on {self.iface}: {exc}") from exc
            for hook, fn in self._fns.items():
                parent = INGRESS_PARENT if hook == "ingress" else EGRESS_PARENT
                try:
                    ipr.tc(
                        "replace-filter",
                        "bpf",
                        idx,
                        FILTER_HANDLE,
                        fd=fn.fd,
                        name=fn.name,
                        parent=parent,
                        prio=FILTER_PRIO,
                        classid=1,
                        direct_action=True,
                    )
                except NetlinkError as exc:
                    raise DatapathError(f"attach {hook} on {self.iface}: {exc}") from exc

    def detach(self) -> bool:
        return detach(self.iface, self.netns, unpin=True)

    def program_fd(self, hook: str = "ingress") -> int:
        if hook not in self._fns:
            raise DatapathError(f"{hook} program not loaded")
        return int(self._fns[hook].fd)

    def table(self, name: str) -> Any:
        if self._bpf is None:
            raise DatapathError("program not loaded")
        return self._bpf[name]

    def close(self) -> None:
        """Drop our file descriptors; an attached filter (and pinned maps) stay in the kernel."""
        if self._bpf is not None:
            self._bpf.cleanup()
            self._bpf = None
            self._fns = {}

    def __enter__(self) -> BpfProgram:
        self.load()
        self.attach()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self.detach()
        finally:
            self.close()
