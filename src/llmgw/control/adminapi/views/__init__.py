"""What the admin API shows of nodes, replicas and models.

The listings and the fleet summary are built from these views and from
nothing else (summary.py), so the two can never disagree: if a GPU is free
in ``ctl nodes`` it is free in ``ctl status``.

One module per subject: ``nodes`` (devices counted by class), ``replicas``,
``models`` (replica counts taken from the replica views, and the desired
count), ``fleet`` (every view as lists, what the listings return) and ``memo``
(views reused between summaries while their inputs are unchanged);
``llmgw.control.gcpause`` pauses garbage collection while views are alive.

Views are plain slotted dataclasses rather than pydantic models, and they are
serialised with orjson. The summary must stay under 50 ms at 2,000 nodes x 8
GPUs; building 16,000 validated pydantic objects alone took ~50 ms on the
project's machines, the same objects as dataclasses ~11 ms. FastAPI still
derives their JSON schema (through pydantic) for the OpenAPI document.

The ``iter_*_views`` builders are generators on purpose. The summary folds
each view into its totals and drops it, so a summary of 2,000 nodes keeps a
handful of objects alive instead of tens of thousands; alive ones would be
promoted by the garbage collector and trigger full collections of the whole
fleet state, which cost 120-300 ms here (measured) and would be the p99.
"""
