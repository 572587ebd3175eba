"""`tokamax-gdn`: the command line of tokamax_gdn.

`validate` is the main job: every registered implementation of every op runs
on inputs shaped like a model preset's GatedDeltaNet layer (default
`qwen3.5-tiny`) and is compared with `reference`, forward and gradients, then
the whole layer runs through each GDN implementation.

One module per subcommand; `COMMANDS` maps each command to its module in this
package. A subcommand module has
  HELP: str                                  the one-line help
  add_arguments(parser) -> None              its options
  run(args) -> int                           the exit code
and its docstring is the subcommand's `--help` description. Adding a
subcommand is adding `tokamax_gdn/cli/<name>.py` and one `"<name>": "<name>"`
line to `COMMANDS`.
Library code raises exceptions; `main` prints a ValueError as
"tokamax-gdn <command>: error: ..." and exits with 2.
"""

import argparse
import importlib
import os
import sys

# libtpu (TPU compiles on CPU) must not ask a cloud metadata server for its chip.
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")

COMMANDS = {
    "list": "list_ops",  # (a module named `list` would shadow the builtin here)
    "validate": "validate",
    "bench": "bench",
    "aot": "aot",
    "autotune": "autotune",
    "train": "train",
}


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(prog="tokamax-gdn", description=__doc__.split("\n\n")[0],
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  sub = parser.add_subparsers(dest="command", required=True, metavar="command")
  for name, module_name in COMMANDS.items():
    module = importlib.import_module(f"{__name__}.{module_name}")
    p = sub.add_parser(name, help=module.HELP, description=module.__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(p)
    p.set_defaults(run=module.run)
  return parser


def main(argv: list[str] | None = None) -> int:
  """Runs one subcommand; returns its exit code (2 for bad usage)."""
  args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
  try:
    return args.run(args)
  except ValueError as e:
    print(f"tokamax-gdn {args.command}: error: {e}", file=sys.stderr)
    return 2


if __name__ == "__main__":
  sys.exit(main())
