"""The admin API's routers, one per resource; adminapi.routes mounts them in order."""
