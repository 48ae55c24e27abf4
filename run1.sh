set -x
source .device-bundle/activate.sh
export PYTHONPATH=$PWD:$PYTHONPATH
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv
timeout 150 python scripts/gpu_check.py --workers 15 --out $OUT/gpu_check > $OUT/gpu_check.log 2>&1; echo gpu_check rc=$?
tail -5 $OUT/gpu_check.log
timeout 200 python -m fmha.bench --grid extras --rounds 3 --variants --impls fmha,fmha_fp8_pingpong,fmha_fp8_nopingpong,fmha_fp8_nopingpong_n192,fmha_fp8_p_unscaled,fmha_fp8_p_scaled --filter "fp8" --out $OUT/fp8 > $OUT/fp8.log 2>&1; echo fp8 rc=$?
tail -12 $OUT/fp8.log
timeout 200 python -m fmha.bench --rounds 3 --variants --impls fmha_tree_softmax,fmha_overlap_only,fmha_nopingpong --filter 'H32/32 D64$|H32/32 D64 causal$' --out $OUT/d64 > $OUT/d64.log 2>&1; echo d64 rc=$?
tail -16 $OUT/d64.log
