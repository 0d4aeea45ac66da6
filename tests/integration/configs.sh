#!/usr/bin/env bash
# configs.sh - every config under configs/ validates, and each trains a few
# steps on the real data, checkpoints and evaluates.
source "$(dirname "$0")/lib.sh"
# configs reading TFRecord shards (configs/fashion_mnist_tfrecord.cfg) need them
# made first, by the test helper meson builds (tests/fixtures/make_fmnist_records.c)
if grep -q "fashion_mnist_records/" configs/*.cfg; then
    check "make runs/fashion_mnist_records" "${LOOM_MAKE_FMNIST_RECORDS:-$(dirname "$LOOM")/tests/make_fmnist_records}" \
        runs/fashion_mnist_records
fi
# and those reading NumPy arrays (configs/fashion_mnist_npy.cfg) theirs (tests/fixtures/make_fmnist_npy.c)
if grep -q "fashion_mnist_npy/" configs/*.cfg; then
    check "make runs/fashion_mnist_npy" "${LOOM_MAKE_FMNIST_NPY:-$(dirname "$LOOM")/tests/make_fmnist_npy}" runs/fashion_mnist_npy
fi
# and those reading scikit-learn's bundled data sets as CSV (configs/breast_cancer.cfg,
# diabetes_regression.cfg) theirs, with Python where scikit-learn is installed
sklearn=0
if grep -q "runs/sklearn/" configs/*.cfg; then
    python3 tests/fixtures/make_sklearn_csv.py runs/sklearn 2>/dev/null && sklearn=1
fi
# and those reading PNG-encoded records (configs/fashion_mnist_png.cfg) theirs (tests/fixtures/make_fmnist_png.c)
if grep -q "fashion_mnist_png/" configs/*.cfg; then
    check "make runs/fashion_mnist_png" "${LOOM_MAKE_FMNIST_PNG:-$(dirname "$LOOM")/tests/make_fmnist_png}" runs/fashion_mnist_png
fi
gpus=$("$LOOM" devices 2>&1 | grep -c "gpu:[0-9]*  ")
for cfg in configs/*.cfg; do
    name=$(basename "$cfg" .cfg)
    if grep -q "runs/sklearn/" "$cfg" && [ "$sklearn" = 0 ]; then
        T=$((T + 1)); echo "ok $T - $cfg # SKIP scikit-learn is not installed (pip install scikit-learn)"
        continue
    fi
    # the fortunes configs (issue 24) read Debian's fortunes package, which loom.sh installs
    if grep -q "/usr/share/games/fortunes/" "$cfg" && ! ls /usr/share/games/fortunes/*.u8 >/dev/null 2>&1; then
        T=$((T + 1)); echo "ok $T - $cfg # SKIP the fortunes package is not installed (apt-get install fortunes)"
        continue
    fi
    # a GPU config (configs/fashion_mnist_gpu.cfg) without a usable GPU: check says what is missing
    if grep -q '"gpu:' "$cfg" && [ "$gpus" -eq 0 ]; then
        expect_fail 2 "check $cfg without a usable GPU says what is missing" 'is not usable: ' "$LOOM" check "$cfg"
        continue
    fi
    # an mpi config (configs/fashion_mnist_mpi.cfg) without the mpi plugin: check says it is missing
    # (in one process it trains as one worker; tests/integration/mpi.sh runs it under mpirun)
    if grep -q 'communication = "mpi"' "$cfg" && ! "$LOOM" plugins 2>&1 | grep -q 'cross-device ops "mpi"'; then
        expect_fail 2 "check $cfg without the mpi plugin says it is missing" 'no cross-device op "mpi" is loaded' \
            "$LOOM" check "$cfg"
        continue
    fi
    # a cluster config (configs/fashion_mnist_multi_worker.cfg) trains through loom launch --local;
    # until multi_worker_mirrored is in the build, its checks are skipped, saying so
    if grep -q "^cluster:" "$cfg"; then
        out=$("$LOOM" check "$cfg" 2>&1); status=$?
        if grep -qF '"multi_worker_mirrored" is not supported yet' <<<"$out"; then
            T=$((T + 1)); echo "ok $T - check and launch $cfg # SKIP multi_worker_mirrored is not in this build yet"
            continue
        fi
        if [ $status -eq 0 ] && grep -q ": ok$" <<<"$out"; then pass "check $cfg"; else fail "check $cfg" "$(echo "$out" | tail -5)"; fi
        check "launch $name for 5 steps" timeout 300 "$LOOM" launch --local "$cfg" --model-dir "$WORK/$name" --set run.max_steps=5 \
            --set run.eval_steps=2 --set run.progress='"none"'
    else
        out=$("$LOOM" check "$cfg" 2>&1); status=$?
        if [ $status -eq 0 ] && grep -q ": ok$" <<<"$out"; then pass "check $cfg"; else fail "check $cfg" "$(echo "$out" | tail -5)"; fi
        # (status_port 0: an example's fixed status port may be taken by another run on this machine; status.sh tests it)
        small=() # resnet50's batches of 32 at 224x224: 8 here, the speed is resnet_bench.sh's
        [ "$name" = resnet50 ] && small=(--set 'data.train.transforms.[0].size=8')
        check "train $name for 5 steps" "$LOOM" train "$cfg" --model-dir "$WORK/$name" --set run.max_steps=5 \
            --set run.eval_steps=2 --set run.progress='"none"' --set run.status_port=0 "${small[@]}"
    fi
    if [ -f "$WORK/$name/ckpt-5.loom" ] && [ -f "$WORK/$name/checkpoint" ]; then pass "$name wrote its checkpoint"; else fail "$name wrote its checkpoint" "$(ls "$WORK/$name")"; fi
    out=$("$LOOM" evaluate "$cfg" --model-dir "$WORK/$name" --set run.eval_steps=2 2>/dev/null)
    contains "evaluate $name" '"step": 5' "$out"
    if [ "$name" = resnet50 ]; then # 224x224 images: eval batches of 8
        contains "evaluate $name honours run.eval_steps (2 batches of 8)" '"examples": 16' "$out"
    elif [ "$name" = fortunes_topic_classifier ]; then # its held-out 10% of four files: 381 fortunes, one batch
        contains "evaluate $name reads the whole held-out set" '"examples": 381' "$out"
    else
        grep -q "runs/sklearn/\|tests/fixtures/csv/" "$cfg" || contains "evaluate $name honours run.eval_steps (2 batches of 500)" '"examples": 1000' "$out"
    fi
done
finish
