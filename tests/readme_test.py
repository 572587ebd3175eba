"""Every ```python block of README.md runs, as written, in a test, so the
README cannot drift from the code.

Each block is found by a marker string it contains and run by a named
fixture that supplies the variables it leaves to the reader (at tiny sizes)
and checks what it produces. Two blocks run elsewhere, where their setup
already lives: the checkpoint-loading block in the layer test (it needs a
safetensors checkpoint written there), the "Long context" block in the
context-parallel checks' 8-device subprocess (tests/multidevice/).
"""

import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests import readme_blocks
from tests.multidevice import context_parallel_checks
from tests.layers import gated_deltanet_test


def _api(code, tmp_path, monkeypatch):
  """The API block's calls on tiny arrays: every result has the stated shape."""
  del tmp_path, monkeypatch
  r = np.random.default_rng(0)
  f32 = lambda *shape: jnp.asarray(r.standard_normal(shape), jnp.float32)
  b, t, hk, hv, k, v = 1, 8, 1, 2, 8, 8
  m, kk, n, groups = 12, 8, 4, 3
  scope = dict(query=f32(b, t, hk, k), key=f32(b, t, hk, k), value=f32(b, t, hv, v),
               g=-jnp.abs(f32(b, t, hv)), beta=jax.nn.sigmoid(f32(b, t, hv)),
               x=f32(b, t, 6), weight=f32(6, 4), lhs=f32(m, kk), rhs=f32(groups, kk, n),
               group_sizes=jnp.asarray([5, 0, 7], jnp.int32), dout=f32(m, n))
  scope.update(q=scope["query"], k=scope["key"], v=scope["value"])
  exec(code, scope)  # pylint: disable=exec-used
  assert scope["out"].shape == (m, n) and scope["drhs"].shape == (groups, kk, n)
  assert scope["final_state"] is None and scope["y"].shape == (b, t, 6)


def _training(code, tmp_path, monkeypatch):
  """The model forward of "Training a model" on 8 tokens."""
  del tmp_path, monkeypatch
  scope = dict(jax=jax, jnp=jnp, tokens=jnp.arange(8, dtype=jnp.int32)[None] % 7)
  exec(code, scope)  # pylint: disable=exec-used
  assert scope["logits"].shape[:2] == (1, 8)
  assert np.isfinite(np.asarray(scope["logits"], np.float32)).all()


def _serving(code, tmp_path, monkeypatch):
  """The serving op's call at the block's head shapes, one decode and one
  3-token prefill request (the op's own random layout)."""
  del tmp_path, monkeypatch
  import tokamax_gdn  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.ops.causal_conv1d_gated_delta_rule import arg_specs  # pylint: disable=g-import-not-at-top
  lay = arg_specs.layout(lengths=[1, 3], n_kq=2, n_v=8, d_k=128, d_v=128, kernel_size=4)
  args, _ = arg_specs.random_call(jax.random.key(0), lay)
  scope = dict(zip(arg_specs.POSITIONAL, args), tokamax_gdn=tokamax_gdn)
  exec(code, scope)  # pylint: disable=exec-used
  assert scope["out"].shape == (args[0].shape[0], 8 * 128)
  assert scope["recurrent_state"].shape == args[4].shape


# marker -> runner(code, tmp_path, monkeypatch)
RUNNERS = {
    "tg.gated_delta_rule(": _api,
    "models.ModelConfig.load": _training,
    "causal_conv1d_gated_delta_rule(": _serving,
}
# Blocks run by other tests (not run twice): marker -> the test that
# execs the block it finds by that marker.
ELSEWHERE = {
    "load_hf_layer(": gated_deltanet_test.test_readme_checkpoint_snippet,
    # the 8-host-device subprocess of tests/context_parallel_test.py (tests/multidevice/)
    'context_parallel_axis="cp"': context_parallel_checks.readme_long_context_snippet,
}


def test_every_python_block_has_exactly_one_runner():
  markers = [*RUNNERS, *ELSEWHERE]
  for i, code in enumerate(readme_blocks.python_blocks()):
    found = [m for m in markers if m in code]
    assert len(found) == 1, f"README python block {i} matches runners {found}:\n{code}"
  for marker, test in ELSEWHERE.items():
    source = inspect.getsource(test)
    assert any(f"readme_blocks.block({q}{marker}{q})" in source for q in "'\""), test
  assert "readme_long_context_snippet" in context_parallel_checks.CHECKS


@pytest.mark.parametrize("marker", list(RUNNERS))
def test_readme_block_runs(marker, tmp_path, monkeypatch):
  RUNNERS[marker](readme_blocks.block(marker), tmp_path, monkeypatch)
