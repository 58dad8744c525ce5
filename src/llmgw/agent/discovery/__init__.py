"""GPU discovery for the agent: what a node has, as placeable devices.

Entry points other parts use:

* :func:`discover` -> :class:`llmgw.wire.NodeInventory` (NVML, else
  nvidia-smi, else CPU slots);
* :func:`llmgw.agent.discovery.pinning.engine_env` -> the environment that
  pins an engine process to its devices;
* :func:`llmgw.agent.discovery.devices.memory_totals` -> node memory with
  shared MIG pools counted once.

Layout: ``base`` (facts and the Source protocol), ``nvml`` and ``nvidia_smi``
(+ ``smi_list``/``smi_xml`` parsers) the two sources, ``fake`` a fake NVML,
``devices`` the MIG rules, ``classes`` the class naming rule, ``health``
health and wear, ``inventory`` the ``discover()`` entry point, ``xid`` the
thread that marks GPUs hit by Xid errors.
"""

from llmgw.agent.discovery.health import LastSeen
from llmgw.agent.discovery.inventory import cpu_devices, discover, inventory_from
from llmgw.agent.discovery.nvml import NvmlApi
from llmgw.agent.discovery.xid import NvmlEventsApi, XidMarks, XidWatcher, ignored_xids_from_env

__all__ = [
    "LastSeen",
    "NvmlApi",
    "NvmlEventsApi",
    "XidMarks",
    "XidWatcher",
    "cpu_devices",
    "discover",
    "ignored_xids_from_env",
    "inventory_from",
]
