"""Which engines can sleep, as the catalog starts them: read alike by the control plane
(which decides who sleeps, control.sleep) and the agent (which puts them to sleep, agent.loras).

Two kinds of sleep:

- vLLM's sleep mode (``--enable-sleep-mode``, CUDA and ROCm builds only:
  vllm/platforms/interface.py ``is_sleep_mode_available``) and the simulator's
  are commanded: ``POST /sleep`` moves the weights to host RAM, ``/wake_up``
  brings them back.
- llama-server sleeps by itself (``--sleep-idle-seconds N``): after N idle
  seconds it frees the model, weights and KV cache alike, and the next request
  that needs the model reloads it from its file before it is answered
  (tools/server/server-queue.cpp, start_loop). No route puts it to sleep: the
  agent watches ``GET /props`` (``is_sleeping``) and wakes it with a request.
"""

from __future__ import annotations

from llmgw.memory import flag_value
from llmgw.wire import EngineKind, ModelSpec

LLAMA_SERVER_IDLE_FLAG = "--sleep-idle-seconds"


def can_sleep(spec: ModelSpec) -> bool:
    """Whether the model's engine is started able to sleep."""
    if spec.engine is EngineKind.SIM:
        return spec.sim is not None and spec.sim.sleep_s is not None
    if spec.engine is EngineKind.VLLM:
        args = [a.replace("_", "-") for a in spec.engine_args]
        return "--enable-sleep-mode" in args
    return sleeps_by_itself(spec)


def sleeps_by_itself(spec: ModelSpec) -> bool:
    """A llama-server started to sleep after some idle seconds (-1 turns it off)."""
    if spec.engine is not EngineKind.LLAMA_SERVER:
        return False
    args = [a.replace("_", "-") if a.startswith("--") else a for a in spec.engine_args]
    value = flag_value(args, (LLAMA_SERVER_IDLE_FLAG,))
    try:
        return value is not None and int(value) > 0
    except ValueError:
        return False
