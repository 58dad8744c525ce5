"""llmgw: a self-hosted LLM gateway and GPU fleet manager."""

__version__ = "0.1.0"
