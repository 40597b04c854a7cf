"""Server-less variants over the SQL store (the store is the only shared medium). See ``docs/serverless.md``.

The ledger (FLchain: signed update and aggregate blocks anyone can audit; ``fedasync ledger``):

- :mod:`~fedasync.serverless.flchain`: the chain: block format,
  :class:`~fedasync.serverless.flchain.ChainView` (what peers aggregate from), appending, new
  chains and member blocks;
- :mod:`~fedasync.serverless.ledger_block`: hashing, who may sign (membership) and the one
  per-block check peers and the auditor both run (pure);
- :mod:`~fedasync.serverless.ledger_rule`: the aggregation rule (FedBuff over K update blocks; pure);
- :mod:`~fedasync.serverless.ledger_peer`: one peer (train, append update and aggregate blocks);
- :mod:`~fedasync.serverless.ledger_verify`: the auditor (``fedasync ledger verify``).

Gossip (decentralized asynchronous (DP-)SGD, AD-PSGD / A(DP)²SGD; ``fedasync gossip``):

- :mod:`~fedasync.serverless.gossip`: the averaging step, peers' model rows, measurements;
- :mod:`~fedasync.serverless.topology`: neighbour sets (pure).

Shared by both:

- :mod:`~fedasync.serverless.common`: the config for N peers and the learning task (the client's
  own training code path, evaluation, the DP accountant);
- :mod:`~fedasync.serverless.runs`: a run's rows in the store, its status, the start barrier and
  the peer registry;
- :mod:`~fedasync.serverless.sim`: the deterministic in-process mode on the virtual clock;
- :mod:`~fedasync.serverless.runner`: peer processes and the monitor that starts and stops them;
- :mod:`~fedasync.serverless.processes`: starting and stopping processes by PID;
- :mod:`~fedasync.serverless.report`: summaries, ``history.csv`` and plots, ``ledger show``'s overview.

Imports go one way: ``common`` <- ``runs`` <- chain/gossip modules <- ``report`` <- ``sim``/``runner``.
"""
