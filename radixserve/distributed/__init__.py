"""Tensor parallelism over ``torch.distributed`` (gloo on a CPU, NCCL on GPUs).

One server with ``--tp-size N`` runs N model ranks.  Rank 0 is the scheduler process: it
alone owns the queue, the radix tree, the page allocator and the sampler, and it decides
every step.  Ranks 1..N-1 are worker processes that hold their shard of the weights and of
the KV pool and run the forward they are told to run.

Why rank 0 decides and sends, rather than every rank running the same scheduler on the same
inputs: the scheduler's decisions depend on things that are not inputs at all — when a
grammar finished compiling on its thread, how long a step took (chunk sizes, the poller),
the wall clock (priorities, timeouts, LRU ages), which request a client dropped mid-step.
Replaying those identically on N processes is a standing source of divergence bugs; one
decision sent to everyone cannot diverge.  The cost is one small message per step (the
batch's token ids, lengths and KV slots, see :mod:`radixserve.distributed.step_message`),
sent over ZeroMQ so that an idle worker waits on a socket, never inside a collective that
would time out.

What each rank holds (:mod:`radixserve.distributed.layers`):
- attention: its share of the KV heads (replicated when there are fewer KV heads than
  ranks) and the query heads that read them; q/k/v column-parallel, o_proj row-parallel;
- MLP: gate/up column-parallel, down row-parallel;
- the embedding and the LM head split over the vocabulary.
Each layer ends in one all-reduce (after o_proj and after down_proj); the logits are
gathered to rank 0, which samples.
"""



class TensorParallelError(RuntimeError):
    """A collective failed: a rank is gone or the group is broken.  The server cannot go on.

    Defined here, without importing torch, so that the launcher side can name it."""
