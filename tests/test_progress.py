"""The progress line of long refits (pure: a plan in, text out)."""

from __future__ import annotations

import io
from types import SimpleNamespace

from reshard.plan.items import RankPlan, Round
from reshard.transport.progress import Progress, wants_progress


def _plan() -> RankPlan:
    t = SimpleNamespace(nbytes=250_000_000)
    rounds = [Round(index=i, sends={1: [t]}, recvs={2: [t]} if i == 3 else {}) for i in range(4)]
    return RankPlan(rank=0, rounds=rounds, num_rounds=4)


def test_a_long_refit_draws_one_line_it_rewrites_and_ends():
    out = io.StringIO()
    p = Progress(7, _plan(), stream=out, after_s=0.0, every_s=0.0)
    for i in range(4):
        p(i)
    p.close()
    text = out.getvalue()
    assert text.count("\r") == 4 and text.endswith("\n") and text.count("\n") == 1
    last = text.rsplit("\r", 1)[1]
    assert last.startswith("reshard refit 7 rank 0 [")
    assert "100% 1.25/1.25 GB" in last and "round 4/4" in last


def test_a_short_refit_draws_nothing():
    out = io.StringIO()
    p = Progress(1, _plan(), stream=out, after_s=60.0)
    for i in range(4):
        p(i)
    p.close()
    assert out.getvalue() == ""


def test_the_line_is_drawn_on_rank_0_of_a_terminal_unless_forced():
    assert wants_progress(True, 5) and not wants_progress(False, 0)
    assert not wants_progress(None, 3)  # only refit rank 0 draws by default
