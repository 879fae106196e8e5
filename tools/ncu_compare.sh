#!/usr/bin/env bash
# Side-by-side ncu metrics of our main attention kernel and FA2's (torch SDPA's FLASH_ATTENTION backend; fa2_varlen:
# its varlen kernels through torch's varlen_attn) for one BENCHMARKS.md shape: cycles, executed instructions, IPC,
# shared-memory and tensor-pipe use, and the top warp stall reasons, so a gap to FA2 reads as "more instructions" or
# "more stalls of kind X". Needs ncu (GPU machine).
# Usage: tools/ncu_compare.sh HEAD_DIM SEQLEN fwd|bwd [--causal]   (IMPLS="flash_attn_hopper sdpa_cudnn" compares the
# Hopper kernels with cuDNN's; any of tools/profile_attention.py --impl; its options after the first three, e.g.
# IMPLS="flash_attn flex" tools/ncu_compare.sh 128 16384 bwd --doc-len 128)
set -uo pipefail
# The profiled script lives in tools/, so Python puts tools/ first on its path, not the tree: a tree built in place
# (python3 setup.py build_ext --inplace, as tools/ab_bench.sh builds its variants) imports only with the tree on the
# path (the thirtieth session's first ncu step found no flash_attn there).
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
HD="$1"; SEQLEN="$2"; DIR="$3"; shift 3
if [ "$DIR" = bwd ]; then ours="regex:bwd_(wide_)?kernel"; fa2="regex:flash_bwd_dq_dk_dv"; else ours="regex:fwd_(persistent_|tma_)?kernel"; fa2="regex:flash_fwd_kernel"; fi
# cuDNN's SDPA kernels on sm90 carry "sdpa" and "fprop" / "bprop" in their generated names.
if [ "$DIR" = bwd ]; then cudnn="regex:sdpa.*bprop|bprop.*sdpa"; else cudnn="regex:sdpa.*fprop|fprop.*sdpa"; fi
METRICS="gpu__time_duration.sum,sm__cycles_elapsed.avg,sm__cycles_active.avg,launch__registers_per_thread,launch__grid_size,lts__t_bytes.sum,dram__bytes_read.sum,smsp__sass_inst_executed_op_local_ld.sum,smsp__sass_inst_executed_op_shared_ld.sum,smsp__inst_executed.sum,sm__inst_executed.avg.per_cycle_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"
for r in barrier short_scoreboard long_scoreboard mio_throttle math_pipe_throttle wait not_selected dispatch_stall lg_throttle no_instruction selected drain membar branch_resolving; do METRICS+=",smsp__average_warps_issue_stalled_${r}_per_issue_active.ratio"; done
for impl in ${IMPLS:-flash_attn sdpa_flash}; do
  # flex: Inductor's attention templates (forward and backward) are named triton_tem_*.
  case "$impl" in sdpa_flash|fa2_varlen) kernel="$fa2" ;; sdpa_cudnn) kernel="$cudnn" ;; flex) kernel="regex:triton_tem" ;;
    *) kernel="$ours" ;; esac
  echo "== $impl"
  ncu --clock-control none -k "$kernel" --launch-skip 2 --launch-count 1 --metrics "$METRICS" \
    python3 tools/profile_attention.py "$HD" "$SEQLEN" --direction "$DIR" --impl "$impl" "$@" 2>&1 |
    tee "/tmp/ncu_$impl.log" | grep -E "^\s+(sm__|smsp__|l1tex__|gpu__|launch__|lts__|dram__)" | awk '{printf "  %-80s %s %s\n", $1, (NF > 2 ? $(NF-1) : ""), $NF}'
  grep -q "smsp__inst_executed" "/tmp/ncu_$impl.log" || tail -5 "/tmp/ncu_$impl.log"
done
