"""Xid events from the fake NVML: which devices they mark, which they leave alone."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import pynvml
import pytest
from tests.agent.helpers import fake_migs

from llmgw.agent.discovery import inventory_from
from llmgw.agent.discovery.fake import FakeGpu, FakeMig, FakeNvml
from llmgw.agent.discovery.health import LastSeen
from llmgw.agent.discovery.nvml import GPU_IS_LOST, NOT_SUPPORTED, NvmlSource
from llmgw.agent.discovery.xid import (
    DEFAULT_IGNORED_XIDS,
    XidMarks,
    XidWatcher,
    describe,
    ignored_xids_from_env,
    parse_ignored_xids,
)
from llmgw.errors import ConfigError
from llmgw.wire import Device, NodeInventory

# 2026-12-02 14:02:11 UTC
NOW = 1796220131.0


def card(n: int, *, instances: int = 0) -> FakeGpu:
    return FakeGpu(
        uuid=f"GPU-{n}",
        name="NVIDIA A100-SXM4-80GB",
        memory_total_mib=81920,
        mig_mode=(1, 1) if instances else (0, 0),
        migs=fake_migs(n, instances),
    )


Watch = Callable[..., tuple[FakeNvml, XidWatcher, XidMarks]]


@pytest.fixture
def watch() -> Iterator[Watch]:
    started: list[XidWatcher] = []

    def make(
        *gpus: FakeGpu, ignored: frozenset[int] = DEFAULT_IGNORED_XIDS
    ) -> tuple[FakeNvml, XidWatcher, XidMarks]:
        fake = FakeNvml(list(gpus))
        marks = XidMarks()
        watcher = XidWatcher(marks, fake, ignored=ignored, wait_ms=20, clock=lambda: NOW)
        watcher.start()
        started.append(watcher)
        return fake, watcher, marks

    yield make
    for watcher in started:
        watcher.stop()


def inventory(fake: FakeNvml, marks: XidMarks) -> NodeInventory:
    snapshot = NvmlSource(fake).read()
    return inventory_from(snapshot, hostname="n1", cache=LastSeen(), xids=marks)


def by_uuid(inv: NodeInventory) -> dict[str, Device]:
    return {d.uuid: d for d in inv.devices}


def until(condition: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def test_fatal_xid_on_a_whole_gpu_marks_the_card_and_every_instance(watch: Watch) -> None:
    fake, watcher, marks = watch(card(0, instances=3), card(1))
    assert watcher.running and watcher.watched == ["GPU-0", "GPU-1"]
    assert fake.deliver_xid(0, 79) == 1
    until(lambda: bool(marks.card_reasons("GPU-0")))
    devices = by_uuid(inventory(fake, marks))
    expected = (
        "Xid 79 (GPU has fallen off the bus) at 2026-12-02 14:02:11 UTC; "
        "restart the agent after the GPU is fixed"
    )
    for uuid in ("MIG-0-0", "MIG-0-1", "MIG-0-2"):
        assert not devices[uuid].healthy
        assert devices[uuid].unhealthy_reasons == [expected]
    assert devices["GPU-1"].healthy and devices["GPU-1"].unhealthy_reasons == []


def test_fatal_xid_on_a_card_without_mig(watch: Watch) -> None:
    fake, _, marks = watch(card(0))
    fake.deliver_xid(0, 48)
    until(lambda: bool(marks.card_reasons("GPU-0")))
    device = by_uuid(inventory(fake, marks))["GPU-0"]
    assert not device.healthy
    assert device.unhealthy_reasons[0].startswith("Xid 48 (double-bit ECC error) at ")


def test_instance_xid_marks_only_that_instance(watch: Watch) -> None:
    fake, _, marks = watch(card(0, instances=3))
    fake.deliver_xid(0, 94, gpu_instance_id=8, compute_instance_id=0)
    until(lambda: not by_uuid(inventory(fake, marks))["MIG-0-1"].healthy)
    devices = by_uuid(inventory(fake, marks))
    assert devices["MIG-0-1"].unhealthy_reasons == [
        "Xid 94 (contained ECC error) at 2026-12-02 14:02:11 UTC; "
        "restart the agent after the GPU is fixed"
    ]
    assert devices["MIG-0-0"].healthy and devices["MIG-0-2"].healthy


def test_instance_mark_follows_the_mig_uuid_not_the_reused_ids(watch: Watch) -> None:
    fake, _, marks = watch(card(0, instances=2))
    fake.deliver_xid(0, 95, gpu_instance_id=7, compute_instance_id=0)
    until(lambda: not by_uuid(inventory(fake, marks))["MIG-0-0"].healthy)
    # Re-carved: a new instance now holds GI 7; the failed one is gone.
    fake.gpus[0].migs[0] = FakeMig(uuid="MIG-new", profile="1g.10gb", gpu_instance_id=7)
    devices = by_uuid(inventory(fake, marks))
    assert devices["MIG-new"].healthy and devices["MIG-0-1"].healthy


def test_unknown_xid_is_named_by_number(watch: Watch) -> None:
    fake, _, marks = watch(card(0))
    fake.deliver_xid(0, 999)
    until(lambda: bool(marks.card_reasons("GPU-0")))
    assert marks.card_reasons("GPU-0")[0].startswith("Xid 999 at ")
    assert describe(79) == "Xid 79 (GPU has fallen off the bus)"


def test_ignored_xids_change_nothing(watch: Watch) -> None:
    fake, _, marks = watch(card(0, instances=2))
    for xid in sorted(DEFAULT_IGNORED_XIDS):
        fake.deliver_xid(0, xid)
    fake.deliver_xid(0, 31, gpu_instance_id=7, compute_instance_id=0)
    # An Xid that is recorded, sent last: once it shows, the others were seen.
    fake.deliver_xid(0, 79, gpu_instance_id=8, compute_instance_id=0)
    until(lambda: not by_uuid(inventory(fake, marks))["MIG-0-1"].healthy)
    devices = by_uuid(inventory(fake, marks))
    assert devices["MIG-0-0"].healthy and devices["MIG-0-0"].unhealthy_reasons == []
    assert marks.card_reasons("GPU-0") == []
    assert [r.split(" at ")[0] for r in devices["MIG-0-1"].unhealthy_reasons] == [
        "Xid 79 (GPU has fallen off the bus)"
    ]


def test_a_configured_list_replaces_the_default(watch: Watch) -> None:
    fake, _, marks = watch(card(0), ignored=parse_ignored_xids("79"))
    fake.deliver_xid(0, 79)
    fake.deliver_xid(0, 13)
    until(lambda: bool(marks.card_reasons("GPU-0")))
    time.sleep(0.05)
    assert [r.split(" at ")[0] for r in marks.card_reasons("GPU-0")] == [
        "Xid 13 (graphics engine exception)"
    ]


def test_a_repeated_xid_keeps_its_first_report(watch: Watch) -> None:
    fake, watcher, marks = watch(card(0))
    fake.deliver_xid(0, 79)
    until(lambda: bool(marks.card_reasons("GPU-0")))
    watcher.clock = lambda: NOW + 60
    fake.deliver_xid(0, 79)
    fake.deliver_xid(0, 48)
    until(lambda: len(marks.card_reasons("GPU-0")) == 2)
    assert "14:02:11" in marks.card_reasons("GPU-0")[0]


def test_not_supported_registration_is_skipped(
    watch: Watch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "llmgw.agent.xid")
    old = card(0)
    old.fail["nvmlDeviceRegisterEvents"] = NOT_SUPPORTED
    older = card(1)
    older.event_types = 0  # the driver lists no Xid events for it
    fake, watcher, marks = watch(old, older, card(2))
    assert watcher.watched == ["GPU-2"]
    assert "too old for Xid events" in caplog.text
    devices = by_uuid(inventory(fake, marks))
    assert all(d.healthy for d in devices.values())
    assert fake.deliver_xid(0, 79) == 0


def test_other_registration_errors_mark_that_gpu(watch: Watch) -> None:
    denied = card(0, instances=1)
    denied.fail["nvmlDeviceRegisterEvents"] = pynvml.NVML_ERROR_NO_PERMISSION
    fake, watcher, marks = watch(denied, card(1))
    assert watcher.watched == ["GPU-1"]
    devices = by_uuid(inventory(fake, marks))
    assert not devices["MIG-0-0"].healthy
    assert devices["MIG-0-0"].unhealthy_reasons[0].startswith("cannot watch for Xid errors (")
    assert devices["GPU-1"].healthy


def test_a_failing_wait_marks_every_watched_gpu_and_ends_the_watch(watch: Watch) -> None:
    fake, watcher, marks = watch(card(0), card(1))
    fake.wait_error = GPU_IS_LOST
    until(lambda: not watcher.running)
    for uuid in ("GPU-0", "GPU-1"):
        assert marks.card_reasons(uuid)[0].startswith("NVML stopped delivering Xid events (")
    assert fake.event_sets[0].freed and not fake.initialised


def test_the_thread_stops_promptly(watch: Watch) -> None:
    fake, watcher, _ = watch(card(0))
    assert watcher.running
    began = time.monotonic()
    watcher.stop()
    assert time.monotonic() - began < 1.0
    assert not watcher.running
    assert fake.event_sets[0].freed and not fake.initialised
    # Started again (the agent restarted in-process): watches a fresh set.
    assert watcher.start() and len(fake.event_sets) == 2


def test_no_watch_without_nvml() -> None:
    watcher = XidWatcher(XidMarks(), FakeNvml.absent())
    assert watcher.start() is False and not watcher.running
    watcher.stop()


def test_ignored_list_parsing() -> None:
    assert parse_ignored_xids("13, 31,43") == frozenset({13, 31, 43})
    assert parse_ignored_xids("") == frozenset()
    assert ignored_xids_from_env({}) == DEFAULT_IGNORED_XIDS
    assert ignored_xids_from_env({"LLMGW_IGNORED_XIDS": "79"}) == frozenset({79})
    for bad in ("13,abc", "-1", "0", "1.5"):
        with pytest.raises(ConfigError, match=r"LLMGW_IGNORED_XIDS: .* is not an Xid number"):
            parse_ignored_xids(bad)
