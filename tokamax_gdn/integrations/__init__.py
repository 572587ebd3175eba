"""Drop-in entry points for other frameworks' GDN call sites.

`maxtext`: `jax_chunk_gated_delta_rule`, MaxText's function (signature and
semantics), running on this package's implementations (docs/integrations.md).
`vllm`: `fused_conv1d_gdn`, vLLM TPU's (tpu-inference) fused conv1d + GDN
kernel's signature, running the serving op (docs/serving.md).
"""
