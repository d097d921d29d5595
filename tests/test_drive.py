"""Driving engines beside a push (one helper for ``Sender.push`` and vLLM's
trainer engine), and workers' typed errors across a text-only channel."""

from __future__ import annotations

import json
import threading

import pytest

from reshard.adapters.core.replies import WorkerReply, failure, raise_from_text, with_replies
from reshard.errors import MixedWeightsError, RefitError, ReshardError
from reshard.sender.engines import push_beside

BUDGET_S = 300  # a hang guard: every wait below ends on an event


class Cancel:
    def __init__(self) -> None:
        self.reasons: list[str | None] = []
        self.set = threading.Event()

    def __call__(self, reason: str | None) -> None:
        self.reasons.append(reason)
        if reason is not None:
            self.set.set()


def test_both_sides_run_and_return():
    cancel = Cancel()
    order: list[str] = []

    def drive(pushed: threading.Event) -> str:
        assert pushed.wait(BUDGET_S)  # a two-phase commit waits for the push
        order.append("commit")
        return "drove"

    def push() -> str:
        order.append("push")
        return "pushed"

    assert push_beside(push, drive, cancel=cancel) == ("pushed", "drove")
    assert order == ["push", "commit"]
    assert cancel.reasons == [None]  # a reason left by an earlier refit is cleared


def test_a_failed_drive_cancels_the_push_and_its_error_wins():
    cancel = Cancel()

    def drive(_pushed: threading.Event) -> None:
        raise RefitError("join", {4: "worker 4 never joined"})

    def push() -> None:
        # The push fails because the drive cancelled it (as the session does).
        assert cancel.set.wait(BUDGET_S)
        raise RefitError("join", {0: "cancelled: " + str(cancel.reasons[-1])})

    with pytest.raises(RefitError, match="worker 4 never joined") as e:
        push_beside(push, drive, cancel=cancel)
    assert isinstance(e.value.__cause__, RefitError) and "cancelled" in str(e.value.__cause__)
    assert cancel.reasons[-1] is not None and "the engines failed" in cancel.reasons[-1]


def test_a_failed_push_alone_raises_its_own_error_after_the_drive_ends():
    drove = threading.Event()

    def drive(pushed: threading.Event) -> None:
        assert pushed.wait(BUDGET_S)
        drove.set()

    def push() -> None:
        raise ValueError("bad layout")

    with pytest.raises(ValueError, match="bad layout"):
        push_beside(push, drive, cancel=Cancel())
    assert drove.is_set()  # the driver was joined before the error


def _mixed_replies() -> list[WorkerReply]:
    err = MixedWeightsError("apply", {5: "refit failed after 2 of 4 layers took the new weights"}, version=3)
    return [failure(err, rank=0), failure(RuntimeError("peer died"), rank=1)]


@pytest.mark.parametrize("channel", ["message", "executor", "http-json"])
def test_workers_typed_errors_survive_a_text_only_channel(channel):
    text = with_replies("reshard: update_weights failed; no worker keeps an update session open", _mixed_replies())
    if channel == "executor":  # vLLM's multiprocess executor quotes the worker's error
        text = f"Worker failed with error '{text}', please check the stack trace above for the root cause"
    elif channel == "http-json":  # an HTTP error body
        text = json.dumps({"error": {"message": text, "type": "Internal Server Error", "code": 500}})
    with pytest.raises(MixedWeightsError) as e:
        raise_from_text(text, "update_weights")
    assert e.value.step == "apply" and 5 in e.value.errors and 1 in e.value.errors


def test_a_refit_error_stays_a_refit_error_and_plain_text_is_left_alone():
    replies = [failure(RefitError("plan", {2: "no source holds box [0:4]"}, agreed=True), rank=0)]
    with pytest.raises(RefitError) as e:
        raise_from_text(with_replies("failed", replies), "update_weights")
    assert not isinstance(e.value, MixedWeightsError) and e.value.step == "plan"
    raise_from_text("Internal Server Error", "update_weights")  # nothing to decode: returns
    raise_from_text("reshard-replies: [not json", "update_weights")
    with pytest.raises(ReshardError, match="failed on 1 worker"):
        raise_from_text(with_replies("x", [failure(OSError("disk"), rank=0)]), "init")


# -- the worker side, typed ----------------------------------------------------------


def _refit_stats():
    from reshard.transport.stats import ExecStats, RefitStats

    ex = ExecStats(rank=5, bytes_received=64, dense_peers={0: "no base yet"})
    return RefitStats(refit=3, rank=5, exec=ex, plan_seconds=0.1, agree_seconds=0.0, total_seconds=1.0, round_bytes=8)


def test_a_workers_account_is_built_in_one_place_and_decoded_strictly():
    """The worker builds its account from its refit session and what its
    engine did; the trainer decodes it strictly: nothing a worker reports
    is dropped on the way (as seven keys were), and a key the type does not
    know is refused by name."""
    import msgspec

    from reshard.sender.engines import EngineStats

    sent = EngineStats.of_refit(_refit_stats(), kept_bytes=64, layers_direct=2, lifecycle_seconds={"begin": 0.5})
    # Through JSON, as vLLM's HTTP server carries it (integer keys become strings).
    reply = WorkerReply.parse(
        json.loads(json.dumps(WorkerReply(ok=True, rank=5, stats=sent.to_builtins()).to_builtins()))
    )
    got = EngineStats.of(reply)
    assert got == sent
    assert (got.rank, got.refit, got.bytes_received, got.dense_peers) == (5, 3, 64, {0: "no base yet"})
    assert got.layers_direct == 2 and got.lifecycle_seconds == {"begin": 0.5}
    with pytest.raises(msgspec.ValidationError, match="unknown field `layers_zapped`"):
        EngineStats.of(WorkerReply(ok=True, rank=5, stats={**sent.to_builtins(), "layers_zapped": 1}))
    with pytest.raises(TypeError, match="layers_zapped"):
        EngineStats.of_refit(_refit_stats(), layers_zapped=1)


def test_the_engine_receivers_declare_one_protocol():
    from reshard.adapters.sglang.receiver import SglangReceiver
    from reshard.adapters.vllm.receiver import VllmReceiver
    from reshard.receiver import EngineReceiver

    for cls in (VllmReceiver, SglangReceiver):
        assert EngineReceiver in cls.__mro__
        assert {"pull", "kept_bytes", "close"} <= set(dir(cls))
