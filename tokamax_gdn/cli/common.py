"""What several subcommands share: the `--model` resolver, GDN shape options,
arg-spec selection, and the table printer.

Errors are exceptions (ValueError for bad user input); `tokamax_gdn.cli.main`
turns them into exit codes.
"""

import argparse
from collections.abc import Mapping, Sequence
import json
import sys
from typing import Any, TextIO

DEFAULT_MODEL = "qwen3.5-tiny"


def load_model(spec: str):
  """A `GatedDeltaNetConfig` from a preset name (`qwen3.5-tiny`) or a preset .yml
  (`layers.presets.preset_file`)."""
  from tokamax_gdn import layers  # pylint: disable=g-import-not-at-top
  return layers.load_preset(spec)


def require_positive(args: argparse.Namespace, *names: str) -> None:
  """ValueError (one line, exit code 2 through `main`) for any of the
  options `names` (attribute names) given below 1."""
  for name in names:
    value = getattr(args, name)
    if value is not None and value < 1:
      raise ValueError(f"--{name.replace('_', '-')} must be >= 1 (got {value})")


def add_gdn_shape_args(parser: argparse.ArgumentParser, *, model_default: str | None,
                       seq_len_default: int | None) -> None:
  """--model, --seq-len, --batch, --hk/--hv/--k/--v (override the model), --dtype."""
  parser.add_argument("--model", default=model_default,
                      help="model preset name or .yml path (heads and head dims)")
  parser.add_argument("--seq-len", "-T", type=int, default=seq_len_default,
                      required=seq_len_default is None, help="tokens per sequence")
  parser.add_argument("--batch", "-B", type=int, default=1)
  parser.add_argument("--hk", type=int, help="key heads (overrides the model)")
  parser.add_argument("--hv", type=int, help="value heads (overrides the model)")
  parser.add_argument("--k", type=int, help="key head dim (overrides the model)")
  parser.add_argument("--v", type=int, help="value head dim (overrides the model)")
  parser.add_argument("--dtype", default="bfloat16", help="activation dtype (default bfloat16)")


def gdn_shape(args: argparse.Namespace):
  """The `LayerShape` the options of `add_gdn_shape_args` describe."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  from tokamax_gdn.benchmarks import workload  # pylint: disable=g-import-not-at-top
  dims = {}
  if args.model:
    cfg = load_model(args.model)
    dims = dict(hk=cfg.num_k_heads, hv=cfg.num_v_heads, k=cfg.head_k_dim, v=cfg.head_v_dim)
  for name in ("hk", "hv", "k", "v"):
    if getattr(args, name) is not None:
      dims[name] = getattr(args, name)
  missing = [f"--{n}" for n in ("hk", "hv", "k", "v") if n not in dims]
  if missing:
    raise ValueError(f"give --model or all of --hk --hv --k --v (missing {' '.join(missing)})")
  if args.seq_len <= 0 or args.batch <= 0:
    raise ValueError("--seq-len and --batch must be positive")
  return workload.LayerShape(b=args.batch, t=args.seq_len, dtype=jnp.dtype(args.dtype), **dims)


def select_specs(op_name: str, names: str | None, tag: str) -> list:
  """The op's ArgSpecs named in `names` (comma-separated), else those tagged `tag`."""
  from tokamax_gdn import registry  # pylint: disable=g-import-not-at-top
  every = registry.arg_specs(op_name)
  if names:
    by_name = {s.name: s for s in every}
    unknown = [n for n in names.split(",") if n not in by_name]
    if unknown:
      raise ValueError(f"unknown {op_name} spec(s) {unknown}; valid: {sorted(by_name)}")
    return [by_name[n] for n in names.split(",")]
  chosen = [s for s in every if tag in s.tags]
  if not chosen:
    raise ValueError(f"no {op_name} spec is tagged {tag!r}")
  return chosen


def _cell(value: Any) -> str:
  if value is None:
    return "-"
  if isinstance(value, float):
    return f"{value:.4g}"
  return str(value)


def print_table(rows: Sequence[Mapping[str, Any]], columns: Mapping[str, str] | None = None,
                *, title: str | None = None, file: TextIO | None = None) -> None:
  """Aligned plain-text table; `columns` maps row keys to headers (default: every key).

  None prints as "-", floats with 4 significant digits; format anything else
  into a string before.
  """
  file = file or sys.stdout
  if title:
    print(title, file=file)
  if not rows:
    print("(no rows)", file=file)
    return
  columns = columns or {k: k for k in rows[0]}
  head = list(columns.values())
  body = [[_cell(r.get(k)) for k in columns] for r in rows]
  widths = [max(len(x) for x in col) for col in zip(head, *body)]
  line = lambda cells: "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()
  for cells in [head, ["-" * w for w in widths], *body]:
    print(line(cells), file=file)


def print_json(obj: Any, file: TextIO | None = None) -> None:
  print(json.dumps(obj, indent=1, default=str), file=file or sys.stdout)
