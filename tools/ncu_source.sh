#!/usr/bin/env bash
# Per-instruction warp-stall samples of our main attention kernel and FA2's (or cuDNN's) for one shape, so a
# stall-reason gap from tools/ncu_compare.sh can be traced to the SASS lines (and CUDA lines, via -lineinfo) behind it.
# Writes DIR/{ours,fa2,cudnn}_NAME.{ncu-rep,sass.csv,cuda.csv,details.txt} (details: launch configuration, occupancy);
# read the CSVs with tools/ncu_hot_lines.py. GPU machine.
# Usage: [IMPLS="flash_attn sdpa_flash sdpa_cudnn"] tools/ncu_source.sh DIR NAME HEAD_DIM SEQLEN fwd|bwd
#        [profile_attention.py options, e.g. --causal or --decode-batch 8]
#        (from the repo root; an in-place build is found there)
set -uo pipefail
DIR="$1"; NAME="$2"; HD="$3"; SEQLEN="$4"; DIRECTION="$5"; shift 5
mkdir -p "$DIR"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# The forward runs as fwd_kernel, fwd_tma_kernel (K / V by TMA) or fwd_persistent_kernel: the thirty-fifth session's
# profile of the plain hd 128 call found none of them with "fwd_kernel" alone.
if [ "$DIRECTION" = bwd ]; then ours="regex:bwd_kernel"; fa2="regex:flash_bwd_dq_dk_dv"; else ours="regex:fwd_(persistent_|tma_)?kernel"; fa2="regex:flash_fwd"; fi
# cuDNN's SDPA kernels on sm90 carry "sdpa" and "fprop" / "bprop" in their generated names (as tools/ncu_compare.sh).
if [ "$DIRECTION" = bwd ]; then cudnn="regex:sdpa.*bprop|bprop.*sdpa"; else cudnn="regex:sdpa.*fprop|fprop.*sdpa"; fi
for impl in ${IMPLS:-flash_attn sdpa_flash}; do
  case "$impl" in
    sdpa_flash) kernel="$fa2"; tag=fa2 ;; sdpa_cudnn) kernel="$cudnn"; tag=cudnn ;; *) kernel="$ours"; tag=ours ;;
  esac
  rep="$DIR/${tag}_$NAME"
  ncu --clock-control none -k "$kernel" --launch-skip 2 --launch-count 1 --import-source yes \
    --section SourceCounters --section WarpStateStats --section SpeedOfLight --section LaunchStats \
    --section Occupancy -f -o "$rep" \
    python3 tools/profile_attention.py "$HD" "$SEQLEN" --direction "$DIRECTION" --impl "$impl" "$@" \
    > "$rep.log" 2>&1 || { echo "ncu $tag $NAME failed:"; tail -5 "$rep.log"; continue; }
  ncu --import "$rep.ncu-rep" --page source --csv --print-source sass > "$rep.sass.csv" 2> "$rep.err"
  ncu --import "$rep.ncu-rep" --page source --csv --print-source cuda > "$rep.cuda.csv" 2>> "$rep.err"
  ncu --import "$rep.ncu-rep" --page details > "$rep.details.txt" 2>> "$rep.err"
  echo "$tag $NAME: $(wc -l < "$rep.sass.csv") sass rows, $(wc -l < "$rep.cuda.csv") cuda rows"
done
