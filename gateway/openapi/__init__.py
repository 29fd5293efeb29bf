"""The OpenAPI documents, assembled above everything they describe.

The write route, the lease API and the admin API each declare their shapes and
refusals; this package reads them and imports nothing from above it.
"""
