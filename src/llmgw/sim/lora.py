"""The simulated engine's LoRA adapters and sleep mode, routed as vLLM routes them.

Adapters (``SimParams.max_loras`` above 0, as vLLM with ``--enable-lora``):
``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}`` takes
``lora_load_s`` and fills one of ``max_loras`` slots; 400 when the name is
loaded already, when no slot is free, or when the adapter's rank (its
``adapter_config.json``'s ``r``, where the path holds one) is above
``max_lora_rank``. ``POST /v1/unload_lora_adapter`` ``{"lora_name"}`` takes
``lora_unload_s``; 404 for a name not loaded. A completion naming a loaded
adapter is served (its answer's ``model`` is the adapter's name); one naming
an adapter not loaded gets vLLM's 404. ``GET /v1/models`` lists each loaded
adapter with its ``parent`` and ``root``.

Sleep (``SimParams.sleep_s`` set, as vLLM with ``--enable-sleep-mode`` and
``VLLM_SERVER_DEV_MODE=1``): ``POST /sleep?level=1`` takes ``sleep_s``, after
which completions get 503 until ``POST /wake_up`` (``wake_s``) returns;
``GET /is_sleeping`` answers ``{"is_sleeping": bool}``. Loaded adapters stay
loaded across a sleep, as vLLM keeps its LoRA manager.

Every duration is multiplied by ``time_factor``, as the engine's others are.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from aiohttp import web

from llmgw.errors import ValidationError
from llmgw.sim.responses import error, json_response, read_json
from llmgw.wire import SimParams


def adapter_rank(path: str) -> int | None:
    """The rank in a PEFT adapter directory's ``adapter_config.json``; None: not there."""
    try:
        config = json.loads((Path(path) / "adapter_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    rank = config.get("r") if isinstance(config, dict) else None
    return rank if isinstance(rank, int) else None


async def adapter_fields(request: web.Request) -> dict[str, Any] | web.Response:
    """The load and unload routes' body: its fields (none when it is not a JSON object,
    whose fields are then missing), or the 400 answer to a body that is not JSON."""
    try:
        body = await read_json(request)
    except ValidationError as exc:
        return error(400, str(exc), "invalid_request_error", None)
    return body if isinstance(body, dict) else {}


class LoraRoutes:
    def __init__(self, model: str, params: SimParams) -> None:
        self.model = model
        self.params = params
        # Name -> path, in load order.
        self.loaded: dict[str, str] = {}
        self.sleeping = False
        self.loads = 0
        self.unloads = 0
        # One change at a time, as vLLM serialises its adapter and sleep calls.
        self._lock = asyncio.Lock()

    def mount(self, app: web.Application) -> None:
        if self.params.max_loras > 0:
            app.router.add_post("/v1/load_lora_adapter", self._load)
            app.router.add_post("/v1/unload_lora_adapter", self._unload)
        if self.params.sleep_s is not None:
            app.router.add_post("/sleep", self._sleep)
            app.router.add_post("/wake_up", self._wake)
            app.router.add_get("/is_sleeping", self._is_sleeping)

    def serves(self, model: str) -> bool:
        return model == self.model or model in self.loaded

    def cards(self, created: int) -> list[dict[str, object]]:
        return [
            {"id": name, "object": "model", "created": created, "owned_by": "llmgw-sim",
             "root": path, "parent": self.model}
            for name, path in self.loaded.items()
        ]  # fmt: skip

    async def _pause(self, seconds: float) -> None:
        await asyncio.sleep(seconds * self.params.time_factor)

    async def _load(self, request: web.Request) -> web.Response:
        body = await adapter_fields(request)
        if isinstance(body, web.Response):
            return body
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str):
            return error(400, "lora_name and lora_path are required", "invalid_request_error",
                         None)  # fmt: skip
        async with self._lock:
            if name in self.loaded:
                return error(400, f"The lora adapter '{name}' has already been loaded.",
                             "invalid_request_error", None)  # fmt: skip
            if len(self.loaded) >= self.params.max_loras:
                return error(400, f"no free adapter slot: {self.params.max_loras} loaded",
                             "invalid_request_error", None)  # fmt: skip
            rank = adapter_rank(path)
            if rank is not None and rank > self.params.max_lora_rank:
                return error(400, f"LoRA rank {rank} is greater than max_lora_rank"
                             f" {self.params.max_lora_rank}.", "invalid_request_error", None)
            await self._pause(self.params.lora_load_s)
            self.loaded[name] = path
            self.loads += 1
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def _unload(self, request: web.Request) -> web.Response:
        body = await adapter_fields(request)
        if isinstance(body, web.Response):
            return body
        name = body.get("lora_name")
        async with self._lock:
            if not isinstance(name, str) or name not in self.loaded:
                return error(404, f"The lora adapter '{name}' cannot be found.",
                             "not_found_error", None)  # fmt: skip
            await self._pause(self.params.lora_unload_s)
            del self.loaded[name]
            self.unloads += 1
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")

    async def _sleep(self, request: web.Request) -> web.Response:
        async with self._lock:
            if not self.sleeping:
                await self._pause(self.params.sleep_s or 0.0)
                self.sleeping = True
        return web.Response(status=200)

    async def _wake(self, request: web.Request) -> web.Response:
        async with self._lock:
            if self.sleeping:
                await self._pause(self.params.wake_s)
                self.sleeping = False
        return web.Response(status=200)

    async def _is_sleeping(self, request: web.Request) -> web.Response:
        return json_response({"is_sleeping": self.sleeping})
