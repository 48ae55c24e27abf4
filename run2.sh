source .device-bundle/activate.sh
export PYTHONPATH=$PWD:$PYTHONPATH
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu --format=csv
timeout 330 python -m fmha.bench --rounds 3 --variants --impls fmha_same_path,fmha_overlap_only,fmha_overlap_nopingpong,fmha_nopingpong --filter 'H32/32 D64$|H32/32 D64 causal$|H16/16 D128$|H16/16 D128 causal$' --out $OUT/mainloops > $OUT/mainloops.log 2>&1; echo rc=$?
tail -30 $OUT/mainloops.log
