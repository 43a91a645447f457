#!/usr/bin/env bash
# Installs what the build needs, builds k3cpp, and runs the whole test suite (CTest), then the
# input-validation and kernel tests again under AddressSanitizer + UndefinedBehaviorSanitizer, then a
# short run of every libFuzzer target (scripts/fuzz.sh, seeded with the inputs that once crashed).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
jobs="$(nproc)"
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DK3_WERROR=ON
cmake --build build -j"$jobs"
ctest --test-dir build -j"$jobs" --output-on-failure

# Sanitizers: every bad-input path (safetensors, config, the k3 CLI end to end, chat requests, the
# HTTP server's requests, the vision tower's config, weights and pixels, image files), the kernel tests, and the tokenizer
# (encode, XTML render/parse, BPE training).
# (The model-level suites run at -O0 under ASan for ~30 min on 2 cores, too slow for every push.)
cmake -S . -B build-asan -DK3_SANITIZE=ON -DCMAKE_BUILD_TYPE=Debug -DK3_BUILD_BENCH=OFF -DK3_WERROR=ON
cmake --build build-asan -j"$jobs" --target k3 test_safetensors test_config test_cli_errors test_kda test_kernels \
  test_tokenizer test_xtml_chat test_xtml_parse test_bpe_train test_train_ops test_train_data test_quantile_balance \
  test_optimizer test_train_kda_chunk test_corpus test_train_grad_lanes test_hardening test_serve test_serve_batcher test_serve_k3_contract test_vision test_image_decode test_media_prompt test_train_vision
ctest --test-dir build-asan -j"$jobs" --output-on-failure -R '^(SafeTensors|Config\.|ConfigErrors|ParamCount|InspectCli|CliErrors|Kda|ShortConv|Gate|L2Norm|AttnRes|Glu|Linear|Mxfp4|RmsNorm|Router|Tokenizer|BpeTrain|KimiSplit|PythonJson|SpecialTokens|Xtml|TrainOps|TrainData|QuantileBalance|Optimizer|TrainKdaChunk|BrownCorpus|RetrievalTasks|GradLanes\.(Assignment|ALane)|Hardening|Serve|Vision|ImageDecode|MediaPrompt|TrainVisionOps|TrainVision\.MissingOrMisshapen)' \
  -E '_NOT_BUILT|PrefixCacheServesWhatAServerWithoutItServes'

# Fuzzing: each target for K3_CI_FUZZ_SECONDS (default 30) from its seeds, ASan + UBSan built in.
bash scripts/fuzz.sh "${K3_CI_FUZZ_SECONDS:-30}"
