"""The agent's assignment convergence, as state + pure step + thin executor.

* :mod:`.state` — the plain records: one :class:`~.state.Record` per assignment key, the
  constants of the rules (retry back-off, drain time, failure reasons). Pure.
* :mod:`.step` — every decision, a plain function over those records and an observation of the
  serving core at ``now`` (one injected clock). Pure; table-tested in
  ``tests/test_convergence_step.py``.
* :mod:`.follow` — follows the node's assignment keys in etcd into the records (the one module
  that reads the store).
* :mod:`.runtime`, :mod:`.reports`, :mod:`.keytask`, :mod:`.unload`, :mod:`.load`,
  :mod:`.demand` — the executor:
  they gather observations, call the decisions and carry out what they say (reports, downloads,
  loads, unloads, evictions); :class:`node_agent.controller.Controller` wires them together.

Nothing is imported here, so importing the pure modules pulls in no I/O.
"""
