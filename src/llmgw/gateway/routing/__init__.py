"""Choosing a replica for one request.

* :mod:`.replica`: a replica as this gateway sees it (address, load, failures);
* :mod:`.measured`: what the gateway measures of a model's replicas;
* :mod:`.prefixindex`: what a prompt looks like to a KV cache (rendering,
  chained block hashes, the bounded index of who holds what);
* :mod:`.policy`: the interface of a policy, and a choice (``Pick``);
  one module per policy behind it: :mod:`.roundrobin`, :mod:`.leastloaded`,
  :mod:`.prefix`;
* :mod:`.router`: one model's router, which narrows the candidates and asks
  the model's policy.

Why the prefix policy chooses as it does, and what was measured: docs/routing.md.
"""
