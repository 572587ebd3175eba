"""The `tokamax-gdn` command: the console script, every subcommand's help, `list`,
`validate` (also with --interpret) at small shapes, and errors as exit codes."""

import importlib
import importlib.metadata
import json
import pathlib
import subprocess
import sys

import pytest

from tokamax_gdn import cli
from tokamax_gdn import registry

# A layer small enough for Pallas interpret mode (validate --interpret).
_MICRO = """\
name: micro-test
variant: qwen3_5
hidden_size: 64
num_k_heads: 1
num_v_heads: 2
head_k_dim: 16
head_v_dim: 16
conv_kernel_size: 4
"""


def test_console_script_runs_list():
  (entry,) = [e for e in importlib.metadata.entry_points(group="console_scripts")
              if e.name == "tokamax-gdn"]
  assert entry.value == "tokamax_gdn.cli:main"
  script = pathlib.Path(sys.executable).parent / "tokamax-gdn"
  proc = subprocess.run([str(script), "list", "--json"], capture_output=True, text=True,
                        check=False, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = json.loads(proc.stdout)
  assert {(r["op"], r["implementation"]) for r in rows} == {
      (o, i) for o in registry.list_ops() for i in registry.implementations(o)}


@pytest.mark.parametrize("command", cli.COMMANDS)
def test_every_subcommand_has_help(command, capsys):
  module = importlib.import_module(f"tokamax_gdn.cli.{cli.COMMANDS[command]}")
  assert module.HELP and module.__doc__
  with pytest.raises(SystemExit) as info:
    cli.main([command, "--help"])
  assert info.value.code == 0
  out = capsys.readouterr().out
  assert out.startswith(f"usage: tokamax-gdn {command}")
  assert module.__doc__.split("\n")[0].strip() in out


def test_list_table(capsys):
  assert cli.main(["list"]) == 0
  lines = capsys.readouterr().out.splitlines()
  assert lines[0].split() == ["op", "implementation", "op_class", "config"]
  assert len(lines) == 2 + len(registry.table())


def test_validate_small_shapes(capsys):
  assert cli.main(["validate", "--seq-len", "16", "--json"]) == 0
  rows = json.loads(capsys.readouterr().out)
  ran = [r for r in rows if r["status"] == "PASS"]
  assert {(r["op"], r["implementation"]) for r in ran} >= {
      ("gated_delta_rule", "xla"), ("causal_conv1d", "xla"), ("gmm", "xla"), ("tgmm", "xla"),
      ("layer:gated_deltanet", "xla")}
  assert all(r["status"] in ("PASS", "skipped: no TPU (add --interpret)") for r in rows), rows


@pytest.mark.slow
def test_validate_interpret_runs_the_pallas_kernels(tmp_path, capsys):
  model = tmp_path / "micro.yml"
  model.write_text(_MICRO)
  assert cli.main(["validate", "--model", str(model), "--seq-len", "16", "--interpret",
                   "--json"]) == 0
  rows = json.loads(capsys.readouterr().out)
  pallas = {r["op"]: r["status"] for r in rows if r["implementation"] == "pallas_mosaic_tpu"}
  # validate checks the training ops (value and gradients); the serving op
  # has its own tests.
  from tokamax_gdn import validate  # pylint: disable=g-import-not-at-top
  assert pallas == {op: "PASS" for op in (*validate.CASES, "layer:gated_deltanet")}


def test_bad_input_is_an_error_message_and_exit_code_2(capsys):
  assert cli.main(["validate", "--model", "no-such-model"]) == 2
  err = capsys.readouterr().err
  assert err.startswith("tokamax-gdn validate: error: Unknown model preset 'no-such-model'")
  with pytest.raises(SystemExit) as info:
    cli.main(["no-such-command"])
  assert info.value.code == 2
