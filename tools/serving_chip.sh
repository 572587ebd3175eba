#!/usr/bin/env bash
# The README's serving table on a TPU: `tokamax-gdn bench --op
# causal_conv1d_gated_delta_rule`'s chained-call table over the serving set,
# ours beside tokamax's `xla` op, vLLM TPU's kernel and our vLLM drop-in
# (docs/serving.md, "Benchmark").
#
# On the chip machine, from the repository root, with the runtime of
# ../shared/tpu unpacked (.tpu/boot.sh, TPU_ON_CHIP.md) and tpu-inference's
# wheel in .whl-tpu/ (git-ignored: carry it, with .tpu/boot.sh and .tpu/meta):
#
#   bash tools/serving_chip.sh decode  "$OUT"
#   bash tools/serving_chip.sh prefill "$OUT"
#   bash tools/serving_chip.sh SPEC,SPEC,... "$OUT"     # any other set
#
# Two groups, each a call of its own that fits ten minutes. Each writes
# $OUT/serving_<group>.json (rewritten after every row: a run cut short keeps
# its rows), $OUT/serving_<group>.md (the tables as printed) and
# $OUT/performance_<group>.md (their record sections). Then, anywhere:
#
#   tokamax-gdn bench --op causal_conv1d_gated_delta_rule \
#       --from-json serving_decode.json,serving_prefill.json [--record]
#
# prints the whole set as one table (markdown: the README's) and records it.
#
# Environment: IMPLS (default below), CHAIN (calls per program, default 32),
# REPS (timed calls per figure, default 20).
set -euo pipefail
usage="usage: bash tools/serving_chip.sh decode|prefill|SPEC,... OUT_DIR"
group=${1:?$usage}
out=${2:?$usage}
case "$group" in
  decode) specs=tp8_decode_64,tp8_decode_512,tp8_decode_cached_64_ctx8192,tp8_spec3_decode_64_ctx1024 ;;
  prefill) specs=tp8_prefill_4096,tp8_mixed_3x512,tp8_mixed_64_t8192 ;;
  *) specs=$group; group=custom ;;
esac
impls=${IMPLS:-pallas_mosaic_tpu,xla,tokamax_xla,vllm,vllm_dropin}

# tpu-inference's files on the path: its GDN v3 kernel imports only JAX, and
# `integrations.vllm.tpu_inference_kernel` loads it without the package's
# __init__ (which imports vLLM itself).
wheel=$(ls .whl-tpu/tpu_inference-*.whl 2>/dev/null | head -1 || true)
if [ -n "$wheel" ]; then
  site=/tmp/tpu_inference_site
  if [ ! -d "$site/tpu_inference" ]; then
    mkdir -p "$site"
    bash .tpu/boot.sh run -m zipfile -e "$wheel" "$site"
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "no .whl-tpu/tpu_inference-*.whl: the vllm rows will say tpu-inference is not on the path" >&2
fi

mkdir -p "$out"
# Compiled programs cached on the machine (it keeps /tmp while it is held):
# a group run again after running out of time does not compile again.
export JAX_COMPILATION_CACHE_DIR=/tmp/tokamax_gdn_jax_cache
bash .tpu/boot.sh run -m tokamax_gdn.cli bench --op causal_conv1d_gated_delta_rule \
    --specs "$specs" --impls "$impls" --chain "${CHAIN:-32}" --reps "${REPS:-20}" \
    --no-parts --json-out "$out/serving_$group.json" --record "$out/performance_$group.md" \
    | tee "$out/serving_$group.md"
