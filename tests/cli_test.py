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



def test_python_dash_m_runs_the_same_command():
  """`python -m tokamax_gdn.cli` (no entry point needed) exits with the command's code."""
  proc = subprocess.run([sys.executable, "-m", "tokamax_gdn.cli", "list", "--json"],
                        capture_output=True, text=True, check=False, timeout=300)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert json.loads(proc.stdout)
  proc = subprocess.run([sys.executable, "-m", "tokamax_gdn.cli", "validate", "--seq-len", "0"],
                        capture_output=True, text=True, check=False, timeout=300)
  assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]

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


def _refused(argv, capsys, *words):
  """argv exits with 2 and one stderr line naming `words`, no traceback."""
  assert cli.main(argv) == 2
  captured = capsys.readouterr()
  lines = captured.err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"tokamax-gdn {argv[0]}: error:"), captured.err
  for w in words:
    assert w in lines[0], (w, lines[0])
  return lines[0]


@pytest.mark.parametrize("command", ["validate", "train"])
def test_bad_preset_files_are_one_line_errors(command, tmp_path, capsys):
  bad_yaml = tmp_path / "bad.yml"
  bad_yaml.write_text("hidden_size: [64\nnum_k_heads: 1\n")
  _refused([command, "--model", str(bad_yaml)], capsys, str(bad_yaml), "not valid YAML")
  incomplete = tmp_path / "incomplete.yml"
  incomplete.write_text("name: x\nnum_k_heads: 1\nnum_v_heads: 2\nmodel:\n  num_layers: 1\n"
                        "  num_attention_heads: 1\n  num_key_value_heads: 1\n  head_dim: 8\n"
                        "  num_experts: 2\n  num_experts_per_tok: 1\n  moe_intermediate_size: 8\n")
  _refused([command, "--model", str(incomplete)], capsys, str(incomplete), "hidden_size",
           "missing")
  a_list = tmp_path / "list.yml"
  a_list.write_text("- 1\n- 2\n")
  _refused([command, "--model", str(a_list)], capsys, str(a_list), "mapping")
  missing = tmp_path / "nodir" / "mymodel.yml"
  _refused([command, "--model", str(missing)], capsys, str(missing), "does not exist")


@pytest.mark.parametrize("argv", [
    ["validate", "--seq-len", "0"], ["validate", "--batch", "0"],
    ["train", "--batch", "0"], ["train", "--steps", "0"], ["train", "--seq-len", "0"],
    ["train", "--batch", "-3"],
])
def test_sizes_below_one_are_refused(argv, capsys):
  _refused(argv, capsys, argv[1], ">= 1")
