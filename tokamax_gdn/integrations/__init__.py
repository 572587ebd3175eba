"""Drop-in entry points for other frameworks' GDN call sites.

`maxtext`: `jax_chunk_gated_delta_rule`, MaxText's function (signature and
semantics), running on this package's implementations (docs/integrations.md).
"""
