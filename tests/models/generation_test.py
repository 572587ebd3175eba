"""Generation against the full forward: greedy `generate` (ragged prefill of
prompts of different lengths, then one token per request per step through the
serving op's state pools and the KV cache) and mixed / continuation `step`
calls with padding give every token the logits `models.forward` gives it on
the whole sequence."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tokamax_gdn import layers
from tokamax_gdn import models
from tokamax_gdn.models.generation import GenerationCache, generate, init_cache, step  # pylint: disable=g-multiple-import
from tokamax_gdn.testing.specs import rel_rms, tolerance

GDN = layers.GatedDeltaNetConfig(hidden_size=32, num_k_heads=2, num_v_heads=4, head_k_dim=16,
                                 head_v_dim=16)
# Two periods of (GDN, attention): two pools of each kind.
CFG = models.ModelConfig(gdn=GDN, num_layers=4, full_attention_interval=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=24, vocab_size=16)
TOL = tolerance(jnp.float32, grad=False)


def _params(seed=0):
  """Random params with the mixers' matrices 5x their init (so that the GDN
  and attention outputs weigh in the logits as much as the embedding) and
  norm weights away from 0."""
  p = models.init_params(jax.random.key(seed), CFG)
  rng = np.random.default_rng(seed + 1)

  def perturb(path, a):
    name = str(path[-1])
    if "norm" in name:
      return a + jnp.asarray(0.1 * rng.standard_normal(a.shape), a.dtype)
    if any(s in name for s in ("proj",)):
      return 5.0 * a
    return a
  return jax.tree_util.tree_map_with_path(perturb, p)


def _forward(params, sequences, implementation):
  """models.forward on each sequence (right-padded into one batch: the model
  is causal and the MoE dropless, so padding changes no earlier logit)."""
  t = max(len(s) for s in sequences)
  batch = np.zeros((len(sequences), t), np.int32)
  for i, s in enumerate(sequences):
    batch[i, :len(s)] = s
  logits, _ = models.forward(params, jnp.asarray(batch), CFG, implementation=implementation,
                             remat=False)
  return [logits[i, :len(s)] for i, s in enumerate(sequences)]


@pytest.mark.parametrize("implementation", ["xla", "reference"])
def test_generate_logits_equal_forward(implementation):
  params = _params()
  rng = np.random.default_rng(0)
  prompts = [rng.integers(0, CFG.vocab_size, n) for n in (5, 1, 9)]
  new = 4
  forced = np.full((3, new), -1, np.int32)
  forced[1, 2] = 7            # a given token mid-generation (e.g. the next question)
  tokens, logits = generate(params, prompts, CFG, new, implementation=implementation,
                            forced=forced)
  assert tokens.shape == (3, new) and logits.shape == (3, new, CFG.vocab_size)
  tokens = np.asarray(tokens)
  np.testing.assert_array_equal(
      tokens, np.where(forced >= 0, forced, np.asarray(jnp.argmax(logits, axis=-1))))
  sequences = [np.concatenate([p, tokens[r, :-1]]) for r, p in enumerate(prompts)]
  want = _forward(params, sequences, implementation)
  for r, p in enumerate(prompts):
    err = rel_rms(logits[r], want[r][len(p) - 1:])
    assert err < TOL, (r, err)


def test_step_mixed_continuation_and_padding():
  """A ragged prefill (with a padding request and padding tokens), then one
  call mixing a decode, a continuation and a fresh prefill: every valid
  token's logits equal the forward's; the padding slot's pools stay as they
  were."""
  params = _params(1)
  rng = np.random.default_rng(1)
  seqs = [rng.integers(0, CFG.vocab_size, n) for n in (6, 8, 3)]
  cache = init_cache(CFG, slots=5, max_len=8)
  cache = cache._replace(gdn=tuple((c + 1.0, s + 1.0) for c, s in cache.gdn))  # nonzero slots
  untouched = [np.asarray(s[4]) for _, s in cache.gdn]
  # Call 1: requests 0 and 1 prefill their first 5 and 4 tokens into slots 1
  # and 3 (the pools there are not zero: a fresh request must not read them);
  # request 2 is padding (null slot); 2 padding tokens at the end.
  tokens1 = np.concatenate([seqs[0][:5], seqs[1][:4], [0, 0]])
  before = cache
  logits1, cache = step(params, cache, tokens1, [0, 5, 9, 9], [1, 3, 0], [0, 2, 2], CFG,
                        implementation="xla")
  # Donated: the pools and KV arrays passed in are given up to the outputs.
  assert all(a.is_deleted() for a in jax.tree.leaves(before))
  # Call 2: request 0 decodes token 5, request 1 continues with tokens 4..7,
  # request 2 starts in slot 2; then a padding request.
  tokens2 = np.concatenate([seqs[0][5:6], seqs[1][4:8], seqs[2]])
  logits2, cache = step(params, cache, tokens2, [0, 1, 5, 8, 8], [1, 3, 2, 0], [1, 2, 3],
                        CFG, implementation="xla")
  assert isinstance(cache, GenerationCache)
  np.testing.assert_array_equal(np.asarray(cache.lengths)[1:4], [6, 3, 8])
  want = _forward(params, seqs, "xla")
  got = [jnp.concatenate([logits1[0:5], logits2[0:1]]),
         jnp.concatenate([logits1[5:9], logits2[1:5]]), logits2[5:8]]
  for r in range(3):
    err = rel_rms(got[r], want[r])
    assert err < TOL, (r, err)
  for (_, s), before in zip(cache.gdn, untouched):
    np.testing.assert_array_equal(np.asarray(s[4]), before)     # a slot no request named


@pytest.mark.parametrize("prompts, kw, match", [
    ([[1, 2], []], {}, "non-empty"),
    ([[1, 16]], {}, r"\[0, 16\)"),
    ([[1.5]], {}, "integers"),
    ([[1, 2]], dict(max_new_tokens=0), "positive"),
    ([[1, 2]], dict(forced=np.zeros((2, 3), np.int32)), "forced"),
])
def test_generate_bad_inputs(prompts, kw, match):
  kw = dict(dict(max_new_tokens=3), **kw)
  with pytest.raises(ValueError, match=match):
    generate(None, prompts, CFG, **kw)


def test_step_bad_layout():
  cache = init_cache(CFG, slots=3, max_len=4)
  with pytest.raises(ValueError, match="query_start_loc"):
    step(None, cache, [1, 2], [0, 2], [1, 2], [0, 2, 2], CFG)


def test_init_cache_bad_inputs():
  with pytest.raises(ValueError, match="null slot"):
    init_cache(CFG, slots=1, max_len=4)
  with pytest.raises(ValueError, match="max_len"):
    init_cache(CFG, slots=2, max_len=0)


def test_step_places_the_cache_once_and_keeps_it_placed():
  # The first call copies `init_cache`'s arrays into the program's layouts
  # where they differ; the returned cache is in them, so the next call uses
  # it as it is (no copy of any array).
  from tokamax_gdn.models import generation  # pylint: disable=g-import-not-at-top
  params = _params()
  cache = init_cache(CFG, 3, 8)
  args = (jnp.array([1, 2], jnp.int32), jnp.array([0, 1, 2], jnp.int32),
          jnp.array([1, 2], jnp.int32), jnp.array([2, 2, 2], jnp.int32))
  _, cache = step(params, cache, *args, CFG, implementation="xla")
  _, formats = generation.step_program(params, cache, args, generation.statics(CFG, "xla"))
  assert [x.format for x in jax.tree.leaves(cache)] == jax.tree.leaves(formats)
  placed = generation.placed(cache, formats)
  assert all(a is b for a, b in zip(jax.tree.leaves(placed), jax.tree.leaves(cache)))


@pytest.mark.aot
def test_decode_step_does_not_relayout_the_gdn_pools_on_v5e():
  """A decode step of a model with 128-lane heads and bf16 pools, compiled
  for v5e as `step` compiles it (the cache's layouts XLA's choice): no copy
  of a conv pool. At the runtime's default layout the step relaid each one
  out into the serving kernel and back (XLA's default for a [65, 3, 512]
  bf16 pool puts the 3-row axis outermost; at 17 slots it did not)."""
  from tokamax_gdn import aot  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.models import generation  # pylint: disable=g-import-not-at-top
  gdn = layers.GatedDeltaNetConfig(hidden_size=128, num_k_heads=1, num_v_heads=2,
                                   head_k_dim=128, head_v_dim=128)
  cfg = models.ModelConfig(gdn=gdn, num_layers=2, full_attention_interval=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=128,
                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                           vocab_size=256)
  mesh = aot.target_mesh("v5e")
  rep = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

  def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=rep), tree)

  b = 64
  params = abstract(jax.eval_shape(lambda: models.init_params(jax.random.key(0), cfg,
                                                              jnp.bfloat16)))
  cache = abstract(jax.eval_shape(lambda: init_cache(cfg, b + 1, 32, jnp.bfloat16)))
  args = abstract(tuple(jax.ShapeDtypeStruct(s, jnp.int32) for s in ((b,), (b + 1,), (b,), (3,))))
  with aot.on_target(mesh):
    compiled, _ = generation.step_program(
        params, cache, args, generation.statics(cfg, "pallas_mosaic_tpu", jnp.bfloat16))
  hlo = compiled.as_text()
  assert aot.pallas_calls(hlo).get("gdn_serve_decode") == 1, aot.pallas_calls(hlo)
  conv = "bf16[%s]" % ",".join(map(str, cache.gdn[0][0].shape))
  copies = aot.copies(hlo, conv)
  assert copies == [], copies
