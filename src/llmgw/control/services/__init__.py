"""The control plane's services, one per resource, sharing one core (services.core)."""
