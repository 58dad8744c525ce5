"""ASGI callable types and the server's Reply, as the gateway names them (llmgw.http.contract)."""

from __future__ import annotations

from llmgw.http.contract import Message, Receive, Reply, Scope, Send

__all__ = ["Message", "Receive", "Reply", "Scope", "Send"]
