"""`tokamax_gdn.validate.run`: compiling in parallel changes no row, a row whose
compile raises is one FAIL row among passing ones, and a long compile is named
while it runs. A micro layer keeps each run to a few small compiles."""

import threading
import time
import types

import pytest

from tokamax_gdn import layers
from tokamax_gdn import registry
from tokamax_gdn import validate

_MICRO = dict(name="micro-test", hidden_size=64, num_k_heads=1, num_v_heads=2, head_k_dim=16,
              head_v_dim=16, conv_kernel_size=4)
_SKIPPED = "skipped: no TPU (add --interpret)"


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
  path = tmp_path_factory.mktemp("validate") / "micro.yml"
  path.write_text("variant: qwen3_5\n" + "".join(f"{k}: {v}\n" for k, v in _MICRO.items()))
  return layers.load_preset(str(path))


@pytest.fixture(scope="module")
def sequential_rows(cfg):
  return validate.run(cfg, seq_len=8, progress=False, workers=1)


def _without_timings(rows):
  return [{k: v for k, v in r.items() if k != "fwd_bwd_ms"} for r in rows]


def test_sequential_rows_pass_in_row_order(sequential_rows):
  pairs = [(o, i) for o in validate.CASES for i in registry.implementations(o)]
  pairs += [(validate.LAYER, i) for i in registry.implementations("gated_delta_rule")
            if i in registry.implementations("causal_conv1d")]
  assert [(r["op"], r["implementation"]) for r in sequential_rows] == pairs
  assert {r["status"] for r in sequential_rows} <= {"PASS", _SKIPPED}, sequential_rows
  ran = [r for r in sequential_rows if r["status"] == "PASS"]
  assert ran and all(float(r["fwd_bwd_ms"].split()[0]) >= 0 for r in ran)


def test_parallel_compiles_give_the_sequential_rows(cfg, sequential_rows):
  parallel = validate.run(cfg, seq_len=8, progress=False, workers=4)
  assert _without_timings(parallel) == _without_timings(sequential_rows)


def _registry_seen_by_validate(monkeypatch, **overrides):
  """Replaces what `validate` finds in the registry, not what the ops find:
  gmm's and tgmm's backward passes look each other up."""
  shim = types.SimpleNamespace(get=registry.get, implementations=registry.implementations)
  for name, value in overrides.items():
    setattr(shim, name, value)
  monkeypatch.setattr(validate, "registry", shim)


def test_a_failing_compile_is_one_fail_row(cfg, sequential_rows, monkeypatch):
  def broken(*args, **kwargs):
    raise RuntimeError("broken on purpose")

  _registry_seen_by_validate(monkeypatch, get=lambda op, name: (
      broken if (op, name) == ("gmm", "xla") else registry.get(op, name)))
  rows = validate.run(cfg, seq_len=8, progress=False, workers=2)
  failed = [r for r in rows if r["status"].startswith("FAIL")]
  assert [(r["op"], r["implementation"]) for r in failed] == [("gmm", "xla")]
  assert failed[0]["status"] == "FAIL (RuntimeError: broken on purpose)"
  others = [r for r in rows if r is not failed[0]]
  assert _without_timings(others) == _without_timings(
      [r for r in sequential_rows if (r["op"], r["implementation"]) != ("gmm", "xla")])


def test_a_long_compile_is_named_while_it_runs(cfg, monkeypatch, capsys):
  monkeypatch.setattr(validate, "STALL_REPORT_S", 0.05)
  monkeypatch.setattr(validate, "CASES", {"gmm": validate.CASES["gmm"]})
  _registry_seen_by_validate(monkeypatch, implementations=(   # no layer rows
      lambda op: registry.implementations(op) if op == "gmm" else {}))
  compile_ = validate._compile  # pylint: disable=protected-access

  def slow_compile(*args):
    time.sleep(0.3)
    return compile_(*args)

  monkeypatch.setattr(validate, "_compile", slow_compile)
  rows = validate.run(cfg, seq_len=8, progress=True, workers=1)
  assert {r["status"] for r in rows} <= {"PASS", _SKIPPED} and len(rows) > 1, rows
  err = capsys.readouterr().err
  assert "validate: still compiling after " in err and "gmm/" in err, err


def test_turns_are_held_in_the_order_handed_out_even_past_a_raise():
  turns = validate._Turns()  # pylint: disable=protected-access
  handed = [turns.next() for _ in range(4)]
  held = []

  def hold(i):
    try:
      with handed[i]:
        held.append(i)
        if i == 1:
          raise RuntimeError("lowering failed")
    except RuntimeError:
      pass

  threads = [threading.Thread(target=hold, args=(i,)) for i in reversed(range(4))]
  for t in threads:
    t.start()
  for t in threads:
    t.join(timeout=10)
  assert held == [0, 1, 2, 3]


def test_closed_turns_release_tasks_waiting_on_ones_that_never_run():
  turns = validate._Turns()  # pylint: disable=protected-access
  never, later = turns.next(), turns.next()   # turn 0's task is cancelled
  held = threading.Event()

  def hold():
    with later:
      held.set()

  t = threading.Thread(target=hold)
  t.start()
  assert not held.wait(0.5)   # waits for turn 0
  turns.close()
  assert held.wait(10)
  t.join(timeout=10)
  del never
