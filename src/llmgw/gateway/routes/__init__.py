"""The /v1 POST routes, each an object that owns its whole answer.

* :mod:`.table`: the interface (``Route``) and the table the gateway mounts;
* :mod:`.completion`: chat, completions and embeddings, mended for each
  engine's dialect; :mod:`.chatstream` relays their streams,
  :mod:`.assemble` builds an unstreamed answer from a stream,
  :mod:`.emptystream` asks why a stream ended before its first event;
* :mod:`.passthrough`: the routes not every engine serves (responses,
  rerank, score, audio transcriptions);
* :mod:`.answer`: what they share in answering: a stream's first chunk, a
  whole answer passed on, the way out for a stream; :mod:`.sse`: server-sent
  events passed on whole, their end and usage noted.
"""
