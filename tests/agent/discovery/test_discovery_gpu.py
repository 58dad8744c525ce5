"""On a real NVIDIA machine: both sources, doctor, and captures kept as fixtures.

Runs only where a GPU is lent (marker ``gpu``); elsewhere it skips, saying so.
It reads and never changes the GPUs (MIG mode included). The raw outputs go to
the test output dir so they can be added to tests/fixtures/nvidia-smi/.
"""

from __future__ import annotations

import io
import json
import shutil
import subprocess
from pathlib import Path

import pynvml
import pytest
from rich.console import Console

from llmgw.agent.discovery import LastSeen, discover
from llmgw.agent.discovery.fake import FakeNvml
from llmgw.cli.doctor import run_doctor
from llmgw.wire import NodeInventory

pytestmark = pytest.mark.gpu


def _nvml_answers() -> bool:
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return False
    pynvml.nvmlShutdown()
    return True


@pytest.fixture
def real_gpu() -> str:
    smi = shutil.which("nvidia-smi")
    if smi is None or not _nvml_answers():
        pytest.skip("no NVIDIA GPU with a working driver on this machine")
    return smi


def test_both_sources_agree_on_real_hardware(real_gpu: str, test_output: Path) -> None:
    captures = test_output / "nvidia-smi-captures"
    captures.mkdir(parents=True, exist_ok=True)
    for name, args in (("L.txt", ["-L"]), ("q-x.xml", ["-q", "-x"]), ("q.txt", ["-q"])):
        done = subprocess.run([real_gpu, *args], capture_output=True, timeout=60, check=True)
        (captures / name).write_bytes(done.stdout)

    via_nvml = discover(nvidia_smi="/nonexistent/nvidia-smi", cache=LastSeen())
    via_smi = discover(nvml=FakeNvml.absent(), nvidia_smi=real_gpu, cache=LastSeen())
    (captures / "inventory-nvml.json").write_text(via_nvml.model_dump_json(indent=2))
    (captures / "inventory-nvidia-smi.json").write_text(via_smi.model_dump_json(indent=2))

    assert via_nvml.source == "nvml" and via_smi.source == "nvidia-smi"
    assert via_nvml.devices and via_nvml.driver_version == via_smi.driver_version

    def shape(inv: NodeInventory) -> list[tuple[str, str, str, bool]]:
        return [(d.label, d.uuid, d.gpu_class, d.placeable) for d in inv.devices]

    assert shape(via_nvml) == shape(via_smi)
    for device in via_nvml.devices:
        assert device.memory_total_mib > 0
        if device.mig is not None:
            assert device.utilization_pct is None


def test_doctor_on_real_hardware(real_gpu: str, tmp_path: Path, test_output: Path) -> None:
    out = io.StringIO()
    code = run_doctor(True, tmp_path / "data", None, console=Console(file=out))
    (test_output / "nvidia-smi-captures").mkdir(parents=True, exist_ok=True)
    (test_output / "nvidia-smi-captures" / "doctor.json").write_text(out.getvalue())
    report = json.loads(out.getvalue())
    assert report["nvml"]["answered"] and report["nvidia_smi"]["answered"]
    assert report["cards"] and code in (0, 1)
    assert code == (0 if report["can_run"] else 1)
