"""Prefill-decode disaggregation: prompts computed on one worker, their output decoded on another.

smg (``--pd-disaggregation --prefill URL BOOTSTRAP_PORT --decode URL``) sends each request to a
prefill worker and a decode worker at once, with SGLang's bootstrap fields: the prefill worker's
host and bootstrap port, and a random room number naming the request on both.

- The decode worker matches the prompt against its own radix tree, reserves slots for the rest,
  and asks the prefill worker's bootstrap port for the KV of the room from the end of its match
  (``wire.KVWant``).  ``decode.DecodeSide``.
- The prefill worker computes the prompt as any request (the radix cache saves what it holds),
  samples the first token, and sends the KV the decode worker asked for with that token
  (``wire.KVData`` and one binary frame of ``KVPool.gather``'s layout); it keeps the request's KV
  locked until the decode worker acknowledges (``wire.KVAck``), then answers its own client
  with the one token.  ``prefill.PrefillSide``.
- The decode worker writes the KV into the reserved slots, inserts the prompt into its tree (its
  next turn hits there), takes the first token as if it had sampled it, and decodes.

Transfer: ZeroMQ over TCP (a ROUTER on the prefill's bootstrap port, a DEALER per prefill worker
on the decode side), or with ``--disaggregation-transfer-backend nixl`` on both, a NIXL write
from the prefill worker's pool straight into the decode worker's slots (``nixl.py``).  Every
failure ends the request on both sides with an error and frees its slots: a timeout
(``--disaggregation-timeout``), a peer that goes away (the decode side watches its connections;
the prefill side cannot route to a gone peer), a room already in use, prompts that differ, KV
layouts that differ.  ``scheduler.DisaggScheduler`` joins this to the step loop.
"""
