"""What each answer is metered with, from the engine's bytes to the store's rows.

* :mod:`.usage`: usage as engines report it, found in an answer without
  parsing the rest, in any route's shape;
* :mod:`.tally` and :mod:`.counter`: for engines that report no usage in
  streams, the text a stream delivered and its exact count, made with the
  engine's own tokenizer (:mod:`.tokenizer`: the only network calls here);
* :mod:`.account`: one answer's usage charged to its key (tokens per
  minute), its model's counters and the usage rows;
* :mod:`.batcher`: the rows per key, model and minute, sent in batches.
"""
