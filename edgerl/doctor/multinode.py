"""`edgerl doctor --nodes M`: what a run over several machines needs that one machine does not.

- NCCL in this torch build (GPUs) or gloo (CPU): the collectives FSDP2 and edgerl use.
- The network interface: NCCL and gloo pick one by themselves and, on a machine with several (Docker
  bridges, VPNs, a second NIC), often one the other machines cannot reach; NCCL_SOCKET_IFNAME and
  GLOO_SOCKET_IFNAME name it (https://docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html).
- The clocks of the ranks, when doctor itself runs under torchrun on every machine: skewed clocks make the
  machines' logs disagree and can trip certificate checks of a shared file system.
Checks read an `Interfaces` and an environment given by the caller, so tests fake them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from edgerl.doctor.check import Check, _c

SKEW_WARN_S = 1.0


@dataclass(frozen=True)
class Interface:
    name: str
    up: bool
    speed_mbps: int                  # 0 where the driver does not say
    ipv4: tuple[str, ...] = ()


@dataclass
class Interfaces:
    """The machine's network interfaces (psutil), or a test's list."""
    found: Optional[list[Interface]] = None
    env: dict[str, str] = field(default_factory=dict)

    def list(self) -> list[Interface]:
        if self.found is not None:
            return self.found
        import psutil
        stats, addrs = psutil.net_if_stats(), psutil.net_if_addrs()
        out = []
        for name, st in stats.items():
            v4 = tuple(a.address for a in addrs.get(name, ()) if a.family.name == "AF_INET")
            out.append(Interface(name, bool(st.isup), int(st.speed or 0), v4))
        return out


def check_backend(cuda: bool, nccl: Callable[[], Optional[str]], gloo: Callable[[], bool]) -> Check:
    if cuda:
        version = nccl()
        if version is None:
            return _c("NCCL", "fail", "this torch build has no NCCL: GPUs on several machines cannot talk",
                      "install a CUDA build of torch from download.pytorch.org (they ship NCCL)")
        return _c("NCCL", "ok", f"NCCL {version} in this torch build")
    if not gloo():
        return _c("gloo", "fail", "this torch build has no gloo backend", "install torch from PyPI")
    return _c("gloo", "ok", "gloo in this torch build (CPU processes; NCCL is for GPUs)")


def _reachable(ifs: list[Interface]) -> list[Interface]:
    return [i for i in ifs if i.up and i.ipv4 and not all(a.startswith("127.") for a in i.ipv4)]


def check_interface(interfaces: Interfaces) -> Check:
    env = interfaces.env
    ifs = interfaces.list()
    named = {k: env[k] for k in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME") if env.get(k)}
    candidates = _reachable(ifs)
    def describe(i: Interface) -> str:
        speed = f", {i.speed_mbps / 1000:g} Gbit/s" if i.speed_mbps else ""
        return f"{i.name} ({', '.join(i.ipv4)}{speed})"
    if named:
        by_name = {i.name: i for i in ifs}
        for key, value in named.items():
            # NCCL's syntax: a prefix, '=' for an exact name, '^' to exclude; only plain names are checked
            if value[:1] in "=^" or "," in value:
                continue
            match = [i for n, i in by_name.items() if n.startswith(value)]
            if not match or not any(i.up for i in match):
                return _c("network interface", "fail", f"{key}={value}, but no interface here starts with "
                          f"{value!r} and is up (found: {', '.join(by_name) or 'none'})",
                          f"set {key} to the interface the machines reach each other on: "
                          + (", ".join(describe(i) for i in candidates) or "none is up"))
        return _c("network interface", "ok", ", ".join(f"{k}={v}" for k, v in named.items())
                  + (f"; up here: {', '.join(describe(i) for i in candidates)}" if candidates else ""))
    if not candidates:
        return _c("network interface", "fail", "no network interface with an IPv4 address is up",
                  "connect the machines on one network")
    if len(candidates) == 1:
        return _c("network interface", "ok", f"one interface to other machines: {describe(candidates[0])}",
                  f"on every machine: export NCCL_SOCKET_IFNAME={candidates[0].name} "
                  f"GLOO_SOCKET_IFNAME={candidates[0].name} (names may differ per machine)")
    return _c("network interface", "warn", f"{len(candidates)} interfaces are up: "
              + ", ".join(describe(i) for i in candidates)
              + "; NCCL and gloo may pick one the other machines cannot reach",
              "on every machine, name the one they reach each other on: export NCCL_SOCKET_IFNAME=NAME "
              "GLOO_SOCKET_IFNAME=NAME")


def check_clocks(times: Optional[list[float]]) -> Check:
    """`times`: time.time() of every rank, gathered at once (None: doctor is not under torchrun)."""
    if times is None:
        return _c("clocks of the ranks", "skip", "doctor runs as one process; to compare the machines' "
                  "clocks run it under torchrun on every machine, as training starts (docs/multinode.md)")
    skew = max(times) - min(times)
    if skew > SKEW_WARN_S:
        worst = max(range(len(times)), key=lambda r: abs(times[r] - times[0]))
        return _c("clocks of the ranks", "warn", f"{len(times)} ranks; rank {worst}'s clock is "
                  f"{times[worst] - times[0]:+.1f} s from rank 0's", "sync the clocks (chrony or systemd-timesyncd)")
    return _c("clocks of the ranks", "ok", f"{len(times)} ranks within {skew * 1000:.0f} ms of each other")


def gathered_clocks() -> Optional[list[float]]:
    """Every rank's clock, when this process runs under torchrun (a gloo group, made and torn down here)."""
    import os
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ or int(os.environ["WORLD_SIZE"]) < 2:
        return None
    import torch.distributed as dist
    made = not dist.is_initialized()
    if made:
        dist.init_process_group("gloo")
    try:
        dist.barrier()
        out: list = [None] * dist.get_world_size()
        dist.all_gather_object(out, time.time())
        return [float(t) for t in out]
    finally:
        if made:
            dist.destroy_process_group()


def multinode_checks(cuda: bool, interfaces: Optional[Interfaces] = None,
                     times: Optional[list[float]] = None) -> list[Check]:
    import os
    import torch.distributed as dist

    def nccl() -> Optional[str]:
        if not dist.is_nccl_available():
            return None
        import torch
        v = torch.cuda.nccl.version()
        return ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return [check_backend(cuda, nccl, dist.is_gloo_available),
            check_interface(interfaces or Interfaces(env=dict(os.environ))), check_clocks(times)]
