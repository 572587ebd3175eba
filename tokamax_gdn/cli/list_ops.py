"""Prints the registry: every op and its registered implementations, with their
tokamax Op and Config classes."""

from tokamax_gdn.cli import common

HELP = "print the registry: ops x implementations"


def add_arguments(parser) -> None:
  parser.add_argument("--json", action="store_true", help="print the rows as JSON")


def run(args) -> int:
  from tokamax_gdn import registry  # pylint: disable=g-import-not-at-top
  rows = [dict(op=o, implementation=i, op_class=c, config=k) for o, i, c, k in registry.table()]
  if args.json:
    common.print_json(rows)
  else:
    common.print_table(rows)
  return 0
