"""Server-less variants over the SQL store (the store is the only shared medium).

- :mod:`fedasync.serverless.flchain`: FLchain, a ledger of signed update and aggregate blocks
  that anyone can audit (``fedasync ledger run|peer|verify|show``);
- :mod:`fedasync.serverless.gossip`: decentralized asynchronous (DP-)SGD, AD-PSGD / A(DP)²SGD
  (``fedasync gossip run|peer``);
- :mod:`fedasync.serverless.topology`: gossip neighbour sets (pure);
- :mod:`fedasync.serverless.sim`: the deterministic in-process mode on the virtual clock;
- :mod:`fedasync.serverless.runner`: peer processes and the monitor that starts and stops them.

See ``docs/serverless.md``.
"""
