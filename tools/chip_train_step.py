"""The training step's record on one TPU chip, in one process (the chip is
opened once): about 4-5 minutes on a v5e.

  python tools/chip_train_step.py [--skip-attention]

1. `tokamax-gdn train --model qwen3.5-tiny --batch 1 --seq-len 4096 --dtype
   bfloat16 --compare-impls pallas_mosaic_tpu,xla --top-ops 10`: the step
   time, MFU and split of both implementations, and where each one's device
   time goes.
2. `tokamax-gdn train --compare-impls pallas_mosaic_tpu,xla --top-ops 10`: the
   same at the train job's shapes (qwen3.5-micro, B = 128, T = 16, float32),
   where the Pallas GDN kernels run the batch folded into one row.
3. `tokamax-gdn train`: the train job itself, to its recall target.
4. The attention core at qwen3.5-tiny's shape (B = 1, T = 4096, 8 query and
   2 key/value heads, D = 128, bf16), forward and forward + backward of
   sum(out²): what the model runs (`models.softmax_attention`: splash's MQA
   kernel per key/value head), splash's MHA kernel on key/value heads
   repeated per query head, and the jnp formula. Skipped when the steps
   above took past `ATTENTION_DEADLINE_S`.

Each part prints its own table; a part that fails prints its error and the
next one runs. Exit code 1 if any part failed.
"""

import argparse
import functools
import sys
import time
import traceback

from tokamax_gdn import cli
from tokamax_gdn.models import softmax_attention

import attention_probe  # tools/attention_probe.py, beside this script

TINY = ["train", "--model", "qwen3.5-tiny", "--batch", "1", "--seq-len", "4096", "--dtype",
        "bfloat16", "--compare-impls", "pallas_mosaic_tpu,xla", "--top-ops", "10"]
MAIN_COMPARE = ["train", "--compare-impls", "pallas_mosaic_tpu,xla", "--top-ops", "10"]
MAIN = ["train"]
ATTENTION_DEADLINE_S = 250


def attention_table() -> bool:
  """Part 4's table (module docstring); whether a core failed."""
  rows = attention_probe.core_table([
      ("model (splash MQA)", functools.partial(softmax_attention.causal_attention,
                                               implementation="pallas_mosaic_tpu")),
      ("splash MHA, K/V repeated", attention_probe.splash_mha),
      ("jnp formula", softmax_attention.xla_attention)])
  return any("error" in r for r in rows)


def main() -> int:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--skip-attention", action="store_true")
  args = p.parse_args()
  start, failed = time.perf_counter(), False
  for argv in (TINY, MAIN_COMPARE, MAIN):
    print(f"\n$ tokamax-gdn {' '.join(argv)}", flush=True)
    try:
      failed |= cli.main(argv) != 0
    except Exception:  # pylint: disable=broad-exception-caught
      traceback.print_exc()
      failed = True
    print(f"[{time.perf_counter() - start:.0f} s]", flush=True)
  if args.skip_attention or time.perf_counter() - start > ATTENTION_DEADLINE_S:
    print("\nattention core table: skipped")
  else:
    print()
    try:
      failed |= attention_table()
    except Exception:  # pylint: disable=broad-exception-caught
      traceback.print_exc()
      failed = True
  print(f"[{time.perf_counter() - start:.0f} s]")
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
