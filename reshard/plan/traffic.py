"""Bytes between every pair of ranks for a whole plan: the cost model's input."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Traffic"]


@dataclass(slots=True)
class Traffic:
    """Bytes between every pair of ranks for a whole plan (the cost model's input).

    ``pairs[(src, dst)]`` counts bytes sent from ``src`` to ``dst`` (pulls and
    forwards), ``transfers`` the transfers behind them, ``local[r]`` bytes a
    rank copies within itself. Per-rank views split bytes into ``net``
    (between domains) and ``nvl`` (between ranks of one domain).
    """

    domain_of: Callable[[int], int]
    pairs: Counter = field(default_factory=Counter)
    transfers: Counter = field(default_factory=Counter)
    local: Counter = field(default_factory=Counter)
    num_rounds: int = 0
    net_in: Counter = field(default_factory=Counter)
    net_out: Counter = field(default_factory=Counter)
    nvl_in: Counter = field(default_factory=Counter)
    nvl_out: Counter = field(default_factory=Counter)

    def finish(self) -> Traffic:
        for c in (self.net_in, self.net_out, self.nvl_in, self.nvl_out):
            c.clear()
        for (s, d), b in self.pairs.items():
            if self.domain_of(s) == self.domain_of(d):
                self.nvl_out[s] += b
                self.nvl_in[d] += b
            else:
                self.net_out[s] += b
                self.net_in[d] += b
        return self

    @property
    def network_bytes(self) -> int:
        return sum(self.net_in.values())

    @property
    def nvlink_bytes(self) -> int:
        return sum(self.nvl_in.values())

    def recv_bytes(self, rank: int) -> int:
        return self.net_in[rank] + self.nvl_in[rank]

    def send_bytes(self, rank: int) -> int:
        return self.net_out[rank] + self.nvl_out[rank]

    @property
    def max_rank_recv_bytes(self) -> int:
        ranks = set(self.net_in) | set(self.nvl_in)
        return max((self.recv_bytes(r) for r in ranks), default=0)

    @property
    def max_rank_send_bytes(self) -> int:
        ranks = set(self.net_out) | set(self.nvl_out)
        return max((self.send_bytes(r) for r in ranks), default=0)
