"""Trains a small Qwen3.5-style decoder (GatedDeltaNet and softmax-attention
blocks, routed MoE MLPs on gmm) from scratch on multi-query associative
recall, and prints loss at start and end, recall accuracy on fresh sequences,
the step time split into GDN fwd+bwd, gmm/tgmm and the rest (from one
profiled step), and a last line with the recall accuracy.

  tokamax-gdn train [--model qwen3.5-micro] [--steps N] [--impl xla|pallas_mosaic_tpu]
                    [--batch B --seq-len T] [--lr LR] [--interpret] [--json]

With `--interpret` (Pallas TPU kernels in interpret mode on CPU) it runs 3
steps at a toy shape, then the same steps with `xla`, and checks that the
losses agree within the bf16 tolerance (exit code 1 if not). See
`tokamax_gdn.training`.
"""

from tokamax_gdn.cli import common

HELP = "train a small Qwen3.5-style model on associative recall (CPU is enough)"


def add_arguments(parser) -> None:
  from tokamax_gdn.training import command  # pylint: disable=g-import-not-at-top
  command.add_arguments(parser)


def run(args) -> int:
  from tokamax_gdn.training import command  # pylint: disable=g-import-not-at-top
  common.require_positive(args, "batch", "steps", "seq_len")
  return command.run(args, common.print_table)
