"""llmgw doctor against a stand-in nvidia-smi and a fake NVML."""

from __future__ import annotations

import io
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

import pynvml
import pytest
from rich.console import Console
from tests.agent.discovery.smi_helpers import fixture_stand_in, list_text, xml_bytes
from typer.testing import CliRunner

from llmgw.agent.discovery.devices import NOTHING_CARVED
from llmgw.agent.discovery.fake import FakeGpu, FakeNvml, fake_from_cards
from llmgw.agent.discovery.nvidia_smi import join
from llmgw.agent.discovery.smi_list import parse_list
from llmgw.agent.discovery.smi_xml import parse_xml
from llmgw.cli.doctor import app, find_engines, run_doctor
from llmgw.wire import Device

LLAMA_ONLY: dict[str, str | None] = {
    "vllm": None,
    "sglang": None,
    "llamacpp": "python module llama_cpp",
}
VLLM_ONLY: dict[str, str | None] = {"vllm": "/usr/bin/vllm", "sglang": None, "llamacpp": None}
NOTHING: dict[str, str | None] = {"vllm": None, "sglang": None, "llamacpp": None}


def doctor(
    tmp_path: Path,
    *,
    fixture: str | None = None,
    nvml: FakeNvml | None = None,
    engines: dict[str, str | None] = LLAMA_ONLY,
    json_out: bool = True,
    **kwargs: Any,
) -> tuple[int, Any]:
    smi = str(fixture_stand_in(tmp_path / "smi", fixture)) if fixture else str(tmp_path / "none")
    out = io.StringIO()
    code = run_doctor(
        json_out,
        kwargs.pop("data_dir", tmp_path / "data"),
        kwargs.pop("control_plane", None),
        nvml=nvml or FakeNvml.absent(),
        nvidia_smi=smi,
        engines=lambda: dict(engines),
        console=Console(file=out, width=200),
        **kwargs,
    )
    text = out.getvalue()
    return code, json.loads(text) if json_out else text


def test_mig_node_shows_cards_mode_and_instances(tmp_path: Path) -> None:
    code, report = doctor(tmp_path, fixture="telegraf-a100-sxm4-80gb-mig-v12.xml")
    assert code == 0 and report["can_run"] is True
    assert report["driver_version"] == "535.54.03" and report["cuda_version"] == "12.2"
    assert report["nvml"]["answered"] is False
    assert report["nvidia_smi"] == {"answered": True, "detail": "1 GPU(s)"}
    (card,) = report["cards"]
    assert card["mode"] == "MIG" and card["healthy"] is True
    assert card["instances"] == [f"0/mig{i} a100-80g-mig-1g.20gb" for i in range(4)]
    assert [d["label"] for d in report["devices"]] == ["0/mig0", "0/mig1", "0/mig2", "0/mig3"]
    assert report["warnings"] == []


def test_mig_enabled_with_nothing_carved_cannot_run(tmp_path: Path) -> None:
    code, report = doctor(tmp_path, fixture="synthetic-a100-80gb-mig-empty-and-pending.xml")
    assert code == 1 and report["can_run"] is False
    assert [c["mode"] for c in report["cards"]] == ["MIG", "whole card; MIG on after a GPU reset"]
    text = "\n".join(report["warnings"])
    assert "GPU 0: MIG mode is enabled but no instances are carved" in text
    assert "GPU 1: MIG mode change pending" in text
    assert "no GPU can take work" in text


@pytest.mark.parametrize("source", ["nvidia-smi", "nvml"])
def test_mig_card_without_a_pending_mode_is_shown_out_of_placement(
    tmp_path: Path, source: str
) -> None:
    name = "synthetic-a100-80gb-mig-no-pending.xml"

    def run(json_out: bool) -> tuple[int, Any]:
        if source == "nvml":
            cards = join(parse_list(list_text(name)), parse_xml(xml_bytes(name)).cards)
            return doctor(tmp_path, nvml=fake_from_cards(cards), json_out=json_out)
        return doctor(tmp_path, fixture=name, json_out=json_out)

    _, text = run(json_out=False)
    assert "no: MIG mode is enabled but no" in text  # the Devices table's Placeable column
    code, report = run(json_out=True)
    assert code == 0 and report["can_run"] is True  # card 0's instances can
    assert [c["mode"] for c in report["cards"]] == ["MIG", "MIG"]
    assert report["cards"][1]["instances"] == []
    empty = report["devices"][-1]
    assert (empty["label"], empty["gpu_class"], empty["placeable"]) == ("1", "a100-80g", False)
    assert empty["unplaceable_reason"] == NOTHING_CARVED
    assert f"GPU 1: {NOTHING_CARVED}" in report["warnings"]


def test_every_gpu_unhealthy_cannot_run(tmp_path: Path) -> None:
    sick = [
        FakeGpu(
            uuid=f"GPU-{n}", name="NVIDIA L4", memory_total_mib=23034, ecc_volatile_uncorrected=1
        )
        for n in range(2)
    ]
    code, report = doctor(tmp_path, nvml=FakeNvml(sick))
    assert code == 1
    assert report["nvml"]["answered"] is True and report["driver_version"] == "550.90.07"
    assert "every GPU is unhealthy: nothing can run on this node" in report["warnings"]
    assert [c["healthy"] for c in report["cards"]] == [False, False]


def test_one_sick_gpu_among_good_ones_still_runs(tmp_path: Path) -> None:
    code, report = doctor(tmp_path, fixture="synthetic-h100-unhealthy.xml", engines=VLLM_ONLY)
    assert code == 0
    assert sum("is unhealthy" in w for w in report["warnings"]) == 3


def test_no_engine_installed_cannot_run(tmp_path: Path) -> None:
    code, report = doctor(tmp_path, engines=NOTHING)
    assert code == 1 and any("no inference engine" in w for w in report["warnings"])
    assert [d["gpu_class"] for d in report["devices"]] == ["cpu"]


def test_cpu_node_with_only_gpu_engines_cannot_run(tmp_path: Path) -> None:
    code, report = doctor(tmp_path, engines=VLLM_ONLY)
    assert code == 1 and any("only GPU engines" in w for w in report["warnings"])


def test_cpu_only_machine_with_llama_cpp_importable_can_run(tmp_path: Path) -> None:
    found = find_engines()
    code, report = doctor(tmp_path, engines=found)
    assert report["nvml"]["answered"] is False and report["nvidia_smi"]["answered"] is False
    assert code == (0 if found["llamacpp"] else 1)


def test_unwritable_data_dir_cannot_run(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code, report = doctor(tmp_path, data_dir=blocker / "data")
    assert code == 1 and report["data_dir"]["writable"] is False
    assert any("data dir" in w and "cannot be created" in w for w in report["warnings"])


def test_existing_data_dir_is_probed(tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    code, report = doctor(tmp_path)
    assert code == 0 and report["data_dir"]["detail"] == "writable"
    assert list((tmp_path / "data").iterdir()) == []  # the probe cleans up


@pytest.fixture
def control_plane() -> Iterator[str]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(404)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_reachable_control_plane(tmp_path: Path, control_plane: str) -> None:
    code, report = doctor(tmp_path, control_plane=control_plane)
    assert code == 0 and report["control_plane"]["reachable"] is True
    assert report["control_plane"]["detail"] == "HTTP 404"  # it answered: that is enough


def test_unreachable_control_plane_cannot_run(tmp_path: Path) -> None:
    code, report = doctor(tmp_path, control_plane="http://127.0.0.1:9")
    assert code == 1 and report["control_plane"]["reachable"] is False
    assert any("control plane http://127.0.0.1:9 is unreachable" in w for w in report["warnings"])
    code, report = doctor(tmp_path, control_plane="ftp://x")
    assert code == 1 and "not an http" in report["control_plane"]["detail"]


def test_memory_held_by_processes_llmgw_did_not_start(tmp_path: Path) -> None:
    code, report = doctor(
        tmp_path, fixture="synthetic-h200-mig-ci-split-processes.xml", started_pids={4242}
    )
    assert code == 0
    assert [(p["device"], p["pid"]) for p in report["foreign_processes"]] == [
        ("0/mig2", 5151),
        ("1", 777),
    ]
    assert report["foreign_memory_mib"] == 29990 + 2048
    assert any("32038 MiB of GPU memory is held by 2 process(es)" in w for w in report["warnings"])


def test_table_for_people(tmp_path: Path) -> None:
    code, text = doctor(tmp_path, fixture="telegraf-a100-sxm4-80gb-mig-v12.xml", json_out=False)
    assert code == 0
    for expected in ("Cards", "0/mig3", "a100-80g-mig-1g.20gb", "MIG", "this node can run"):
        assert expected in text
    code, text = doctor(tmp_path, engines=NOTHING, json_out=False)
    assert code == 1 and "nothing can run on this node" in text and "warning:" in text


def test_devices_in_json_are_wire_devices(tmp_path: Path) -> None:
    _, report = doctor(tmp_path, fixture="synthetic-h200-mig-ci-split-processes.xml")
    devices = [Device.model_validate(d) for d in report["devices"]]
    assert devices[0].mig is not None and devices[0].utilization_pct is None


def test_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_library() -> None:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)

    monkeypatch.setattr(pynvml, "nvmlInit", no_library)
    exe = fixture_stand_in(tmp_path / "smi", "netdata-a100-sxm4-40gb-mig-510-v11.xml")
    monkeypatch.setenv("LLMGW_NVIDIA_SMI", str(exe))
    result = CliRunner().invoke(app, ["--json", "--data-dir", str(tmp_path / "d")])
    report = json.loads(result.stdout)
    assert report["cards"][0]["instances"] == [
        "0/mig0 a100-40g-mig-3g.20gb",
        "0/mig1 a100-40g-mig-3g.20gb",
    ]
    assert result.exit_code == (0 if any(find_engines().values()) else 1)
