"""Cluster descriptions: GPUs to hosts to NVLink domains, and link speeds."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PRESETS", "Cluster", "Deployment", "place"]


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    """A homogeneous GPU cluster. Bandwidths are per GPU and per direction."""

    name: str
    gpus_per_host: int
    """GPUs in one host (one operating system)."""
    hosts_per_domain: int
    """Hosts joined by NVLink into one domain (1 for a DGX; 18 for a GB200 NVL72 rack)."""
    nic_gbit: float
    """Scale-out NIC bandwidth per GPU, Gb/s per direction (one rail per GPU)."""
    nvlink_gbyte: float
    """NVLink bandwidth per GPU, GB/s per direction."""
    hbm_gbyte: float = 2000.0
    """Copies between two processes on one GPU (colocated trainer and engine), GB/s."""
    message_latency_s: float = 5e-6
    """Cost of one point-to-point message on the sending and receiving GPU."""
    round_latency_s: float = 20e-6
    """Cost of one grouped round (launch and completion of a batch of sends)."""
    nic_per_host: bool = False
    """One NIC per host, shared by all its GPUs (``nic_gbit`` is then the
    host's); ``False``: one rail per GPU (DGX, GB200)."""
    broadcast: str = "ring"
    """How gather-and-broadcast's broadcast moves: ``ring`` (NCCL's pipelined
    chain: the bytes once through the slowest link) or ``tree`` (gloo's:
    whole buckets hop down a binomial tree, level after level;
    :func:`reshard.costmodel.cost.tree_broadcast_seconds`)."""
    refit_seconds: float = 0.0
    """A fixed cost of every refit whatever its bytes: the control plane's
    agreements on the store (joins excluded), the plan, the process group's
    first messages."""

    def __post_init__(self) -> None:
        if self.gpus_per_host < 1 or self.hosts_per_domain < 1:
            raise ValueError(f"cluster {self.name}: hosts and domains need at least one GPU")
        if self.nic_gbit <= 0 or self.nvlink_gbyte <= 0 or self.hbm_gbyte <= 0:
            raise ValueError(f"cluster {self.name}: bandwidths must be positive")
        if self.broadcast not in ("ring", "tree"):
            raise ValueError(f"cluster {self.name}: broadcast is ring or tree, got {self.broadcast!r}")

    @classmethod
    def parse(cls, text: str) -> Cluster:
        """A preset's name, or a description ``key=value,...`` of
        :class:`Cluster`'s fields (``gpus_per_host``, ``nic_gbit`` and
        ``nvlink_gbyte`` required; ``nic_per_host=1``, ``broadcast=tree``,
        ``refit_seconds=0.25`` ...), optionally after a preset or a name and
        a colon: ``dgx-h100:nic_per_host=1`` changes a preset."""
        from dataclasses import fields, replace

        if "=" not in text:
            if text not in PRESETS:
                raise ValueError(f"unknown cluster {text!r}; presets: {', '.join(sorted(PRESETS))}, or key=value,...")
            return PRESETS[text]
        head, _, body = text.rpartition(":") if ":" in text.split("=", 1)[0] else ("", "", text)
        types = {f.name: f.type for f in fields(cls)}
        values: dict[str, object] = {}
        for item in body.split(","):
            key, eq, raw = item.strip().partition("=")
            key = key.strip().replace("-", "_")
            if not eq or key not in types or key == "name":
                known = ", ".join(k for k in types if k != "name")
                raise ValueError(f"cluster description: {item.strip()!r} is not key=value for one of: {known}")
            kind = str(types[key])
            raw = raw.strip()
            if "bool" in kind:
                values[key] = raw.lower() in ("1", "true", "yes", "on")
            elif "int" in kind:
                values[key] = int(raw)
            elif "float" in kind:
                values[key] = float(raw)
            else:
                values[key] = raw
        if head in PRESETS:
            return replace(PRESETS[head], name=text, **values)  # type: ignore[arg-type]
        missing = [k for k in ("gpus_per_host", "nic_gbit", "nvlink_gbyte") if k not in values]
        if missing:
            raise ValueError(f"cluster description {text!r} needs {', '.join(missing)}")
        values.setdefault("hosts_per_domain", 1)
        return cls(name=head or "custom", **values)  # type: ignore[arg-type]

    @property
    def gpus_per_domain(self) -> int:
        return self.gpus_per_host * self.hosts_per_domain

    @property
    def nic_bytes_per_s(self) -> float:
        return self.nic_gbit * 1e9 / 8

    @property
    def nvlink_bytes_per_s(self) -> float:
        return self.nvlink_gbyte * 1e9

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_gbyte * 1e9


PRESETS: dict[str, Cluster] = {
    # DGX H100: 8 GPUs per host on NVSwitch (NVLink 4: 900 GB/s bidirectional,
    # 450 GB/s each way), one 400 Gb/s ConnectX-7 rail per GPU.
    "dgx-h100": Cluster(name="dgx-h100", gpus_per_host=8, hosts_per_domain=1, nic_gbit=400, nvlink_gbyte=450),
    # GB200 NVL72: 18 compute trays of 4 GPUs in one NVLink 5 domain
    # (1.8 TB/s bidirectional per GPU), one 400 Gb/s rail per GPU.
    "gb200-nvl72": Cluster(
        name="gb200-nvl72", gpus_per_host=4, hosts_per_domain=18, nic_gbit=400, nvlink_gbyte=900, hbm_gbyte=4000
    ),
}


@dataclass(frozen=True, slots=True)
class Deployment:
    """Where each rank runs. Trainer ranks come first, then engine ranks."""

    gpu_of: tuple[int, ...]
    host_of: tuple[int, ...]
    domain_of: tuple[int, ...]
    trainer_ranks: range
    engine_ranks: range

    def domain(self, rank: int) -> int:
        return self.domain_of[rank]

    def ranks_in_domain(self, domain: int) -> int:
        return len({g for g, d in zip(self.gpu_of, self.domain_of, strict=True) if d == domain})


def place(cluster: Cluster, n_trainer: int, n_engine: int, *, colocate: bool = False) -> Deployment:
    """Trainer rank i on GPU i; engine ranks on the hosts after the trainer's
    (each side fills its hosts in order), or, with ``colocate``, engine rank
    j on GPU j, sharing GPUs and hosts with the trainer."""
    if n_trainer < 1 or n_engine < 1:
        raise ValueError("need at least one trainer rank and one engine rank")
    gph = cluster.gpus_per_host
    trainer_hosts = -(-n_trainer // gph)
    engine_first_gpu = 0 if colocate else trainer_hosts * gph
    gpus = list(range(n_trainer)) + [engine_first_gpu + j for j in range(n_engine)]
    hosts = [g // gph for g in gpus]
    domains = [h // cluster.hosts_per_domain for h in hosts]
    return Deployment(
        gpu_of=tuple(gpus),
        host_of=tuple(hosts),
        domain_of=tuple(domains),
        trainer_ranks=range(n_trainer),
        engine_ranks=range(n_trainer, n_trainer + n_engine),
    )
