"""PURE: the write policy every other package reads; it imports only the standard library
and leases' pure model.

The decision (`decision`), what it changes in the store (`plan`, and `batch_plan` for a
group-committed batch) and the records they produce (`records`). The stores, the config,
the HTTP edge and the write route import this package; it imports none of them.
"""
