/* Library identity and the CPU's best target (target.h). */
#include "target.h"

#include "layer_ops.h"

#define SPARK_KERNELS_ABI_VERSION 11

int spark_kernels_abi_version(void) { return SPARK_KERNELS_ABI_VERSION; }

/* The build's own target, from the instruction sets its flags enable (engine/kernels/build.py's TARGETS). */
int spark_kernels_target(void) {
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
    return SPARK_TARGET_AVX512;
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
    return SPARK_TARGET_AVX2;
#else
    return SPARK_TARGET_PORTABLE;
#endif
}

/* __builtin_cpu_supports reads cpuid and checks that the operating system saves the registers the
 * extension needs (XCR0), so a kernel or hypervisor that disables AVX-512 state is respected. The AVX-512
 * target needs every extension its flags enable (build.py: x86-64-v4 plus BF16, VNNI and VBMI): a CPU with
 * AVX-512F but without BF16 (Skylake-X, Ice Lake) runs the AVX2 library. */
int spark_cpu_best_target(void) {
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
    __builtin_cpu_init();
    const int v3 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("bmi")
                   && __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("f16c")
                   && __builtin_cpu_supports("movbe");
    const int avx512 = v3 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                       && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")
                       && __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512bf16")
                       && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vbmi");
    return avx512 ? SPARK_TARGET_AVX512 : v3 ? SPARK_TARGET_AVX2 : SPARK_TARGET_PORTABLE;
#else
    return SPARK_TARGET_PORTABLE;
#endif
}

int spark_kernels_max_head_dim(void) { return SPARK_MAX_HEAD_DIM; }
int spark_kernels_max_group(void) { return SPARK_MAX_GROUP; }
