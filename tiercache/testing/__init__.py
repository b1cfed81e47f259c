"""What tests need from tiercache, shipped with it so that other projects' tests can use it too.

* :mod:`tiercache.testing.tier_suite` — the conformance suite of the tier contract: a new tier (or a
  wrapper around one) gets the whole contract checked by writing one fixture. Needs pytest.
* :mod:`tiercache.testing.faults` — a tier wrapper that injects errors, latency and "disk full".
* :mod:`tiercache.testing.checkpoints` — tiny seeded model checkpoints for engine tests and
  benchmarks (imports torch and transformers inside its functions).
* :mod:`tiercache.testing.poll` — wait for a condition by polling, never by a blind sleep.

Nothing here is imported by the product, and importing this package imports none of them.
"""
