#!/usr/bin/env bash
# Build llama.cpp's `llama-server` (and `llama-bench`), the batch-1 reference of benchmarks/batch1.py, into
# benchmarks/llama_cpp/build/bin/ (git-ignored). Idempotent: when the binary exists it only reports its version.
#   Source: the llama.cpp vendored in the llama-cpp-python 0.3.36 sdist (vendor/llama.cpp), fetched with
#   `pip download --no-binary :all:` so the pinned version is what gets built.
#   Build: CPU only, Release, static, GGML_NATIVE=OFF with the x86 extensions this host's /proc/cpuinfo flags
#   switched on one by one (AVX2, FMA, F16C, BMI2, AVX-512F, AVX-512 VBMI/VNNI/BF16, AVX-VNNI) and AMX always
#   off: a native build enables AMX on hosts whose CPU flags it but whose kernel does not allow the tile state,
#   and then crashes at the first AMX instruction. No network at build time: no OpenSSL/HTTPS, no prebuilt web UI.
#   (LLAMA_CURL is deprecated in this llama.cpp and only warns, so it is not passed; LLAMA_OPENSSL=OFF is its
#   replacement.) `nice`, -j 2 (JOBS overrides): the machine is shared.
# Environment: PYTHON (default python3, for pip download), JOBS (default 2).
set -euo pipefail
cd "$(dirname "$0")"
version=0.3.36
build=build
bin="$build/bin/llama-server"
if [ -x "$bin" ]; then
  echo "[llama.cpp] $bin exists: $("$bin" --version 2>&1 | grep -m1 -i version || true)"
  exit 0
fi
python="${PYTHON:-python3}"
jobs="${JOBS:-2}"
mkdir -p "$build/sdist"
sdist="$build/sdist/llama_cpp_python-$version.tar.gz"
if [ ! -f "$sdist" ]; then
  echo "[llama.cpp] downloading the llama-cpp-python==$version sdist"
  "$python" -m pip download --disable-pip-version-check -q --no-deps --no-binary :all: \
    -d "$build/sdist" "llama-cpp-python==$version"
fi
src="$build/src/llama_cpp_python-$version/vendor/llama.cpp"
if [ ! -f "$src/CMakeLists.txt" ]; then
  mkdir -p "$build/src"
  tar xzf "$sdist" -C "$build/src"
fi

flags="$(grep -m1 '^flags' /proc/cpuinfo)"
has() { [[ " ${flags#*:} " == *" $1 "* ]] && echo ON || echo OFF; }
isa=(
  -DGGML_AVX="$(has avx)"
  -DGGML_AVX2="$(has avx2)"
  -DGGML_FMA="$(has fma)"
  -DGGML_F16C="$(has f16c)"
  -DGGML_BMI2="$(has bmi2)"
  -DGGML_AVX_VNNI="$(has avx_vnni)"
  -DGGML_AVX512="$(has avx512f)"
  -DGGML_AVX512_VBMI="$(has avx512vbmi)"
  -DGGML_AVX512_VNNI="$(has avx512_vnni)"
  -DGGML_AVX512_BF16="$(has avx512_bf16)"
  -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
)
echo "[llama.cpp] configuring: ${isa[*]}"
nice -n 10 cmake -S "$src" -B "$build/cmake" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
  -DGGML_NATIVE=OFF -DGGML_CPU=ON -DGGML_BACKEND_DL=OFF -DGGML_CPU_ALL_VARIANTS=OFF "${isa[@]}" \
  -DLLAMA_OPENSSL=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON \
  >"$build/cmake.log"
echo "[llama.cpp] building llama-server and llama-bench with -j $jobs (several minutes; log in $build/build.log)"
nice -n 10 cmake --build "$build/cmake" --config Release -j "$jobs" --target llama-server llama-bench \
  >"$build/build.log" 2>&1 || { tail -30 "$build/build.log"; exit 1; }
mkdir -p "$build/bin"
cp "$build/cmake/bin/llama-server" "$build/cmake/bin/llama-bench" "$build/bin/"
echo "[llama.cpp] built $bin: $("$bin" --version 2>&1 | grep -m1 -i version || true)"
