// ATen's vector types (`at::vec::Vectorized<float>`) for this build's `-march=native` width: ATen picks the width
// from these macros, which its own build sets per kernel file. Include before <ATen/cpu/vec/vec.h>.
#pragma once
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__) && defined(__AVX512VL__)
#define CPU_CAPABILITY_AVX512
#define CPU_CAPABILITY AVX512
#elif defined(__AVX2__) && defined(__FMA__)
#define CPU_CAPABILITY_AVX2
#define CPU_CAPABILITY AVX2
#endif
